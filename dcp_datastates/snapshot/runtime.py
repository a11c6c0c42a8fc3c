"""The snapshot runtime of a writer: the one owner of its sessions, from ``stage()`` to release.

``DataStatesWriter`` speaks DCP's contract; everything that outlives one writer call lives here:

* the host pool and the snapshot threads, sized and started by the first save;
* the hand-off of a session from ``stage()`` (caller's thread) to the DCP thread that saves it
  (``claim``);
* the flushes that are running (``close()`` waits for them);
* reaping sessions whose save died before writing them, and dropping the ones nobody will write.

Session lifecycle as the runtime sees it::

    new_session --stage()--> UNCLAIMED --claim()--> CLAIMED --start_flush()--> FLUSHING --> done
        |                        |                     |
        +--(plain dcp.save)------+---------------------+--> start_snapshot() + start_flush()
                                 +--(never claimed / owner died / close)--> aborted
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem

from ..errors import InvalidStateDictError, SnapshotAbortedError
from ..flush import flush
from ..options import MiB, WriterOptions
from ..providers import StateProvider
from ..storage import Storage
from . import guard as _guard
from .engine import SnapshotScheduler, SnapshotSession
from .pool import HostPool

logger = logging.getLogger(__name__)

#: How long a new stage() waits for the previous staged snapshot to be claimed by its DCP thread.
CLAIM_TIMEOUT_S = 30.0


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 << 30


def pool_bytes_for(state_bytes: int, items: int) -> int:
    """Pool bytes that hold a whole state: pieces align each tensor to 64 bytes."""
    return state_bytes + 64 * items


class _Resources:
    """What a runtime allocates once, on the first save, and reuses: pool and threads."""

    def __init__(self, options: WriterOptions, pool_bytes: int, on_stall: Any) -> None:
        self.pool = HostPool(pool_bytes)
        self.chunk_bytes = options.effective_chunk_bytes(self.pool.capacity)
        self.coalesce_bytes = min(options.coalesce_bytes, self.chunk_bytes)
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


class SnapshotRuntime:
    """Sessions of one writer across threads; see the module docstring for their lifecycle."""

    def __init__(self, options: WriterOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._claimed = threading.Condition(self._lock)
        #: (session, or the future of one still being planned; staging thread; token)
        self._unclaimed: tuple[Future[SnapshotSession], threading.Thread, Any] | None = None
        self._planner: ThreadPoolExecutor | None = None  # builds sessions stage() recorded
        self._sessions: list[SnapshotSession] = []
        self._resources: _Resources | None = None
        #: ``staged`` future of the most recent ``stage()``.
        self.last_staged: Future[None] | None = None

    # -- resources ---------------------------------------------------------------------------
    @property
    def pool(self) -> HostPool | None:
        return self._resources.pool if self._resources is not None else None

    @property
    def pool_capacity(self) -> int:
        return self._resources.pool.capacity if self._resources is not None else 0

    @property
    def pool_peak(self) -> int:
        return self._resources.pool.peak_in_use if self._resources is not None else 0

    def _ensure(self, state_bytes: int, rank: int) -> _Resources:
        with self._lock:  # the planning thread and a plain dcp.save's thread may both get here
            return self._ensure_locked(state_bytes, rank)

    def _ensure_locked(self, state_bytes: int, rank: int) -> _Resources:
        if self._resources is None:
            size = self.options.host_pool_bytes
            if size is None:
                cap = int(physical_memory() * self.options.max_pool_fraction)
                size = max(16 * MiB, min(state_bytes, cap))
            self._resources = _Resources(self.options, size, self.reap_abandoned)
            logger.info("rank %d: host pool of %d bytes", rank, self._resources.pool.capacity)
        return self._resources

    def prepare(self, state_bytes: int, items: int, rank: int) -> HostPool:
        """Size the pool for a first save of ``items`` items, ``state_bytes`` in all, and start
        faulting it in (``pool.py``), if no save did yet; a later save reuses it as it is."""
        return self._ensure(pool_bytes_for(state_bytes, items), rank).pool

    # -- sessions ----------------------------------------------------------------------------
    def new_session(
        self, items: Sequence[tuple[WriteItem, StateProvider]], rank: int
    ) -> SnapshotSession:
        """A session for this rank's ``items`` (not started): sizes the pool on first use."""
        res = self._ensure(pool_bytes_for(sum(p.nbytes for _, p in items), len(items)), rank)
        session = SnapshotSession(
            [(item.index, provider) for item, provider in items],
            pool=res.pool,
            chunk_bytes=res.chunk_bytes,
            coalesce_bytes=res.coalesce_bytes,
            rank=rank,
        )
        self._check_fits(session, res.pool)
        with self._lock:
            self._sessions = [s for s in self._sessions if not s.finished] + [session]
        return session

    @staticmethod
    def _check_fits(session: SnapshotSession, pool: HostPool) -> None:
        for piece in session.pieces:
            if piece.nbytes > pool.capacity:
                fqn = piece.parts[0][0].fqn
                raise InvalidStateDictError(
                    f"rank {session.rank}: a row of non-contiguous tensor {fqn!r} needs "
                    f"{piece.nbytes} bytes, more than the {pool.capacity}-byte host pool; "
                    "raise host_pool_bytes or save a contiguous copy"
                )

    def stage(
        self,
        session: SnapshotSession,
        token: Any,
        *,
        guard: bool,
        started: float,
        on_device: bool = True,
    ) -> None:
        """Start ``session``'s copies and leave it for the next save on another thread to claim
        (with ``token``, the caller's per-save record). Waits for an earlier staged session to
        be claimed first; one never claimed within :data:`CLAIM_TIMEOUT_S` is dropped.
        ``guard``: optimizer steps wait for the snapshot; ``on_device``: on the device where the
        copies allow it (a fence), else on the host."""
        session.created = started
        built: Future[SnapshotSession] = Future()
        built.set_result(session)
        self._leave_for_claim(built, token, session.rank)
        if guard:
            _guard.guard(session.staged, session.fence_on_device if on_device else None)
        assert self._resources is not None
        self._resources.scheduler.submit(session)
        self.last_staged = session.staged

    def stage_later(
        self, build: Callable[[], SnapshotSession], token: Any, *, guard: bool, started: float
    ) -> Future[None]:
        """:meth:`stage` for a session that ``build()`` makes on the planning thread (from what
        the caller recorded, ``capture.py``): the caller only leaves it for the claim and
        guards the optimizer step. Host copies only (the guard waits on the host). Returns the
        ``staged`` future; it resolves when the snapshot is complete, or, if planning failed,
        at once (the save reports that error, once, through its own future)."""
        rank = getattr(token, "rank", 0)
        built: Future[SnapshotSession] = Future()
        staged: Future[None] = Future()
        self._leave_for_claim(built, token, rank)
        if guard:
            _guard.guard(staged)
        self.last_staged = staged
        with self._lock:
            if self._planner is None:
                self._planner = ThreadPoolExecutor(1, thread_name_prefix="datastates-plan")
            planner = self._planner
        planner.submit(self._build_and_start, build, built, staged, started)
        return staged

    def _build_and_start(
        self,
        build: Callable[[], SnapshotSession],
        built: Future[SnapshotSession],
        staged: Future[None],
        started: float,
    ) -> None:
        try:
            session = build()
        except BaseException as exc:  # reaches the save through claim(); the state is free
            built.set_exception(exc)
            staged.set_result(None)
            return
        session.created = started
        session.staged.add_done_callback(lambda _: staged.set_result(None))
        built.set_result(session)
        assert self._resources is not None
        self._resources.scheduler.submit(session)

    def _leave_for_claim(self, built: Future[SnapshotSession], token: Any, rank: int) -> None:
        with self._claimed:
            if self._unclaimed is not None and not self._claimed.wait_for(
                lambda: self._unclaimed is None, timeout=CLAIM_TIMEOUT_S
            ):
                logger.warning("rank %d: a staged snapshot was never saved; dropping it", rank)
                error = SnapshotAbortedError(
                    f"rank {rank}: a snapshot staged {CLAIM_TIMEOUT_S:.0f}s ago was "
                    "never picked up by a save; it was dropped. Call stage() only through "
                    "dcp.async_save or dcp_datastates.async_save"
                )
                _abort_when_built(self._unclaimed[0], error)
            self._unclaimed = (built, threading.current_thread(), token)

    def claim(self) -> tuple[SnapshotSession, Any] | None:
        """On a DCP save thread: take the session staged (on another thread) for this save;
        waits here, not on the caller, for its planning to end (and raises what that raised)."""
        with self._claimed:
            pending = self._unclaimed
            if pending is None or pending[1] is threading.current_thread():
                return None
            built, _, token = pending
            self._unclaimed = None
            self._claimed.notify_all()
        session = built.result()
        session.owner = threading.current_thread()
        return session, token

    def start_snapshot(self, session: SnapshotSession) -> None:
        """A plain ``dcp.save``: snapshot the live tensors now, on this (the saving) thread's
        behalf; the caller stays blocked until the save ends."""
        session.owner = threading.current_thread()
        assert self._resources is not None
        self._resources.scheduler.submit(session)

    def start_flush(
        self,
        session: SnapshotSession,
        *,
        storage: Storage,
        items: Sequence[WriteItem],
        prefix: str,
    ) -> Future[Any]:
        """Write ``items`` of ``session`` as their pieces land; the future holds the results."""
        session.flush_started = True
        result = flush(
            storage=storage,
            items=items,
            session=session,
            prefix=prefix,
            workers=self.options.flush_workers,
            sync=self.options.sync_files,
        )
        assert self._resources is not None
        self._resources.track(result)
        return result

    # -- sessions nobody will write ----------------------------------------------------------
    def reap_abandoned(self) -> None:
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

    def drop_unwritten(self, error: BaseException) -> None:
        """Abort snapshots that no save will write any more (for a writer whose saves are over:
        a save that failed while planning leaves its copied pieces holding the pool)."""
        with self._lock:
            sessions = [s for s in self._sessions if not s.finished]
            self._unclaimed = None
        for s in sessions:
            s.abort(error)

    def close(self, path: str) -> None:
        """Release the pool and threads. Waits for saves that are flushing; a snapshot no save
        is writing (staged but never saved) is dropped."""
        if self._planner is not None:
            self._planner.shutdown(wait=True)  # sessions being planned now exist, or failed
            self._planner = None
        if self._resources is None:
            return
        self._resources.wait_for_flushes()
        self.drop_unwritten(
            SnapshotAbortedError(
                f"the DataStatesWriter for {path} was closed before this snapshot was "
                "written; save again with an open writer"
            )
        )
        self._resources.close()
        self._resources = None


def _abort_when_built(built: Future[SnapshotSession], error: BaseException) -> None:
    def abort(f: Future[SnapshotSession]) -> None:
        if f.exception() is None:
            f.result().abort(error)

    built.add_done_callback(abort)
