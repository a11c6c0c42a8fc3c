"""Waits on the training thread that let signal handlers run.

Python runs a signal's handler on the main thread only, once that thread runs bytecode again. A
lock wait without a timeout is woken by a signal the main thread itself takes, but not by one
whose C handler ran on another thread, nor by one that landed in the last instant before the
wait began. A SIGTERM that arrives while the loop waits on a hung save (a commit, or a snapshot
held back by a full pool in front of a hung flush) would then never run its handler, and neither
a preemption deadline nor a second signal could end the process: 7 of 180 Checkpointer workers
SIGTERMed on a loaded two-core machine hung so, none with the waits below.
"""

from __future__ import annotations

import os
import signal
import weakref
from collections.abc import Callable
from typing import Any, Protocol

#: The longest such a wait sleeps at a time, and so the longest a signal can go unhandled.
SIGNAL_POLL_S = 0.1


def wait_in_slices(wait: Callable[[float], bool]) -> None:
    """Call ``wait(SIGNAL_POLL_S)`` until it returns True (the awaited thing happened)."""
    while not wait(SIGNAL_POLL_S):
        pass


# -- one handler per signal, shared by every checkpointer listening for it -----------------------
class Listener(Protocol):
    def _on_signal(self, signum: int, frame: Any) -> None: ...


#: signum -> (the handler before ours, the listeners in the order they subscribed).
_SUBSCRIBED: dict[int, tuple[Any, list[weakref.ref[Listener]]]] = {}


def subscribe(signum: int, listener: Listener) -> None:
    """Have ``signum`` call ``listener._on_signal`` (main thread only). Each listener made in
    one process hears it: a second ``signal.signal`` used to replace the first's handler, and
    of two checkpointers (a model's and an EMA's) only the last made saved on SIGTERM (a user
    sweep)."""
    if signum not in _SUBSCRIBED:
        _SUBSCRIBED[signum] = (signal.signal(signum, _dispatch), [])
    _SUBSCRIBED[signum][1].append(weakref.ref(listener))


def unsubscribe(signum: int, listener: Listener) -> None:
    """Stop ``listener`` hearing ``signum``; the last one out puts the earlier handler back."""
    entry = _SUBSCRIBED.get(signum)
    if entry is None:
        return
    previous, refs = entry
    refs[:] = [r for r in refs if r() is not None and r() is not listener]
    if not refs:
        del _SUBSCRIBED[signum]
        signal.signal(signum, previous)


def listeners(signum: int | None = None) -> list[Listener]:
    """The live listeners of ``signum`` (of every signal: None), in the order they came."""
    entries = _SUBSCRIBED.values() if signum is None else [_SUBSCRIBED.get(signum, (None, []))]
    found: list[Listener] = []
    for _, refs in entries:
        for ref in refs:
            listener = ref()
            if listener is not None and listener not in found:
                found.append(listener)
    return found


def _dispatch(signum: int, frame: Any) -> None:
    live = listeners(signum)
    if live:
        for listener in live:
            listener._on_signal(signum, frame)
        return
    # Every listener was dropped without closing: the signal is not ours to swallow.
    previous, _ = _SUBSCRIBED.pop(signum)
    signal.signal(signum, previous)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signum)
