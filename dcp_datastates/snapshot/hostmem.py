"""Unpinned host memory for the pool, faulted in ahead of the copies that will use it.

A fresh ``torch.empty`` of a few GB is only address space: the first copy into it takes a page
fault per 4 KiB page (1.0-1.3 s per GB in a fresh process here, 2.3 s per GB with other jobs
running, against 0.3 s for the same copy into touched memory), which made the first save several
times slower than the next ones. Here the buffer is an anonymous mapping that the kernel
populates one slice per call (``MADV_POPULATE_WRITE``, Linux 5.14+: 0.7-0.8 s per GB, no fault
per page) on background threads (up to four, each its own slices), from the start, so copies
use the populated front while the rest is populated. Where the kernel refuses that advice, slices
are touched by writing zeros.

Transparent huge pages are advised *off* for it: in a fresh process, getting 2 MiB pages (by
fault or by populate) cost 4.5-6 s per GB on this machine, several times the 4 KiB pages' cost.

Memory is zeroed with ``memset``, never a torch kernel: on a thread other than the caller's, an
ATen kernel large enough to run in parallel gives that thread an OpenMP team of its own, which
slows every training step for as long as the thread lives (``docs/design.md``, "Threads").
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch

from .._platform.pages import populate_write

logger = logging.getLogger(__name__)

#: Bytes populated per call: small enough that the first copy starts soon.
SLICE_BYTES = 64 << 20
#: Threads that populate a pool at once: the kernel takes each one's faults on its own core.
POPULATE_THREADS = max(1, min(4, os.cpu_count() or 1))


class PopulatedBuffer:
    """``nbytes`` of anonymous host memory; :meth:`populate` faults a slice of it in."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _advise(self._map, "MADV_NOHUGEPAGE")  # see the module docstring
        # frombuffer keeps the mapping alive as long as the tensor (and its views) are.
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]
        self._populate_call = True  # until the kernel refuses MADV_POPULATE_WRITE

    def populate(self, offset: int, nbytes: int) -> None:
        """Fault ``[offset, offset + nbytes)`` in (zeroed pages, as fresh memory is anyway)."""
        if nbytes <= 0:
            return
        if self._populate_call:
            if populate_write(self._map, offset, nbytes):
                return
            self._populate_call = False
            logger.debug("MADV_POPULATE_WRITE refused; touching the host pool page by page")
        ctypes.memset(self.tensor.data_ptr() + offset, 0, nbytes)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages are faulted in, filled by ``memset`` on the calling
    thread (``torch.zeros`` would start an OpenMP team on a background thread)."""
    tensor = torch.empty(shape, dtype=dtype)
    ctypes.memset(tensor.data_ptr(), 0, tensor.numel() * tensor.element_size())
    return tensor


def _advise(mapping: mmap.mmap, name: str) -> bool:
    advice = getattr(mmap, name, None)
    if advice is None:  # pragma: no cover - platform without it
        return False
    try:
        mapping.madvise(advice)
    except OSError:  # pragma: no cover - kernel without THP
        return False
    return True
