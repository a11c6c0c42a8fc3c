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
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_pending: dict[Future[None], Callable[[], bool] | None] = {}
_handle: Any = None
#: Seconds optimizer steps spent waiting on snapshots, for stats and tests.
waited_seconds = 0.0
waits = 0
#: Steps that were fenced on the device instead of waiting on the host.
fences = 0


def _pre_step_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global waited_seconds, waits, fences
    with _lock:
        pending = [(f, fence) for f, fence in _pending.items() if not f.done()]
    if not pending:
        return
    start = time.perf_counter()
    host = [f for f, fence in pending if fence is None or not _fenced(fence)]
    if host:
        wait(host)
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


def guard(staged: Future[None], fence: Callable[[], bool] | None = None) -> None:
    """Make optimizer steps wait for ``staged`` until it resolves.

    ``fence``, if given, is tried first: True means the step's stream now waits on the device.
    """
    global _handle
    with _lock:
        if _handle is None:
            _handle = register_optimizer_step_pre_hook(_pre_step_hook)
        _pending[staged] = fence
    staged.add_done_callback(_forget)


def _forget(staged: Future[None]) -> None:
    with _lock:
        _pending.pop(staged, None)


def pending_snapshots() -> int:
    with _lock:
        return sum(1 for f in _pending if not f.done())
