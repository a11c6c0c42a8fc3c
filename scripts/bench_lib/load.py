"""The load scenario: stock ``FileSystemReader`` vs ``DataStatesReader`` on the same checkpoints.

Two checkpoints of the same state, one written by our writer and one by stock
``FileSystemWriter``, are each loaded by both readers into one preallocated target, with the page
cache dropped (cold) and then warm, beside raw reads of the same data files (large reads into
reused buffers: one stream through the files in order, and four streams each reading a contiguous
quarter, as many as ``DataStatesReader`` has I/O threads), so loads can be given as a share of
what the disk allowed. Readers and raw reads alternate and reverse order between rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_datastates import DataStatesReader, DataStatesWriter

from . import limits, state
from .common import GB, Recorder, alternate, fresh_dir, go_cold, log, now

RAW1 = "raw read 1 stream"
RAW4 = "raw read 4 streams"
RAWS = (RAW1, RAW4)
STOCK = "stock FileSystemReader"
OURS = "ours DataStatesReader"
READERS: dict[str, Callable[[Path], Any]] = {STOCK: FileSystemReader, OURS: DataStatesReader}


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
    rec: Recorder, *, workdir: Path, nbytes: int, tensors: int, rounds: int, cold: bool
) -> None:
    workdir = fresh_dir(workdir / "load")
    sd = state.build(nbytes, tensors)
    size = state.nbytes(sd)
    log(f"load: {size / GB:.2f} GB in {len(state.tensors_of(sd))} tensors, {rounds} rounds")
    ckpts = _write(sd, workdir)
    target = state.empty_like(sd)
    for r in range(rounds):
        for ckpt in alternate(list(ckpts), r):
            files = sorted(ckpts[ckpt].glob("*.distcp"))
            file_bytes = sum(f.stat().st_size for f in files)
            for cache in ("cold", "warm"):
                for name in alternate([RAW1, RAW4, STOCK, OURS], r):
                    dropped = go_cold(rec, cold) if cache == "cold" else False
                    if name == RAW1:
                        seconds = limits.read_files(files, parallel=False)
                    elif name == RAW4:
                        seconds = limits.read_streams(files, 4)
                    else:
                        state.poison(target)
                        reader = READERS[name](ckpts[ckpt])
                        t0 = now()
                        dcp.load(target, storage_reader=reader, no_dist=True)
                        seconds = now() - t0
                        state.check_loaded(sd, target)
                    rec.emit(
                        "load",
                        name,
                        {"seconds": seconds, "gb_per_s": file_bytes / GB / seconds},
                        checkpoint=ckpt,
                        cache=cache if cache == "warm" or dropped else "cold (cache not dropped)",
                        bytes=size,
                        file_bytes=file_bytes,
                        files=len(files),
                        tensors=len(state.tensors_of(sd)),
                        round=r,
                    )
