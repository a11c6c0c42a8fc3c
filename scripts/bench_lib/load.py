"""The load scenario: stock ``FileSystemReader`` vs ``DataStatesReader`` on the same checkpoints.

Two checkpoints of the same state, one written by our writer and one by stock
``FileSystemWriter``, are each loaded by both readers into one preallocated target, with the page
cache dropped (cold) and then warm, beside raw reads of the same data files (large reads into
reused buffers: one stream through the files in order, and four streams each reading a contiguous
quarter, as many as ``DataStatesReader`` has I/O threads), so loads can be given as a share of
what the disk allowed. Readers and raw reads alternate and reverse order between rounds.

Warm, one more raw read gives the ceiling of a *verified* load: four streams read the files into
one buffer as large as they are (a load's bytes land in memory, not in a small reused buffer that
stays in cache), 1 MiB per read, each piece's crc32c computed right after it lands (``RAW4_CRC``;
not a "raw read" for the percentages, which stay against the plain raw reads).

An object-heavy state (``--load-objects`` small Python objects and four small tensors, what
training keeps beside the model) is written by both writers too and loaded warm by both readers:
``checkpoint="objects"`` (written by ours) and ``"objects stock"`` (written by stock).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from crc32c import crc32c
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_datastates import DataStatesReader, DataStatesWriter

from . import limits, state
from .common import GB, Recorder, alternate, fresh_dir, go_cold, log, now

RAW1 = "raw read 1 stream"
RAW4 = "raw read 4 streams"
RAWS = (RAW1, RAW4)
RAW4_CRC = "raw read+crc32c 4 streams into memory"
LIMITS = (RAW4_CRC,)
STOCK = "stock FileSystemReader"
OURS = "ours DataStatesReader"
READERS: dict[str, Callable[[Path], Any]] = {STOCK: FileSystemReader, OURS: DataStatesReader}
OBJECTS = "objects"  # checkpoint label: the object-heavy state written by ours
OBJECTS_STOCK = "objects stock"  # ... written by stock
LABELS = {
    "ours": "written by ours",
    "stock": "written by stock",
    OBJECTS: "objects, written by ours",
    OBJECTS_STOCK: "objects, written by stock",
}
PIECE = 1 << 20  # bytes per read of RAW4_CRC (what DataStatesReader checks at a time)


def read_checked(paths: Sequence[Path], streams: int, into: torch.Tensor) -> float:
    """Seconds for ``streams`` threads to read the concatenation of ``paths`` into ``into`` (a
    uint8 tensor at least that large), each its own contiguous share, ``PIECE`` bytes per read,
    computing each piece's crc32c right after it lands."""
    sizes = [p.stat().st_size for p in paths]
    total = sum(sizes)
    share = max(1, -(-total // streams))
    dest = memoryview(into.numpy())
    fds = [os.open(p, os.O_RDONLY) for p in paths]

    def one(k: int) -> None:
        lo, hi, base = k * share, min(total, (k + 1) * share), 0
        for fd, size in zip(fds, sizes, strict=True):
            at, end = max(lo, base), min(hi, base + size)
            while at < end:
                piece = dest[at : min(at + PIECE, end)]
                got = os.preadv(fd, [piece], at - base)
                crc32c(piece[:got])
                at += got
            base += size

    try:
        t0 = now()
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(one, range(streams)))
        return now() - t0
    finally:
        for fd in fds:
            os.close(fd)


def _write(sd: dict[str, Any], workdir: Path) -> dict[str, Path]:
    ckpts = {"ours": workdir / "ours", "stock": workdir / "stock"}
    writer = DataStatesWriter(ckpts["ours"])
    try:
        dcp.save(sd, storage_writer=writer, no_dist=True)
    finally:
        writer.close()
    dcp.save(sd, storage_writer=FileSystemWriter(ckpts["stock"]), no_dist=True)
    return ckpts


def run(
    rec: Recorder,
    *,
    workdir: Path,
    nbytes: int,
    tensors: int,
    rounds: int,
    cold: bool,
    objects: int = 0,
) -> None:
    workdir = fresh_dir(workdir / "load")
    _tensor_state(rec, workdir, nbytes=nbytes, tensors=tensors, rounds=rounds, cold=cold)
    if objects:
        _object_state(rec, workdir, count=objects, rounds=rounds)


def _tensor_state(
    rec: Recorder, workdir: Path, *, nbytes: int, tensors: int, rounds: int, cold: bool
) -> None:
    sd = state.build(nbytes, tensors)
    size = state.nbytes(sd)
    log(f"load: {size / GB:.2f} GB in {len(state.tensors_of(sd))} tensors, {rounds} rounds")
    ckpts = _write(sd, workdir)
    target = state.empty_like(sd)
    sizes = [sum(f.stat().st_size for f in c.glob("*.distcp")) for c in ckpts.values()]
    into = torch.ones(max(sizes), dtype=torch.uint8)  # RAW4_CRC's destination, touched once
    for r in range(rounds):
        for ckpt in alternate(list(ckpts), r):
            files = sorted(ckpts[ckpt].glob("*.distcp"))
            for cache in ("cold", "warm"):
                names = [RAW1, RAW4, STOCK, OURS] + ([RAW4_CRC] if cache == "warm" else [])
                for name in alternate(names, r):
                    dropped = go_cold(rec, cold) if cache == "cold" else False
                    if name == RAW1:
                        seconds = limits.read_files(files, parallel=False)
                    elif name == RAW4:
                        seconds = limits.read_streams(files, 4)
                    elif name == RAW4_CRC:
                        seconds = read_checked(files, 4, into)
                    else:
                        state.poison(target)
                        reader = READERS[name](ckpts[ckpt])
                        t0 = now()
                        dcp.load(target, storage_reader=reader, no_dist=True)
                        seconds = now() - t0
                        state.check_loaded(sd, target)
                    label = cache if cache == "warm" or dropped else "cold (cache not dropped)"
                    _emit(rec, name, seconds, sd, files, checkpoint=ckpt, cache=label, round=r)


def _emit(
    rec: Recorder, name: str, seconds: float, sd: dict, files: list[Path], **fields: Any
) -> None:
    """One load's JSON line: its time, the bandwidth over the files read, the state's sizes."""
    file_bytes = sum(f.stat().st_size for f in files)
    rec.emit(
        "load",
        name,
        {"seconds": seconds, "gb_per_s": file_bytes / GB / seconds},
        bytes=state.nbytes(sd),
        file_bytes=file_bytes,
        files=len(files),
        tensors=len(state.tensors_of(sd)),
        **fields,
    )


def _object_state(rec: Recorder, workdir: Path, *, count: int, rounds: int) -> None:
    sd = state.objects(count)
    written = _write(sd, workdir / "objects")
    ckpts = {OBJECTS: written["ours"], OBJECTS_STOCK: written["stock"]}
    log(f"load: {count} small objects and 4 tensors, warm, {rounds} rounds")
    for r in range(rounds):
        for ckpt in alternate(list(ckpts), r):
            files = sorted(ckpts[ckpt].glob("*.distcp"))
            for name in alternate([STOCK, OURS], r):
                target = state.blank(sd)
                reader = READERS[name](ckpts[ckpt])
                # Every load starts from the same collector state: otherwise the allocations of
                # the previous load (and of the check after it) leave a full collection due, and
                # whichever reader runs next pays it (0.13-0.14 s here, half a load).
                gc.collect()
                t0 = now()
                dcp.load(target, storage_reader=reader, no_dist=True)
                seconds = now() - t0
                state.check_same(sd, target)
                _emit(
                    rec,
                    name,
                    seconds,
                    sd,
                    files,
                    checkpoint=ckpt,
                    cache="warm",
                    objects=count,
                    round=r,
                )
