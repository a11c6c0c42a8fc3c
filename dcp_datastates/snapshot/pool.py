"""A bounded host-memory pool, allocated once and reused: a ring of blocks with back-pressure.

Blocks are reserved strictly in snapshot order by one scheduler thread, and may be released in any
order; space is reclaimed from the oldest block forward. With pieces never larger than the pool,
this cannot deadlock as long as the flush stage releases pieces in the order it was given them
(see ``scheduler.py``).
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from collections.abc import Callable

import torch

from .._platform import cuda as _cuda
from .hostmem import POPULATE_THREADS, SLICE_BYTES, PopulatedBuffer

logger = logging.getLogger(__name__)

#: Blocks start and end on 4 KiB: the flush writes a tensor's bytes straight from its block with
#: ``O_DIRECT`` (``localfile.py``), which needs the memory address aligned to the device block.
#: Parts inside a block stay 64-byte aligned (``pieces.py``).
ALIGN = 4096


def block_slack(nbytes: int, coalesce_bytes: int) -> int:
    """Bytes a pool needs above ``nbytes`` of pieces for the rounding of their blocks: each block
    rounds up by less than ALIGN, and a block holds at least ``coalesce_bytes`` of a big tensor
    or follows one (``pieces.py``: small tensors share a block until a big one ends it), so there
    are at most two blocks per ``coalesce_bytes``, and one more (0.8% with the default 1 MiB)."""
    return ALIGN * (2 * (nbytes // max(ALIGN, coalesce_bytes)) + 2)


#: Every pool not yet collected, for leak checks (``live_pools``).
_LIVE: weakref.WeakSet[HostPool] = weakref.WeakSet()


def live_pools() -> list[HostPool]:
    """Pools that still hold their buffer (allocated and not closed)."""
    return [p for p in list(_LIVE) if p.allocated_bytes]


def _align(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class HostPool:
    """``capacity`` bytes of host memory handed out as aligned blocks.

    The buffer is allocated lazily by the first :meth:`reserve` (on the scheduler thread, never on
    the training thread) and kept until :meth:`close`; with ``populate`` (a writer's pool) it is
    mapped at once and faulted in by a background thread (``hostmem.py``), and a reserve waits
    only until its own block is. With a GPU, pinning it takes seconds for
    tens of GB, so it starts in the background as soon as the pool exists (the size is known),
    pinned through the creating thread's device (the rank's own); the first reserve waits for it.
    """

    def __init__(self, capacity: int, *, populate: bool = False, align: int = ALIGN) -> None:
        self.align = align  # of every block's offset and size (tests use small ones)
        self.capacity = _align(capacity, align)
        self._buffer: torch.Tensor | None = None
        self._cond = threading.Condition()
        self._blocks: collections.deque[list[int]] = collections.deque()  # [offset, size, live]
        self._by_offset: dict[int, list[int]] = {}
        self._head = 0
        self.in_use = 0
        self.peak_in_use = 0
        _LIVE.add(self)
        self._allocation: threading.Thread | None = None
        self._allocated: list[torch.Tensor | BaseException] = []
        #: Bytes from offset 0 that are faulted in (unpinned pools, populated in the background).
        self._ready = self.capacity
        self._populating: PopulatedBuffer | None = None
        self._populator: threading.Thread | None = None
        self._closing = False
        #: A memoryview of the whole buffer, for ``memoryview``; dropped with the buffer.
        self._whole: memoryview | None = None
        if _cuda.pinning():
            device = _cuda.current_device()
            self._allocation = threading.Thread(
                target=self._allocate, args=(device,), name="datastates-pin", daemon=True
            )
            self._allocation.start()
        elif populate:
            # First touch of fresh pages made the first save several times slower than the next
            # (hostmem.py): fault them in now, front first, while the first snapshot is planned.
            self._populating = PopulatedBuffer(self.capacity)
            self._buffer = self._populating.tensor
            self._ready = 0
            self._populator = threading.Thread(
                target=self._populate, name="datastates-populate", daemon=True
            )
            self._populator.start()

    def _populate(self) -> None:
        """Fault the pool in: this thread front to back, as copies will use it, and up to
        ``POPULATE_THREADS - 1`` helpers from the back towards it; the front skips what they did.
        One thread faulted 1.3 GB/s, and stock's first copy, faulting its fresh tensors on every
        core of its OpenMP team, beat our first save. The helpers never hold the front back: a
        starved helper delays only a slice the front has not reached."""
        buffer = self._populating
        assert buffer is not None
        slices = -(-self.capacity // SLICE_BYTES)
        claimed = [0, slices]  # next slice of the front; one past the last free slice at the back
        done: set[int] = set()

        def work(front: bool) -> None:
            try:
                while True:
                    with self._cond:
                        if self._closing or claimed[0] >= claimed[1]:
                            return
                        if front:
                            i = claimed[0]
                            claimed[0] += 1
                        else:
                            claimed[1] -= 1
                            i = claimed[1]
                    at = i * SLICE_BYTES
                    buffer.populate(at, min(SLICE_BYTES, self.capacity - at))
                    with self._cond:  # the ready front grows over the slices done, in order
                        done.add(at)
                        while self._ready in done:
                            done.discard(self._ready)
                            self._ready = min(self.capacity, self._ready + SLICE_BYTES)
                        self._cond.notify_all()
            except BaseException:  # never let an error die here: copies fault pages in themselves
                logger.warning("populating the host pool failed; copies fault it in", exc_info=True)

        helpers = [
            threading.Thread(
                target=work, args=(False,), name=f"datastates-populate-{i}", daemon=True
            )
            for i in range(1, min(POPULATE_THREADS, slices))
        ]
        try:
            for helper in helpers:
                helper.start()
            work(True)
        finally:
            for helper in helpers:
                helper.join()  # before the whole pool is declared ready: none writes it after
            with self._cond:
                self._ready = self.capacity
                self._cond.notify_all()

    def _allocate(self, device: int | None) -> None:
        try:
            self._allocated.append(_cuda.allocate_host_buffer(self.capacity, device))
        except BaseException as exc:  # reported by the first reserve
            self._allocated.append(exc)

    @property
    def allocated_bytes(self) -> int:
        return 0 if self._buffer is None else self.capacity

    @property
    def populated_bytes(self) -> int:
        """Bytes of the pool faulted in ahead of use (the whole pool once population is over)."""
        return self._ready

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Wait until the whole pool is faulted in (``DataStatesWriter.warm_up``)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._ready >= self.capacity, timeout)

    def _ensure_buffer(self) -> torch.Tensor:
        if self._buffer is None and self._allocation is not None:
            self._allocation.join()
            self._allocation = None
            result = self._allocated.pop()
            if isinstance(result, BaseException):
                raise RuntimeError(
                    f"pinning the {self.capacity}-byte host pool failed: {result}; lower "
                    "host_pool_bytes"
                ) from result
            self._buffer = result
        if self._buffer is None:
            self._buffer = _cuda.allocate_host_buffer(self.capacity)
            logger.debug(
                "host pool allocated: %d bytes (pinned=%s)", self.capacity, _cuda.pinning()
            )
        return self._buffer

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        assert self._buffer is not None
        return self._buffer[offset : offset + nbytes]

    def memoryview(self, offset: int, nbytes: int) -> memoryview:
        # One view of the whole buffer, sliced: a tensor slice and its numpy array per call
        # cost more than the flush's own work for a small record (20,000 of them a save).
        if self._whole is None:
            assert self._buffer is not None
            self._whole = memoryview(self._buffer.numpy())
        return self._whole[offset : offset + nbytes]

    def _try_reserve(self, size: int) -> int | None:
        if not self._blocks:
            self._head = 0
            start = 0
        else:
            tail = self._blocks[0][0]
            if self._head > tail:  # not wrapped: free space is [head, capacity) and [0, tail)
                if self._head + size <= self.capacity:
                    start = self._head
                elif size <= tail:
                    start = 0
                else:
                    return None
            elif self._head + size <= tail:  # wrapped: free space is [head, tail)
                start = self._head
            else:
                return None
        block = [start, size, 1]
        self._blocks.append(block)
        self._by_offset[start] = block
        self._head = start + size
        self.in_use += size
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return start

    def reserve(
        self,
        nbytes: int,
        *,
        cancelled: Callable[[], bool],
        on_stall: Callable[[], None] | None = None,
        on_full: Callable[[], None] | None = None,
    ) -> int | None:
        """Reserve a block, waiting for space; returns its offset, or ``None`` if ``cancelled()``.

        ``on_full`` runs once, before the first wait for space (a held-back flush may start);
        ``on_stall`` runs about once a second while waiting (to reap abandoned saves).
        """
        size = _align(max(nbytes, 1), self.align)
        if size > self.capacity:
            raise ValueError(f"a {nbytes}-byte piece cannot fit a {self.capacity}-byte host pool")
        self._ensure_buffer()
        with self._cond:
            while True:
                if cancelled():
                    return None
                offset = self._try_reserve(size)
                if offset is not None:
                    # The first pass over a fresh pool: its copy starts once its block is in.
                    while self._ready < offset + size:
                        self._cond.wait()
                    return offset
                if on_full is not None:
                    self._cond.release()
                    try:
                        on_full()
                    finally:
                        self._cond.acquire()
                    on_full = None
                    continue  # space may have been freed meanwhile
                if not self._cond.wait(timeout=1.0) and on_stall is not None:
                    self._cond.release()
                    try:
                        on_stall()
                    finally:
                        self._cond.acquire()

    def release(self, offset: int) -> None:
        with self._cond:
            block = self._by_offset.pop(offset)
            block[2] = 0
            self.in_use -= block[1]
            while self._blocks and not self._blocks[0][2]:
                self._blocks.popleft()
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake waiters so they re-check their cancellation."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            if self._blocks:
                raise RuntimeError(f"host pool closed with {len(self._blocks)} blocks in use")
            self._closing = True
        if self._populator is not None:
            self._populator.join()  # stops after the slice in progress
            self._populator = None
        with self._cond:
            self._buffer = None
            self._whole = None
            self._populating = None
        if self._allocation is not None:
            self._allocation.join()
            self._allocation = None
            self._allocated.clear()

    def discard(self) -> None:
        """Drop the buffer whatever is in use (its owner is gone; nothing reads it any more)."""
        self._allocated.clear()  # a pinning still running is dropped when it ends
        with self._cond:
            self._buffer = None
            self._whole = None
            self._blocks.clear()
            self._by_offset.clear()
            self.in_use = 0
            self._cond.notify_all()
