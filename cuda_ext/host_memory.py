"""Exact-size page-locked host buffers through the CUDA driver (``cuMemHostAlloc``).

torch's caching host allocator rounds pinned allocations up to a power of two (a 3 GB pool would
pin 4 GB); ``cuMemHostAlloc`` pins exactly what is asked for (rounded to a page). The buffer is
allocated in the primary context of the caller's own device (the rank's device, never device 0
from every rank), as PORTABLE memory (pinned for every context), without WRITECOMBINED (the flush
reads it on the CPU).

Importable without cuda-python and without a GPU: :func:`available` says whether it can work.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch

try:
    from cuda.bindings import driver as _driver
except ImportError:  # cuda-python < 12.6 layout, or not installed
    try:
        from cuda import cuda as _driver  # type: ignore[no-redef]
    except ImportError:
        _driver = None


def available() -> bool:
    """True when cuda-python is installed and a CUDA device is usable."""
    return _driver is not None and torch.cuda.is_available()


def _check(result: Any, call: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != _driver.CUresult.CUDA_SUCCESS:
        _, text = _driver.cuGetErrorString(err)
        name = text.decode() if isinstance(text, bytes) else text
        raise RuntimeError(f"{call} failed: {err!r} ({name})")
    return rest[0] if rest else None


def _free(ptr: int, device: Any) -> None:
    try:
        _driver.cuMemFreeHost(ptr)
    finally:
        _driver.cuDevicePrimaryCtxRelease(device)


def pinned_empty(nbytes: int, device: int | None = None) -> torch.Tensor:
    """A uint8 CPU tensor of exactly ``nbytes`` of page-locked memory, freed with the tensor.

    ``device`` is the CUDA device whose context pins it (default: the current one); the calling
    thread is switched to that device.
    """
    if not available():
        raise RuntimeError("pinned_empty needs cuda-python and a CUDA device")
    index = torch.cuda.current_device() if device is None else int(device)
    torch.cuda.set_device(index)
    _check(_driver.cuInit(0), "cuInit")
    dev = _check(_driver.cuDeviceGet(index), f"cuDeviceGet({index})")
    ctx = _check(_driver.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({index})")
    try:
        _check(_driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        flags = _driver.CU_MEMHOSTALLOC_PORTABLE
        ptr = int(_check(_driver.cuMemHostAlloc(nbytes, flags), f"cuMemHostAlloc({nbytes})"))
    except BaseException:
        _driver.cuDevicePrimaryCtxRelease(dev)
        raise
    holder = (ctypes.c_uint8 * nbytes).from_address(ptr)
    # Not at interpreter exit: the driver may be gone by then, and the process frees it anyway.
    weakref.finalize(holder, _free, ptr, dev).atexit = False
    return torch.frombuffer(holder, dtype=torch.uint8, count=nbytes)
