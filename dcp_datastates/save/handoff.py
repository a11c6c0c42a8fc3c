"""The hand-off of a staged snapshot from ``stage()``'s thread to the save thread that claims it.

``stage()`` runs on the caller's thread; the save that writes the snapshot runs on another
(DCP's async save thread, or one of the writer's save threads). Between the two, the session
waits in one slot (UNCLAIMED in the lifecycle of ``runtime.py``). This module owns:

* the slot: one staged session at a time; a second ``stage()`` waits for the first to be
  claimed, and drops it if no save claimed it within :data:`CLAIM_TIMEOUT_S`;
* ``claim``, on the save thread (never the thread that staged);
* what a save thread learns when ``close(timeout)`` dropped its snapshot before it could claim it.

It has no lock of its own: it shares the runtime's lock and Condition (passed in), since
whether the slot is free decides whether the runtime is busy. Methods that say so run with the
lock held by the caller; the others take it. It never aborts a session: it returns the ones it
takes out of the slot, and the runtime aborts them once the lock is released (a session's
retirement callback takes that lock). May import ``snapshot``, ``_concurrency`` and ``errors``;
never ``save.runtime``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from .._concurrency.latch import Latch
from ..errors import SnapshotAbortedError
from ..snapshot.session import SnapshotSession

logger = logging.getLogger(__name__)

#: How long a staged snapshot may wait for the save that claims it; then it is dropped.
CLAIM_TIMEOUT_S = 30.0


@dataclass
class _Staged:
    session: SnapshotSession
    thread: threading.Thread  # the thread that called stage(): never the one that claims
    token: Any  # the writer's per-save record (its stats)
    expect_claim: bool  # staged by a dcp.async_save, whose save thread will claim it
    at: float
    claimed: Latch | None = None  # set when a save thread claims it (or it is dropped)

    def let_go(self) -> None:
        if self.claimed is not None:
            self.claimed.set()


def never_claimed_error(rank: int) -> SnapshotAbortedError:
    return SnapshotAbortedError(
        f"rank {rank}: a snapshot staged {CLAIM_TIMEOUT_S:.0f}s ago was never picked up by "
        "a save; it was dropped. Call stage() only through dcp.async_save (with this writer "
        "as storage_writer) or dcp_datastates.async_save"
    )


class HandOff:
    """The slot between ``stage()`` and the save thread's ``claim()``, under the runtime's
    ``lock`` (``changed`` is its Condition)."""

    def __init__(self, lock: threading.Lock, changed: threading.Condition) -> None:
        self._lock = lock
        self._changed = changed
        self._unclaimed: _Staged | None = None
        #: The thread that staged a snapshot ``close(timeout)`` dropped before its save thread
        #: claimed it, and the error that save is to fail with.
        self._dropped_claim: tuple[threading.Thread, SnapshotAbortedError] | None = None

    # -- on stage()'s thread ------------------------------------------------------------------
    def wait_for_slot(self, rank: int) -> SnapshotSession | None:
        """Caller holds the lock. Wait for the session staged before to be claimed; one not
        claimed within :data:`CLAIM_TIMEOUT_S` is taken out and returned, for the caller to
        abort (``rank``: the staging rank, for the log)."""
        if self._unclaimed is None or self._changed.wait_for(
            lambda: self._unclaimed is None, timeout=CLAIM_TIMEOUT_S
        ):
            return None
        stale = self._unclaimed
        stale.let_go()
        self._unclaimed = None
        logger.warning("rank %d: a staged snapshot was never saved; dropping it", rank)
        return stale.session

    def leave(
        self,
        session: SnapshotSession,
        token: Any,
        expect_claim: bool,
        claimed: Latch | None,
    ) -> None:
        """Caller holds the lock and waited for the slot: leave ``session`` for a save thread."""
        self._unclaimed = _Staged(
            session, threading.current_thread(), token, expect_claim, time.monotonic(), claimed
        )

    # -- on the save thread -------------------------------------------------------------------
    def has_unclaimed(self) -> bool:
        return self._unclaimed is not None

    def claim(self) -> tuple[SnapshotSession, Any] | None:
        """On a DCP save thread: take the session staged (on another thread) for this save."""
        with self._changed:
            pending = self._unclaimed
            if pending is None or pending.thread is threading.current_thread():
                return None
            self._unclaimed = None
            self._changed.notify_all()
            pending.session.owner = threading.current_thread()
            pending.let_go()
        pending.session.planned.wait()  # a deferred session: here, not on the caller's thread
        return pending.session, pending.token

    def check_dropped_claim(self) -> None:
        """For a save that claimed no snapshot: raise, once, the error of the snapshot this
        thread was to claim if ``close(timeout)`` dropped it (the thread that staged it is not
        this one)."""
        with self._lock:
            dropped, self._dropped_claim = self._dropped_claim, None
            if dropped is not None and dropped[0] is not threading.current_thread():
                raise dropped[1]
            self._dropped_claim = dropped

    # -- dropping what is in the slot ----------------------------------------------------------
    def drop_unclaimed(self) -> SnapshotSession | None:
        """Empty the slot (the save that was to claim it will not run); returns its session."""
        with self._changed:
            pending, self._unclaimed = self._unclaimed, None
            self._changed.notify_all()
        if pending is None:
            return None
        pending.let_go()
        return pending.session

    def take_stale(self, now: float) -> SnapshotSession | None:
        """Caller holds the lock: the session left in the slot longer than
        :data:`CLAIM_TIMEOUT_S` before ``now``, taken out (for the caller to abort)."""
        stale = self._unclaimed
        if stale is None or now - stale.at <= CLAIM_TIMEOUT_S:
            return None
        self._unclaimed = None
        self._changed.notify_all()
        return stale.session

    def take_stray(self) -> SnapshotSession | None:
        """Caller holds the lock (``close()``): the session staged by a direct ``stage()``
        call, which no save will claim, taken out; one a save is about to claim stays."""
        stray = self._unclaimed
        if stray is None or stray.expect_claim:
            return None
        self._unclaimed = None
        return stray.session

    def forget(self, error: SnapshotAbortedError | None = None) -> None:
        """Caller holds the lock: empty the slot for good (the writer is closing). With
        ``error``, the save thread that was about to claim it fails with it instead
        (:meth:`check_dropped_claim`)."""
        if error is not None and self._unclaimed is not None:
            self._dropped_claim = (self._unclaimed.thread, error)
        self._unclaimed = None
