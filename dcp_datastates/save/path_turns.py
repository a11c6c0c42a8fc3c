"""One save per checkpoint directory at a time, in this process: saves to the same directory take
turns, in the order they were called.

Two saves to one directory that overlap (a rolling ``latest`` path saved again before the last
save ended) would interleave there: the later one removes the earlier one's ``.metadata`` and
rewrites its data files while the earlier one still writes and commits, and a future could report
success for a committed checkpoint whose data the other save overwrote. So a save's first touch
of the directory (``prepare_local_plan``, every rank) waits until every earlier save to it in this
process is over; its snapshot is not held back (the copies run, the state may change on time),
only its writes.

A save takes its turn when it is called (``stage()`` on the caller's thread; a plain ``dcp.save``
at its first writer call) and is *over* when the thread that runs it is done with it:

- the thread ended (``dcp.async_save`` runs each save on a thread of its own);
- the thread started another save, or called ``stage()`` (a plain ``dcp.save`` on the caller's
  thread returned before its caller could do either);
- the writer's save thread said its ``dcp.save`` ended (``dcp_datastates.async_save``);
- it was never claimed by a save thread and was dropped (its ``dcp.async_save`` failed).

Until then the waiting save rechecks every :data:`RECHECK_S` (a thread's end sets no event).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

RECHECK_S = 0.05
#: Directories kept in line before ``take`` sweeps those whose saves all ended (a save that
#: ends with its thread never says so; without the sweep every new path would stay listed).
SWEEP_AT = 64

_changed = threading.Condition()
_order = itertools.count()
_turns: dict[str, list[Turn]] = {}
_local = threading.local()  # .owned: the turn of the save this thread runs


def _after_fork_in_child() -> None:
    """A process made by ``os.fork()`` waits for none of its parent's saves (they run there)."""
    global _changed, _local
    _changed = threading.Condition()
    _turns.clear()
    _local = threading.local()


os.register_at_fork(after_in_child=_after_fork_in_child)


def directory_key(path: str | os.PathLike) -> str:
    """The directory ``path`` names, the same however it is spelled (local paths absolute)."""
    path = os.fspath(path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    if "://" in path:
        return path.rstrip("/")
    return os.path.abspath(path)


class Turn:
    """One save's place in its directory's line."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.seq = next(_order)
        self.owner: threading.Thread | None = None
        self.ended = False
        self._session: Callable[[], Any] | None = None  # weak: the snapshot staged for it

    def dropped_with(self, session: Any) -> None:
        """Its save's snapshot: unclaimed and retired, it was dropped (no save will run)."""
        self._session = weakref.ref(session)

    def over(self) -> bool:
        if self.ended:
            return True
        if self.owner is not None:
            return not self.owner.is_alive()
        if self._session is None:
            return False  # a plain dcp.save's turn gets its owner as it is taken
        session = self._session()
        return session is None or (session.owner is None and session.retired)

    def run_here(self) -> None:
        """The current thread runs this save (the ones it ran before are over)."""
        end_owned()
        self.owner = threading.current_thread()
        _local.owned = self

    def wait(self, where: str) -> None:
        """Return once every earlier save to this directory is over."""
        logged = False
        with _changed:
            while True:
                line = _turns.get(self.key, [])
                line[:] = [t for t in line if t is self or not t.over()]
                if not any(t.seq < self.seq for t in line):
                    return
                if not logged:
                    logger.info("a save to %s waits for the save before it to end", where)
                    logged = True
                _changed.wait(RECHECK_S)

    def leave(self) -> None:
        """This save will not touch its directory again (it is over or never started)."""
        with _changed:
            self.ended = True
            line = _turns.get(self.key)
            if line is not None:
                line[:] = [t for t in line if t is not self]
                if not line:
                    del _turns[self.key]
            _changed.notify_all()


def take(path: str | os.PathLike) -> Turn:
    """A turn for a save to ``path`` called now, after the saves already in line."""
    turn = Turn(directory_key(path))
    with _changed:  # on the caller's thread (stage()): its own line only, but now and then
        if len(_turns) > SWEEP_AT:
            for key in [k for k, line in _turns.items() if all(t.over() for t in line)]:
                del _turns[key]
        line = _turns.setdefault(turn.key, [])
        line[:] = [t for t in line if not t.over()]
        line.append(turn)
    return turn


def end_owned() -> None:
    """The current thread is done with the save it ran (it starts or stages another)."""
    owned = getattr(_local, "owned", None)
    if owned is not None:
        _local.owned = None
        owned.leave()


__all__ = ["Turn", "directory_key", "end_owned", "take"]
