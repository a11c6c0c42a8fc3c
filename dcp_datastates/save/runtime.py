"""The snapshot runtime of a writer: the one owner of its sessions, from ``stage()`` to release.

``DataStatesWriter`` speaks DCP's contract; everything that outlives one writer call lives here:

* the host pool and the snapshot threads, sized and started by the first save, given back by
  ``close()`` or, for a writer dropped without it, when the writer is garbage collected;
* the hand-off of a session from ``stage()`` (caller's thread) to the DCP thread that saves it
  (``claim``), through the slot of ``handoff.py``;
* the flushes that are running (``close()`` waits for them);
* reaping sessions whose save died before writing them, and dropping the ones nobody will write.

What the pool and threads are, and how big, is ``resources.py``; planning a session ``stage()``
only recorded, on the planning thread, is ``deferred.py``; the slot a staged session waits in
until its save thread claims it (UNCLAIMED below) is ``handoff.py``. This module holds the one
lock (and its Condition) over the sessions and the hand-off, shared with ``handoff.py``; a child
made by ``os.fork()`` disowns them (``forks.py``).

Session lifecycle as the runtime sees it::

    new_session --stage()--> UNCLAIMED --claim()--> CLAIMED --start_flush()--> FLUSHING
        |                        |                     |                          |
        |                        |  never claimed /    |  owner thread died (or   |  flush
        |                        |  close() / writer   |  its save ended) before  |  resolved
        |                        v  collected          v  writing                 v
        +--(plain dcp.save: start_snapshot + start_flush)------------------> RETIRED

A session *retires* (``SnapshotSession.retire``) when its flush resolves or it is aborted, and no
copy is in flight: its pool blocks are back and it holds no reference to the caller's tensors.
``close()`` waits for every session to retire (those staged by ``dcp.async_save`` are about to
be claimed) and refuses new work from its first line on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem

from .._concurrency.latch import Latch
from ..errors import SnapshotAbortedError, WriterClosedError
from ..options import WriterOptions
from ..providers import StateProvider
from ..snapshot import cow as _cow
from ..snapshot import forward_gate as _forward_gate
from ..snapshot import guard as _guard
from ..snapshot.pool import HostPool
from ..snapshot.session import SnapshotSession
from ..storage.base import Storage
from . import forks
from .deferred import DeferredPlanning, Plan
from .handoff import HandOff, never_claimed_error
from .resources import Resources, SaveThreads, auto_pool_bytes, check_fits
from .sessions import LiveSessions

logger = logging.getLogger(__name__)


class SnapshotRuntime:
    """Sessions of one writer across threads; see the module docstring for their lifecycle."""

    def __init__(self, options: WriterOptions, name: str) -> None:
        self.options = options
        self.name = name  # the writer's path, for messages
        #: Inherited by a child made by ``os.fork()``: its threads, sessions and saves are the
        #: parent's, so in the child it is closed for good and lets go of nothing.
        self.inherited = False
        forks.register(self)  # disowned in a child made by os.fork() (forks.py)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        #: The session staged and not yet claimed by its save thread (``handoff.py``).
        self._handoff = HandOff(self._lock, self._changed)
        #: Sessions until they retire, and their retirement callback (``sessions.py``).
        self._live = LiveSessions(self._changed)
        self._resources: Resources | None = None
        #: Plans what ``stage()`` only recorded, on its own thread (``deferred.py``).
        self._deferred = DeferredPlanning(
            guard_forward=options.guard_forward, copy_on_write=options.copy_on_write
        )
        self._savers = SaveThreads()  # run dcp_datastates.async_save's saves
        self.closed = False
        #: Pool and threads given back (``close()`` ended, or ``abandon()``): no save may make
        #: them again. Between ``closed`` and this, close() waits for the saves already staged,
        #: and the first save's planning still makes the pool.
        self._released = False
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

    def _ensure(self, expected_bytes: int, rank: int) -> Resources:
        # caller holds self._lock
        if self._resources is None:
            if self._released:
                raise self._closed_error()  # a session close() gave up on: no new pool
            size = self.options.host_pool_bytes
            if size is None:
                size = auto_pool_bytes(self.options, expected_bytes)
            self._resources = Resources(self.options, size, self.reap_abandoned)
            logger.info("rank %d: host pool of %d bytes", rank, self._resources.pool.capacity)
        return self._resources

    def _ensure_locked(self, expected_bytes: int, rank: int) -> Resources:
        """:meth:`_ensure` for the planning thread: close() waits for the session it plans, so
        a writer closed since may still make its pool."""
        with self._lock:
            return self._ensure(expected_bytes, rank)

    def _inherited_by_fork(self) -> None:
        """In a child made by ``os.fork()``: the threads are gone, and a parent thread may have
        held the lock at the fork (a user sweep: the child hung at exit, in the writer's
        finalizer). Forget the parent's work, without waiting or freeing (the pool's memory is
        the child's private copy, unmapped with the process)."""
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.closed = self.inherited = self._released = True
        self._handoff = HandOff(self._lock, self._changed)
        self._resources = None
        self._savers = SaveThreads()
        self._live = LiveSessions(self._changed)
        self._deferred.inherited_by_fork()

    def _closed_error(self) -> WriterClosedError:
        if self.inherited:
            return WriterClosedError(
                f"the DataStatesWriter for {self.name} was inherited through os.fork(); it "
                "saves only in the process that made it: make a new writer in this process"
            )
        return WriterClosedError(
            f"the DataStatesWriter for {self.name} is closed; make a new writer to save again"
        )

    def check_open(self) -> None:
        if self.closed:
            raise self._closed_error()

    def check_open_to_save(self) -> None:
        """For a save that claimed no snapshot: on a writer that ``close(timeout)`` shut while
        the save thread of a staged snapshot was starting, that save fails as the snapshot did
        (:class:`SnapshotAbortedError`, once); any other save on a closed writer is refused."""
        self._handoff.check_dropped_claim()
        self.check_open()

    # -- sessions ----------------------------------------------------------------------------
    def new_session(
        self,
        items: Sequence[tuple[WriteItem, StateProvider]],
        rank: int,
        *,
        expected_bytes: int | None = None,
    ) -> SnapshotSession:
        """A session for this rank's ``items`` (not started). The first one sizes the pool from
        ``expected_bytes``, what this rank is expected to write (default: all of ``items``)."""
        if expected_bytes is None:
            expected_bytes = sum(p.nbytes for _, p in items)
        with self._lock:
            self.check_open()
            res = self._ensure(expected_bytes, rank)
        session = SnapshotSession(
            [(item.index, provider) for item, provider in items],
            pool=res.pool,
            chunk_bytes=res.chunk_bytes,
            coalesce_bytes=res.coalesce_bytes,
            rank=rank,
        )
        session.local_plan = getattr(items, "local_plan", None)
        check_fits(session, res.pool)
        with self._lock:
            self._live.add(session)
        return session

    def stage(
        self,
        session: SnapshotSession,
        token: Any,
        *,
        started: float,
        expect_claim: bool,
    ) -> None:
        """Start ``session``'s copies and leave it for the save thread to claim (with ``token``,
        the writer's per-save record). Waits for an earlier staged session to be claimed first;
        one never claimed within ``handoff.CLAIM_TIMEOUT_S`` is dropped."""
        session.created = started
        try:
            self._hand_off(session, token, expect_claim)
        except BaseException as exc:
            self.abort(session, exc)  # never left behind for close() to wait on
            raise
        if self.options.guard_optimizer_step:
            # On CUDA the step's stream may wait on the copies instead of the host (a fence).
            fence = session.fence_on_device if self.options.guard_on_device else None
            _guard.guard(session.staged, session.add_optimizer_wait, fence, session.stop_live)
        self._watch_writes(session, _forward_gate.protect)
        assert self._resources is not None
        self._resources.scheduler.submit(session)
        self.last_staged = session.staged

    def _watch_writes(self, session: SnapshotSession, enter: Callable[..., None]) -> None:
        """On the caller's thread: ``session``'s tensors are copied before a module forward
        or an operator on this thread writes them (``forward_gate``, ``cow``)."""
        forward, cow = self.options.guard_forward, self.options.copy_on_write
        if forward or cow:
            enter(session, forward=forward, cow=cow)
        if cow:
            _cow.activate()

    def _hand_off(
        self,
        session: SnapshotSession,
        token: Any,
        expect_claim: bool,
        claimed: Latch | None = None,
        returning: Latch | None = None,
    ) -> None:
        """Leave ``session`` for a save thread to claim; ``returning`` is registered for
        :meth:`caller_returning` once it is handed off (a failed ``stage()`` leaves none)."""
        stale = None
        try:
            with self._lock:  # self._changed's lock (its __enter__ in Python is two more frames)
                self.check_open()
                stale = self._handoff.wait_for_slot(session.rank)
                self.check_open()  # close() may have run while this waited
                self._handoff.leave(session, token, expect_claim, claimed)
                if returning is not None:
                    self._deferred.expect_return(threading.current_thread(), returning)
        finally:
            if stale is not None:
                # Outside the lock, as in start_flush: with no copy in flight it retires at
                # once, and its retirement callback takes the lock (under it, stage() hung).
                self.abort(stale, never_claimed_error(stale.rank))

    def stage_later(
        self,
        plan: Plan,
        token: Any,
        *,
        rank: int,
        started: float,
        expect_claim: bool,
        after: Callable[[], None] | None = None,
    ) -> SnapshotSession:
        """:meth:`stage` for a state ``stage()`` only recorded (``capture.py``): the session is
        planned on the planning thread by ``plan()`` (its items and the bytes this rank will
        write); ``after`` runs there next, once the session is planned and started. Host
        copies only. Until it is planned, the optimizer step waits as for the
        copies, module forwards wait too (so the forward gate covers its buffers), and the save
        thread's claim waits; a planning failure fails the session, and so the save."""
        with self._lock:
            self.check_open()
            session = self._deferred.take_session(rank)
            session.created = started
            self._live.add(session)
            planner = self._deferred.planner()
        # Planning starts once the save thread has claimed the session and the caller is
        # returning from dcp.async_save: started at stage(), it took the GIL from the caller's
        # last milliseconds in dcp.async_save (5-15 ms of blocked time at 5,000 tensors), and
        # started at the claim, which DCP's save thread makes before the caller has returned,
        # it still did (a Python thread waiting for the GIL gets it only after the 5 ms switch
        # interval: 99 tensors, 2.1 ms median from stage()'s return to dcp.async_save's).
        claimed = Latch() if expect_claim else None
        returning = Latch() if expect_claim else None
        try:
            self._hand_off(session, token, expect_claim, claimed, returning)
        except BaseException as exc:
            self.abort(session, exc)  # never left behind for close() to wait on
            raise
        if self.options.guard_optimizer_step:
            _guard.guard(session.staged, session.add_optimizer_wait, None, session.stop_live)
        self._watch_writes(session, _forward_gate.hold)
        self.last_staged = session.staged
        planner.submit(
            self._deferred.plan_and_start,
            *(session, plan, self._ensure_locked, claimed, returning, after),
        )
        return session

    def caller_returning(self) -> None:
        """The calling thread is returning from ``dcp.async_save``: see
        :meth:`DeferredPlanning.caller_returning`."""
        self._deferred.caller_returning()

    def run_save(self, save: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``save(*args)`` (a ``dcp.save``) on one of the writer's save threads, which are
        kept between saves (``dcp_datastates.async_save``); one per save running at once. A
        thread is idle again just after its save's future resolves, so a save started at once
        from a callback or right after ``result()`` may start another (32 at most)."""
        with self._lock:
            self.check_open()
            return self._savers.submit(save, *args)

    def prepare(self, expected_bytes: int, rank: int, *, staged: bool = False) -> HostPool:
        """Size the pool now (if no save did yet) and start faulting it in (``pool.py``).
        ``staged``: for a save already staged (the first save's planning), which ``close()``
        waits for, so a writer closed since may still make its pool."""
        with self._lock:
            if not staged:
                self.check_open()
            return self._ensure(expected_bytes, rank).pool

    def start_threads(self) -> None:
        """Start the threads a first save would start on its way (``warm_up``): the planning
        thread and a save thread, on the caller's, and the copy workers, which the first copy
        waits for. Each start waits for its thread to run: the first save after ``warm_up`` at 4
        GB returned after 1.9-3.1 ms where later saves take 0.7-0.8, and its first copy started
        14-22 ms after the call against 8-11 ms (``CHANGELOG.md``, item 24)."""
        with self._lock:
            self.check_open()
            planner = self._deferred.planner()
            savers, res = self._savers, self._resources
        planner.start()
        savers.start()
        if res is not None:
            res.scheduler.start_copy_workers()

    # -- the hand-off (handoff.py) ------------------------------------------------------------
    def has_unclaimed(self) -> bool:
        return self._handoff.has_unclaimed()

    def claim(self) -> tuple[SnapshotSession, Any] | None:
        """On a DCP save thread: take the session staged (on another thread) for this save."""
        return self._handoff.claim()

    def drop_unclaimed(self, error: BaseException) -> None:
        """The save that was to claim the staged session will not run (``dcp.async_save``
        failed after staging): drop the session now."""
        pending = self._handoff.drop_unclaimed()
        if pending is not None:
            self.abort(pending, error)

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
        transforms: Sequence[Any] = (),
    ) -> Future[Any]:
        """Write ``items`` of ``session`` as their pieces land (through stream ``transforms``,
        if any: ``transforms.py``); the future holds the results.

        A session that was dropped (``close()`` gave up on it) fails here with its error: the
        live tensors are never read in its place."""
        with self._lock:
            res = self._resources
            refused = session.aborted or res is None
            if refused:
                failed: Future[Any] = Future()
                failed.set_exception(session.error or self._closed_error())
            else:
                session.flush_started = True
        if refused:
            # Outside the lock: a session with no copy in flight retires at once, and its
            # retirement callback takes this lock (``_retired``): under it, the save thread
            # waited for itself, and close() for both.
            session.retire()
            return failed
        result = res.flush(session, storage, items, prefix, transforms)
        result.add_done_callback(lambda _f: self._flush_over(session))
        return result

    def _flush_over(self, session: SnapshotSession) -> None:
        session.flush_done = True
        session.retire()

    # -- sessions nobody will write ----------------------------------------------------------
    def abort(self, session: SnapshotSession, error: BaseException) -> None:
        """Drop ``session`` (its save failed before writing it): blocks back, session retired."""
        session.abort(error)
        if not session.flush_started:
            session.retire()  # a flush that did start retires it when it resolves

    def reap_abandoned(self) -> None:
        """Abort snapshots nobody will write: the DCP thread that claimed one died before
        flushing it (its save failed while planning), or none claimed it in time."""
        now = time.monotonic()
        with self._changed:
            sessions = self._live.all()
            stale = self._handoff.take_stale(now)
        if stale is not None:
            logger.warning("rank %d: a staged snapshot was never saved; dropping it", stale.rank)
            self.abort(stale, never_claimed_error(stale.rank))
        for s in sessions:
            if s.owner is not None and not s.owner.is_alive() and not s.flush_started:
                self.abort(s, self._unwritten_error(s, "exited"))

    def save_ended(self) -> None:
        """On a writer save thread (``run_save``), once its ``dcp.save`` returned or raised: a
        session it claimed and never flushed is dropped as :meth:`reap_abandoned` drops one
        whose DCP thread exited (this thread lives on for the next save)."""
        me = threading.current_thread()
        with self._lock:
            mine = [s for s in self._live.busy() if s.owner is me and not s.flush_started]
        for s in mine:
            self.abort(s, self._unwritten_error(s, "ended its save"))

    @staticmethod
    def _unwritten_error(session: SnapshotSession, what: str) -> SnapshotAbortedError:
        assert session.owner is not None
        return SnapshotAbortedError(
            f"rank {session.rank}: the DCP save thread {session.owner.name!r} {what} before "
            "writing its snapshot (its save failed while planning; see that save's error); "
            "the snapshot was dropped and its pool space freed"
        )

    def close(self, timeout: float | None = None) -> None:
        """Refuse new work, wait for every session to retire, then give back pool and threads.

        Sessions staged by ``dcp.async_save`` are waited for (their save thread is about to
        claim them); one staged by a direct ``stage()`` call, which no save will claim, is
        dropped at once. After ``timeout`` seconds (if given) the sessions still open are
        dropped: their saves fail with :class:`SnapshotAbortedError` and never read live
        tensors.
        """
        with self._changed:
            self.closed = True
            stray = self._handoff.take_stray()
        if stray is not None:
            self.abort(stray, self._dropped_error())
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.reap_abandoned()
            with self._changed:
                busy = self._live.busy()
                left = None if deadline is None else deadline - time.monotonic()
                if not busy or (left is not None and left <= 0):
                    break
                self._changed.wait(timeout=0.5 if left is None else min(0.5, left))
        if busy:
            with self._changed:  # a save thread yet to claim its snapshot fails with this
                self._handoff.forget(self._dropped_error())
            for s in busy:
                self.abort(s, self._dropped_error())
        self._deferred.close()  # a session dropped while planned stays empty
        # Their saves retired above; close() may run on one of them (a done callback).
        self._savers.shutdown()
        with self._lock:
            res, self._resources = self._resources, None
            self._released = True
        if res is not None:
            res.close()

    def _dropped_error(self) -> SnapshotAbortedError:
        return SnapshotAbortedError(
            f"the DataStatesWriter for {self.name} was closed before this snapshot was "
            "written; save again with an open writer"
        )

    def abandon(self) -> None:
        """The writer was garbage collected without ``close()``: drop what is left and let the
        threads and the pool go, without blocking (this runs inside the garbage collector)."""
        with self._changed:
            self.closed = True
            self._handoff.forget()
            busy = self._live.busy()
            res, self._resources = self._resources, None
            self._released = True
            self._deferred.close(wait=False)
            self._savers.shutdown()
        error = SnapshotAbortedError(
            f"the DataStatesWriter for {self.name} was garbage collected before this snapshot "
            "was written"
        )
        for s in busy:
            self.abort(s, error)
        if res is not None:
            res.abandon()
