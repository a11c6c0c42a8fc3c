"""``Checkpointer``: periodic async checkpoints for a plain training loop, with preemption saves.

Layout under ``root``::

    root/step_00000100/   a DCP checkpoint (committed once its ``.metadata`` exists)
    root/latest           the step of the newest committed checkpoint (written atomically)
    root/step_00000100.replacing, .replaced   while a committed step is saved again (steps.py)

Rules:

- ``latest`` moves only after a save is durable and committed on every rank (the upload future
  resolves after the coordinator wrote ``.metadata``), and only rank 0 writes it.
- Retention (``keep_latest_k``) runs after that move and deletes only committed checkpoints older
  than the K newest; the one in flight is never among them (at most one save is in flight, and
  it is newer than every committed one). A checkpoint is deleted ``.metadata`` first, so a
  half-deleted directory is never mistaken for a committed one. With retention on, a step
  directory older than the newest commit that never committed (its save failed, or its process
  died: a crash, a second signal) is deleted too; one newer than it is left (the step a resumed
  run will save again).
- Saving a step that is committed already writes beside it and swaps the new one in once it is
  committed (``steps.py``): a committed checkpoint of that step exists throughout.
- Resuming (``load_latest``) tries ``latest``'s step, then the older committed ones, newest
  first, and loads the first that every rank loads (``resume.py``), logging each one passed
  over and why.
- Preemption: a signal (SIGTERM by default) or :meth:`Checkpointer.request_preemption` only sets
  a flag. At the next :meth:`Checkpointer.maybe_save` every rank agrees (one all-reduce) that a
  preemption is pending, finishes the save in flight, takes a final checkpoint of the current
  state if that step is not saved yet, commits it, moves ``latest`` and exits (``SystemExit``).
  A watchdog bounds all of that by ``preemption_deadline_s``; a second signal or an expired
  deadline ends the process at once (``os._exit``): ``latest`` still names the previous
  committed checkpoint, which nothing has touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import signal
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from .._concurrency import signals as _signals
from .._concurrency.signals import wait_in_slices
from ..errors import CheckpointSaveError, StorageWriteError, unknown_options
from ..format import LATEST_NAME
from ..options import WriterOptions
from ..save import incremental
from ..save.api import async_save
from ..save.compat import STOCK_WRITER_ARGS
from ..save.writer import DataStatesWriter
from ..storage.base import LocalStorage
from . import resume, steps
from .memflush import Flusher
from .memory import MemoryTier
from .memtier import MemorySide
from .options import ABORT_EXIT_CODE, CheckpointerOptions
from .preemption import Agreed, Preemption, agree
from .steps import step_dir_name
from .summary import summary_line

__all__ = ["ABORT_EXIT_CODE", "Checkpointer", "step_dir_name"]

logger = logging.getLogger(__name__)


class Checkpointer:
    """Save ``app_state`` every ``every_steps`` steps with :class:`DataStatesWriter`, keep the
    ``keep_latest_k`` newest committed checkpoints, and save once more on preemption.

    Args:
        root: Local directory holding the checkpoints (shared by all ranks); made if missing,
            and refused at construction if this process cannot write in it.
        every_steps: :meth:`maybe_save` saves when ``step % every_steps == 0`` (an int >= 1).
        keep_latest_k: Committed checkpoints to keep; ``0`` keeps all.
        process_group: A CPU-capable group for DCP's collectives (default: a new gloo group, so
            that the save thread never shares a group with the training loop's collectives).
            The preemption vote and the resume broadcast use a gloo group of their own.
        preemption_signals: Signals that request a preemption save; ``()`` installs no handler
            (nor does a Checkpointer made outside the main thread, where Python allows none).
        preemption_deadline_s: Time from the first signal to the final commit; past it the
            process exits with ``abort_exit_code`` and the previous checkpoint stays ``latest``.
        exit_on_preemption: Raise ``SystemExit(preemption_exit_code)`` once the final
            checkpoint is committed; otherwise :meth:`maybe_save` returns and :attr:`preempted`
            is True.
        writer: A :class:`DataStatesWriter` to reuse (default: one made here, closed by
            :meth:`close`); ``writer_options`` go to the one made here.
        memory: A :class:`~dcp_datastates.checkpointers.memory.MemoryTier`: each save is
            committed in host memory that outlives the process first, then flushed to
            ``root`` in the background (``memtier.py``); a restart loads the newest step
            committed in either, memory first. ``latest`` names the newest durable step. The
            writer made here saves ``node_local`` (one memory directory per node); a writer
            passed in must too where ranks run on several nodes.

    The options of its own are checked as :class:`CheckpointerOptions` (a bad one raises
    ``ValueError`` naming it). :attr:`last_summary` is one line about the newest committed
    save on this rank, also logged at INFO.
    """

    #: The memory tier's flush to ``root`` (a test's subclass blocks it).
    flusher_class: type[Flusher] = Flusher

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        every_steps: int = 100,
        keep_latest_k: int = 0,
        process_group: dist.ProcessGroup | None = None,
        preemption_signals: Iterable[int] = (signal.SIGTERM,),
        preemption_deadline_s: float = 120.0,
        exit_on_preemption: bool = True,
        preemption_exit_code: int = 0,
        abort_exit_code: int = ABORT_EXIT_CODE,
        writer: DataStatesWriter | None = None,
        memory: MemoryTier | None = None,
        **writer_options: Any,
    ) -> None:
        self.options = CheckpointerOptions(
            every_steps=every_steps,
            keep_latest_k=keep_latest_k,
            preemption_deadline_s=preemption_deadline_s,
            exit_on_preemption=exit_on_preemption,
            preemption_exit_code=preemption_exit_code,
            abort_exit_code=abort_exit_code,
        )
        self.root = os.path.abspath(os.fspath(root))
        if "://" in os.fspath(root):
            raise ValueError(f"Checkpointer supports local directories only, got {root!s}")
        vars(self).update(dataclasses.asdict(self.options))  # every_steps, keep_latest_k, ...
        distributed = dist.is_available() and dist.is_initialized()
        # Collectives on one group from two threads can pair up wrongly: DCP's save thread and
        # the training thread (the vote, the user's own collectives) each get a group of their own.
        if distributed and process_group is None:
            process_group = dist.new_group(backend="gloo")
        self.process_group = process_group
        self._vote_group = dist.new_group(backend="gloo") if distributed else None
        self._check_writable()
        if writer is not None and writer_options:
            raise ValueError(
                f"Checkpointer(writer=..., {', '.join(sorted(writer_options))}=...): give the "
                "options to the writer you pass, or pass no writer"
            )
        self._owns_writer = writer is None
        if memory is not None and writer is None:  # each node commits into its own memory
            writer_options.setdefault("node_local", True)
        try:
            self.writer = (
                writer if writer is not None else DataStatesWriter(self.root, **writer_options)
            )
        except TypeError as exc:
            if "unknown option" not in str(exc):
                raise
            own = [p for p in inspect.signature(Checkpointer).parameters if p != "writer_options"]
            known = list(dict.fromkeys([*own[1:], *WriterOptions.names(), *STOCK_WRITER_ARGS]))
            unknown = sorted(set(writer_options) - set(known))
            raise unknown_options("Checkpointer", unknown, known) from None
        self._lock = threading.Lock()
        self._in_flight: tuple[int, threading.Event] | None = None
        self._error: BaseException | None = None
        self._committed_step: int | None = None
        self.last_summary: str | None = None
        #: Bytes this node's memory tier held after the newest save (None without one).
        self.memory_bytes: int | None = None
        self._preemption = Preemption(
            preemption_deadline_s, abort_exit_code, os.path.join(self.root, LATEST_NAME)
        )
        self._requested, self._finished = self._preemption.requested, self._preemption.finished
        self.preempted = False
        signals = tuple(preemption_signals)
        if signals and threading.current_thread() is not threading.main_thread():
            logger.warning(
                "Checkpointer made outside the main thread: no handler for signals %s; call "
                "request_preemption() when the job is told to stop",
                signals,
            )
            signals = ()
        self._signals = signals
        self._memory: MemorySide | None = None
        if memory is not None:
            hooks = (self._on_durable, self._store_error, self.flusher_class)
            self._memory = MemorySide.open(memory, self.root, self._ranks(), *hooks)
        for signum in signals:
            _signals.subscribe(signum, self)  # with any other checkpointer listening

    # -- ranks ---------------------------------------------------------------------------------
    def _dist(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if self._dist() else 0

    def _save_kwargs(self) -> dict[str, Any]:
        if not self._dist():
            return {"no_dist": True}
        return {"process_group": self.process_group}

    def _ranks(self) -> resume.Ranks:
        rank = dist.get_rank(self._vote_group) if self._vote_group is not None else 0
        return resume.Ranks(rank, self._save_kwargs(), self._vote_group)

    def _check_writable(self) -> None:
        """Every rank writes in ``root``: refuse it here, on every rank, if one cannot (the
        first save failed, and said so one call later)."""
        problem = steps.check_writable(self.root, self._rank())
        failing = self._ranks().failing(problem is not None)
        if problem is not None:
            raise problem
        if failing:
            raise StorageWriteError(
                f"rank {self._rank()}: the Checkpointer root {self.root} is not writable on "
                f"rank(s) {failing} (their error says why)"
            )

    # -- saving --------------------------------------------------------------------------------
    def maybe_save(self, step: int, app_state: dict[str, Any]) -> bool:
        """Call once per step, after the optimizer step; returns True if a save was started.

        Raises the error of an earlier background save (once), and ``SystemExit`` after a
        preemption save when ``exit_on_preemption`` is set.
        """
        if self.preempted:
            return False  # the final checkpoint is committed; the loop should stop
        agreed = self._agree()
        if agreed.preempted:
            self._final_save(step, app_state)
            return False
        self._raise_failed(agreed.failed)
        if step % self.every_steps != 0:
            return False
        return self.save(step, app_state)

    def save(self, step: int, app_state: dict[str, Any]) -> bool:
        """Start an async save of ``app_state`` as ``step`` (after the one in flight ends).

        Call it on every rank. An earlier save's error is raised on every rank, at the same
        call, and none saves (:meth:`_raise_failed`).

        A step committed already (a run resumed by other means saves the step ``latest``
        names) is saved beside it and swapped in once committed (``steps.py``)."""
        self._wait_in_flight()
        replacing = False
        # Bounds what memory holds (may wait for a flush); False: memory was full, to root.
        to_memory = self._memory is not None and self._memory.before_save(self._ranks())
        if not to_memory and self._rank() == 0 and step != self._committed_step:
            steps.settle(self.root)  # what a crash left of a replacement; none is in flight
            replacing = steps.is_committed(steps.path(self.root, step))
        agreed = self._agree(vote_preemption=False, replacing=replacing)
        self._raise_failed(agreed.failed)
        if step == self._committed_step:
            return False  # already committed from this state: nothing to save
        path = steps.path(self.root, step) + (steps.REPLACING if agreed.replacing else "")
        if self.writer.options.incremental and self._memory is None:
            self._seed_incremental()
        if to_memory and self._memory is not None:
            path = self._memory.step_path(step)  # the flush to root replaces a committed one
        response = async_save(app_state, self.writer, checkpoint_id=path, **self._save_kwargs())
        done = threading.Event()
        with self._lock:
            self._in_flight = (step, done)
        response.upload_completion.add_done_callback(
            lambda f, s=step, d=done, p=path: self._on_done(s, p, f, d)
        )
        return True

    def _on_done(self, step: int, path: str, fut: Future[Any], done: threading.Event) -> None:
        """Runs on DCP's save thread once the save is committed (or failed) on this rank."""
        exc = fut.exception()
        committed = exc is None
        in_memory = self._memory is not None and path == self._memory.step_path(step)
        if exc is not None and in_memory:
            self._memory.save_failed(step, exc)
        elif exc is None and in_memory:
            self._memory.flush(step)  # committed in memory: `latest` moves once it is durable
        elif exc is None:
            try:
                if self._rank() == 0:
                    committed = False
                    if path != steps.path(self.root, step):
                        steps.swap_in(self.root, step)
                    LocalStorage(self.root).put_atomic(LATEST_NAME, f"{step}\n".encode(), sync=True)
                    committed = True  # `latest` names it: a retention failure leaves it so
                    self._purge(step)
            except BaseException as e:  # noqa: BLE001 - reported once through maybe_save/wait
                exc = e
        if committed:
            self._summarize(step, path)
        with self._lock:
            if committed:
                self._committed_step = step
            if exc is not None:
                what = "retention after the checkpoint of" if committed else "checkpoint of"
                logger.error("%s step %d in %s failed: %s", what, step, self.root, exc)
                self._error = self._error or exc
            if self._in_flight is not None and self._in_flight[1] is done:
                self._in_flight = None
        done.set()

    def _summarize(self, step: int, path: str) -> None:
        """:attr:`last_summary` and its INFO line, from the writer's figures for this save."""
        stats = self.writer.last_stats
        if stats is None or os.path.normpath(stats.checkpoint_id) != os.path.normpath(path):
            return  # a writer shared with other saves has moved on
        self.last_summary = summary_line(step, stats)
        if self._memory is not None:
            self.memory_bytes = self._memory.bytes_held()
            self.last_summary += f", {self.memory_bytes / 1e6:.1f} MB held in memory on this node"
        logger.info("%s", self.last_summary)

    def _on_durable(self, step: int) -> None:
        """Rank 0, on the flush thread: ``step`` is committed in ``root`` (from memory)."""
        LocalStorage(self.root).put_atomic(LATEST_NAME, f"{step}\n".encode(), sync=True)
        self._purge(step)

    def _store_error(self, exc: BaseException) -> None:
        with self._lock:
            self._error = self._error or exc

    def wait(self) -> None:
        """Wait for the save in flight (committed and ``latest`` moved); raise this rank's error
        of an earlier save once."""
        self._wait_in_flight()
        if self._memory is not None:
            self._memory.flusher.wait()  # and durable in root
        self._raise_pending_error()

    def _wait_in_flight(self) -> None:
        with self._lock:
            pending = self._in_flight
        if pending is not None:
            # Set at the end of `_on_done`: committed and `latest` moved. In slices: a hung
            # commit must not keep a SIGTERM's handler from running (see _signals).
            wait_in_slices(pending[1].wait)

    def _raise_pending_error(self) -> None:
        with self._lock:
            exc, self._error = self._error, None
        if exc is not None:
            raise exc

    def _raise_failed(self, failed: list[int]) -> None:
        """Raise an earlier save's error on every rank when ``failed`` (the ranks holding one,
        agreed by :meth:`_agree`) is not empty.

        Some errors are one rank's alone (rank 0 writes ``latest`` and runs retention): raised
        there only, that rank skipped the vote and the save the others went on to, which then
        waited for it in their collectives; a loop that caught the error went on with its
        collectives paired one call apart. Ranks without an error of their own raise
        :class:`CheckpointSaveError` naming the ranks that have one."""
        if not failed:
            return
        self._raise_pending_error()
        raise CheckpointSaveError(
            f"rank {self._rank()}: an earlier checkpoint failed on rank(s) {failed} (the error "
            "is raised and logged there); every rank raises at this call and none saves this "
            "step, so that they all go on in step: catch it to go on training"
        )

    # -- retention -----------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps of the committed checkpoints under ``root``, oldest first."""
        return sorted(step for step, committed in steps.listing(self.root).items() if committed)

    def _purge(self, newest: int) -> None:
        if self.keep_latest_k:
            steps.purge(self.root, newest, self.keep_latest_k)

    # -- loading -------------------------------------------------------------------------------
    def _seed_incremental(self) -> None:
        """After a restart, an incremental writer's first save may reuse the newest step's
        records (``incremental.seed``: on their content proof alone)."""
        try:
            newest = self.latest_step()
        except (OSError, ValueError):  # a damaged ``latest``: nothing to offer
            return
        if newest is not None:
            incremental.seed(self.writer, steps.path(self.root, newest), self._rank())

    def latest_step(self) -> int | None:
        """The step ``latest`` names on this rank's view of ``root``, or None."""
        return steps.read_latest(self.root)

    def load_latest(self, app_state: dict[str, Any], **reader_options: Any) -> int | None:
        """Load the newest checkpoint that loads into ``app_state``; returns its step, or None
        (nothing loaded) if there is no committed one.

        Tries the step ``latest`` names, then the older committed ones, newest first: one that
        is damaged or not committed is passed over, with a warning saying why. All ranks load
        the same step (rank 0 picks the order; they agree on each try). If none loads, raises
        :class:`~dcp_datastates.CheckpointLoadError` listing each step tried and why."""
        self._wait_in_flight()  # DCP's collectives of a save and a load must not interleave
        if self._memory is not None:
            self._memory.flusher.wait()
        order = steps.resume_order(self.root) if self._rank() == 0 else []
        if self._memory is not None:
            step = self._memory.load_newest(order, app_state, reader_options, self._ranks())
        else:
            step = resume.load_newest(self.root, order, app_state, reader_options, self._ranks())
        if step is not None:
            self._committed_step = step
        return step

    def load(self, app_state: dict[str, Any], *, step: int, **reader_options: Any) -> int:
        """Load the checkpoint of ``step`` into ``app_state`` on every rank; returns ``step``.

        Raises :class:`~dcp_datastates.CheckpointNotCommittedError` listing the committed steps
        if it has none, and :class:`~dcp_datastates.CheckpointLoadError` if it does not load
        (no fallback: that step was asked for). ``latest`` does not move. With a memory tier,
        a step committed in memory on every rank loads from there (and is then flushed to
        ``root`` if it is not durable yet), else from ``root``; memory then keeps only that
        step (a newer one there must not be what a restart resumes from)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be an int >= 0: one of committed_steps()")
        self._wait_in_flight()
        if self._memory is not None:
            self._memory.flusher.wait()  # it keeps only `step` in memory then
            self._memory.load_step(step, app_state, reader_options, self._ranks())
        else:
            resume.load_step(self.root, step, app_state, reader_options, self._ranks())
        self._committed_step = step
        return step

    # -- preemption ----------------------------------------------------------------------------
    def request_preemption(self) -> None:
        """What the signal does: save at the next :meth:`maybe_save`, then exit."""
        self._preemption.request()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._preemption.on_signal(signum)

    def _agree(self, *, vote_preemption: bool = True, replacing: bool = False) -> Agreed:
        """One all-reduce on the vote group: whether any rank saw a preemption (acted on by
        all, at the same step), the ranks holding an earlier save's error (raised by all,
        :meth:`_raise_failed`), and whether the step to save is committed already (rank 0's
        ``replacing``: every rank must save to the same directory)."""
        flag = vote_preemption and self._requested.is_set()
        with self._lock:
            failed = self._error is not None
        agreed = agree(self._vote_group if self._dist() else None, flag, failed, replacing)
        if agreed.preempted and not flag:
            self.request_preemption()
        return agreed

    def _final_save(self, step: int, app_state: dict[str, Any]) -> None:
        logger.warning("preemption: final checkpoint of step %d in %s", step, self.root)
        with contextlib.suppress(Exception):
            self.wait()  # finish the save in flight; a failure there must not stop the final one
        self.save(step, app_state)
        self.wait()
        self.preempted = True
        self._finished.set()
        # Other checkpointers told of the same signal (a model's and an EMA's) save first: the
        # last one to finish its final save ends the process.
        pending = [
            c
            for c in _signals.listeners()
            if c is not self and c._requested.is_set() and not c._finished.is_set()
        ]
        if self.exit_on_preemption and not pending:
            raise SystemExit(self.preemption_exit_code)

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the save in flight, restore signal handlers, close an owned writer; remove
        the memory tier's segment once every step in it is durable."""
        durable = False
        try:
            self.wait()
            durable = True
        finally:
            for signum in self._signals:
                with contextlib.suppress(ValueError):  # not the main thread
                    _signals.unsubscribe(signum, self)
            self._signals = ()
            if self._memory is not None:
                self._memory.close(remove=durable)  # else a restart still finds it
            if self._owns_writer:
                self.writer.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
