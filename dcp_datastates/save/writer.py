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

Where each step lives: ``staging.py`` is STAGED (caller and planning thread), ``snapshot/`` the
copies up to SAFE, ``runtime.py`` the sessions and their threads, ``flush.py`` FLUSHING to
DURABLE, ``commit.py`` COMMITTED; ``calls.py`` says who called ``stage()`` and guards the ranks,
``records.py`` keeps one save's state and ``SaveStats``. This module is the DCP contract; DCP's
private names are used only in ``_dcp_private.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from .. import _dcp_private
from .._concurrency.futures import RelayFuture
from ..errors import InvalidStateDictError, WriterUsageError
from ..snapshot import cow as _cow
from ..stats import SaveStats
from ..storage import localfile
from . import commit as _commit
from . import records as _records
from .calls import (
    _RankTarget,
    _refuse_file_target,
    _refuse_split_targets,
    announced,
    fails_on_every_rank,
    which_call,
)
from .compat import StockWriterAttributes, lazy_staging_planner, stock_stage, writer_options
from .planner import (
    GlobalPlanMemo,
    StagedSavePlanner,
    is_planned_elsewhere,
)
from .process_staging import daemon_runtime, raise_relayed, stage_for_process
from .records import _Save
from .runtime import SnapshotRuntime
from .staging import ThreadStaging
from .transforms import stream_transforms


@_dcp_private.no_synchronize_after_execute
class DataStatesWriter(StorageWriter, AsyncStager, StockWriterAttributes):
    """A DCP storage writer with a lazy snapshot and a streaming flush.

    Takes every argument of stock ``FileSystemWriter``, by name and in the same positions (see
    :mod:`dcp_datastates.save.compat` and the README's table), and has its attributes
    (``StockWriterAttributes``); our own options are keyword-only.

    Args:
        path: Checkpoint directory: a local path or any fsspec URL. ``checkpoint_id`` passed to a
            DCP call overrides it for that save.
        single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict: Accepted for
            compatibility, without effect.
        sync_files, overwrite: As stock (and :class:`~dcp_datastates.WriterOptions`).
        thread_count: Files written in parallel per rank (``flush_workers``).
        _extensions: As stock: stream transforms every record is written through, such as
            ``[ZStandard()]`` compression (``transforms.py``); stock readers decode them.
        serialization_format: ``TORCH_SAVE`` only (see :func:`compat.writer_options`).
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
            serialization_format=serialization_format,
            options=options,
        )
        self._transforms = stream_transforms(_extensions)  # compression, ...: transforms.py
        self.save_id: str | None = None  # the latest save's StorageMeta.save_id
        self.last_stats: SaveStats | None = None
        self.last_failed_stats: SaveStats | None = None
        # Stock FileSystemWriter's attributes, for code that reads them (accepted, no effect).
        self.single_file_per_rank = single_file_per_rank
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        self._init_runtime_state()

    def _init_runtime_state(self, shared: SnapshotRuntime | None = None) -> None:
        """The parts of the writer that never travel. ``shared``: DCP's checkpoint daemon's
        runtime, for a writer unpickled there."""
        self._unpickled = shared is not None
        self._runtime = shared if shared is not None else SnapshotRuntime(self.options, self.path)
        # A writer dropped without close() gives its pool and threads back when collected.
        # The runtime and its threads never refer to the writer, so collection can happen.
        self._finalizer = weakref.finalize(self, self._runtime.abandon)
        if shared is not None:
            self._finalizer.detach()  # the shared runtime outlives every writer unpickled here
        self._local = threading.local()
        self._process_staged: Future[None] | None = None
        self._staging = ThreadStaging(self._runtime, self.options)  # stage() in this process
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
            "_transforms": self._transforms,
            "last_stats": None,
            "last_failed_stats": None,
            "save_id": None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # DCP's checkpoint daemon unpickles a new writer for every request and never closes it:
        # they all share one runtime (pool and threads) per options, so the daemon stays flat.
        self._init_runtime_state(
            daemon_runtime(
                self.options, lambda: SnapshotRuntime(self.options, "the checkpoint daemon")
            )
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
        self._staging.forget()
        self._global_plans.forget()
        self._finalizer.detach()
        _cow.settle()  # this thread's copy-on-write mode, if nothing else is in flight

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
                copy_on_write=self.options.copy_on_write,
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
        staged, stats = self._staging.stage(
            state_dict,
            call,
            call.checkpoint_id or self.path,
            announced=announced(self),
            start=start,
        )
        self._process_staged = None
        self._local.staged_stats = stats
        stats.blocked_s = stats.stage_s = time.monotonic() - start
        return staged

    #: Which save called ``stage()`` (``calls.which_call``), bound as a method so that the frames
    #: it counts up to DCP's (and its warning's ``stacklevel``) start at ``stage()``.
    _which_call = which_call

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
        self._staging.warm_up(state_dict, self.path, wait=wait)

    # -- for dcp_datastates.async_save (api.py) --------------------------------------------
    def _check_open(self) -> None:
        """Raise ``WriterClosedError`` if the writer is closed (or inherited through a fork)."""
        self._runtime.check_open()

    def _forget_staged_stats(self) -> None:
        """No stage() on this thread has a record yet (async_save is about to stage)."""
        self._local.staged_stats = None

    def _staged_stats(self) -> SaveStats | None:
        """The record of the last stage() on this thread (what async_save reports into)."""
        return getattr(self._local, "staged_stats", None)

    def _abandon_staged(self, error: BaseException) -> None:
        """The dcp.async_save that staged failed before its save could start."""
        self._runtime.drop_unclaimed(error)

    def _run_save(self, save: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``save(*args)`` on one of the writer's own save threads (``runtime.run_save``)."""
        return self._runtime.run_save(save, *args)

    def _staged_planner(self) -> StagedSavePlanner:
        """A planner that reuses the local plan of the snapshot a save thread claims, and the
        last single-rank global plan."""
        return StagedSavePlanner(self._staged_local_plan, self._global_plans)

    def _forget_save(self) -> None:
        """This thread's save is over: its per-thread record is dropped (the thread is reused)."""
        self._local.__dict__.pop("save", None)

    def _save_ended(self) -> None:
        """A save ended: a snapshot its thread claimed and never wrote is dropped."""
        self._runtime.save_ended()

    def synchronize_staging(self) -> None:
        """Wait until the last staged snapshot is complete (the state may then change)."""
        staged = self.staging_future
        if staged is not None:
            staged.result()
        _cow.settle()

    @property
    def staging_future(self) -> Future[None] | None:
        """Resolves when the most recent ``stage()``'s snapshot is complete."""
        if self._process_staged is not None:
            return self._process_staged
        return self._runtime.last_staged

    # -- StorageWriter -----------------------------------------------------------------------
    def _begin(self, path: str) -> _Save:
        """The first writer call of a save on this thread (``records._Save.begin``)."""
        save = self._local.save = _Save.begin(self._runtime, path, self.options)
        return save

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
        self._save().set_up(is_coordinator, **kwargs)

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
            save.refuse_overwrite(self.options.overwrite)
        if is_planned_elsewhere(plan):
            plan = save.writers_plan(plan)
        if not save.use_collectives:
            plan = dataclasses.replace(plan, storage_data=f"__{save.rank}_")
        elif plan.storage_data is None and dist.is_initialized() and dist.get_world_size() > 1:
            # Several processes: the coordinator checks that every rank names one checkpoint.
            # (The planner matched the plan to its cache before: global_plan.py.)
            target = _RankTarget(save.storage.describe("").rstrip("/"), self.options.node_local)
            plan = dataclasses.replace(plan, storage_data=target)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save = self._save()
        # Before anything is removed or written; node-local: the ranks whose files it checks.
        save.here = _refuse_split_targets(plans, save.storage.describe("").rstrip("/"))
        # Also the records of a save with the other use_collectives setting: its data files have
        # the same names (a user sweep: overwrite=False saved over one, and an old .metadata
        # was left committing overwritten data).
        save.clear_old_records(overwrite=self.options.overwrite, sync=self.options.sync_files)
        # A plan keeps its prefix (a rank's own, a cached plan's); s3.py may add a data_dir.
        at = getattr(save.storage, "data_dir", lambda rank: "")
        return [
            p if isinstance(p.storage_data, str) else replace(p, storage_data=f"{at(i)}__{i}_")
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._save()
        session = save.session
        if session is None:  # plain dcp.save: no stage(), snapshot live tensors now
            session = self._staging.session_for_plan(plan, planner, save.rank, save.path)
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
                save.check_plan_matches(plan)
            except InvalidStateDictError as exc:
                self._runtime.abort(session, exc)  # pool blocks back now, not at thread exit
                raise
        if save.stats is not None:
            save.stats.flush_started_s = time.monotonic() - save.started
        result = self._runtime.start_flush(
            session,
            storage=save.storage,
            items=plan.items,
            prefix=plan.storage_data,
            transforms=self._transforms,
        )
        result.add_done_callback(lambda f: _records.flushed(self, self._runtime, save, f))
        return RelayFuture(result)  # DCP waits on a torch future (dcp_future.py says how)

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
                ranks_here=save.here,
            )
        except BaseException as exc:
            _records.failed(self, save, exc)
            raise
        if save.stats is not None:
            save.stats.commit_s = time.monotonic() - start
        _records.done(self, save)
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
