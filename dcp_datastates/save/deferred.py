"""Planning a snapshot that ``stage()`` only recorded, on the writer's planning thread.

``SnapshotRuntime.stage_later`` hands such a session off at once, unplanned; this module plans
and starts it later, off the caller's thread. It owns:

* the ``datastates-plan`` thread (one ``JobThreads``), started lazily and shut down by ``close``;
* the spare session the next ``stage_later`` takes, made on the planning thread;
* when planning may start: once the save thread claimed the session (``CLAIM_START_WAIT_S``)
  and the caller is returning from ``dcp.async_save`` (``caller_returning``, ``RETURN_WAIT_S``).

It has its own lock. The runtime calls in while holding its lock (runtime's lock first, then
this one); this module never holds its lock while it calls the runtime's ``ensure``, which takes
the runtime's. ``ensure`` comes with each job, never kept: kept, it made a reference cycle
(runtime -> this -> the runtime's bound method) that only the cyclic GC broke. May import
``snapshot``, ``providers``, ``_concurrency`` and ``save.resources``; never ``save.runtime``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence

from torch.distributed.checkpoint.planner import WriteItem

from .._concurrency.latch import Latch
from .._concurrency.workers import JobThreads
from ..providers import StateProvider
from ..snapshot import forward_gate as _forward_gate
from ..snapshot.session import SnapshotSession
from .resources import Resources, check_fits

logger = logging.getLogger(__name__)

#: How long planning waits for the save thread to claim its session (it normally does within
#: milliseconds, as ``dcp.async_save`` returns); then it plans anyway.
CLAIM_START_WAIT_S = 0.5
#: How long planning then waits for the caller to be on its way out of ``dcp.async_save``
#: (:meth:`DeferredPlanning.caller_returning`; it normally is within a millisecond or two); a
#: DCP that never says so delays planning by this much.
RETURN_WAIT_S = 0.05

#: What ``stage()`` recorded, planned: this rank's items and the bytes it will write.
Plan = Callable[[], tuple[Sequence[tuple[WriteItem, StateProvider]], int]]
#: The runtime's pool and threads for ``(expected_bytes, rank)``, made by the first save; it
#: takes the runtime's lock.
Ensure = Callable[[int, int], Resources]


def _quietly(work: Callable[[], None]) -> None:
    """Run bookkeeping that no save depends on; a failure is logged, never raised."""
    try:
        work()
    except Exception:  # noqa: BLE001 - only a cache is lost: the next stage() walks
        logger.debug("planning-thread bookkeeping failed", exc_info=True)


def _deferred_session(rank: int) -> SnapshotSession:
    """A session ``stage()`` only recorded: the planning thread plans it."""
    return SnapshotSession([], pool=None, chunk_bytes=0, coalesce_bytes=0, rank=rank, deferred=True)


class DeferredPlanning:
    """The planning thread of one runtime and what it keeps between saves; ``guard_forward``:
    the runtime's option (module forwards wait for a session's copies)."""

    def __init__(self, *, guard_forward: bool, copy_on_write: bool = False) -> None:
        self._guard_forward = guard_forward
        self._copy_on_write = copy_on_write
        self._lock = threading.Lock()
        self._closed = False
        self._planner: JobThreads | None = None  # plans what stage() recorded
        #: A session for the next ``stage_later``, made on the planning thread after the last
        #: one was planned: made on the caller, it was 25-40 us of a 0.6 ms blocked call.
        self._spare: SnapshotSession | None = None
        #: Per session planned later, the thread that staged it and the latch its planning
        #: waits on until that thread is returning from ``dcp.async_save``.
        self._returning: list[tuple[threading.Thread, Latch]] = []

    def take_session(self, rank: int) -> SnapshotSession:
        """The session for a ``stage_later`` of ``rank``: the spare, or a new one."""
        with self._lock:
            session, self._spare = self._spare, None
        if session is None or session.rank != rank:
            session = _deferred_session(rank)
        return session

    def planner(self) -> JobThreads:
        """The planning thread (made, not started, on first use)."""
        with self._lock:
            if self._planner is None:
                self._planner = JobThreads(1, "datastates-plan")
            return self._planner

    def expect_return(self, thread: threading.Thread, returning: Latch) -> None:
        """``returning`` is set by :meth:`caller_returning` on ``thread`` (or by the planning,
        once it stopped waiting for it)."""
        with self._lock:
            self._returning.append((thread, returning))

    def plan_and_start(
        self,
        session: SnapshotSession,
        plan: Plan,
        ensure: Ensure,
        claimed: Latch | None = None,
        returning: Latch | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        """On the planning thread: plan ``session`` and start its copies, then run ``after``."""
        try:
            self._plan_and_start_session(session, plan, ensure, claimed, returning)
        finally:
            if after is not None:  # one job for both: a submit costs the caller 10-20 us
                _quietly(after)
            _quietly(functools.partial(self._make_spare, session.rank))

    def _plan_and_start_session(
        self,
        session: SnapshotSession,
        plan: Plan,
        ensure: Ensure,
        claimed: Latch | None,
        returning: Latch | None,
    ) -> None:
        if claimed is not None:
            claimed.wait(CLAIM_START_WAIT_S)
        if returning is not None:
            returning.wait(RETURN_WAIT_S)
            self._let_plan(returning)  # never left behind for a later caller_returning()
        try:
            try:
                items, expected_bytes = plan()
                res = ensure(expected_bytes, session.rank)
                planned = session.plan(
                    [(item.index, provider) for item, provider in items],
                    pool=res.pool,
                    chunk_bytes=res.chunk_bytes,
                    coalesce_bytes=res.coalesce_bytes,
                )
                if planned:
                    session.local_plan = getattr(items, "local_plan", None)
                    check_fits(session, res.pool)
            except BaseException as exc:  # reaches the save through its flush, once
                session.plan_failed(exc)
                return
            if not planned:
                return
            if self._guard_forward or self._copy_on_write:
                _forward_gate.protect(session, forward=self._guard_forward, cow=self._copy_on_write)
            res.scheduler.submit(session)
        finally:
            _forward_gate.release(session)

    def caller_returning(self) -> None:
        """The calling thread is returning from the ``dcp.async_save`` that staged its sessions
        (DCP reads ``should_synchronize_after_execute`` there, after starting the save thread):
        their planning may take the GIL now."""
        me = threading.current_thread()
        with self._lock:
            mine = [event for thread, event in self._returning if thread is me]
            if mine:
                self._returning = [entry for entry in self._returning if entry[0] is not me]
        for event in mine:
            event.set()

    def _let_plan(self, returning: Latch) -> None:
        returning.set()
        with self._lock:
            self._returning = [entry for entry in self._returning if entry[1] is not returning]

    def _make_spare(self, rank: int) -> None:
        """On the planning thread: the session the next ``stage_later`` takes."""
        spare = _deferred_session(rank)
        with self._lock:
            if not self._closed:
                self._spare = spare

    def close(self, *, wait: bool = True) -> None:
        """No spare from now on; the planning thread runs the plans queued, then ends (``wait``:
        and this waits for it; a session dropped while planned stays empty)."""
        with self._lock:
            self._closed = True
            self._spare = None
            planner = self._planner
        if planner is not None:
            planner.shutdown(wait=wait)

    def inherited_by_fork(self) -> None:
        """In a child made by ``os.fork()`` (the runtime's fork hook calls this): the planning
        thread is gone and a parent thread may have held the lock; forget it all."""
        self._lock = threading.Lock()
        self._closed = True
        self._planner = self._spare = None
        self._returning = []
