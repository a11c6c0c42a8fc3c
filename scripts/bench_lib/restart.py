"""The restart scenario: how long a restarted process takes to load the same committed step from
the memory tier (``/dev/shm``), from the local disk (cold: page cache dropped where allowed, and
warm) and from S3 (moto on loopback), side by side.

One ``Checkpointer`` with a memory tier saves the state once: the step is committed in memory
and flushed to the local root; it is then copied to the S3 server. Each round, a fresh
``Checkpointer`` resumes (``load_latest``) from memory, one without a memory tier from the disk,
and ``DataStatesReader`` + ``dcp.load`` from S3, into the same preallocated target (checked
after each). The figure is the whole call a restarted loop makes, agreement and listing
included. Target: memory >= 5x faster than the cold disk at 2 GB. Warm disk reads come from the
page cache, which is memory too: that row shows what a disk read costs once cached.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesReader
from dcp_datastates.checkpointers.checkpointer import Checkpointer, step_dir_name
from dcp_datastates.checkpointers.memory import MemoryTier
from dcp_datastates.checkpointers.mirror import copy_checkpoint
from dcp_datastates.storage.base import LocalStorage, storage_for

from . import state
from .common import GB, Recorder, Spread, alternate, fresh_dir, go_cold, log, now
from .objstore import _ENV, moto_process

MEMORY, S3 = "memory tier (/dev/shm)", "s3 (moto)"
COLD, WARM = "local disk, cold", "local disk, warm"


def run(
    rec: Recorder, *, workdir: Path, nbytes: int, tensors: int, rounds: int, cold: bool
) -> None:
    workdir = fresh_dir(workdir / "restart")
    root = workdir / "ckpt"
    sd = state.build(nbytes, tensors)
    size = state.nbytes(sd)
    tier = MemoryTier(job_id=f"bench-{uuid.uuid4().hex[:8]}")
    log(f"restart: {size / GB:.2f} GB in {len(state.tensors_of(sd))} tensors, {rounds} rounds")
    with Checkpointer(root, every_steps=1, preemption_signals=(), memory=tier) as ck:
        ck.save(1, sd)
        ck.wait()
        held = ck.memory_bytes or 0
        saver = _keep_segment(ck)  # the segment stays, as a crash would leave it
    target = state.empty_like(sd)
    extra = {"bytes": size, "tensors": len(state.tensors_of(sd)), "memory_bytes": held}
    os.environ.update(_ENV)
    import boto3

    try:
        with moto_process() as (endpoint, _):
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
            opts = {"endpoint_url": endpoint}
            url = f"s3://{bucket}/{step_dir_name(1)}"
            copy_checkpoint(LocalStorage(root / step_dir_name(1)), storage_for(url, opts))
            for r in range(rounds):
                for name in alternate([MEMORY, COLD, WARM, S3], r):
                    state.poison(target)
                    dropped = _cold(rec, cold, root) if name == COLD else None
                    t0 = now()
                    if name == MEMORY:
                        with Checkpointer(root, preemption_signals=(), memory=tier) as again:
                            step = again.load_latest(target)
                            seconds = now() - t0
                            _keep_segment(again)
                    elif name in (COLD, WARM):
                        with Checkpointer(root, preemption_signals=()) as again:
                            step = again.load_latest(target)
                        seconds = now() - t0
                    else:
                        reader = DataStatesReader(url, storage_options=opts)
                        dcp.load(target, storage_reader=reader, no_dist=True)
                        step, seconds = 1, now() - t0
                    assert step == 1, (name, step)
                    state.check_loaded(sd, target)
                    label = name if dropped is not False else f"{name} (cache not dropped)"
                    rec.emit(
                        "restart",
                        label,
                        {"resume_s": seconds, "gb_per_s": size / GB / seconds},
                        round=r,
                        **extra,
                    )
    finally:
        saver()


def _cold(rec: Recorder, cold: bool, root: Path) -> bool:
    """Drop the page cache (root), else evict the checkpoint's own files from it with
    ``posix_fadvise(DONTNEED)`` (clean pages; no root needed): the disk is read either way."""
    if not cold or go_cold(rec, cold):
        return cold
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    rec.note("restart: 'cold' disk reads evict the checkpoint's files with fadvise(DONTNEED)")
    return True


def _keep_segment(ck: Checkpointer) -> Any:
    """Keep ``ck``'s memory segment past its close (what a crash leaves); returns the function
    that removes it at the end."""
    side = ck._memory  # noqa: SLF001 - the bench stands in for a crash
    assert side is not None, "the memory tier is off (see the log)"
    segment = side.segment
    side.close = lambda *, remove: side.flusher.close()  # type: ignore[method-assign]
    return lambda: segment.remove()


def table(rec: Recorder) -> str:
    """The scenario's summary (Markdown); empty when it did not run."""
    rows = rec.select("restart")
    if not rows:
        return ""
    names = list(dict.fromkeys(r["system"] for r in rows))
    spreads = {
        n: Spread.of(r["figures"]["resume_s"] for r in rows if r["system"] == n) for n in names
    }
    mem = spreads.get(MEMORY)
    size = rows[0]["bytes"] / GB
    lines = [
        f"### Restart ({size:.2f} GB, one process; memory tier held "
        f"{rows[0]['memory_bytes'] / GB:.2f} GB)",
        "",
        "| resume from | seconds | GB/s | time / memory's |",
        "|---|---|---|---|",
    ]
    for name, s in spreads.items():
        if s is None:
            continue
        times = "-" if mem is None or not mem.median else f"{s.median / mem.median:.1f}x"
        lines.append(f"| {name} | {s.fmt(3)} | {size / s.median:.2f} | {times} |")
    return "\n".join(lines) + "\n"
