"""The object-store scenario: an S3 server on loopback (moto, in its own process), stock
``FsspecWriter``/``FsspecReader`` against ``DataStatesWriter``/``DataStatesReader`` on the same
state, and the tiered save (local directory, mirrored to the server in the background) with its
blocked, local-durable and remote-committed times beside a direct async save to the server.

moto keeps objects in memory and parses every request in Python: its figures measure the client
path and the request pattern (parts in flight, ranged GETs in parallel), not a real store's
bandwidth. Systems alternate and reverse order between rounds.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from dcp_datastates import DataStatesReader, DataStatesWriter, WriterOptions, async_save
from dcp_datastates.checkpointers.tiers import Tier, TieredCheckpointer
from dcp_datastates.storage import s3

from . import state
from .common import GB, Recorder, Spread, alternate, fresh_dir, log, now

HOST = "127.0.0.1"  # loopback only
STOCK_W, OURS_W = "stock FsspecWriter", "ours DataStatesWriter"
STOCK_R, OURS_R = "stock FsspecReader", "ours DataStatesReader"
DIRECT, TIERED = "ours async_save to s3", "ours tiered local+s3"
_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "BOTO_CONFIG": "/dev/null",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


def settings(system: str, opts: dict[str, Any], objects: int) -> dict[str, Any]:
    """How ``system`` wrote to the store: objects per save, part size, parts in flight per
    object, and objects written at once (what the durable time depends on; moto on loopback
    rewards concurrency less than a real store does, ``docs/storage.md``)."""
    if system == STOCK_W:  # one file per rank (thread_count=1), s3fs's parts, one at a time
        import s3fs

        part = s3fs.S3FileSystem.default_block_size
        return {"objects": objects, "part_bytes": part, "parts_in_flight": 1, "at_once": 1}
    return {
        "objects": objects,
        "part_bytes": opts.get("part_bytes", s3.PART_BYTES),
        "parts_in_flight": opts.get("parts_in_flight", s3.PARTS_IN_FLIGHT),
        "at_once": WriterOptions().flush_workers,
    }


def describe(x: dict[str, Any]) -> str:
    return (
        f"{x['objects']} data objects, {x['part_bytes'] >> 20} MiB parts, "
        f"{x['parts_in_flight']} in flight per object, {x['at_once']} objects at once"
    )


@contextmanager
def moto_process() -> Iterator[tuple[str, int]]:
    """``python -m moto.server`` on a free loopback port; its endpoint and process id while the
    block runs."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **_ENV},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection((HOST, port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)
        yield f"http://{HOST}:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run(rec: Recorder, *, workdir: Path, nbytes: int, tensors: int, rounds: int) -> None:
    os.environ.update(_ENV)
    import boto3
    import s3fs

    workdir = fresh_dir(workdir / "objstore")
    sd = state.build(nbytes, tensors)
    size = state.nbytes(sd)
    log(f"objstore: {size / GB:.2f} GB in {len(state.tensors_of(sd))} tensors, {rounds} rounds")
    with moto_process() as (endpoint, _):
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        opts = {"endpoint_url": endpoint}
        target = state.empty_like(sd)
        extra = {"bytes": size, "tensors": len(state.tensors_of(sd)), "endpoint": "moto loopback"}
        for r in range(rounds):
            s3fs.S3FileSystem.clear_instance_cache()
            urls = {name: f"s3://{bucket}/r{r}/{name.split()[0]}" for name in (STOCK_W, OURS_W)}
            for name in alternate([STOCK_W, OURS_W], r):
                t0 = now()
                if name == STOCK_W:
                    writer: Any = FsspecWriter(urls[name], **opts)
                    dcp.save(sd, storage_writer=writer, no_dist=True)
                else:
                    writer = DataStatesWriter(urls[name], storage_options=opts)
                    try:
                        dcp.save(sd, storage_writer=writer, no_dist=True)
                    finally:
                        writer.close()
                seconds = now() - t0
                root = urls[name].removeprefix("s3://")
                objects = sum(p.endswith(".distcp") for p in s3fs.S3FileSystem(**opts).find(root))
                rec.emit(
                    "objstore",
                    name,
                    {"save_s": seconds, "gb_per_s": size / GB / seconds},
                    settings=settings(name, opts, objects),
                    round=r,
                    **extra,
                )
            for ckpt in (STOCK_W, OURS_W):
                for name in alternate([STOCK_R, OURS_R], r):
                    state.poison(target)
                    if name == STOCK_R:
                        reader: Any = FsspecReader(urls[ckpt], **opts)
                    else:
                        reader = DataStatesReader(urls[ckpt], storage_options=opts)
                    t0 = now()
                    dcp.load(target, storage_reader=reader, no_dist=True)
                    seconds = now() - t0
                    state.check_loaded(sd, target)
                    rec.emit(
                        "objstore",
                        name,
                        {"load_s": seconds, "gb_per_s": size / GB / seconds},
                        checkpoint=ckpt.split()[0],
                        round=r,
                        **extra,
                    )
            _tiered(rec, sd, workdir / f"r{r}", f"s3://{bucket}/r{r}", opts, r, extra)


def _tiered(
    rec: Recorder, sd: dict, local: Path, remote: str, opts: dict, r: int, extra: dict
) -> None:
    for name in alternate([DIRECT, TIERED], r):
        t0 = now()
        if name == DIRECT:
            writer = DataStatesWriter(f"{remote}/direct", storage_options=opts)
            try:
                resp = async_save(sd, writer, no_dist=True)
                blocked = now() - t0
                resp.upload_completion.result()
                durable = now() - t0
            finally:
                writer.close()
            figures = {"blocked_s": blocked, "remote_committed_s": durable}
        else:
            tiers = TieredCheckpointer(
                Tier(url=str(local), keep=1), Tier(url=f"{remote}/tiered", storage_options=opts)
            )
            try:
                handle = tiers.save(sd, step=1)
                handle.local.result()
                handle.remote.result()
            finally:
                tiers.close()
            figures = {
                "blocked_s": handle.blocked_s,
                "local_durable_s": handle.local_s,
                "remote_committed_s": handle.remote_s,
            }
        rec.emit("objstore", name, figures, round=r, **extra)


def table(rec: Recorder) -> str:
    """The scenario's summary (Markdown); empty when it did not run."""
    if not rec.select("objstore"):
        return ""

    def med(system: str, figure: str, **match: Any) -> Spread | None:
        rows = rec.select("objstore", system=system, **match)
        return Spread.of(r["figures"][figure] for r in rows if figure in r["figures"])

    def fmt(s: Spread | None) -> str:
        return "-" if s is None else s.fmt(3)

    def ratio(a: Spread | None, b: Spread | None) -> str:
        return "-" if a is None or b is None or not b.median else f"{a.median / b.median:.2f}x"

    lines = [
        "### Object store (moto on loopback, in its own process)",
        "",
        "| what | stock | ours | ours/stock speed |",
        "|---|---|---|---|",
    ]
    sw, ow = med(STOCK_W, "gb_per_s"), med(OURS_W, "gb_per_s")
    lines.append(f"| save GB/s | {fmt(sw)} | {fmt(ow)} | {ratio(ow, sw)} |")
    st, ot = med(STOCK_W, "save_s"), med(OURS_W, "save_s")
    lines.append(f"| save (durable) s | {fmt(st)} | {fmt(ot)} | time {ratio(ot, st)} |")
    for ckpt in ("stock", "ours"):
        sr, orr = (
            med(STOCK_R, "gb_per_s", checkpoint=ckpt),
            med(OURS_R, "gb_per_s", checkpoint=ckpt),
        )
        lines.append(
            f"| load GB/s ({ckpt}'s checkpoint) | {fmt(sr)} | {fmt(orr)} | {ratio(orr, sr)} |"
        )
    lines += [
        "",
        "| save | blocked s | local durable s | remote committed s |",
        "|---|---|---|---|",
    ]
    for name in (DIRECT, TIERED):
        cells = [fmt(med(name, f)) for f in ("blocked_s", "local_durable_s", "remote_committed_s")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for name in (STOCK_W, OURS_W):
        saved = [r["settings"] for r in rec.select("objstore", system=name) if "settings" in r]
        if saved:
            lines.append(f"- {name}: {describe(saved[0])}")
    return "\n".join(lines) + "\n"
