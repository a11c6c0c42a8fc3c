"""How a local data file is written: direct I/O where the file system allows it, the page
cache otherwise.

A save writes each data file once, front to back, fsyncs it, and nobody reads it back soon.
Through the page cache every byte costs a copy into freshly allocated cache pages (and, when
memory is short, reclaiming other pages first), and the final ``fsync`` then waits for most of
the file: on the 2-core VM of ``docs/benchmarks.md`` 1 GB of buffered ``write()`` took 0.2-2.6 s
of CPU against 0.03-0.09 s with ``O_DIRECT`` from an aligned buffer, and one direct writer
reached 1.45-1.58 GB/s against 0.21-0.78 GB/s buffered (``docs/benchmarks.md``,
"Targets"). ``O_DIRECT`` needs the memory address, the file offset and the length
of every write aligned to the device's block. Two ways in:

- ``write``: bytes are gathered into an aligned buffer (one ``memmove``, which releases the GIL)
  and written in full buffers. Records' heads and tails, small tensors and objects go this way.
- ``write_external``: a tensor's bytes in the host pool, whose blocks start on ALIGN
  (``snapshot/pool.py``), at a file offset on ALIGN (the flush pads before such a record,
  ``flush.py``), are queued as they are, and written with the buffer's bytes before them in one
  ``writev`` of up to ``DIRECT_BUFFER`` bytes: no copy. The pool block is released (the
  caller's ``release``) once that write is done. Only the last partial block of the tensor is
  copied into the buffer.

The unaligned end of the file is written through the page cache after ``O_DIRECT`` is switched
off, and the caller's ``fsync`` makes everything durable (data and the file's size) as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

from .._platform.pages import populate_write

#: Alignment of direct writes: memory, offset and length (4 KiB covers 512 B and 4 KiB devices).
ALIGN = 4096
#: Bytes gathered before one direct write. One write is split into requests of the device's
#: ``max_sectors_kb`` (4 MiB on the benchmark VM) that are all in flight at once, and ext4 lets
#: only one direct write per file run at a time: so the buffer sets the queue depth per file.
#: With 4 files, 32 MiB beat 16 and 8 MiB in two alternating runs (1.03-1.88 GB/s against
#: 0.75-1.52 and 0.90-1.53; ``scripts/bench_durable.py``).
DIRECT_BUFFER = 32 << 20
#: Below this a copy is a slice assignment; above it a ``memmove`` that releases the GIL.
_SMALL = 64 << 10
#: Records whose data is at least this long get their data on an ALIGN boundary of the file
#: (``flush.py`` writes up to ALIGN - 1 zero bytes before the record, which no record covers:
#: at most 0.4% more file), so ``write_external`` can write it from the pool.
EXTERNAL_MIN = 1 << 20
#: Queued segments before a ``writev`` regardless of bytes (Linux takes at most 1024).
_MAX_SEGMENTS = 256

#: False writes every data file through the page cache (what benchmarks compare against).
ENABLED = True

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_spare: list[mmap.mmap] = []  # buffers of closed files, reused by the next ones
_spare_lock = threading.Lock()
_MAX_SPARE = 4  # one per file of a rank with the default flush_workers


def _after_fork_in_child() -> None:
    """A process made by ``os.fork()`` maps its own buffers (a parent thread may have held the
    lock at the fork)."""
    global _spare_lock
    _spare_lock = threading.Lock()
    _spare.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _anonymous() -> mmap.mmap:
    """A buffer of ``DIRECT_BUFFER`` bytes, page aligned. Private: ``mmap``'s default is shared,
    and a process forked from this one wrote into the same pages as the files this one was
    writing from them."""
    return mmap.mmap(-1, DIRECT_BUFFER, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _take_buffer() -> mmap.mmap:
    with _spare_lock:
        while _spare:
            buf = _spare.pop()
            if len(buf) == DIRECT_BUFFER:
                return buf
            buf.close()  # DIRECT_BUFFER was changed (benchmarks do)
    return _anonymous()


def _faulted_in(buf: mmap.mmap) -> mmap.mmap:
    """``buf`` with every page faulted in, so its first ``memmove`` takes no page fault."""
    if not populate_write(buf):  # an older kernel: touch the pages instead
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(buf)), 0, len(buf))
    return buf


def prepare_buffers(count: int) -> int:
    """Keep ``count`` (at most one per file a rank writes at once) buffers mapped and faulted in
    for the next files, so that a first save does not pay for them: in a fresh process the 4
    buffers took 33,000 page faults inside the first save, on the cores the snapshot's copies
    need (one A/B at 2 GB on the benchmark VM, under load: 0.34 s to safe against 0.24 s with
    the buffers prepared). ``DataStatesWriter.warm_up`` calls it; returns how many buffers
    were made."""
    if not (_O_DIRECT and ENABLED):
        return 0
    made = 0
    with _spare_lock:
        missing = min(count, _MAX_SPARE) - len(_spare)
    for _ in range(max(0, missing)):
        try:
            buf = _faulted_in(_anonymous())
        except OSError as exc:  # memory exhausted: say what was being mapped and what to do
            raise OSError(
                exc.errno,
                f"warm_up could not map the flush's direct-write buffer {made + 1} of "
                f"{missing} ({DIRECT_BUFFER >> 20} MiB each, one per file written at once): "
                f"{exc.strerror or exc}. Free host memory, or lower flush_workers or "
                "host_pool_bytes; a save without warm_up maps them itself",
            ) from exc
        with _spare_lock:
            if len(_spare) >= _MAX_SPARE:
                buf.close()
                break
            _spare.append(buf)
            made += 1
    return made


def _give_buffer(buf: mmap.mmap) -> None:
    with _spare_lock:
        if len(_spare) < _MAX_SPARE:
            _spare.append(buf)
            return
    buf.close()


def release_spare_buffers() -> int:
    """Unmap the buffers kept for reuse (``DataStatesWriter.close`` calls this, so a closed
    writer leaves no direct-write memory behind); returns how many bytes were released. A file
    opened later maps a fresh buffer."""
    with _spare_lock:
        spare, _spare[:] = list(_spare), []
    for buf in spare:
        # A view of it may live on (a failed file's traceback): then it is unmapped when that goes.
        with contextlib.suppress(BufferError):
            buf.close()
    return len(spare) * DIRECT_BUFFER


def _advance(segments: list[memoryview], done: int) -> list[memoryview]:
    """``segments`` without their first ``done`` bytes."""
    while segments and done >= segments[0].nbytes:
        done -= segments[0].nbytes
        segments = segments[1:]
    if done:
        segments = [segments[0][done:], *segments[1:]]
    return segments


def _address(view: memoryview) -> int | None:
    """Address of a writable buffer's first byte, or None for read-only ones (``bytes``)."""
    if view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class DirectFile:
    """A file written front to back with ``O_DIRECT`` in aligned ``DIRECT_BUFFER`` writes.

    ``flush()`` writes what is gathered (the unaligned end through the page cache); after it the
    file takes plain writes. Any ``EINVAL`` from a direct write (a file system that accepted the
    flag at open but refuses it here) switches the file to plain writes for the rest of it.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf: mmap.mmap | None = _take_buffer()
        self._view = memoryview(self._buf)
        self._base = _address(self._view)
        assert self._base is not None and self._base % ALIGN == 0
        self._cap = len(self._buf)
        self._fill = 0
        self._direct = True
        # write_external's queue: segments in file order; the buffer's [0, _mark) is among them.
        self._queue: list[memoryview] = []
        self._queued = 0
        self._mark = 0
        self._releases: list[Callable[[], None]] = []

    @classmethod
    def open(cls, path: str) -> DirectFile | None:
        """The file at ``path``, created or truncated, or None where ``O_DIRECT`` is refused
        (tmpfs, some network file systems, platforms without it)."""
        if not (_O_DIRECT and ENABLED):
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                return None
            raise
        try:
            return cls(fd)
        except BaseException:
            os.close(fd)
            raise

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        n = src.nbytes
        if not self._direct:  # what is still gathered goes first
            self.submit()
            if self._fill:
                self._write_all(self._view[: self._fill])
                self._fill = 0
            self._write_all(src)
            return n
        pos = 0
        addr = _address(src) if n >= _SMALL else None
        while pos < n:
            if self._fill == self._cap:
                self.submit()  # frees the buffer's queued part
                if self._fill == self._cap:
                    self._drain(self._cap)
            take = min(n - pos, self._cap - self._fill)
            if addr is not None and take >= _SMALL:
                ctypes.memmove(self._base + self._fill, addr + pos, take)  # type: ignore[operator]
            else:
                self._view[self._fill : self._fill + take] = src[pos : pos + take]
            self._fill += take
            pos += take
        return n

    def aligned(self) -> bool:
        """Whether the next byte written lands on an ALIGN boundary of the file."""
        return (self._fill - self._mark) % ALIGN == 0

    def write_external(self, data: memoryview, release: Callable[[], None]) -> bool:
        """Write ``data`` without copying most of it: where its address and the file's position
        agree modulo ALIGN, the bytes up to its first aligned address go through the buffer,
        and its whole blocks from there are written from where they lie; ``release()`` runs
        once those bytes are written (or the file is closed), and ``data`` must stay unchanged
        until then. False, with nothing done, where it cannot: the caller then uses ``write``."""
        src = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        addr = _address(src) if self._direct and src.nbytes >= ALIGN else None
        if addr is None:
            return False
        head = (-addr) % ALIGN
        whole = (src.nbytes - head) // ALIGN * ALIGN
        if whole <= 0 or (self._fill - self._mark + head) % ALIGN:
            return False
        if head:  # through the buffer: the file's next byte is then on a block
            self.write(src[:head])
            src = src[head:]
        if self._fill > self._mark:  # the buffer's bytes before it go first
            self._queue.append(self._view[self._mark : self._fill])
            self._queued += self._fill - self._mark
            self._mark = self._fill
        self._queue.append(src[:whole])
        self._queued += whole
        self.write(src[whole:])  # may submit the queue, src's part with it: still unreleased
        self._releases.append(release)
        if self._queued >= self._cap or len(self._queue) >= _MAX_SEGMENTS:
            self.submit()
        return True

    def copy_in(self, data: memoryview) -> memoryview:
        """Copy ``data`` (at most :meth:`room` bytes) into the buffer, as ``write`` does, and
        return where it lies there: valid until the next :meth:`submit`. A file that writes
        plainly (``EINVAL``) writes a private copy of it now and returns that copy."""
        n = data.nbytes
        if not self._direct:  # a file that refused a direct write: written now, from a copy
            kept = memoryview(bytes(data.cast("B")))
            self.write(kept)
            return kept
        assert n <= self._cap - self._fill, "copy_in: more than the buffer's room"
        addr = _address(data)
        if addr is not None:
            ctypes.memmove(self._base + self._fill, addr, n)  # type: ignore[operator]
        else:
            self._view[self._fill : self._fill + n] = data.cast("B")
        self._fill += n
        return self._view[self._fill - n : self._fill]

    @property
    def writes_directly(self) -> bool:
        """False once the file system refused a direct write: ``write`` and ``copy_in`` then
        write to the disk before they return."""
        return self._direct

    def room(self) -> int:
        """Bytes ``write`` takes into the buffer before it must write some of it out."""
        return self._cap - self._fill

    def queue_buffered(self) -> bool:
        """Queue the whole blocks the buffer gathered for the next :meth:`submit` (the
        unaligned rest stays in front of what follows): a caller that wrote from memory that
        may change once ``write`` returned (a live tensor) has its bytes on the disk from this
        copy, a step at a time. False where the file writes plainly (``write`` wrote them)."""
        if not self._direct:
            return False
        whole = self._mark + (self._fill - self._mark) // ALIGN * ALIGN
        if whole > self._mark:
            self._queue.append(self._view[self._mark : whole])
            self._queued += whole - self._mark
            self._mark = whole
        return True

    def submit(self) -> None:
        """Write what ``write_external`` queued now (before waiting for anything that needs
        the pool blocks it holds), then release those blocks."""
        if not self._queue:
            return
        segments, self._queue, self._queued = self._queue, [], 0
        releases, self._releases = self._releases, []
        try:
            while segments:
                try:
                    done = os.writev(self._fd, segments)
                except OSError as exc:
                    if not self._direct or exc.errno != errno.EINVAL:
                        raise
                    self._plain()  # refused direct: the rest through the page cache
                    continue
                if self._direct and done % ALIGN:  # a short direct write left us unaligned
                    self._plain()
                segments = _advance(segments, done)
        finally:
            for release in releases:
                release()
        rest = self._fill - self._mark
        if rest and self._mark:
            self._view[:rest] = self._view[self._mark : self._fill]
        self._fill, self._mark = rest, 0

    def _drain(self, nbytes: int) -> None:
        """Write the first ``nbytes`` (a multiple of ALIGN) of the buffer, keep the rest."""
        done = 0
        while done < nbytes and self._direct:
            try:
                done += os.write(self._fd, self._view[done:nbytes])
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._plain()
            if done % ALIGN:  # a short direct write left us unaligned: finish without O_DIRECT
                self._plain()
        if done < nbytes:
            self._write_all(self._view[done:nbytes])
        rest = self._fill - nbytes
        if rest and nbytes:
            self._view[:rest] = self._view[nbytes : self._fill]
        self._fill = rest

    def _plain(self) -> None:
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self._direct = False

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            done += os.write(self._fd, view[done:])

    def flush(self) -> None:
        """Write everything gathered: full blocks directly, the unaligned end through the page
        cache. Later writes go through the page cache."""
        if self._buf is None:
            return
        self.submit()
        if self._direct:
            self._drain(self._fill // ALIGN * ALIGN)
        if self._direct:
            self._plain()
        if self._fill:
            self._write_all(self._view[: self._fill])
            self._fill = 0
        self._release()

    def _release(self) -> None:
        releases, self._releases, self._queue = self._releases, [], []
        for release in releases:  # closed unwritten: nothing reads those blocks any more
            release()
        if self._buf is not None:
            self._view.release()
            _give_buffer(self._buf)
            self._buf = None

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Close without writing what is still gathered (``flush()`` first to keep it)."""
        self._release()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


__all__ = ["ALIGN", "DIRECT_BUFFER", "EXTERNAL_MIN", "DirectFile", "prepare_buffers"]
