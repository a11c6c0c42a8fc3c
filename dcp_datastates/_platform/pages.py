"""Faulting in the pages of an anonymous mapping before they are used.

Both the host pool (``snapshot/hostmem.py``) and the direct-write buffers (``localfile.py``) are
fresh anonymous memory whose first touch costs a page fault per 4 KiB page; the kernel can take
those faults for a whole range in one call instead.
"""

from __future__ import annotations

import mmap

#: ``MADV_POPULATE_WRITE`` from ``<linux/mman.h>`` (Linux 5.14+; the mmap module does not export
#: it).
MADV_POPULATE_WRITE = 23


def populate_write(mapping: mmap.mmap, start: int = 0, length: int | None = None) -> bool:
    """Fault ``[start, start + length)`` of ``mapping`` in for writing (from the page holding
    ``start``; ``length`` defaults to the rest of it). False where the kernel or platform
    refuses: the caller then touches the pages itself."""
    if length is None:
        length = len(mapping) - start
    page_start = start - start % mmap.PAGESIZE
    try:
        mapping.madvise(MADV_POPULATE_WRITE, page_start, length + start - page_start)
    except (OSError, ValueError, AttributeError):  # old kernel, or no madvise on this platform
        return False
    return True
