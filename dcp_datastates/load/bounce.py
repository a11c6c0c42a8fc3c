"""Loading into GPU memory through pinned bounce buffers, double-buffered.

A record whose target is a CUDA tensor (whole, contiguous, the saved dtype and shape) is read in
regions into one of two pinned buffers of the reading thread while the other buffer's
host-to-device copy runs on a side stream: the read of region ``i + 1`` overlaps the copy of
region ``i``, and a buffer is reused only once its copy's event fired. The record's checksum is
taken over head, data and tail in file order as the regions land, exactly as for a CPU target.

Ordering with the caller, on every device the load touches (one side stream per device):
``begin(devices)``, on the caller's thread before any read, makes each side stream wait for
the caller's current stream there (the targets' allocation and any fill queued on it come
first), not for a reading thread's; ``end()``, on the caller's thread after the last read,
makes the caller's current streams wait for every copy and waits for them on the host, so the
targets hold the checkpoint when ``dcp.load`` returns. Every CUDA call goes through a
``_platform.cuda.Runtime`` (a simulated GPU in tests).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from crc32c import crc32c

from .._platform.cuda import TORCH_CUDA, Runtime

#: read_into(offset, buffers) -> bytes read, as ``RangedFile.read_into``
ReadInto = Callable[[int, list[memoryview]], int]


class BounceBuffers:
    """Two staging buffers of ``region_bytes`` per reading thread, pinned when ``pin``."""

    def __init__(self, region_bytes: int, *, pin: bool, runtime: Runtime | None = None) -> None:
        self.region_bytes = region_bytes
        self.pin = pin
        self.runtime: Runtime = runtime if runtime is not None else TORCH_CUDA
        self._local = threading.local()
        self._streams: dict[int, Any] = {}
        self._begun: set[int] = set()  # devices whose side stream waits for the caller's
        self._lock = threading.Lock()

    def begin(self, devices: Iterable[int]) -> None:
        """On the caller's thread, before any read: the copies to ``devices`` come after the
        work queued so far on the caller's current streams there."""
        for index in devices:
            stream = self._stream(index)
            stream.wait_stream(self.runtime.current_stream(index))
            with self._lock:
                self._begun.add(index)

    def end(self) -> None:
        """On the caller's thread, after the last read: the caller's current stream on each
        device waits for every copy to it, and so does the host (the load has landed)."""
        rt = self.runtime
        with self._lock:
            begun = sorted(self._begun)
        events = []
        for index in begun:
            event = rt.new_event(blocking=True)
            event.record(self._stream(index))
            rt.current_stream(index).wait_event(event)
            events.append(event)
        for event in events:
            event.synchronize()

    def deliver(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy the host tensor ``source`` into the device tensor ``target`` on the target
        device's side stream (after ``begin``'s wait for the caller's stream)."""
        index = self.runtime.device_of(target)
        if index is None:
            target.copy_(source)
            return
        stream = self._ordered_stream(index)
        with self.runtime.on(index, stream):
            target.copy_(source, non_blocking=True)
        self.runtime.keep(target, stream)

    def _buffers(self) -> list[torch.Tensor]:
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = [
                torch.empty(self.region_bytes, dtype=torch.uint8, pin_memory=self.pin)
                for _ in range(2)
            ]
            self._local.done = [None, None]
        return buffers

    def _stream(self, index: int) -> Any:
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = self.runtime.new_stream(index)
            return stream

    def _ordered_stream(self, index: int) -> Any:
        """The side stream of device ``index``, after the caller's work (``begin``); without a
        ``begin``, after the calling thread's current stream, for each use."""
        stream = self._stream(index)
        with self._lock:
            begun = index in self._begun
        if not begun:
            stream.wait_stream(self.runtime.current_stream(index))
        return stream

    def fill(
        self,
        target: torch.Tensor,
        read_into: ReadInto,
        *,
        data_at: int,
        head: bytearray,
        tail: bytearray,
        checksum: bool,
    ) -> tuple[int, int]:
        """Read the record's data into ``target`` (its bytes, in order); returns (crc, bytes read).

        ``head`` and ``tail`` are filled from the bytes just before and after the data.
        """
        flat = target.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        index = self.runtime.device_of(target)
        stream = None
        if index is not None:
            # This reading thread works on the target's device: its pinned buffers and copies
            # belong to that device's context, never to device 0 by default.
            self.runtime.set_device(index)
            # The target's earlier work (its allocation, a zero fill) comes first.
            stream = self._ordered_stream(index)
        buffers = self._buffers()
        # Kept across records: a buffer's last copy may still be running when the next one starts.
        done: list[Any] = self._local.done
        crc, got_total = 0, 0
        step = self.region_bytes
        starts = list(range(0, max(nbytes, 1), step))
        for i, start in enumerate(starts):
            n = min(step, nbytes - start)
            slot = i % 2
            if done[slot] is not None:
                done[slot].synchronize()  # the copy that last used this buffer has finished
            buf = buffers[slot][:n]
            views = [memoryview(buf.numpy())] if n else []
            if i == 0 and head:
                views.insert(0, memoryview(head))
            if i == len(starts) - 1 and tail:
                views.append(memoryview(tail))
            at = data_at + start - (len(head) if i == 0 else 0)
            want = sum(v.nbytes for v in views)
            got = read_into(at, views)
            got_total += got
            if got != want:
                return crc, got_total
            if checksum:
                if i == 0 and head:
                    crc = crc32c(head, value=crc)
                if n:
                    crc = crc32c(views[1 if i == 0 and head else 0], value=crc)
            if n:
                done[slot] = self._copy(flat[start : start + n], buf, index, stream)
        if checksum and tail:
            crc = crc32c(tail, value=crc)
        return crc, got_total

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, index: int | None, stream: Any) -> Any:
        if stream is None or index is None:
            dst.copy_(src)
            return None
        rt = self.runtime
        with rt.on(index, stream):
            dst.copy_(src, non_blocking=True)
            event = rt.new_event(blocking=True)
            event.record(stream)
        rt.keep(dst, stream)
        return event


__all__ = ["BounceBuffers"]
