"""``DataStatesWriter``: the DCP ``StorageWriter`` and ``AsyncStager`` that runs our stages.

It is both, on purpose: DCP only streams if the object that stages (``stage()``) is the one that
writes (``write_data()``), because the snapshot started in one is consumed by the other.

Lifecycle of one save (the state names appear in code, logs and docs)::

    state      thread                 rank          call
    ---------  ---------------------  ------------  -----------------------------------------------
    STAGED     caller (training)      every         stage(sd): record sd (structure, version
                                                    counters, copies of tiny tensors; capture.py)
                                                    and return; the planning thread plans this
                                                    rank's items, makes the providers, queues the
                                                    snapshot. (A state with device tensors,
                                                    subclasses or objects is planned right here.)
                                                    Copies run on the snapshot threads from here;
                                                    the next forward copies module buffers first
                                                    (forward gate);
                                                    optimizer.step() waits for them (the guard).
    PLANNING   DCP save thread        every         reset(id), set_up_storage_writer: claim the
                                                    staged snapshot (refused if its process
                                                    group is gone); prepare_local_plan: wait
                                                    for earlier saves to the same directory
                                                    (path_turns.py), raise the snapshot's error
                                                    if it failed already, mkdir
                                      coordinator   prepare_global_plan: refuse ranks naming
                                                    different checkpoints, remove old commit
                                                    records, name each rank's files
    FLUSHING   DCP save thread +      every         write_data: files written as pieces land;
               flush threads                        a plain dcp.save (no stage) snapshots here
    SAFE       snapshot threads       every         all pieces copied (or written from the live
                                                    tensors): staged future resolves
    DURABLE    flush threads          every         every file of this rank fsynced once
    COMMITTED  DCP save thread        coordinator   finish: manifest, then .metadata atomically
    RETIRED    any                    every         the save is over: pool blocks back, no
                                                    reference to the caller's tensors kept

A save that fails anywhere reports once, through the future DCP hands back (or ours from
``dcp_datastates.async_save``), and releases its pool blocks. Two saves may overlap: their
snapshots queue for the pool in order, their flushes run on their own DCP threads.

This module is the DCP contract only. The sessions themselves (pool, threads, the hand-off from
``stage()`` to the save thread, reaping and dropping) belong to ``snapshot/runtime.py``; every
use of a DCP private name is in ``_dcp_private.py``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import errno
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from .. import _dcp_private
from .._concurrency.futures import RelayFuture
from ..errors import InvalidStateDictError, WriterClosedError, WriterUsageError
from ..format import new_save_id
from ..snapshot.capture import Capture
from ..snapshot.replay import CaptureCache
from ..snapshot.session import SnapshotSession
from ..stats import SaveStats
from ..storage import localfile
from ..storage.base import Storage, is_local, storage_for
from . import commit as _commit
from . import path_turns
from .compat import lazy_staging_planner, stock_stage, writer_options
from .planner import (
    PLANNED_KEY,
    GlobalPlanMemo,
    is_planned_elsewhere,
    plan_providers,
    planned_elsewhere,
    provider_from_any_planner,
)
from .process_staging import daemon_runtime, raise_relayed, stage_for_process
from .runtime import SnapshotRuntime

logger = logging.getLogger(__name__)

#: (writer, call) announced by dcp_datastates.async_save for the stage() it is about to cause.
_ANNOUNCED: contextvars.ContextVar[tuple[Any, _dcp_private.AsyncSaveCall] | None] = (
    contextvars.ContextVar("dcp_datastates_announced_call", default=None)
)


def _current_rank() -> int:
    return dist.get_rank() if _dcp_private.DIST_AVAILABLE and dist.is_initialized() else 0


def _world_size(call: _dcp_private.AsyncSaveCall) -> int:
    """Ranks in the process group a save staged now runs on (1 for a save without one)."""
    if call.no_dist or not (_dcp_private.DIST_AVAILABLE and dist.is_initialized()):
        return 1
    return dist.get_world_size(call.process_group)


def lost_process_group(stats: SaveStats | None) -> WriterUsageError | None:
    """The error for a save staged in a process group of several ranks whose save thread finds
    none: the script destroyed it right after the call (a user sweep). DCP then saved each rank
    as rank 0 of one, into the same files, and committed one rank's state as the whole."""
    if stats is None or stats.world_size == 1:
        return None
    if _dcp_private.DIST_AVAILABLE and dist.is_initialized():
        return None
    return WriterUsageError(
        f"rank {stats.rank}: the save to {stats.checkpoint_id} was staged in a process group "
        f"of {stats.world_size} ranks, which was destroyed before its save ran; nothing was "
        "written. Wait for the save (its future, or writer.close()) before "
        "dist.destroy_process_group()"
    )


def _refuse_file_target(path: str | os.PathLike) -> None:
    """Refuse, on the caller's thread, a local checkpoint path that is an existing file.

    Otherwise the save only fails later on DCP's save thread (``prepare_local_plan``), and the
    caller of an async save learns it from a traceback of that thread.
    """
    text = os.fspath(path)
    if is_local(text) and os.path.isfile(local := text.removeprefix("file://")):
        root = os.path.abspath(local)  # as LocalStorage names it
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"checkpoint path {root} exists and is not a directory; pick another path",
            root,
        )


class _Save:
    """Per-save state, held thread-locally on the thread DCP runs the save on."""

    def __init__(
        self, path: str, turn: path_turns.Turn, storage_options: Any = None, *, direct: bool = True
    ) -> None:
        self.path = path
        self.turn = turn  # its place among saves to its directory (path_turns.py)
        self.storage_options = storage_options
        self.direct = direct
        self.rank = _current_rank()
        self.is_coordinator = True
        self.use_collectives = True
        # StorageMeta.save_id, as stock writers make one; ours says a manifest was committed.
        self.save_id = new_save_id()
        self.session: SnapshotSession | None = None
        self.stats: SaveStats | None = None
        self.started = time.monotonic()
        self.synchronous = False  # a plain dcp.save: no stage(), the caller waits throughout
        self.done = False  # this rank will make no more writer calls for this save

    @property
    def commit_rank(self) -> int | None:
        """Whose commit record this save writes: None for ``.metadata``, else the rank's own."""
        return None if self.use_collectives else self.rank

    @functools.cached_property
    def storage(self) -> Storage:
        return storage_for(self.path, self.storage_options, direct=self.direct)


@dataclasses.dataclass(frozen=True)
class _RankTarget:
    """A local plan's ``storage_data`` until the global plan: the checkpoint this rank saves
    to, so that the coordinator refuses a save whose ranks name different checkpoints before
    any of them writes (a path built from the clock on each rank: each rank's files landed in
    its own directory and the commit failed on a file missing from the coordinator's)."""

    path: str


def _refuse_split_targets(plans: Sequence[SavePlan]) -> None:
    """Raises ``WriterUsageError`` naming each rank's checkpoint where the ranks' local plans
    (:class:`_RankTarget`) name more than one."""
    if _dcp_private.plan_caching_in_use():  # cached plans name earlier saves' checkpoints
        return
    ranks_at: dict[str, list[int]] = {}
    for rank, plan in enumerate(plans):
        if isinstance(plan.storage_data, _RankTarget):
            ranks_at.setdefault(plan.storage_data.path, []).append(rank)
    if len(ranks_at) < 2:
        return
    shown = sorted(ranks_at.items(), key=lambda kv: kv[1][0])
    where = "; ".join(
        f"rank {ranks[0]}: {path}" + (f" (and {len(ranks) - 1} more ranks)" if ranks[1:] else "")
        for path, ranks in shown[:4]
    )
    more = f"; {len(shown) - 4} more paths" if len(shown) > 4 else ""
    raise WriterUsageError(
        f"the ranks of one save name {len(shown)} different checkpoints ({where}{more}); "
        "nothing was written. Pass every rank the same checkpoint_id: build it on one rank "
        "(e.g. from the step, not the clock) or broadcast rank 0's"
    )


def fails_on_every_rank(error: Exception, call: _dcp_private.AsyncSaveCall) -> bool:
    """Whether ``stage()`` hands ``error`` (about the state dict) to the save rather than raise
    it: in a save whose ranks plan and commit together, where the other ranks would wait for
    this one in DCP's collectives. (With the PROCESS executor the staging sends it to the
    daemon in place of the state: ``process_staging.failed_state``.)"""
    if isinstance(error, (WriterClosedError, WriterUsageError)):
        return False  # about the writer or the call: the same on every rank
    if not call.found:
        return False
    return _world_size(call) > 1


def _raise(error: BaseException) -> Any:
    raise error


@_dcp_private.no_synchronize_after_execute
class DataStatesWriter(StorageWriter, AsyncStager):
    """A DCP storage writer with a lazy snapshot and a streaming flush.

    Takes every argument of stock ``FileSystemWriter``, by name and in the same positions (see
    :mod:`dcp_datastates.save.compat` and the README's table); our own options are keyword-only.

    Args:
        path: Checkpoint directory: a local path or any fsspec URL. ``checkpoint_id`` passed to a
            DCP call overrides it for that save.
        single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict: Accepted for
            compatibility, without effect.
        sync_files, overwrite: As stock (and :class:`~dcp_datastates.WriterOptions`).
        thread_count: Files written in parallel per rank (``flush_workers``).
        _extensions: Must be empty: stream transforms (compression) are refused.
        serialization_format: ``TORCH_SAVE`` only.
        **options: Keyword-only fields of :class:`~dcp_datastates.WriterOptions`
            (``host_pool_bytes``, ``flush_workers``, ``guard_optimizer_step``, ...).

    Attributes:
        last_stats: :class:`~dcp_datastates.SaveStats` of the most recent save on this rank.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int | None = None,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: Any = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.options = writer_options(
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
            _extensions=_extensions,
            serialization_format=serialization_format,
            options=options,
        )
        self.save_id: str | None = None  # the latest save's StorageMeta.save_id
        self.last_stats: SaveStats | None = None
        self.last_failed_stats: SaveStats | None = None
        # Stock FileSystemWriter's attributes, for code that reads them (accepted, no effect).
        self.single_file_per_rank = single_file_per_rank
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        self._init_runtime_state()

    # Stock FileSystemWriter's attributes that are options of ours (a user sweep: code reading
    # writer.overwrite or writer.thread_count broke on ours).
    @property
    def sync_files(self) -> bool:
        return self.options.sync_files

    @property
    def overwrite(self) -> bool:
        return self.options.overwrite

    @property
    def thread_count(self) -> int:
        """Files written in parallel per rank: ``flush_workers``."""
        return self.options.flush_workers

    def _init_runtime_state(self) -> None:
        self._unpickled = False
        self._runtime = SnapshotRuntime(self.options, self.path)
        # A writer dropped without close() gives its pool and threads back when collected.
        # The runtime and its threads never refer to the writer, so collection can happen.
        self._finalizer = weakref.finalize(self, self._runtime.abandon)
        self._local = threading.local()
        self._process_staged: Future[None] | None = None
        # The last layout of the state saved, replayed by the next stage() (replay.py).
        self._captures = CaptureCache(self.options.eager_copy_bytes)
        # The last single-rank global plan, for a save that replays it (planner.py).
        self._global_plans = GlobalPlanMemo()

    # The PROCESS executor pickles the writer into a daemon: ship options, not threads or memory.
    def __getstate__(self) -> dict[str, Any]:
        if self._runtime.has_unclaimed():
            # stage() took this for a THREAD-executor save (live tensors, streamed from here),
            # but the writer is being pickled: DCP is running it in another process.
            error = WriterUsageError(
                f"the DataStatesWriter for {self.path} is being pickled while a snapshot it "
                "staged for an in-process save is pending: stage() did not recognise the "
                "PROCESS executor. Use dcp_datastates.async_save(..., "
                "async_checkpointer_type=AsyncCheckpointerType.PROCESS) instead"
            )
            self._runtime.drop_unclaimed(error)
            raise error
        return {
            "path": self.path,
            "options": self.options,
            "single_file_per_rank": self.single_file_per_rank,
            "per_thread_copy_ahead": self.per_thread_copy_ahead,
            "cache_staged_state_dict": self.cache_staged_state_dict,
            "last_stats": None,
            "last_failed_stats": None,
            "save_id": None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime_state()
        # DCP's checkpoint daemon unpickles a new writer for every request and never closes it:
        # they all share one runtime (pool and threads) per options, so the daemon stays flat.
        self._finalizer.detach()  # the shared runtime outlives every writer unpickled here
        self._unpickled = True
        self._runtime = daemon_runtime(
            self.options, lambda: SnapshotRuntime(self.options, "the checkpoint daemon")
        )

    def close(self, timeout: float | None = None) -> None:
        """Refuse new saves from now on, wait for the saves already staged or writing to end,
        and release the host pool and the writer's threads.

        A snapshot staged by ``dcp.async_save`` is waited for (its save is about to run); one
        staged by calling ``stage()`` directly, which no save will write, is dropped. With
        ``timeout``, saves still open after that many seconds fail with
        :class:`~dcp_datastates.errors.SnapshotAbortedError`. Calling it again is a no-op.
        A writer unpickled in DCP's checkpoint daemon leaves the daemon's shared runtime open;
        one inherited by a child of ``os.fork()`` is the parent's, and is left alone.
        """
        if self._runtime.inherited:  # in a child of os.fork(): the parent's, nothing to close
            self._finalizer.detach()  # (a parent thread may have held the caches' locks)
            return
        if not self._unpickled:
            self._runtime.close(timeout)
            localfile.release_spare_buffers()
        self._captures.forget()
        self._global_plans.forget()
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._runtime.closed

    # -- AsyncStager -------------------------------------------------------------------------
    def _returning_from_async_save(self) -> None:
        """``dcp.async_save`` started the save thread and is returning (``_dcp_private``): the
        planning thread may take the GIL now (``SnapshotRuntime.caller_returning``)."""
        self._runtime.caller_returning()

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE | Future[STATE_DICT_TYPE]:
        """Start the lazy snapshot of ``state_dict`` and return at once (see the lifecycle).

        Returns ``state_dict``, or, to a plain ``dcp.async_save`` with DCP's default planner of
        a state this writer recorded (and so plans itself), a placeholder of which that planner
        plans nothing: the writer's plan takes its place (``planner.PlannedElsewhere``)."""
        start = time.monotonic()
        self._runtime.check_open()
        call = self._which_call()
        _refuse_file_target(call.checkpoint_id or self.path)
        if call.mode == "process":
            staged = stage_for_process(
                state_dict,
                guard=self.options.guard_optimizer_step,
                guard_forward=self.options.guard_forward,
                eager_copy_bytes=self.options.eager_copy_bytes,
                state_error=call.state_error,
                relay=functools.partial(fails_on_every_rank, call=call),
            )
            self._process_staged = staged.staged
            self._local.staged_stats = None
            return staged.result
        if call.planner is not None and not lazy_staging_planner(call.planner):
            # A planner of the user's decides what is saved (resolve_data): stage as stock does,
            # a blocking CPU copy, and let write_data resolve every item through that planner.
            copied = stock_stage(state_dict)
            done: Future[None] = Future()
            done.set_result(None)
            self._process_staged = done  # staging_future: complete, not the runtime's
            self._local.staged_stats = None
            return copied
        rank = _current_rank()
        stats = SaveStats(
            checkpoint_id=os.fspath(call.checkpoint_id or self.path),  # set_up_storage_writer
            rank=rank,  # writes the storage's name for it; a save failing first has this one
            pool_bytes=self._runtime.pool_capacity,
            world_size=_world_size(call),
        )
        path_turns.end_owned()  # a plain dcp.save this thread ran has returned
        turn = path_turns.take(call.checkpoint_id or self.path)
        try:
            staged = self._stage_session(state_dict, call, stats, turn, start)
        except BaseException:
            turn.leave()  # no save will run: the saves after it need not wait
            raise
        self._process_staged = None
        self._local.staged_stats = stats
        stats.blocked_s = stats.stage_s = time.monotonic() - start
        return staged

    def _stage_session(
        self,
        state_dict: STATE_DICT_TYPE,
        call: _dcp_private.AsyncSaveCall,
        stats: SaveStats,
        turn: path_turns.Turn,
        start: float,
    ) -> STATE_DICT_TYPE:
        """stage()'s snapshot: recorded for the planning thread, or planned here."""
        rank = stats.rank
        try:
            if call.state_error is not None:
                raise call.state_error
            captured = self._captures.capture(state_dict)
            items = None if captured is not None else plan_providers(state_dict)
        except Exception as exc:
            if not fails_on_every_rank(exc, call):
                raise
            # Raised here, on this rank only, the error would leave the other ranks' saves
            # waiting in DCP's collectives for good: it fails this rank's save instead (its
            # write_data raises it), which DCP reports to every rank.
            logger.error(
                "rank %d: the state cannot be saved (%s: %s); the save fails on every rank",
                rank,
                type(exc).__name__,
                exc,
            )
            session = self._runtime.stage_later(
                functools.partial(_raise, exc),
                (stats, turn),
                rank=rank,
                started=start,
                expect_claim=True,
            )
            turn.dropped_with(session)
            return state_dict
        staged: STATE_DICT_TYPE = state_dict
        if captured is not None:  # host tensors and plain values: plan on the planning thread
            if call.found and call.planner is None and not self._announced():
                # A plain dcp.async_save: its save thread plans what this returns with a
                # DefaultSavePlanner of DCP's; the planning thread's plan takes its place.
                staged = planned_elsewhere()
            stats.eager_bytes = captured.eager_bytes
            session = self._runtime.stage_later(
                functools.partial(self._plan_captured, captured, call),
                (stats, turn),
                rank=rank,
                started=start,
                expect_claim=call.found,
                after=functools.partial(self._captures.learn, captured),
            )
        else:
            assert items is not None
            session = self._runtime.new_session(
                items, rank, expected_bytes=_expected_write_bytes(items, call)
            )
            try:
                stats.eager_bytes = session.freeze_small(self.options.eager_copy_bytes)
            except BaseException as exc:
                self._runtime.abort(session, exc)
                raise
            self._runtime.stage(session, (stats, turn), started=start, expect_claim=call.found)
        turn.dropped_with(session)
        return staged

    def _plan_captured(
        self, captured: Capture, call: _dcp_private.AsyncSaveCall
    ) -> tuple[list[tuple[Any, Any]], int]:
        """On the planning thread: the items (and the bytes this rank will write) of what
        ``stage()`` recorded."""
        captured.resolve()
        if self._runtime.pool is None:
            # The first save: faulting the pool in (pool.py) overlaps the planning below. The
            # save is staged: a close() since waits for it, so the pool is made even then.
            self._runtime.prepare(
                captured.tensor_bytes() + 64 * captured.tensors, _current_rank(), staged=True
            )
        items = plan_providers(
            captured.state,
            versions=captured.versions,
            previous=captured.previous_plan,
            private=captured.private,
            probes=captured.probes,
        )
        captured.local_plan, captured.previous_plan = items.local_plan, None
        return items, _expected_write_bytes(items, call)

    def warm_up(self, state_dict: STATE_DICT_TYPE, *, wait: bool = False) -> None:
        """Allocate the host pool for saves of ``state_dict`` now, and fault it in on a
        background thread, so that the first save runs as fast as the next ones (a fresh pool's
        first touch costs about a second per GB). Optional: the first save otherwise starts the
        same work itself, overlapped with its planning and copies. ``wait``: return only once
        the whole pool is faulted in. No effect on the pool once a save has sized it.

        On the calling thread, before any save, it also records the state's layout and plans it
        once (``snapshot/replay.py``; about 10 us a tensor), as a first save would, where the
        replay covers the state (host tensors, dicts, lists and scalars; not DTensors): the
        first save then replays that layout and reuses that plan where it still holds, instead
        of walking and planning in full (at 1,000-20,000 tensors its time to safe was 1.2-4.3x the
        steady state's after a ``warm_up`` that only made the pool). For a local checkpoint
        written with ``direct_writes``, the flush's aligned buffers (one per file, 32 MiB each)
        are mapped and faulted in here too, on the calling thread, and the threads a first save
        starts (planning, copies, one save thread) are started."""
        tensors = _tensors_of(state_dict)
        nbytes = sum(t.numel() * t.element_size() for t in tensors) + 64 * len(tensors)
        pool = self._runtime.prepare(nbytes, _current_rank())
        self._runtime.start_threads()
        opts = self.options
        if opts.direct_writes and opts.sync_files and is_local(self.path):
            localfile.prepare_buffers(opts.flush_workers)
        if not self._captures.has_record():
            self._learn_layout(state_dict)
        if wait:
            pool.wait_populated()

    def _learn_layout(self, state_dict: STATE_DICT_TYPE) -> None:
        """What a first save's ``stage()`` and planning thread record of ``state_dict``: its
        layout and local plan (nothing is copied for a save; the plan's providers are dropped)."""
        captured = self._captures.capture(state_dict)
        if captured is None:  # device tensors, subclasses, objects: planned at each stage()
            return
        captured.resolve()
        items = plan_providers(
            captured.state,
            versions=captured.versions,
            private=captured.private,
            probes=captured.probes,
        )
        captured.local_plan = items.local_plan
        self._captures.learn(captured)

    def _which_call(self) -> _dcp_private.AsyncSaveCall:
        """Which save called stage(): told by dcp_datastates.async_save, else read off DCP's
        frame. Refuses a call that cannot produce a correct checkpoint."""
        told = _ANNOUNCED.get()
        if told is not None and told[0] is self:
            return told[1]
        call = _dcp_private.async_save_call(depth=2)
        if not call.found:
            _dcp_private.warn_call_not_found()
            return call
        if call.storage_writer is not self:
            other = type(call.storage_writer).__name__ if call.storage_writer else "none"
            raise WriterUsageError(
                f"a DataStatesWriter can only stage for itself (it streams its own snapshot in "
                f"write_data), but dcp.async_save was given storage_writer={other}. Pass "
                "storage_writer=DataStatesWriter(path) and no async_stager, or use "
                "dcp_datastates.async_save(state_dict, path); to save with another storage "
                "writer, leave async_stager out (DCP's DefaultStager)"
            )
        return call

    def _announced(self) -> bool:
        """Whether dcp_datastates.async_save told this thread's next stage() its call."""
        told = _ANNOUNCED.get()
        return told is not None and told[0] is self

    def _announce(self, call: _dcp_private.AsyncSaveCall) -> contextvars.Token:
        """dcp_datastates.async_save says which call the next stage() on this thread is for."""
        return _ANNOUNCED.set((self, call))

    def _staged_stats(self) -> SaveStats | None:
        """The record of the last stage() on this thread (what async_save reports into)."""
        return getattr(self._local, "staged_stats", None)

    def _abandon_staged(self, error: BaseException) -> None:
        """The dcp.async_save that staged failed before its save could start."""
        self._runtime.drop_unclaimed(error)

    def synchronize_staging(self) -> None:
        """Wait until the last staged snapshot is complete (the state may then change)."""
        staged = self.staging_future
        if staged is not None:
            staged.result()

    @property
    def staging_future(self) -> Future[None] | None:
        """Resolves when the most recent ``stage()``'s snapshot is complete."""
        if self._process_staged is not None:
            return self._process_staged
        return self._runtime.last_staged

    # -- StorageWriter -----------------------------------------------------------------------
    def _begin(self, path: str) -> _Save:
        """The first writer call of a save on this thread: new per-save state, and claim the
        snapshot staged for it (claiming first, so that a save dying later is seen dead)."""
        claimed = self._runtime.claim()
        if claimed is None:
            self._runtime.check_open_to_save()  # a closed writer finishes staged saves only
        session = stats = None
        if claimed is not None:
            session, (stats, turn) = claimed
        else:
            turn = path_turns.take(path)  # a plain dcp.save takes its turn here
        turn.run_here()
        save = self._local.save = _Save(
            path, turn, self.options.storage_options, direct=self.options.direct_writes
        )
        if session is not None:
            save.session, save.stats, save.started = session, stats, session.created
        return save

    @staticmethod
    def _writers_plan(save: _Save, placeholder: SavePlan) -> SavePlan:
        """The local plan of the snapshot this save claimed, in place of DCP's plan of the
        placeholder state dict ``stage()`` returned (``planner.PlannedElsewhere``)."""
        session = save.session
        if session is not None and session.local_plan is not None:
            return session.local_plan
        if session is not None and session.error is not None:
            return placeholder  # planning failed: write_data raises its error, as before
        raise WriterUsageError(
            f"rank {save.rank}: DCP is saving the placeholder state dict that "
            f"DataStatesWriter.stage() returns ({PLANNED_KEY!r}) but this save claimed no "
            "snapshot the writer planned; pass that state dict only to the dcp.async_save "
            "that staged it"
        )

    def _staged_local_plan(self) -> SavePlan | None:
        """The local plan of the snapshot this thread's save claimed, when the writer planned it
        (``planner.StagedSavePlanner``); None otherwise."""
        save = getattr(self._local, "save", None)
        if save is None or save.done or save.session is None:
            return None
        return save.session.local_plan

    def _save(self) -> _Save:
        save = getattr(self._local, "save", None)
        if save is None or save.done:
            save = self._begin(self.path)
        return save

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._begin(os.fspath(checkpoint_id) if checkpoint_id else self.path)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        save = self._save()
        save.is_coordinator = is_coordinator
        if kwargs.get("rank") is not None:
            save.rank = kwargs["rank"]
        # use_collectives=False (DCP passes it to a "kwargs" parameter): every rank plans,
        # writes and commits on its own, __{rank}_*.distcp and __{rank}.metadata, as stock does.
        save.use_collectives = kwargs.get("use_collectives", True)
        if not save.use_collectives:
            save.is_coordinator = True
        lost = lost_process_group(save.stats) if save.session is not None else None
        if lost is not None:  # an error nobody may wait for: the script is ending
            logger.error("%s", lost)
            raise lost
        if save.stats is None:
            save.stats = SaveStats(checkpoint_id="", rank=save.rank)
        save.stats.checkpoint_id = save.storage.describe("").rstrip("/")
        save.stats.rank = save.rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        save = self._save()
        save.turn.wait(save.storage.describe("").rstrip("/"))  # earlier saves to it end first
        if save.session is not None and save.session.error is not None:
            # The snapshot failed already (a state stage() could not save, a Stateful that
            # raised, a change seen by a copy): raised in this local step, DCP reports it to
            # every rank before the global plan, which a rank missing items could fail first.
            # Retired first, as write_data does: kept in the runtime's list, its error's
            # traceback (DCP's frames) held the writer, its threads and pool, and the state
            # dict for good (a user sweep: 16 MB and 3 threads per failed save).
            error = save.session.error
            self._runtime.abort(save.session, error)
            raise error
        raise_relayed(plan)  # in DCP's daemon: this rank's staging failed (PROCESS executor)
        save.storage.makedirs()
        if save.is_coordinator and not self.options.overwrite:
            # Refused in the local step, as stock refuses: an error in the global step leaves
            # DCP's plan cache (enable_plan_caching) half updated, and the next save then
            # committed metadata naming items no rank wrote (a user sweep).
            self._refuse_overwrite(save)
        if is_planned_elsewhere(plan):
            plan = self._writers_plan(save, plan)
        if not save.use_collectives:
            plan = dataclasses.replace(plan, storage_data=f"__{save.rank}_")
        elif plan.storage_data is None and dist.is_initialized() and dist.get_world_size() > 1:
            # Several processes: the coordinator checks that every rank names one checkpoint.
            # (A single rank's plan keeps its identity, which GlobalPlanMemo matches by.)
            target = _RankTarget(save.storage.describe("").rstrip("/"))
            plan = dataclasses.replace(plan, storage_data=target)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save = self._save()
        _refuse_split_targets(plans)  # before anything is removed or written
        # Also the records of a save with the other use_collectives setting: its data files have
        # the same names (a user sweep: overwrite=False saved over one, and an old .metadata
        # was left committing overwritten data).
        records = self._refuse_overwrite(save)
        if records:
            _commit.uncommit(save.storage, records, sync=self.options.sync_files)
            logger.warning(
                "overwriting the checkpoint at %s (removed %s first)",
                save.storage.describe(""),
                ", ".join(records),
            )
        # A plan keeps the prefix it has (a rank's own, without collectives; a cached plan's).
        return [
            p if isinstance(p.storage_data, str) else dataclasses.replace(p, storage_data=f"__{i}_")
            for i, p in enumerate(plans)
        ]

    def _refuse_overwrite(self, save: _Save) -> list[str]:
        """The commit records at the save's path (:func:`commit.commit_records`); raises
        ``FileExistsError`` if there are any and ``overwrite=False``."""
        records = _commit.commit_records(save.storage, save.commit_rank)
        if records and not self.options.overwrite:
            raise FileExistsError(
                f"{save.storage.describe(records[0])} exists and overwrite=False; save to a "
                "new path or pass overwrite=True"
            )
        return records

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._save()
        session = save.session
        if session is None:  # plain dcp.save: no stage(), snapshot live tensors now
            session = self._session_from_planner(plan, planner, save.rank)
            save.session = session
            save.started = time.monotonic()
            save.synchronous = True
            self._runtime.start_snapshot(session)
        elif session.error is not None:
            # Failed before its flush (a copy saw a change) or dropped (close() gave up on it):
            # never read the live tensors. The session retires now: kept in the runtime's list
            # until a stall reaped it, its error's traceback (DCP's frames) held this writer
            # out of the collector's reach, and a dropped writer never gave back its pool.
            self._runtime.abort(session, session.error)
            raise session.error
        else:
            try:
                self._check_plan_matches(plan, session, save.rank)
            except InvalidStateDictError as exc:
                self._runtime.abort(session, exc)  # pool blocks back now, not at thread exit
                raise
        if save.stats is not None:
            save.stats.flush_started_s = time.monotonic() - save.started
        result = self._runtime.start_flush(
            session, storage=save.storage, items=plan.items, prefix=plan.storage_data
        )
        result.add_done_callback(lambda f: self._flushed(save, f))
        return RelayFuture(result)  # DCP waits on a torch future (dcp_future.py says how)

    def _session_from_planner(
        self, plan: SavePlan, planner: SavePlanner, rank: int
    ) -> SnapshotSession:
        self._runtime.check_open()
        items = [(item, provider_from_any_planner(item, planner)) for item in plan.items]
        return self._runtime.new_session(items, rank)  # plan.items: exactly what we write

    @staticmethod
    def _check_plan_matches(plan: SavePlan, session: SnapshotSession, rank: int) -> None:
        for item in plan.items:
            provider = session.providers.get(item.index)
            if provider is None:
                raise InvalidStateDictError(
                    f"rank {rank}: item {item.index.fqn!r} was not in the state dict given to "
                    "stage(); the state dict changed between staging and saving"
                )
            staged_shape = getattr(provider, "shape", None)
            staged_dtype = getattr(provider, "dtype", None)
            if item.tensor_data is not None and staged_shape is not None:
                shape, staged = tuple(item.tensor_data.chunk.sizes), tuple(staged_shape)
                dtype = item.tensor_data.properties.dtype
                if shape != staged or (staged_dtype is not None and dtype != staged_dtype):
                    raise InvalidStateDictError(
                        f"rank {rank}: tensor {item.index.fqn!r} was staged as {staged_dtype} of "
                        f"shape {staged} but planned as {dtype} of shape {shape}; do not replace "
                        "tensors while a save is staged, and give dcp.async_save a planner that "
                        "plans the state dict as it is"
                    )

    def _flushed(self, save: _Save, fut: Future[list[WriteResult]]) -> None:
        session, stats = save.session, save.stats
        assert session is not None and stats is not None
        if session.staged_at is not None:
            stats.safe_to_mutate_s = session.staged_at - save.started
        stats.flushed_s = time.monotonic() - save.started
        if fut.exception() is not None or not save.is_coordinator:
            save.done = True
        if fut.exception() is not None:
            self._failed(save, fut.exception())
            return
        results = fut.result()
        stats.items = len(results)
        stats.bytes_written = sum(r.size_in_bytes for r in results)
        stats.pool_bytes = self._runtime.pool_capacity
        stats.pool_peak_bytes = self._runtime.pool_peak
        if not save.is_coordinator:
            self._done(save)

    @staticmethod
    def _session_figures(save: _Save) -> None:
        stats, session = save.stats, save.session
        assert stats is not None
        stats.durable_s = time.monotonic() - save.started
        if session is not None:
            stats.optimizer_wait_s = session.optimizer_wait_s
            stats.forward_frozen_bytes = session.forward_frozen_bytes
            stats.forward_blocked_s = session.forward_blocked_s
            stats.live_bytes = session.live_bytes
        if save.synchronous:
            stats.blocked_s = stats.durable_s

    def _done(self, save: _Save) -> None:
        self._session_figures(save)
        assert save.stats is not None
        self.last_stats = save.stats
        logger.info("%s", save.stats.summary())

    def _failed(self, save: _Save, error: BaseException) -> None:
        """A failed save gets its own record; ``last_stats`` keeps the last good one."""
        save.done = True
        if save.stats is None:
            return
        self._session_figures(save)
        record_failure(self, save.stats, error)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        save = self._save()
        start = time.monotonic()
        metadata.storage_meta = self.storage_meta()
        try:
            _commit.commit(
                save.storage,
                metadata,
                results,
                sync=self.options.sync_files,
                rank=save.rank,
                commit_rank=save.commit_rank,
            )
        except BaseException as exc:
            self._failed(save, exc)
            raise
        if save.stats is not None:
            save.stats.commit_s = time.monotonic() - start
        self._done(save)
        save.done = True

    def storage_meta(self) -> StorageMeta | None:
        save = self._save()
        self.save_id = save.save_id
        return StorageMeta(checkpoint_id=save.path, save_id=save.save_id)

    @property
    def checkpoint_id(self) -> str:
        save = getattr(self._local, "save", None)
        return save.path if save is not None else self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def record_failure(writer: DataStatesWriter, stats: SaveStats, error: BaseException) -> None:
    """Mark ``stats`` as a failed save's and keep it as the writer's ``last_failed_stats``."""
    if stats.error is None:
        stats.error = f"{type(error).__name__}: {error}"
        logger.error("%s", stats.summary())
    writer.last_failed_stats = stats
    if writer.last_stats is stats:  # pragma: no cover - a committed save cannot fail later
        writer.last_stats = None


def _expected_write_bytes(items: list, call: _dcp_private.AsyncSaveCall) -> int:
    """Bytes this rank is expected to write: its shards, and its share of replicated items
    (DCP gives each replicated item to one rank, balancing bytes across ranks)."""
    world = _world_size(call)
    total = 0
    for item, provider in items:
        if item.type == WriteItemType.SHARD:
            total += provider.nbytes
        else:
            total += provider.nbytes // world
    return total


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_of(v)]
    return []
