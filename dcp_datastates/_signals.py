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

from collections.abc import Callable

#: The longest such a wait sleeps at a time, and so the longest a signal can go unhandled.
SIGNAL_POLL_S = 0.1


def wait_in_slices(wait: Callable[[float], bool]) -> None:
    """Call ``wait(SIGNAL_POLL_S)`` until it returns True (the awaited thing happened)."""
    while not wait(SIGNAL_POLL_S):
        pass
