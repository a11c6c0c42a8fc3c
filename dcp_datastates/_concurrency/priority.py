"""Lower the CPU scheduling priority of the calling thread (Linux: per-thread nice value).

On a machine whose cores the training loop keeps busy, our background threads (the flush: write
into the page cache, crc32c) compete with forward and backward. A forward's parallel regions wait
for their slowest thread at each barrier, so a core taken by a flush thread for a few
milliseconds holds the whole region back by as much. With a higher nice value the kernel runs the
training threads first and gives the flush the time they leave idle.

A thread can only raise its own nice value without privileges, never lower it back, so this is
applied to threads that do nothing else (each flush file has its own thread).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

_warned = False


def lower_thread_priority(nice: int, tid: int | None = None) -> bool:
    """Raise the nice value of thread ``tid`` (a native id of this process; default: the
    calling thread) to at least ``nice`` (0 leaves it alone).

    Returns True when the thread now runs at that nice value or lower priority; False where
    per-thread priorities are not available (non-Linux) or the kernel refused (logged once).
    """
    global _warned
    if nice <= 0:
        return True
    if not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id() if tid is None else tid
    try:
        # On Linux PRIO_PROCESS with a thread id sets that thread's nice value alone.
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except OSError as exc:
        if not _warned:
            _warned = True
            logger.warning(
                "could not lower the priority of background thread %s (nice %d): %s; it runs "
                "at the caller's priority",
                threading.current_thread().name,
                nice,
                exc,
            )
        return False
