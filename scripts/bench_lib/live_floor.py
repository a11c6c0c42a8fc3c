"""What flushing straight from the live tensors could save (issue 11's suggestion for
host-resident state), measured on the floor before it is built into the writer.

``LiveFloor`` is the floor (``floor.py``: one copy thread, one flush thread, crc32c, direct
writes, the next optimizer step waits for the copy) with one change: the copier takes the
state's tensors from the back and the flusher from the front. A tensor the flusher reaches
before the copier is checksummed and written straight from its live memory and never copied;
the two meet in the middle. The step waits until every tensor is copied or written (and, once
it has begun, the flusher takes no more live tensors), never for the disk behind the copies.
What it saves is the copy (``memmove``) of what was written live: as much as the disk writes
while the copier runs.

For the live bytes to be written with ``O_DIRECT``, the file places each tensor at an offset
equal to its address modulo 4096; its copy in the buffer (laid out like the file) is then
aligned the same way, so both paths write the aligned middle directly and the fragments at
either end (under 4 KiB each) through the page cache. Like the floor's, the file cannot be
loaded; its bytes are the state's (``tests/test_bench_floor.py``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from crc32c import crc32c

from . import floor
from .floor import LazyFloor
from .state import tensors_of

#: Alignment of direct writes, in memory and in the file.
ALIGN = 4096


class LiveFloor(LazyFloor):
    """The floor whose flusher writes, from the live tensors, what the copier has not reached.
    ``live_bytes`` has one entry per save: the bytes written without a copy."""

    def __init__(self, nice: int = 10) -> None:
        super().__init__(nice)
        self.live_bytes: list[int] = []

    @staticmethod
    def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
        offsets, at = [], 0
        for t in tensors:
            at += (t.data_ptr() - at) % ALIGN  # the offset is the address modulo ALIGN
            offsets.append(at)
            at += t.numel() * t.element_size()
        return offsets, at + ALIGN

    def save(self, state: Any, path: Path, opt: torch.optim.Optimizer) -> tuple[Future, Any]:
        tensors = [t for t in tensors_of(state) if t.numel()]
        offsets, total = self._layout(tensors)
        base = self._buffer(total)
        cond = threading.Condition()
        copied = [False] * len(tensors)
        # tensors[:front] are the flusher's (written live), tensors[back:] the copier's
        claim = {"front": 0, "back": len(tensors), "writing": False, "stepping": False}

        def settled() -> bool:
            return (
                claim["front"] >= claim["back"]
                and not claim["writing"]
                and all(copied[claim["back"] :])
            )

        def wait_for_snapshot(*_: Any) -> None:
            with cond:
                claim["stepping"] = True  # no more live writes: the step may change them
                cond.wait_for(settled)

        hook = opt.register_step_pre_hook(wait_for_snapshot)

        def copy() -> None:
            while True:
                with cond:
                    if claim["back"] <= claim["front"]:
                        return
                    claim["back"] -= 1
                    j = claim["back"]
                t = tensors[j]
                floor.ctypes.memmove(base + offsets[j], t.data_ptr(), t.numel() * t.element_size())
                with cond:
                    copied[j] = True
                    cond.notify_all()

        def flush() -> None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            try:
                direct = os.open(path, flags | getattr(os, "O_DIRECT", 0))
            except OSError:  # a file system without O_DIRECT
                direct = os.open(path, flags)
            plain = os.open(path, os.O_WRONLY)
            live = 0
            try:
                for i, t in enumerate(tensors):
                    n = t.numel() * t.element_size()
                    with cond:
                        mine = i < claim["back"] and not claim["stepping"]
                        if mine:
                            claim["front"], claim["writing"] = i + 1, True
                        else:
                            claim["front"] = max(claim["front"], i)
                            cond.notify_all()
                            cond.wait_for(lambda i=i: copied[i])
                    src = t.data_ptr() if mine else base + offsets[i]
                    _write(direct, plain, src, n, offsets[i])
                    if mine:
                        live += n
                        with cond:
                            claim["writing"] = False
                            cond.notify_all()
                os.fsync(direct)
            finally:
                with cond:  # a failed flush must not hold the step back
                    claim["writing"] = False
                    claim["front"] = len(tensors)
                    cond.notify_all()
                os.close(plain)
                os.close(direct)
                self.live_bytes.append(live)

        self._copier.submit(copy)
        return self._flusher.submit(flush), hook


def _write(direct: int, plain: int, src: int, n: int, at: int) -> None:
    """Checksum ``n`` bytes at address ``src`` and write them at file offset ``at`` (``src``
    and ``at`` agree modulo ALIGN): the aligned middle directly, in the floor's chunks, the
    fragments at either end through the page cache."""
    head = min((-src) % ALIGN, n)
    middle = (n - head) // ALIGN * ALIGN
    pieces = [(0, head, plain)]
    pieces += [
        (k, min(floor.CHUNK, head + middle - k), direct)
        for k in range(head, head + middle, floor.CHUNK)
    ]
    pieces.append((head + middle, n - head - middle, plain))
    for k, m, fd in pieces:
        if m:
            data = (ctypes.c_char * m).from_address(src + k)
            crc32c(data)
            done = 0
            while done < m:
                done += os.pwrite(fd, memoryview(data)[done:], at + k + done)
