"""Exact-size page-locked host buffers through the CUDA driver (``cuMemHostAlloc``).

torch's caching host allocator rounds pinned allocations up to a power of two (a 3 GB pool would
pin 4 GB); ``cuMemHostAlloc`` pins exactly what is asked for (rounded to a page). The buffer is
allocated in the primary context of the caller's own device (the rank's device, never device 0
from every rank), as PORTABLE memory (pinned for every context), without WRITECOMBINED (the flush
reads it on the CPU).

The memory is freed by a finalizer when the last tensor over it goes, on whichever thread drops
it: often one that never made a CUDA call (a dropped writer's scheduler thread frees its pool),
where no context is current and ``cuMemFreeHost`` fails. The free makes the device's primary
context current for the call (``cuCtxPushCurrent``) and checks every result; a failure is
logged naming the pool (a finalizer has no caller to raise to).

Importable without cuda-python and without a GPU: :func:`available` says whether it can work.
"""

from __future__ import annotations

import ctypes
import logging
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

logger = logging.getLogger(__name__)


def available() -> bool:
    """True when cuda-python is installed and a CUDA device is usable."""
    return _driver is not None and torch.cuda.is_available()


def _check(result: Any, call: str, driver: Any = None) -> Any:
    driver = driver if driver is not None else _driver
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(err)
        name = text.decode() if isinstance(text, bytes) else text
        raise RuntimeError(f"{call} failed: {err!r} ({name})")
    return rest[0] if rest else None


def _free(driver: Any, ptr: int, device: Any, context: Any, what: str) -> None:
    """Free ``what`` (a pinned buffer at ``ptr``) in its device's primary ``context``, made
    current on this thread for the call, then release the context's retain."""
    try:
        _check(driver.cuCtxPushCurrent(context), f"cuCtxPushCurrent for {what}", driver)
        try:
            _check(driver.cuMemFreeHost(ptr), f"cuMemFreeHost of {what}", driver)
        finally:
            _check(driver.cuCtxPopCurrent(), f"cuCtxPopCurrent after freeing {what}", driver)
    except Exception:
        logger.error(
            "freeing %s failed; it stays pinned until the process exits", what, exc_info=True
        )
    finally:
        try:
            _check(driver.cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease", driver)
        except Exception:
            logger.error("releasing the context of %s failed", what, exc_info=True)


def pinned_empty(nbytes: int, device: int | None = None) -> torch.Tensor:
    """A uint8 CPU tensor of exactly ``nbytes`` of page-locked memory, freed with the tensor.

    ``device`` is the CUDA device whose context pins it (default: the current one); the calling
    thread is switched to that device.
    """
    if not available():
        raise RuntimeError("pinned_empty needs cuda-python and a CUDA device")
    index = torch.cuda.current_device() if device is None else int(device)
    torch.cuda.set_device(index)
    return pinned_with(_driver, nbytes, index)


def pinned_with(driver: Any, nbytes: int, index: int) -> torch.Tensor:
    """:func:`pinned_empty` through ``driver`` (cuda-python's ``driver`` module, or a test's
    stand-in), in the primary context of device ``index``."""
    _check(driver.cuInit(0), "cuInit", driver)
    dev = _check(driver.cuDeviceGet(index), f"cuDeviceGet({index})", driver)
    ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({index})", driver)
    try:
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", driver)
        flags = driver.CU_MEMHOSTALLOC_PORTABLE
        ptr = int(_check(driver.cuMemHostAlloc(nbytes, flags), f"cuMemHostAlloc({nbytes})", driver))
    except BaseException:
        driver.cuDevicePrimaryCtxRelease(dev)
        raise
    holder = (ctypes.c_uint8 * nbytes).from_address(ptr)
    what = f"the {nbytes}-byte pinned host pool at {ptr:#x} on cuda:{index}"
    # Not at interpreter exit: the driver may be gone by then, and the process frees it anyway.
    weakref.finalize(holder, _free, driver, ptr, dev, ctx, what).atexit = False
    return torch.frombuffer(holder, dtype=torch.uint8, count=nbytes)
