"""The floor of a lazy, verified, durable checkpoint of host-resident state: the training
target's limit (issue 11).

What any checkpoint must do on the training's cores if it returns to the caller at once, lets
forward and backward run on, keeps the state of the call and makes it durable with checksums,
and nothing else:

- one thread copies every tensor into a buffer allocated once and reused (``memmove``, which
  releases the GIL), and the next optimizer step waits for that copy (a step pre-hook), as our
  optimizer guard makes it;
- one thread at the flush's nice value computes the crc32c of each 32 MiB of the buffer as soon
  as it is copied, writes it with ``O_DIRECT`` (no copy into the page cache) and at the end
  fsyncs the one file.

No planning, no metadata, no pickles, no second file, no mutation checks; what it writes cannot
be loaded. Its overhead in the training's paired blocks, against stock async's in the same
cycles, is what the target can be measured against: where even this floor costs more than
0.3x stock's overhead, the cores, not our code, stop the target.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from crc32c import crc32c

from dcp_datastates._concurrency.priority import lower_thread_priority

from .state import tensors_of

#: Bytes per checksummed direct write, as our flush writes a big tensor.
CHUNK = 32 << 20
_PAGE = 4096


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class LazyFloor:
    """A reusable minimal checkpointer; :meth:`save` returns the future of its fsync."""

    def __init__(self, nice: int = 10) -> None:
        self._nice = nice
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._base = 0
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="floor-copy")
        self._flusher = ThreadPoolExecutor(
            1, thread_name_prefix="floor-flush", initializer=lambda: lower_thread_priority(nice)
        )

    def _buffer(self, nbytes: int) -> int:
        """The buffer's address, (re)allocated and faulted in where the state outgrew it."""
        if self._map is None or len(self._map) < nbytes:
            self.close_buffer()
            self._map = mmap.mmap(-1, _align(max(nbytes, 1), _PAGE))
            self._view = memoryview(self._map)
            t = torch.frombuffer(self._map, dtype=torch.uint8)
            t.fill_(0)  # faulted in now, not during a timed save
            self._base = t.data_ptr()
        return self._base

    def prepare(self, state: Any) -> None:
        self._buffer(self._layout(tensors_of(state))[1])

    @staticmethod
    def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
        offsets, at = [], 0
        for t in tensors:
            offsets.append(at)
            at = _align(at + t.numel() * t.element_size(), 64)
        return offsets, at

    def save(self, state: Any, path: Path, opt: torch.optim.Optimizer) -> tuple[Future, Any]:
        """Start a checkpoint of ``state``'s tensors into ``path``; returns the future of its
        fsync and the handle of the optimizer hook (remove it once the future is done)."""
        tensors = [t for t in tensors_of(state) if t.numel()]
        offsets, total = self._layout(tensors)
        base = self._buffer(total)
        copied = threading.Event()
        ready: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()

        def wait_for_copy(*_: Any) -> None:
            copied.wait()

        hook = opt.register_step_pre_hook(wait_for_copy)

        def copy() -> None:
            sent = 0
            try:
                for t, at in zip(tensors, offsets, strict=True):
                    n = t.numel() * t.element_size()
                    ctypes.memmove(base + at, t.data_ptr(), n)
                    while at + n - sent >= CHUNK:
                        ready.put((sent, sent + CHUNK))
                        sent += CHUNK
            finally:
                copied.set()
                ready.put((sent, _align(total, _PAGE)))
                ready.put(None)

        def flush() -> None:
            assert self._view is not None
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            try:
                fd = os.open(path, flags | getattr(os, "O_DIRECT", 0))
            except OSError:  # a file system without O_DIRECT
                fd = os.open(path, flags)
            try:
                while (piece := ready.get()) is not None:
                    lo, hi = piece
                    if hi > lo:
                        crc32c(self._view[lo:hi])
                        os.pwrite(fd, self._view[lo:hi], lo)
                os.fsync(fd)
            finally:
                os.close(fd)

        self._copier.submit(copy)
        return self._flusher.submit(flush), hook

    def close_buffer(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._map is not None:
            self._map.close()
            self._map = None

    def close(self) -> None:
        self._copier.shutdown()
        self._flusher.shutdown()
        self.close_buffer()
