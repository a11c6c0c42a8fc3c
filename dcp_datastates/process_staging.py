"""Staging for ``AsyncCheckpointerType.PROCESS``, where the save runs in another process.

There the staged state dict is pickled to DCP's checkpoint daemon, so the writer cannot stream
from live tensors: the daemon must receive a real copy. The copy is still lazy: ``stage()``
returns a future at once and a background thread copies every tensor into *one* shared-memory
segment per save (not one per tensor: thousands of segments exhaust file descriptors); the
optimizer guard makes the next step wait for it. DCP waits for the future before sending the
copy, and the daemon's writer streams it to storage.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .errors import InvalidStateDictError, SnapshotMutationError
from .planner import check_state_dict
from .snapshot import guard as _guard

logger = logging.getLogger(__name__)


@dataclass
class ProcessStaging:
    result: Future[Any]  # the staged copy of the state dict
    staged: Future[None]  # resolves when the copy is complete (or failed)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def stage_for_process(state_dict: dict[str, Any], *, guard: bool) -> ProcessStaging:
    check_state_dict(state_dict)
    sources: list[tuple[str, torch.Tensor, int]] = []  # (fqn, live tensor, version)
    offsets: list[int] = []
    total = 0

    def plan(value: Any, fqn: str) -> Any:
        nonlocal total
        if isinstance(value, DTensor):
            local = plan(value.to_local(), fqn)
            return lambda buf: DTensor.from_local(
                local(buf),
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                raise InvalidStateDictError(
                    f"item {fqn!r} is a {type(value).__name__}; the PROCESS checkpointer stages "
                    "plain tensors and DTensors only (use the THREAD checkpointer)"
                )
            t = value.detach()
            total += (-total) % 64
            start = total
            sources.append((fqn, t, t._version))
            offsets.append(start)
            total += _nbytes(t)
            return lambda buf: buf[start : start + _nbytes(t)].view(t.dtype).view(t.shape)
        if isinstance(value, dict):
            parts = {k: plan(v, f"{fqn}.{k}" if fqn else str(k)) for k, v in value.items()}
            return lambda buf: {k: make(buf) for k, make in parts.items()}
        if isinstance(value, (list, tuple)):
            parts_l = [plan(v, f"{fqn}.{i}") for i, v in enumerate(value)]
            kind = type(value)
            return lambda buf: kind(make(buf) for make in parts_l)
        frozen = copy.deepcopy(value)  # objects are mutable: copy them now, on the caller thread
        return lambda buf: frozen

    build: Callable[[torch.Tensor], Any] = plan(state_dict, "")
    result: Future[Any] = Future()
    staged: Future[None] = Future()
    if guard:
        _guard.guard(staged)

    def run() -> None:
        try:
            buf = torch.empty(max(total, 1), dtype=torch.uint8).share_memory_()
            staged_dict = build(buf)
            for (fqn, src, version), start in zip(sources, offsets, strict=True):
                n = _nbytes(src)
                if n:
                    buf[start : start + n].view(src.dtype).view(src.shape).copy_(src)
                if src._version != version:
                    raise SnapshotMutationError(
                        fqn=fqn, rank=_rank(), before=version, after=src._version
                    )
            result.set_result(staged_dict)
        except BaseException as exc:  # reaches the caller through DCP's upload future
            result.set_exception(exc)
        finally:
            staged.set_result(None)

    threading.Thread(target=run, name="datastates-process-stage", daemon=True).start()
    return ProcessStaging(result=result, staged=staged)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
