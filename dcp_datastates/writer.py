"""``DataStatesWriter``: the DCP ``StorageWriter`` and ``AsyncStager`` that runs our stages.

It is both, on purpose: DCP only streams if the object that stages (``stage()``) is the one that
writes (``write_data()``), because the snapshot started in one is consumed by the other.

Lifecycle of one save (the state names appear in code, logs and docs)::

    state      thread                 rank          call
    ---------  ---------------------  ------------  -----------------------------------------------
    STAGED     caller (training)      every         stage(sd): check sd, plan this rank's items,
                                                    make providers (objects serialized now), queue
                                                    the snapshot; returns sd in about a millisecond.
                                                    Copies run on the snapshot threads from here;
                                                    optimizer.step() waits for them (the guard).
    PLANNING   DCP save thread        every         reset(id), set_up_storage_writer: claim the
                                                    staged snapshot; prepare_local_plan: mkdir
                                      coordinator   prepare_global_plan: remove an old .metadata,
                                                    name each rank's files
    FLUSHING   DCP save thread +      every         write_data: files written as pieces land;
               flush threads                        a plain dcp.save (no stage) snapshots here
    SAFE       snapshot threads       every         all pieces copied: staged future resolves
    DURABLE    flush threads          every         every file of this rank fsynced once
    COMMITTED  DCP save thread        coordinator   finish: manifest, then .metadata atomically

A save that fails anywhere reports once, through the future DCP hands back (or ours from
``dcp_datastates.async_save``), and releases its pool blocks. Two saves may overlap: their
snapshots queue for the pool in order, their flushes run on their own DCP threads.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import functools
import logging
import os
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from . import commit as _commit
from .errors import InvalidStateDictError, SnapshotAbortedError
from .flush import flush
from .format import METADATA_NAME
from .options import MiB, WriterOptions
from .planner import plan_providers, provider_from_any_planner
from .process_staging import stage_for_process
from .snapshot import guard as _guard
from .snapshot.engine import SnapshotScheduler, SnapshotSession
from .snapshot.pool import HostPool
from .stats import SaveStats
from .storage import LocalStorage, Storage, storage_for

logger = logging.getLogger(__name__)

#: How long a new stage() waits for the previous staged snapshot to be claimed by its DCP thread.
_CLAIM_TIMEOUT_S = 30.0


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 << 30


def _current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _async_save_call() -> dict[str, Any]:
    """Arguments of the ``dcp.async_save`` that called ``stage()`` (empty if there is none).

    DCP tells a stager neither which executor will run the save (the process executor needs a
    different hand-off, see ``process_staging``) nor where the checkpoint goes, so look a few
    frames up.
    """
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            return {}
        if frame.f_code.co_name == "async_save" and frame.f_code.co_filename.endswith(
            "state_dict_saver.py"
        ):
            mode = frame.f_locals.get("async_checkpointer_type")
            return {
                "mode": getattr(mode, "value", None),
                "checkpoint_id": frame.f_locals.get("checkpoint_id"),
            }
        frame = frame.f_back
    return {}


def _refuse_file_target(path: str | os.PathLike) -> None:
    """Refuse, on the caller's thread, a local checkpoint path that is an existing file.

    Otherwise the save only fails later on DCP's save thread (``prepare_local_plan``), and the
    caller of an async save learns it from a traceback of that thread.
    """
    storage = storage_for(path)
    if isinstance(storage, LocalStorage) and os.path.isfile(storage.root):
        raise NotADirectoryError(
            errno.ENOTDIR,
            f"checkpoint path {storage.root} exists and is not a directory; pick another path",
            storage.root,
        )


class _Runtime:
    """What a writer allocates once and reuses across saves; never pickled."""

    def __init__(self, options: WriterOptions, pool_bytes: int, on_stall: Any) -> None:
        self.pool = HostPool(pool_bytes)
        self.chunk_bytes = options.effective_chunk_bytes(self.pool.capacity)
        self.scheduler = SnapshotScheduler(
            self.pool, copy_workers=options.copy_workers, on_stall=on_stall
        )
        self.flushes: set[Future[Any]] = set()  # running flushes, which close() waits for

    def track(self, flush: Future[Any]) -> None:
        self.flushes.add(flush)
        flush.add_done_callback(self.flushes.discard)

    def wait_for_flushes(self) -> None:
        concurrent.futures.wait(list(self.flushes))

    def close(self) -> None:
        self.wait_for_flushes()
        self.scheduler.close()  # waits for copies in flight; they release their blocks
        self.pool.close()


class _Save:
    """Per-save state, held thread-locally on the thread DCP runs the save on."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rank = _current_rank()
        self.is_coordinator = True
        self.session: SnapshotSession | None = None
        self.stats: SaveStats | None = None
        self.started = time.monotonic()
        self.synchronous = False  # a plain dcp.save: no stage(), the caller waits throughout
        self.guard_wait_start = _guard.waited_seconds
        self.done = False  # this rank will make no more writer calls for this save

    @functools.cached_property
    def storage(self) -> Storage:
        return storage_for(self.path)


class DataStatesWriter(StorageWriter, AsyncStager):
    """A DCP storage writer with a lazy snapshot and a streaming flush.

    Args:
        path: Checkpoint directory: a local path or any fsspec URL. ``checkpoint_id`` passed to a
            DCP call overrides it for that save.
        **options: Keyword-only fields of :class:`~dcp_datastates.WriterOptions`
            (``host_pool_bytes``, ``flush_workers``, ``guard_optimizer_step``, ...).

    Attributes:
        last_stats: :class:`~dcp_datastates.SaveStats` of the most recent save on this rank.
    """

    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike, **options: Any) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.options = WriterOptions(**options)
        self.last_stats: SaveStats | None = None
        self._init_runtime_state()

    def _init_runtime_state(self) -> None:
        self._runtime: _Runtime | None = None
        self._lock = threading.Lock()
        self._claimed = threading.Condition(self._lock)
        self._unclaimed: tuple[SnapshotSession, threading.Thread, SaveStats] | None = None
        self._sessions: list[SnapshotSession] = []
        self._local = threading.local()
        self._last_staged: Future[None] | None = None

    # The PROCESS executor pickles the writer into a daemon: ship options, not threads or memory.
    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "options": self.options, "last_stats": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime_state()

    # -- runtime -----------------------------------------------------------------------------
    def _ensure_runtime(self, state_bytes: int) -> _Runtime:
        if self._runtime is None:
            size = self.options.host_pool_bytes
            if size is None:
                cap = int(_physical_memory() * self.options.max_pool_fraction)
                size = max(16 * MiB, min(state_bytes, cap))
            self._runtime = _Runtime(self.options, size, self._reap_abandoned)
            logger.info(
                "rank %d: host pool of %d bytes", _current_rank(), self._runtime.pool.capacity
            )
        return self._runtime

    def _new_session(self, items: list, rank: int) -> SnapshotSession:
        state_bytes = sum(p.nbytes for _, p in items)
        runtime = self._ensure_runtime(state_bytes)
        session = SnapshotSession(
            [(item.index, provider) for item, provider in items],
            pool=runtime.pool,
            chunk_bytes=runtime.chunk_bytes,
            coalesce_bytes=min(self.options.coalesce_bytes, runtime.chunk_bytes),
            rank=rank,
        )
        self._check_fits(session, runtime)
        with self._lock:
            self._sessions = [s for s in self._sessions if not s.finished] + [session]
        return session

    def _check_fits(self, session: SnapshotSession, runtime: _Runtime) -> None:
        for piece in session.pieces:
            if piece.nbytes > runtime.pool.capacity:
                fqn = piece.parts[0][0].fqn
                raise InvalidStateDictError(
                    f"rank {session.rank}: a row of non-contiguous tensor {fqn!r} needs "
                    f"{piece.nbytes} bytes, more than the {runtime.pool.capacity}-byte host pool; "
                    "raise host_pool_bytes or save a contiguous copy"
                )

    def _reap_abandoned(self) -> None:
        """Abort snapshots whose DCP thread died before flushing them (their save failed early)."""
        with self._lock:
            sessions = list(self._sessions)
        for s in sessions:
            if s.owner is not None and not s.owner.is_alive() and not s.flush_started:
                s.abort(
                    SnapshotAbortedError(
                        f"rank {s.rank}: the DCP save thread {s.owner.name!r} exited before "
                        "writing its snapshot (its save failed while planning; see that save's "
                        "error); the snapshot was dropped and its pool space freed"
                    )
                )

    def _drop_unwritten(self, error: BaseException) -> None:
        """Abort snapshots that no save will write any more (for a writer whose saves are over:
        a save that failed while planning leaves its copied pieces holding the pool)."""
        with self._lock:
            sessions = [s for s in self._sessions if not s.finished]
            self._unclaimed = None
        for s in sessions:
            s.abort(error)

    def close(self) -> None:
        """Release the host pool and the writer's threads. Waits for saves that are flushing;
        a snapshot no save is writing (staged but never saved) is dropped."""
        if self._runtime is not None:
            self._runtime.wait_for_flushes()
            self._drop_unwritten(
                SnapshotAbortedError(
                    f"the DataStatesWriter for {self.path} was closed before this snapshot was "
                    "written; save again with an open writer"
                )
            )
            self._runtime.close()
            self._runtime = None

    # -- AsyncStager -------------------------------------------------------------------------
    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE | Future[STATE_DICT_TYPE]:
        """Start the lazy snapshot of ``state_dict`` and return at once (see the lifecycle)."""
        start = time.monotonic()
        call = _async_save_call()
        _refuse_file_target(call.get("checkpoint_id") or self.path)
        if call.get("mode") == "process":
            staged = stage_for_process(state_dict, guard=self.options.guard_optimizer_step)
            self._last_staged = staged.staged
            return staged.result
        rank = _current_rank()
        items = plan_providers(state_dict)
        session = self._new_session(items, rank)
        stats = SaveStats(checkpoint_id="", rank=rank, pool_bytes=self._runtime.pool.capacity)
        with self._claimed:
            if self._unclaimed is not None and not self._claimed.wait_for(
                lambda: self._unclaimed is None, timeout=_CLAIM_TIMEOUT_S
            ):
                stale = self._unclaimed[0]
                logger.warning("rank %d: a staged snapshot was never saved; dropping it", rank)
                stale.abort(
                    SnapshotAbortedError(
                        f"rank {rank}: a snapshot staged {_CLAIM_TIMEOUT_S:.0f}s ago was never "
                        "picked up by a save; it was dropped. Call stage() only through "
                        "dcp.async_save or dcp_datastates.async_save"
                    )
                )
            self._unclaimed = (session, threading.current_thread(), stats)
        if self.options.guard_optimizer_step:
            fence = session.fence_on_device if self.options.guard_on_device else None
            _guard.guard(session.staged, fence)
        self._runtime.scheduler.submit(session)
        self._last_staged = session.staged
        session.created = start
        stats.blocked_s = stats.stage_s = time.monotonic() - start
        return state_dict

    def synchronize_staging(self) -> None:
        """Wait until the last staged snapshot is complete (the state may then change)."""
        if self._last_staged is not None:
            self._last_staged.result()

    @property
    def staging_future(self) -> Future[None] | None:
        """Resolves when the most recent ``stage()``'s snapshot is complete."""
        return self._last_staged

    # -- StorageWriter -----------------------------------------------------------------------
    def _begin(self, path: str) -> _Save:
        """The first writer call of a save on this thread: new per-save state, and claim the
        snapshot staged for it (claiming first, so that a save dying later is seen dead)."""
        save = self._local.save = _Save(path)
        with self._claimed:
            pending = self._unclaimed
            if pending is not None and pending[1] is not threading.current_thread():
                session, _, stats = pending
                self._unclaimed = None
                self._claimed.notify_all()
                session.owner = threading.current_thread()
                save.session, save.stats, save.started = session, stats, session.created
        return save

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
        if save.stats is None:
            save.stats = SaveStats(checkpoint_id="", rank=save.rank)
        save.stats.checkpoint_id = save.storage.describe("").rstrip("/")
        save.stats.rank = save.rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._save().storage.makedirs()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save = self._save()
        if save.storage.exists(METADATA_NAME):
            if not self.options.overwrite:
                raise FileExistsError(
                    f"{save.storage.describe(METADATA_NAME)} exists and overwrite=False; save to a "
                    "new path or pass overwrite=True"
                )
            _commit.uncommit(save.storage)
            logger.warning("overwriting the checkpoint at %s", save.storage.describe(""))
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._save()
        session = save.session
        if session is None:  # plain dcp.save: no stage(), snapshot live tensors now
            session = self._session_from_planner(plan, planner, save.rank)
            save.session = session
            save.started = time.monotonic()
            session.owner = threading.current_thread()
            save.synchronous = True
            self._runtime.scheduler.submit(session)
        else:
            try:
                self._check_plan_matches(plan, session, save.rank)
            except InvalidStateDictError as exc:
                session.abort(exc)  # give its pool blocks back now, not when the thread exits
                raise
        session.flush_started = True
        if save.stats is not None:
            save.stats.flush_started_s = time.monotonic() - save.started
        result = flush(
            storage=save.storage,
            items=plan.items,
            session=session,
            prefix=plan.storage_data,
            workers=self.options.flush_workers,
            sync=self.options.sync_files,
        )
        self._runtime.track(result)
        result.add_done_callback(lambda f: self._flushed(save, f))
        return _to_torch_future(result)

    def _session_from_planner(
        self, plan: SavePlan, planner: SavePlanner, rank: int
    ) -> SnapshotSession:
        items = [(item, provider_from_any_planner(item, planner)) for item in plan.items]
        return self._new_session(items, rank)

    @staticmethod
    def _check_plan_matches(plan: SavePlan, session: SnapshotSession, rank: int) -> None:
        for item in plan.items:
            provider = session.providers.get(item.index)
            if provider is None:
                raise InvalidStateDictError(
                    f"rank {rank}: item {item.index.fqn!r} was not in the state dict given to "
                    "stage(); the state dict changed between staging and saving"
                )
            source = getattr(provider, "source", None)
            if item.tensor_data is not None and source is not None:
                shape, staged = tuple(item.tensor_data.chunk.sizes), tuple(source.shape)
                if shape != staged:
                    raise InvalidStateDictError(
                        f"rank {rank}: tensor {item.index.fqn!r} was staged with shape {staged} "
                        f"but planned with {shape}; do not replace tensors while a save is staged"
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
            logger.error(
                "rank %d: save to %s failed: %s", save.rank, stats.checkpoint_id, fut.exception()
            )
            return
        results = fut.result()
        stats.items = len(results)
        stats.bytes_written = sum(r.size_in_bytes for r in results)
        stats.pool_bytes = self._runtime.pool.capacity if self._runtime else 0
        stats.pool_peak_bytes = self._runtime.pool.peak_in_use if self._runtime else 0
        if not save.is_coordinator:
            self._done(save)

    def _done(self, save: _Save) -> None:
        stats = save.stats
        assert stats is not None
        stats.durable_s = time.monotonic() - save.started
        stats.optimizer_wait_s = _guard.waited_seconds - save.guard_wait_start
        if save.synchronous:
            stats.blocked_s = stats.durable_s
        self.last_stats = stats
        logger.info("%s", stats.summary())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        save = self._save()
        start = time.monotonic()
        _commit.commit(
            save.storage, metadata, results, sync=self.options.sync_files, rank=save.rank
        )
        if save.stats is not None:
            save.stats.commit_s = time.monotonic() - start
        self._done(save)
        save.done = True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._save().path, save_id=uuid.uuid4().hex)

    @property
    def checkpoint_id(self) -> str:
        save = getattr(self._local, "save", None)
        return save.path if save is not None else self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _to_torch_future(fut: Future[Any]) -> torch.futures.Future:
    """DCP waits on a ``torch.futures.Future``; relay our result (or error) into one."""
    out: torch.futures.Future = torch.futures.Future()

    def relay(f: Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(f.result())

    fut.add_done_callback(relay)
    return out
