"""Durable time of stock ``FsspecWriter`` against ours on S3 (moto on loopback) per set of our
settings, with the CPU each side spent: why two checks of the same comparison read differently
(issue 41), and what ``part_bytes``, ``parts_in_flight`` and ``flush_workers`` change.

    python scripts/bench_s3_settings.py --mb 192 --rounds 3 --moto process \\
        --configs "default;part_mib=64;inflight=4;workers=1"

``--moto process`` runs ``python -m moto.server`` (as ``bench.py objstore`` does; its CPU is
read from ``/proc``); ``--moto thread`` runs ``ThreadedMotoServer`` inside this process (as the
tests and the recipe in ``docs/storage.md`` do), where its CPU is in ``client_cpu``. A config is
``part_mib=N,inflight=N,workers=N`` (any subset). Systems alternate, reversed every round; every
save is deleted after it is timed. One JSON line per save; prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import objstore, state  # noqa: E402


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def _moto_thread() -> Iterator[tuple[str, None]]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind((objstore.HOST, 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address=objstore.HOST, port=port, verbose=False)
    server.start()
    try:
        yield f"http://{objstore.HOST}:{port}", None
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=192, help="state size, MiB")
    ap.add_argument("--tensors", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--moto", choices=["process", "thread"], default="process")
    ap.add_argument("--configs", default="default", help="';'-separated sets of our settings")
    args = ap.parse_args()
    os.environ.update(objstore._ENV)
    import boto3
    import s3fs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from dcp_datastates import DataStatesWriter

    sd = state.build(args.mb << 20, args.tensors)
    systems = ["stock"] + args.configs.split(";")
    server = objstore.moto_process() if args.moto == "process" else _moto_thread()
    with server as (endpoint, pid):
        bucket = f"s3set-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        opts = {"endpoint_url": endpoint}
        for r in range(args.rounds):
            for name in systems if r % 2 == 0 else systems[::-1]:
                s3fs.S3FileSystem.clear_instance_cache()
                root = f"{bucket}/r{r}/{uuid.uuid4().hex[:8]}"
                moto0, cpu0, t0 = pid and _cpu_s(pid), time.process_time(), time.perf_counter()
                if name == "stock":
                    dcp.save(sd, storage_writer=FsspecWriter(f"s3://{root}", **opts), no_dist=True)
                else:
                    cfg = dict(kv.split("=") for kv in name.split(",")) if name != "default" else {}
                    so: dict = dict(opts)
                    if "part_mib" in cfg:
                        so["part_bytes"] = int(cfg["part_mib"]) << 20
                    if "inflight" in cfg:
                        so["parts_in_flight"] = int(cfg["inflight"])
                    workers = {"flush_workers": int(cfg["workers"])} if "workers" in cfg else {}
                    writer = DataStatesWriter(f"s3://{root}", storage_options=so, **workers)
                    try:
                        dcp.save(sd, storage_writer=writer, no_dist=True)
                    finally:
                        writer.close()
                seconds = time.perf_counter() - t0
                fs = s3fs.S3FileSystem(**opts)
                out = {
                    "round": r,
                    "system": "stock FsspecWriter" if name == "stock" else f"ours {name}",
                    "durable_s": round(seconds, 3),
                    "client_cpu_s": round(time.process_time() - cpu0, 2),
                    "moto_cpu_s": round(_cpu_s(pid) - moto0, 2) if pid else None,
                    "objects": sum(p.endswith(".distcp") for p in fs.find(root)),
                    "moto": args.moto,
                    "bytes": state.nbytes(sd),
                }
                print(json.dumps(out), flush=True)
                fs.rm(root, recursive=True)  # moto keeps every object in memory


if __name__ == "__main__":
    main()
