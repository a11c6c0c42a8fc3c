"""Blocked / safe-to-mutate / durable seconds of one save, ours beside stock DCP, in one run.

    python scripts/compare_save.py --gb 3 --tensors 120 --dir /tmp/cmp

Each system saves the same state to its own directory; systems alternate over --repeat rounds
(disk speed swings between runs), and the medians are printed with ratios to stock.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter, async_save

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def make_state(gb: float, tensors: int) -> dict:
    per = int(gb * 1e9 / tensors / 4)
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"t{i}": torch.randn(per, generator=gen) for i in range(tensors)}, "step": 1}


def stock_sync(sd: dict, path: Path) -> dict:
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    t = time.perf_counter() - t0
    return {"blocked_s": t, "safe_s": t, "durable_s": t}


def stock_async(sd: dict, path: Path) -> dict:
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, checkpoint_id=str(path), no_dist=True)
    blocked = time.perf_counter() - t0
    fut.result()
    return {"blocked_s": blocked, "safe_s": blocked, "durable_s": time.perf_counter() - t0}


def ours_async(sd: dict, path: Path, writer: DataStatesWriter) -> dict:
    t0 = time.perf_counter()
    resp = async_save(sd, writer, checkpoint_id=str(path), no_dist=True)
    blocked = time.perf_counter() - t0
    resp.staging_completion.result()
    safe = time.perf_counter() - t0
    resp.upload_completion.result()
    return {"blocked_s": blocked, "safe_s": safe, "durable_s": time.perf_counter() - t0}


def ours_sync(sd: dict, path: Path, writer: DataStatesWriter) -> dict:
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=writer, checkpoint_id=str(path), no_dist=True)
    t = time.perf_counter() - t0
    return {"blocked_s": t, "safe_s": t, "durable_s": t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--tensors", type=int, default=120)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dcp_datastates_compare"))
    args = ap.parse_args()
    sd = make_state(args.gb, args.tensors)
    writer = DataStatesWriter(args.dir / "unused")
    systems = {
        "stock dcp.save": lambda p: stock_sync(sd, p),
        "stock dcp.async_save": lambda p: stock_async(sd, p),
        "ours async_save": lambda p: ours_async(sd, p, writer),
        "ours dcp.save": lambda p: ours_sync(sd, p, writer),
    }
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(args.repeat):
        for i, (name, fn) in enumerate(systems.items()):
            path = args.dir / f"r{r}_{i}"
            shutil.rmtree(path, ignore_errors=True)
            runs[name].append(fn(path))
            shutil.rmtree(path, ignore_errors=True)
            print(json.dumps({"system": name, "round": r, **runs[name][-1]}), flush=True)
    med = {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in runs.items()}
    base = med["stock dcp.async_save"]
    gb = args.gb
    print(
        f"\n{'system':24} {'blocked s':>10} {'safe s':>9} {'durable s':>10} {'GB/s':>6}"
        "  vs stock async (blocked, durable)"
    )
    for name, m in med.items():
        print(
            f"{name:24} {m['blocked_s']:10.4f} {m['safe_s']:9.3f} {m['durable_s']:10.3f} "
            f"{gb / m['durable_s']:6.2f}  {m['blocked_s'] / base['blocked_s']:.4f}x, "
            f"{m['durable_s'] / base['durable_s']:.2f}x"
        )
    writer.close()


if __name__ == "__main__":
    main()
