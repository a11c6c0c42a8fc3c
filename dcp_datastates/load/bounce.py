"""Loading into GPU memory through pinned bounce buffers, double-buffered.

A record whose target is a CUDA tensor (whole, contiguous, the saved dtype and shape) is read in
regions into one of two pinned buffers of the reading thread while the other buffer's
host-to-device copy runs on a side stream: the read of region ``i + 1`` overlaps the copy of
region ``i``, and a buffer is reused only once its copy's event fired. The record's checksum is
taken over head, data and tail in file order as the regions land, exactly as for a CPU target.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from crc32c import crc32c

#: read_into(offset, buffers) -> bytes read, as ``RangedFile.read_into``
ReadInto = Callable[[int, list[memoryview]], int]


class BounceBuffers:
    """Two staging buffers of ``region_bytes`` per reading thread, pinned when ``pin``."""

    def __init__(self, region_bytes: int, *, pin: bool) -> None:
        self.region_bytes = region_bytes
        self.pin = pin
        self._local = threading.local()
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _buffers(self) -> list[torch.Tensor]:
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = [
                torch.empty(self.region_bytes, dtype=torch.uint8, pin_memory=self.pin)
                for _ in range(2)
            ]
            self._local.done = [None, None]
        return buffers

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        with self._lock:
            stream = self._streams.get(device.index)
            if stream is None:
                stream = self._streams[device.index] = torch.cuda.Stream(device=device)
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
        stream = self._stream(target.device)
        if stream is not None:
            # This reading thread works on the target's device: its pinned buffers and copies
            # belong to that device's context, never to device 0 by default.
            torch.cuda.set_device(target.device)
        buffers = self._buffers()
        # Kept across records: a buffer's last copy may still be running when the next one starts.
        done: list[torch.cuda.Event | None] = self._local.done
        crc, got_total = 0, 0
        step = self.region_bytes
        starts = list(range(0, max(nbytes, 1), step))
        if stream is not None:
            # The target's earlier work (its allocation, a zero fill) comes first.
            stream.wait_stream(torch.cuda.current_stream(target.device))
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
                done[slot] = self._copy(flat[start : start + n], buf, stream)
        if checksum and tail:
            crc = crc32c(tail, value=crc)
        return crc, got_total

    @staticmethod
    def _copy(
        dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None
    ) -> torch.cuda.Event | None:
        if stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        dst.record_stream(stream)
        return event


__all__ = ["BounceBuffers"]
