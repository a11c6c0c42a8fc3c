"""Where the durable time of ``ours async`` goes, beside the write+fsync limit, in one process.

    python scripts/bench_durable.py [--gb 1.5] [--rounds 3] [--variants direct:2,buffered:2]

Each round runs the raw write+fsync limit (``--writers`` threads, page cache, fsync each, as in
``bench.py save``) and one ``dcp_datastates.async_save`` per variant, in an order that reverses
every round: ``direct:N[:MiB]`` / ``buffered:N`` = data files with or without ``O_DIRECT``,
``flush_workers=N``, a direct buffer of MiB (default ``localfile.DIRECT_BUFFER``). Each
variant reuses one writer (its first save, untimed, fills the pool). Per save it
prints the durable throughput and, per data file: wall time of the file's flush, CPU time of its
thread (``time.thread_time``: crc32c, copies, the kernel's work inside ``write``), time waiting
for snapshot pieces, the final ``fsync``, and the dirty page cache (machine-wide) when that
``fsync`` started. At the end: the ratio of medians to the limit and the ratio in each round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import limits, state  # noqa: E402
from bench_lib.common import alternate  # noqa: E402

import dcp_datastates.save.flush as flush_mod
from dcp_datastates import DataStatesWriter, async_save
from dcp_datastates.snapshot.session import SnapshotSession  # noqa: E402
from dcp_datastates.storage import localfile  # noqa: E402

GB = 1 << 30
LIMIT = "limit"


class Probe:
    """Per-file figures of the flush, gathered by wrapping the flush's own calls."""

    def __init__(self) -> None:
        self.files: list[dict[str, Any]] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        wait, fsync, flush_file = SnapshotSession.wait, os.fsync, flush_mod._flush_file
        local = self._local

        def timed_wait(session: SnapshotSession, slice_: Any) -> memoryview:
            t = time.perf_counter()
            try:
                return wait(session, slice_)
            finally:
                local.wait = getattr(local, "wait", 0.0) + time.perf_counter() - t

        def timed_fsync(fd: int) -> None:
            dirty = _dirty_bytes()
            t = time.perf_counter()
            fsync(fd)
            local.fsync = (time.perf_counter() - t, dirty)

        def timed_flush_file(storage: Any, name: str, items: Any, session: Any, **kw: Any) -> Any:
            local.wait, local.fsync = 0.0, (0.0, 0)
            t, cpu = time.perf_counter(), time.thread_time()
            out = flush_file(storage, name, items, session, **kw)
            row = {
                "file": name.rsplit("/", 1)[-1],
                "wall": time.perf_counter() - t,
                "cpu": time.thread_time() - cpu,
                "wait": local.wait,
                "fsync": local.fsync[0],
                "dirty_gb": local.fsync[1] / GB,
            }
            with self._lock:
                self.files.append(row)
            return out

        SnapshotSession.wait = timed_wait  # type: ignore[method-assign]
        os.fsync = timed_fsync
        flush_mod._flush_file = timed_flush_file  # type: ignore[assignment]


def _dirty_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Dirty:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--tensors", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--writers", type=int, default=4, help="writers of the raw limit")
    ap.add_argument("--variants", default="direct:2,buffered:2")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench_durable"))
    args = ap.parse_args()
    variants = args.variants.split(",")
    work = args.dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sd = state.build(args.gb * GB, args.tensors)
    nbytes = state.nbytes(sd)
    probe = Probe()
    default_buffer = localfile.DIRECT_BUFFER
    writers: dict[str, DataStatesWriter] = {}
    times: dict[str, list[float]] = {v: [] for v in [LIMIT, *variants]}
    print(f"{nbytes / GB:.2f} GB, {args.rounds} rounds, limit: write+fsync x{args.writers}")
    try:
        for r in range(args.rounds):
            for v in alternate([LIMIT, *variants], r):
                os.sync()  # nobody else's dirty pages in this measurement
                if v == LIMIT:
                    s = limits.write_fsync(work, nbytes, args.writers)
                    times[v].append(s)
                    print(f"r{r} {'limit':>11} {nbytes / GB / s:5.2f} GB/s {s:6.2f} s", flush=True)
                    continue
                mode, workers, *mib = v.split(":")
                localfile.ENABLED = mode == "direct"
                localfile.DIRECT_BUFFER = int(mib[0]) << 20 if mib else default_buffer
                if v not in writers:
                    writers[v] = DataStatesWriter(
                        work / f"root_{r}", host_pool_bytes=nbytes, flush_workers=int(workers)
                    )
                    async_save(
                        sd, writers[v], checkpoint_id=work / "warm"
                    ).upload_completion.result()
                    shutil.rmtree(work / "warm")
                    os.sync()
                probe.files.clear()
                t0 = time.perf_counter()
                resp = async_save(sd, writers[v], checkpoint_id=work / "ckpt")
                resp.upload_completion.result()
                s = time.perf_counter() - t0
                times[v].append(s)
                st = writers[v].last_stats
                assert st is not None
                files = " ".join(
                    f"[{x['file']} wall {x['wall']:.2f} cpu {x['cpu']:.2f} wait {x['wait']:.2f} "
                    f"fsync {x['fsync']:.2f} dirty {x['dirty_gb']:.2f}GB]"
                    for x in sorted(probe.files, key=lambda x: x["file"])
                )
                print(
                    f"r{r} {v:>11} {nbytes / GB / s:5.2f} GB/s {s:6.2f} s (safe "
                    f"{st.safe_to_mutate_s:.2f}, flushed {st.flushed_s:.2f}, commit "
                    f"{st.commit_s:.3f}) {files}",
                    flush=True,
                )
                shutil.rmtree(work / "ckpt")
    finally:
        localfile.ENABLED = True
        localfile.DIRECT_BUFFER = default_buffer
        for w in writers.values():
            w.close()
        shutil.rmtree(work, ignore_errors=True)
    limit = times[LIMIT]
    speeds = " ".join(f"{nbytes / GB / s:.2f}" for s in limit)
    print(f"limit: GB/s per round {speeds}")
    for v in variants:
        speeds = " ".join(f"{nbytes / GB / s:.2f}" for s in times[v])
        print(f"{v}: GB/s per round {speeds}")
        per_round = " ".join(f"{a / b:.2f}" for a, b in zip(limit, times[v], strict=True))
        ratio = statistics.median(limit) / statistics.median(times[v])
        print(f"{v}: throughput / limit, of medians {ratio:.2f}; per round {per_round}")


if __name__ == "__main__":
    main()
