"""The optimizer-step guard: the next ``optimizer.step()`` waits for in-flight snapshots.

One global ``torch.optim`` step pre-hook, registered on first use, covers every optimizer in the
process, so unmodified training loops are safe. The per-tensor version check in the providers is
the last line of defence when the guard is off.

On CUDA the step need not block the host: a snapshot registered with a *fence* makes the step's
stream wait on the copies' events (``SnapshotSession.fence_on_device``), so the step's kernels
queue behind the copies while Python runs ahead. Where a fence is not possible (CPU copies, host
parts, or ``fence`` is None) the hook waits on the host, as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._concurrency.signals import wait_in_slices

logger = logging.getLogger(__name__)

_lock = threading.Lock()
#: Staged futures optimizer steps wait for, each with who to tell how long a step waited, how
#: to fence the step on the device instead (None: the host waits) and what to tell as it begins.
_pending: dict[
    Future[None],
    tuple[Callable[[float], None] | None, Callable[[], bool] | None, Callable[[], None] | None],
] = {}
_handle: Any = None
#: Seconds optimizer steps spent waiting on snapshots (all writers), for tests and logs.
waited_seconds = 0.0
waits = 0
#: Steps that were fenced on the device instead of waiting on the host.
fences = 0


def _after_fork_in_child() -> None:
    """A process made by ``os.fork()`` runs none of its parent's snapshots: its steps wait for
    none (they waited for good), and a parent thread may have held the lock at the fork."""
    global _lock
    _lock = threading.Lock()
    _pending.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _pre_step_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global waited_seconds, waits, fences
    with _lock:
        pending = [(f, *rest) for f, rest in _pending.items() if not f.done()]
    if not pending:
        return
    start = time.perf_counter()
    host = False
    for _staged, _on_wait, _fence, on_step in pending:
        if on_step is not None:  # first: writes from the live tensors stop before any wait
            on_step()
    for staged, on_wait, fence, _on_step in pending:
        if fence is None or not _fenced(fence):
            host = True
            # In slices: a snapshot held back by a hung flush must not keep a signal's handler
            # from running on this (the training) thread.
            wait_in_slices(lambda s, f=staged: bool(wait([f], timeout=s).done))
        if on_wait is not None:
            # This snapshot held the step back (on the host, or until fenced) this long.
            on_wait(time.perf_counter() - start)
    waited = time.perf_counter() - start
    with _lock:
        waited_seconds += waited
        if host:
            waits += 1
        else:
            fences += 1
    logger.debug("optimizer step waited %.3fs for %d snapshot(s)", waited, len(pending))


def _fenced(fence: Callable[[], bool]) -> bool:
    try:
        return fence()
    except Exception:  # the host wait is always correct: fall back to it
        logger.warning(
            "fencing the optimizer step on the device failed; waiting on the host", exc_info=True
        )
        return False


def guard(
    staged: Future[None],
    on_wait: Callable[[float], None] | None = None,
    fence: Callable[[], bool] | None = None,
    on_step: Callable[[], None] | None = None,
) -> None:
    """Make optimizer steps wait for ``staged`` until it resolves; ``on_wait(seconds)`` is told
    how long each step that waited was held back by it. ``fence``, if given, is tried first:
    True means the step's stream now waits for the snapshot on the device, not the host.
    ``on_step()``, if given, runs as a step begins, before any wait (the snapshot stops
    writing from the live tensors, ``SnapshotSession.stop_live``)."""
    global _handle
    with _lock:
        if _handle is None:
            _handle = register_optimizer_step_pre_hook(_pre_step_hook)
        _pending[staged] = (on_wait, fence, on_step)
    staged.add_done_callback(_forget)


def _forget(staged: Future[None]) -> None:
    with _lock:
        _pending.pop(staged, None)


def pending_snapshots() -> int:
    with _lock:
        return sum(1 for f in _pending if not f.done())
