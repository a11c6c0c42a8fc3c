"""Exact-size page-locked host buffers through ``cudaHostAlloc``.

torch's caching host allocator rounds pinned allocations up to a power of two (a 3 GB pool would
pin 4 GB); ``cudaHostAlloc`` pins exactly what is asked for.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

try:
    from cuda.bindings import runtime as _cudart
except ImportError:  # older cuda-python layout, or not installed
    try:
        from cuda import cudart as _cudart  # type: ignore[no-redef]
    except ImportError:
        _cudart = None


def available() -> bool:
    """True when cuda-python is installed and a CUDA device is usable."""
    return _cudart is not None and torch.cuda.is_available()


def _check(result: tuple) -> object:
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA runtime call failed: {err}")
    return rest[0] if rest else None


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of exactly ``nbytes`` in page-locked memory, freed with the tensor."""
    if not available():
        raise RuntimeError("pinned_empty needs cuda-python and a CUDA device")
    ptr = int(_check(_cudart.cudaHostAlloc(nbytes, _cudart.cudaHostAllocDefault)))
    holder = (ctypes.c_uint8 * nbytes).from_address(ptr)
    weakref.finalize(holder, _cudart.cudaFreeHost, ptr)
    return torch.frombuffer(holder, dtype=torch.uint8, count=nbytes)
