"""The one guarded entry to CUDA-specific helpers (``cuda_ext``), with pure-torch fallbacks."""

from __future__ import annotations

import torch

try:  # cuda_ext needs cuda-python; without it (or without a GPU) torch does the work.
    from cuda_ext import host_memory as _host_memory
except ImportError:  # pragma: no cover - depends on the machine
    _host_memory = None


def pinning() -> bool:
    """Whether host buffers are page-locked (only useful, and only done, with a CUDA device)."""
    return torch.cuda.is_available()


def allocate_host_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 host buffer of exactly ``nbytes``: pinned when a GPU is present, plain otherwise."""
    if pinning() and _host_memory is not None and _host_memory.available():
        return _host_memory.pinned_empty(nbytes)
    if pinning():
        # torch's caching host allocator rounds up to a power of two; acceptable as a fallback.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(nbytes, dtype=torch.uint8)
