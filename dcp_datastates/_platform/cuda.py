"""The one guarded entry to CUDA-specific helpers (``cuda_ext``), with pure-torch fallbacks, and
the seam between the CUDA paths and the CUDA runtime (:class:`Runtime`).

The snapshot's device copies (``snapshot/device.py``) and the load's bounce buffers
(``load/bounce.py``) make every stream, event and device call through a :class:`Runtime`:
:data:`TORCH_CUDA` is torch's; ``snapshot/device_fake.FakeCuda`` is a simulated GPU that runs the
same code on CPU tensors in tests, with its kernels behind the host.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Protocol

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


class Runtime(Protocol):
    """The CUDA calls the copy and load paths make. Streams have ``wait_event``, ``wait_stream``,
    ``synchronize`` and ``device_index``, and are hashable; events have ``record(stream)``,
    ``query`` and ``synchronize`` (``torch.cuda.Stream`` and ``torch.cuda.Event`` do)."""

    def device_of(self, tensor: torch.Tensor) -> int | None:
        """The device index of a tensor in device memory; None for host memory."""
        ...

    def new_stream(self, index: int) -> Any:
        """A side stream of device ``index`` (independent of every other stream)."""
        ...

    def current_stream(self, index: int) -> Any:
        """The calling thread's current stream on device ``index``."""
        ...

    def new_event(self, *, blocking: bool = False) -> Any:
        """An event; ``blocking``: a host thread waiting on it sleeps instead of spinning."""
        ...

    def on(self, index: int, stream: Any) -> contextlib.AbstractContextManager[None]:
        """Work issued in the block goes to ``stream`` of device ``index``."""
        ...

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` so far ran."""
        ...

    def empty(self, nbytes: int, index: int) -> torch.Tensor:
        """``nbytes`` of uninitialized device memory (uint8)."""
        ...

    def is_stream(self, obj: Any) -> bool: ...

    def set_device(self, index: int) -> None:
        """Make device ``index`` the calling thread's current device."""
        ...


class TorchCuda:
    """:class:`Runtime` through ``torch.cuda``."""

    def device_of(self, tensor: torch.Tensor) -> int | None:
        return tensor.device.index if tensor.is_cuda else None

    def new_stream(self, index: int) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=index)

    def current_stream(self, index: int) -> torch.cuda.Stream:
        return torch.cuda.current_stream(index)

    def new_event(self, *, blocking: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(blocking=blocking)

    @contextlib.contextmanager
    def on(self, index: int, stream: torch.cuda.Stream) -> Iterator[None]:
        with torch.cuda.device(index), torch.cuda.stream(stream):
            yield

    def keep(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def empty(self, nbytes: int, index: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=index)

    def is_stream(self, obj: Any) -> bool:
        return isinstance(obj, torch.cuda.Stream)

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)


TORCH_CUDA = TorchCuda()
