"""What the machine allows: write+fsync, cold and warm sequential read, memcpy, pinned D2H.

The measured systems cannot beat these, so the targets compare against them; they are measured
in the same run because this disk's speed swings several-fold from one run to the next.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dcp_datastates.options import WriterOptions

from .common import GB, Recorder, fresh_dir, go_cold, log, now

BLOCK = 8 << 20  # bytes per write() / readinto()


def _payload(block: int = BLOCK) -> memoryview:
    # Random bytes: a compressing or deduplicating file system must not get an easy ride.
    return memoryview(os.urandom(block))


_random: list[memoryview] = []  # the largest random, page-aligned block made so far


def _aligned_payload(block: int = BLOCK) -> memoryview:
    """``block`` random bytes, page aligned (as ``O_DIRECT`` needs), made once and reused: the
    write sweep asks for several sizes in a row, and ``os.urandom`` of 64 MiB is not free."""
    if not _random or _random[0].nbytes < block:
        buf = mmap.mmap(-1, block)
        buf.write(os.urandom(block))
        _random[:] = [memoryview(buf)]
    return _random[0][:block]


def file_share(total_bytes: int, writers: int) -> int:
    """Bytes each of ``writers`` files gets of ``total_bytes``: an equal share, rounded up to
    4 KiB (``O_DIRECT`` lengths are aligned), so the writers write about ``total_bytes``."""
    return max(4096, -(-total_bytes // writers // 4096) * 4096)


def direct_supported(directory: Path) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT``."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    probe = directory / "limit_probe.bin"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def write_fsync(
    directory: Path, total_bytes: int, writers: int, *, direct: bool = False, block: int = BLOCK
) -> float:
    """Seconds for ``writers`` threads to each write ``file_share`` bytes into its own file in
    ``block``-byte writes and fsync it at the end (with ``direct``: ``O_DIRECT`` from an aligned
    buffer, bypassing the page cache)."""
    share = file_share(total_bytes, writers)
    block = min(block, share)
    data = _aligned_payload(block)
    barrier = threading.Barrier(writers + 1)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)

    def one(i: int) -> None:
        fd = os.open(directory / f"limit_{i}.bin", flags, 0o644)
        try:
            barrier.wait()
            left = share
            while left > 0:
                left -= os.write(fd, data[: min(block, left)])
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(writers) as pool:
        futures = [pool.submit(one, i) for i in range(writers)]
        barrier.wait()
        t0 = now()
        for f in futures:
            f.result()
        seconds = now() - t0
    for i in range(writers):
        (directory / f"limit_{i}.bin").unlink()
    return seconds


def read_files(paths: Sequence[Path], *, parallel: bool) -> float:
    """Seconds to read ``paths`` front to back with large reads into reused buffers (one thread
    per file when ``parallel``, else one file after another)."""

    def one(path: Path, buf: bytearray) -> None:
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass

    t0 = now()
    if parallel and len(paths) > 1:
        with ThreadPoolExecutor(len(paths)) as pool:
            list(pool.map(lambda p: one(p, bytearray(BLOCK)), paths))
    else:
        buf = bytearray(BLOCK)
        for p in paths:
            one(p, buf)
    return now() - t0


def read_streams(paths: Sequence[Path], streams: int) -> float:
    """Seconds for ``streams`` threads to read the concatenation of ``paths``, each its own
    contiguous share, with large reads into a reused buffer: what several readers can get."""
    sizes = [(p, p.stat().st_size) for p in paths]
    share = max(1, -(-sum(size for _, size in sizes) // streams))
    pieces: list[list[tuple[Path, int, int]]] = [[] for _ in range(streams)]
    pos = 0
    for path, size in sizes:
        offset = 0
        while offset < size:
            k = min(pos // share, streams - 1)
            take = min(size - offset, (k + 1) * share - pos)
            pieces[k].append((path, offset, take))
            offset, pos = offset + take, pos + take

    def one(mine: list[tuple[Path, int, int]]) -> None:
        view = memoryview(bytearray(BLOCK))
        for path, offset, length in mine:
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                while length > 0 and (n := f.readinto(view[: min(BLOCK, length)])):
                    length -= n

    t0 = now()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(one, pieces))
    return now() - t0


def memcpy(nbytes: int, repeat: int = 3) -> float:
    """Best seconds of ``repeat`` host-to-host copies of ``nbytes`` (after one warm-up copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeat):
        t0 = now()
        dst.copy_(src)
        best = min(best, now() - t0)
    return best


def memcpy_parallel(nbytes: int, threads: int, repeat: int = 3) -> float:
    """Best seconds of ``repeat`` copies of ``nbytes`` split into 32 MiB chunks copied by
    ``threads`` threads: what our snapshot's copy workers (as many as it starts, in chunks of
    its default ``chunk_bytes``) could reach at most for host-resident state."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    chunk = WriterOptions().chunk_bytes
    jobs = [(dst[o : o + chunk], src[o : o + chunk]) for o in range(0, nbytes, chunk)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            t0 = now()
            list(pool.map(lambda job: job[0].copy_(job[1]), jobs))
            best = min(best, now() - t0)
    return best


def state_copy(tensors: Sequence[torch.Tensor], threads: int, repeat: int = 2) -> float:
    """Best seconds of ``repeat`` copies of ``tensors`` (host, contiguous) into one buffer faulted
    in beforehand, as our pool is after ``warm_up``: each tensor in ``chunk_bytes`` pieces, taken
    in order by ``threads`` threads that ``memmove`` them, as our copy workers do.

    The save scenario measures it in a save process right after that process's saves (the same
    state, the same moment's memory bandwidth): the quickest a snapshot that copies all of the
    state can be safe. The limits scenario's ``memcpy xN`` copies one hot buffer, at another
    moment: on the AMD VM it read 26-33 GB/s in a full run whose save copies could not pass
    13-14 GB/s, and 13-15 GB/s in a run of its own (issue 11, item 23)."""
    from dcp_datastates.providers.tensor import host_copy
    from dcp_datastates.snapshot.hostmem import PopulatedBuffer

    sizes = [t.numel() * t.element_size() for t in tensors]
    buffer = PopulatedBuffer(sum(sizes))
    buffer.populate(0, sum(sizes))
    base, chunk = buffer.tensor.data_ptr(), WriterOptions().chunk_bytes
    jobs, at = [], 0
    for t, n in zip(tensors, sizes, strict=True):
        jobs += [(base + at + o, t.data_ptr() + o, min(chunk, n - o)) for o in range(0, n, chunk)]
        at += n
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            t0 = now()
            list(pool.map(lambda job: host_copy(*job), jobs))
            best = min(best, now() - t0)
    return best


def copy_workers() -> int:
    """The copy workers a writer with default options starts on this machine."""
    return WriterOptions().effective_copy_workers()


def memcpy_parallel_name() -> str:
    return f"memcpy x{copy_workers()} (our copy workers)"


def pinned_d2h(nbytes: int, repeat: int = 3) -> float | None:
    """Best seconds of a device-to-pinned-host copy of ``nbytes``; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = now()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, now() - t0)
    return best


def run(rec: Recorder, *, workdir: Path, nbytes: int, rounds: int, cold: bool) -> None:
    """The disk write sweep and its best (``disk_limit.py``), cold and warm reads, memcpy;
    repeat."""
    from . import disk_limit  # it builds on this module's writers

    workdir = fresh_dir(workdir / "limits")
    gb = nbytes / GB
    read_file = workdir / "read.bin"
    log(f"limits: {gb:.2f} GB per measurement, {rounds} rounds")
    for r in range(rounds):
        best, s, gbps = disk_limit.sweep(rec, workdir, nbytes, r, "limits")
        rec.emit(
            "limits",
            disk_limit.LIMITS_BEST,
            {"seconds": s, "gb_per_s": gbps},
            config=best,
            bytes=nbytes,
            round=r,
        )
        fd = os.open(read_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        data = _payload()
        for _ in range(max(1, nbytes // BLOCK)):
            os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        size = read_file.stat().st_size
        dropped = go_cold(rec, cold)
        s = read_files([read_file], parallel=False)
        rec.emit(
            "limits",
            "read cold" if dropped else "read cold (cache not dropped)",
            {"seconds": s, "gb_per_s": size / GB / s},
            bytes=size,
            cache_dropped=dropped,
            round=r,
        )
        s = read_files([read_file], parallel=False)
        rec.emit(
            "limits", "read warm", {"seconds": s, "gb_per_s": size / GB / s}, bytes=size, round=r
        )
        s = memcpy(nbytes)
        rec.emit("limits", "memcpy", {"seconds": s, "gb_per_s": gb / s}, bytes=nbytes, round=r)
        s = memcpy_parallel(nbytes, copy_workers())
        rec.emit(
            "limits",
            memcpy_parallel_name(),
            {"seconds": s, "gb_per_s": gb / s},
            bytes=nbytes,
            threads=copy_workers(),
            round=r,
        )
        s = pinned_d2h(nbytes)
        if s is not None:
            rec.emit(
                "limits", "pinned d2h", {"seconds": s, "gb_per_s": gb / s}, bytes=nbytes, round=r
            )
    read_file.unlink()
