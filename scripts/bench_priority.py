"""Interleaved A/B measurements of the flush threads' priority (``flush_nice``), issue 11.

    python scripts/bench_priority.py train 10 [0,10]     # training overhead: cycles, nice values
    python scripts/bench_priority.py train 16 "copy_workers=1;copy_workers=2"  # or writer options
    python scripts/bench_priority.py train 16 "live_flush=True;live_flush=False"
    python scripts/bench_priority.py safe 1.0 4 [0,10]   # safe vs DefaultStager: GB, rounds
    python scripts/bench_priority.py safe 3.0 6 "live_flush=True;live_flush=False"

``train``: the train scenario's model (0.33 GB state, AdamW), run as blocks of 4 steps; each block
starts with a checkpoint of one system (no checkpoint, stock ``dcp.async_save`` with its default
stager, ours at each nice value), round-robin, and ends once that checkpoint is durable (as the
scenario waits for the previous save before the next). A system's overhead is the median over
cycles of its block time minus the no-checkpoint block of the same cycle: systems a few seconds
apart see the same machine load, which a shared two-core machine changes from second to second.

``safe``: ``DefaultStager`` (cached, unpinned) staging against our time to safe (and our
durable time), same process, one warmed writer per nice value or set of writer options. Nothing
is asserted; figures are printed.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch.distributed.checkpoint as dcp  # noqa: E402
from bench_lib import state  # noqa: E402
from bench_lib.systems import DEFAULT_STAGING  # noqa: E402
from bench_lib.train import TrainConfig, _Trainee  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

from dcp_datastates import DataStatesWriter, async_save  # noqa: E402

STEPS_PER_BLOCK = 4


def _block(system: str, trainee: _Trainee, writer: DataStatesWriter | None, path: Path) -> float:
    t0 = time.perf_counter()
    future: Any = None
    if system != "none":
        msd, osd = get_state_dict(trainee.model, trainee.opt)
        sd = {"model": msd, "optim": osd, "step": 0}
        if writer is None:
            future = dcp.async_save(
                sd,
                storage_writer=FileSystemWriter(path),
                async_stager=DefaultStager(DEFAULT_STAGING),
                no_dist=True,
            )
        else:
            future = async_save(sd, writer, checkpoint_id=path, no_dist=True).upload_completion
    for _ in range(STEPS_PER_BLOCK):
        trainee.step()
    if future is not None:
        future.result()
    took = time.perf_counter() - t0
    shutil.rmtree(path, ignore_errors=True)
    return took


def train(cycles: int, configs: list[dict[str, int | bool]]) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench_priority_"))
    names = ["ours " + ",".join(f"{k}={v}" for k, v in c.items()) for c in configs]
    systems = ["none", "stock async_save", *names]
    writers = {
        name: DataStatesWriter(root / f"w{i}", **c)
        for i, (name, c) in enumerate(zip(names, configs, strict=True))
    }
    trainee = _Trainee.make(TrainConfig())
    blocks: dict[str, list[float]] = {s: [] for s in systems}
    try:
        for s in systems:  # warm-up: optimizer state, allocator, each writer's pool
            _block(s, trainee, writers.get(s), root / "warm")
        for c in range(cycles):
            k = c % len(systems)
            for s in systems[k:] + systems[:k]:
                blocks[s].append(_block(s, trainee, writers.get(s), root / f"c{c}"))
    finally:
        for w in writers.values():
            w.close()
        shutil.rmtree(root, ignore_errors=True)
    base = blocks["none"]
    stock = statistics.median(a - b for a, b in zip(blocks["stock async_save"], base, strict=True))
    print(f"{cycles} cycles of {STEPS_PER_BLOCK}-step blocks, load {os.getloadavg()[0]:.1f}")
    for s in systems:
        over = statistics.median(a - b for a, b in zip(blocks[s], base, strict=True))
        ratio = f" ({over / stock:.2f}x stock)" if s != "none" and stock > 0 else ""
        print(f"  {s:32s} block {statistics.median(blocks[s]):.3f}s overhead {over:+.3f}s{ratio}")


def safe(gb: float, rounds: int, configs: list[dict[str, int | bool]]) -> None:
    sd = state.build(gb * 1e9, 120)
    names = [",".join(f"{k}={v}" for k, v in c.items()) or "defaults" for c in configs]
    stager = DefaultStager(DEFAULT_STAGING)
    stager.stage(sd)  # its cache, as in steady state
    root = Path(tempfile.mkdtemp(prefix="bench_priority_"))
    writers = {
        n: DataStatesWriter(root / f"w{i}", **c)
        for i, (n, c) in enumerate(zip(names, configs, strict=True))
    }
    staged: list[float] = []
    ours: dict[str, list[float]] = {n: [] for n in names}
    durable: dict[str, list[float]] = {n: [] for n in names}
    try:
        for w in writers.values():
            w.warm_up(sd, wait=True)
        for r in range(rounds):
            t = time.perf_counter()
            stager.stage(sd)
            staged.append(time.perf_counter() - t)
            order = list(writers.items())
            for i, (n, w) in enumerate(order if r % 2 == 0 else order[::-1]):
                path = root / f"c{i}_{r}"
                dcp.async_save(sd, storage_writer=w, checkpoint_id=path, no_dist=True).result()
                assert w.last_stats is not None and w.last_stats.safe_to_mutate_s is not None
                ours[n].append(w.last_stats.safe_to_mutate_s)
                durable[n].append(w.last_stats.durable_s or 0.0)
                shutil.rmtree(path, ignore_errors=True)
    finally:
        stager.close()
        for w in writers.values():
            w.close()
        shutil.rmtree(root, ignore_errors=True)
    s0 = statistics.median(staged)
    print(f"{gb} GB, {rounds} rounds, load {os.getloadavg()[0]:.1f}: DefaultStager {s0:.3f}s")
    for n in names:
        m = statistics.median(ours[n])
        runs = ", ".join(f"{x:.3f}" for x in ours[n])
        d = statistics.median(durable[n])
        print(f"  ours {n}: safe {m:.3f}s ({m / s0:.2f}x) [{runs}], durable {d:.3f}s")


def _nices(args: list[str], at: int) -> list[int]:
    if len(args) <= at:
        return [0, 10]
    try:
        return [int(x) for x in args[at].split(",")]
    except ValueError:
        raise SystemExit(
            f"{args[at]!r} is neither nice values (0,10) nor writer options "
            '("copy_workers=1;copy_workers=2")'
        ) from None


def _configs(args: list[str], at: int) -> list[dict[str, int | bool]]:
    """Writer options per system: ``"copy_workers=1;copy_workers=2,flush_nice=0"``, or nice
    values as before (``0,10``)."""
    if len(args) > at and "=" in args[at]:
        configs = []
        for config in args[at].split(";"):
            options: dict[str, int | bool] = {}
            for kv in config.split(","):
                name, _, value = kv.partition("=")
                if value in ("True", "False"):
                    options[name.strip()] = value == "True"
                    continue
                if not value.lstrip("-").isdigit():
                    raise SystemExit(
                        f"writer option {kv!r} in {args[at]!r} is not name=integer (or "
                        'name=True/False); write e.g. "copy_workers=1;copy_workers=2,flush_nice=0"'
                    )
                options[name.strip()] = int(value)
            configs.append(options)
        return configs
    return [{"flush_nice": n} for n in _nices(args, at)]


if __name__ == "__main__":
    argv = sys.argv
    if len(argv) >= 3 and argv[1] == "train":
        train(int(argv[2]), _configs(argv, 3))
    elif len(argv) >= 4 and argv[1] == "safe":
        safe(float(argv[2]), int(argv[3]), _configs(argv, 4))
    else:
        raise SystemExit(__doc__)
