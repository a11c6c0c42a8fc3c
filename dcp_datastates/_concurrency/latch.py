"""``Latch``: a one-shot event that makes a ``threading.Event`` only for a thread that must wait.

A save keeps a few hundred of these alive: two per snapshot piece (copied; enqueued on the
device), two per session (planned; the flush may start) and two per call (claimed; the caller is
returning). As ``threading.Event`` each was eight objects (the event, its ``Condition``, the
condition's lock, deque, dict and bound lock methods): about 2,100 of the 9,000 objects a save of
the train benchmark's state kept alive, which the cyclic GC's young collections promote and
which so set off its full collections (0.1 per save, 170 ms each). Most are never waited on
while unset (the flush of host state without live writes starts once the snapshot is staged),
so the event is made on demand.
"""

from __future__ import annotations

import os
import threading

#: Guards every latch's flag against a waiter making its event while the flag is set (a wait
#: that would never return). Held for a few bytecodes; latches are set a few hundred times a save.
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:  # a parent thread may have held it at the fork
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Latch:
    """``set()`` once, ``is_set()``, ``wait(timeout)``: ``threading.Event``'s calls, without
    ``clear()`` (nothing resets a latch)."""

    __slots__ = ("_set", "_event")

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def set(self) -> None:
        with _LOCK:
            self._set = True
            event = self._event
        if event is not None:
            event.set()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set (or ``timeout`` seconds); True once set, as ``Event.wait``."""
        if self._set:
            return True
        with _LOCK:
            if self._set:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def __repr__(self) -> str:
        return f"<Latch {'set' if self._set else 'unset'}>"
