"""The sessions a runtime holds until they retire, and their retirement callback.

Shares the runtime's lock and Condition (passed in; ``runtime.py`` says when each is held): the
list is read and changed under that lock, and a session's retirement takes it to drop the
session and wake ``close()``. May import ``snapshot``; nothing else of ``save/``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from ..snapshot.session import SnapshotSession


class LiveSessions:
    """Sessions not yet retired, kept so that ``close()`` can wait for them and drop them."""

    def __init__(self, changed: threading.Condition) -> None:
        self._changed = changed
        self._sessions: list[SnapshotSession] = []
        #: Every session's retirement callback (it holds this list weakly).
        self.on_retired = self._weak_callback()

    def add(self, session: SnapshotSession) -> None:
        # caller holds the lock
        session.on_retired = self.on_retired
        self._sessions = [s for s in self._sessions if not s.retired] + [session]

    def all(self) -> list[SnapshotSession]:
        # caller holds the lock
        return list(self._sessions)

    def busy(self) -> list[SnapshotSession]:
        # caller holds the lock
        return [s for s in self._sessions if not s.retired]

    def _weak_callback(self) -> Callable[[SnapshotSession], None]:
        """A session's retirement callback, holding this list weakly: the runtime holds its
        sessions, and a bound method in each made a reference cycle that only the cyclic GC
        broke, so the pool of a writer dropped without ``close()`` (DCP's writer per save) stayed
        mapped until a full collection: one more state's worth of host memory per save."""
        ref = weakref.WeakMethod(self._retired)

        def retired(session: SnapshotSession) -> None:
            method = ref()
            if method is not None:
                method(session)

        return retired

    def _retired(self, session: SnapshotSession) -> None:
        with self._changed:
            # Not kept once retired: a failed session holds its error, whose traceback holds
            # the frames of the save that failed, the writer's among them; the writer's
            # finalizer holds this runtime, so a writer dropped after a failed save (DCP's
            # writer per save) was kept alive by its own finalizer, threads and pool included.
            self._sessions = [s for s in self._sessions if s is not session]
            self._changed.notify_all()
