"""The optimizer-step guard: the next ``optimizer.step()`` waits for in-flight snapshots.

One global ``torch.optim`` step pre-hook, registered on first use, covers every optimizer in the
process, so unmodified training loops are safe. The per-tensor version check in the providers is
the last line of defence when the guard is off.
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
#: Staged futures optimizer steps wait for, each with who to tell how long a step waited.
_pending: dict[Future[None], Callable[[float], None] | None] = {}
_handle: Any = None
#: Seconds optimizer steps spent waiting on snapshots (all writers), for tests and logs.
waited_seconds = 0.0
waits = 0


def _pre_step_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global waited_seconds, waits
    with _lock:
        pending = [(f, cb) for f, cb in _pending.items() if not f.done()]
    if not pending:
        return
    start = time.perf_counter()
    for staged, on_wait in pending:
        wait([staged])
        if on_wait is not None:
            # This snapshot held the step back from its start until it completed.
            on_wait(time.perf_counter() - start)
    waited = time.perf_counter() - start
    with _lock:
        waited_seconds += waited
        waits += 1
    logger.debug("optimizer step waited %.3fs for %d snapshot(s)", waited, len(pending))


def guard(staged: Future[None], on_wait: Callable[[float], None] | None = None) -> None:
    """Make optimizer steps wait for ``staged`` until it resolves; ``on_wait(seconds)`` is told
    how long each step that waited was held back by it."""
    global _handle
    with _lock:
        if _handle is None:
            _handle = register_optimizer_step_pre_hook(_pre_step_hook)
        _pending[staged] = on_wait
    staged.add_done_callback(_forget)


def _forget(staged: Future[None]) -> None:
    with _lock:
        _pending.pop(staged, None)


def pending_snapshots() -> int:
    with _lock:
        return sum(1 for f in _pending if not f.done())
