"""The one guarded entry to CUDA-specific helpers (``cuda_ext``), with pure-torch fallbacks."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _host_memory():
    """``cuda_ext.host_memory`` when importable (it needs cuda-python), else None. Imported on
    first use only: loading cuda-python's driver bindings costs ~80 ms, and CPU runs never do."""
    try:
        from cuda_ext import host_memory
    except ImportError:  # pragma: no cover - depends on the machine
        return None
    return host_memory


def pinning() -> bool:
    """Whether host buffers are page-locked (only useful, and only done, with a CUDA device)."""
    return torch.cuda.is_available()


def current_device() -> int | None:
    """The calling thread's CUDA device (the rank's own), or None without CUDA."""
    return torch.cuda.current_device() if pinning() else None


def allocate_host_buffer(nbytes: int, device: int | None = None) -> torch.Tensor:
    """A uint8 host buffer of exactly ``nbytes``: pinned when a GPU is present, plain otherwise.

    ``device`` is the CUDA device that pins it (default: the current one); the calling thread is
    switched to it, so a background thread never pins through device 0 by accident.
    """
    if not pinning():
        return torch.empty(nbytes, dtype=torch.uint8)
    if device is not None:
        torch.cuda.set_device(device)
    host_memory = _host_memory()
    if host_memory is not None and host_memory.available():
        try:
            return host_memory.pinned_empty(nbytes, device)
        except Exception as exc:  # e.g. a driver older than the cuda-python build
            logger.warning("cuMemHostAlloc of %d bytes failed (%s); using torch", nbytes, exc)
    # torch's caching host allocator rounds up to a power of two; acceptable as a fallback.
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
