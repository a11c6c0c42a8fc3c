"""Staging for ``AsyncCheckpointerType.PROCESS``, where the save runs in another process.

There the staged state dict is pickled to DCP's checkpoint daemon, so the writer cannot stream
from live tensors: the daemon must receive a real copy. The copy is still lazy: ``stage()``
returns a future at once and a background thread copies every tensor into *one* shared-memory
segment per save (not one per tensor: thousands of segments exhaust file descriptors); the
optimizer guard makes the next step wait for it. DCP waits for the future before sending the
copy, and the daemon's writer streams it to storage.

Each tensor is read through a ``TensorProvider``, as in the THREAD executor, so the same
protections hold: small tensors are copied during ``stage()`` (``eager_copy_bytes``), the forward
gate copies module buffers before forward updates them (``guard_forward``), and the version
counter and sampled bytes catch any other change.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .errors import InvalidStateDictError
from .planner import check_state_dict
from .providers.tensor import TensorProvider
from .snapshot import forward_gate as _forward_gate
from .snapshot import guard as _guard

logger = logging.getLogger(__name__)


@dataclass
class ProcessStaging:
    result: Future[Any]  # the staged copy of the state dict
    staged: Future[None]  # resolves when the copy is complete (or failed)


class _StagedDTensor:
    """A staged DTensor on its way to the daemon: pickles as its local tensor and its spec, and
    unpickles there as a DTensor.

    Not a DTensor here because pickling a DTensor whose local tensor is a view at a non-zero
    offset into a shared-memory segment crashes the process (SIGSEGV in torch 2.13), and every
    staged tensor is such a view (one segment per save). The plain view pickles fine.
    """

    def __init__(self, local: torch.Tensor, spec: Any) -> None:
        self.local = local
        self.spec = spec

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_dtensor, (self.local, self.spec))


def _rebuild_dtensor(local: torch.Tensor, spec: Any) -> DTensor:
    # The constructor, not DTensor.from_local: from_local would move a CPU copy back to the mesh's
    # device (a GPU), and would record an autograd op.
    return DTensor(local, spec, requires_grad=False)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Protected:
    """What the forward gate needs of a staging: its tensors, its future, its figures."""

    def __init__(self, providers: list[TensorProvider], staged: Future[None]) -> None:
        self.providers = providers
        self.staged = staged
        self.forward_frozen_bytes = 0
        self.forward_blocked_s = 0.0

    def raw_providers(self) -> list[TensorProvider]:
        return [p for p in self.providers if p.nbytes > 0]


def stage_for_process(
    state_dict: dict[str, Any],
    *,
    guard: bool,
    guard_forward: bool = True,
    eager_copy_bytes: int = 0,
) -> ProcessStaging:
    check_state_dict(state_dict)
    sources: list[TensorProvider] = []  # each live tensor, read through a provider
    offsets: list[int] = []
    total = 0

    def plan(value: Any, fqn: str) -> Any:
        nonlocal total
        if isinstance(value, DTensor):
            local = plan(value.to_local(), fqn)
            spec = value._spec  # mesh, placements, global shape/stride/dtype: all it takes
            return lambda buf: _StagedDTensor(local(buf), spec)
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                raise InvalidStateDictError(
                    f"item {fqn!r} is a {type(value).__name__}; the PROCESS checkpointer stages "
                    "plain tensors and DTensors only (use the THREAD checkpointer)"
                )
            t = value.detach()
            total += (-total) % 64
            start = total
            sources.append(TensorProvider(fqn, t))
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
    for provider in sources:
        provider.note_part()  # one copy each, into its place in the segment
        if 0 < provider.nbytes <= eager_copy_bytes:
            provider.freeze()
    if guard:
        _guard.guard(staged)
    if guard_forward:
        _forward_gate.protect(_Protected(sources, staged))

    def run() -> None:
        rank = _rank()
        try:
            buf = shared_bytes(max(total, 1))
            staged_dict = build(buf)
            for provider, start in zip(sources, offsets, strict=True):
                n = provider.nbytes
                if n:
                    provider.copy_into(buf[start : start + n], 0, n)
                provider.check_unchanged(rank)
            result.set_result(staged_dict)
        except BaseException as exc:  # reaches the caller through DCP's upload future
            result.set_exception(exc)
        finally:
            for provider in sources:
                provider.release()  # hold no reference to the caller's tensors any more
            staged.set_result(None)

    threading.Thread(target=run, name="datastates-process-stage", daemon=True).start()
    return ProcessStaging(result=result, staged=staged)


def shared_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh shared memory as a uint8 tensor, written by nothing yet.

    Not ``torch.empty(n).share_memory_()``: that copies the new tensor's bytes into the shared
    segment, a parallel ATen copy of the whole state on this thread (its own OpenMP team beside
    the training's, ``docs/design.md``, "Threads"): staging the train benchmark's 0.33 GB state
    took 0.27-0.28 s of CPU with it, 0.20 s without."""
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


_daemon_runtimes: dict[Any, Any] = {}
_daemon_lock = threading.Lock()


def _after_fork_in_child() -> None:  # the runtimes' threads are the parent's
    global _daemon_lock
    _daemon_lock = threading.Lock()
    _daemon_runtimes.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def daemon_runtime(options: Any, make: Callable[[], Any]) -> Any:
    """The one writer runtime (pool and threads) per options of this process, for writers that
    were unpickled here.

    DCP's checkpoint daemon unpickles a new writer for every save request and never closes it:
    each would allocate its own pool and threads and leave them behind (6 saves of 48 MiB grew
    the daemon by 3 threads and ~96 MiB per save). Sharing one runtime keeps the daemon flat and
    reuses the pool, as one long-lived writer would; the daemon runs its saves one at a time.
    """
    with _daemon_lock:
        runtime = _daemon_runtimes.get(options)
        if runtime is None:
            runtime = _daemon_runtimes[options] = make()
        return runtime
