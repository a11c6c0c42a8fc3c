"""The replication scenario: what peer replication (``checkpointers.peers``) costs a training step.

``world`` gloo ranks (``bench.py _replication-worker``), one rank per simulated node, each with a
memory root (``/dev/shm`` when it is there) holding its part of a step: ``nbytes / world`` bytes
in data files plus a small ``.metadata``. Every rank runs the same training-like step loop: a
few single-threaded matmuls (compute-bound) and an all-reduce of a gradient on the default group.
Rounds alternate: ``steps`` steps without replication, then a round in which every rank starts
``PeerReplicator.replicate`` at the first step and keeps stepping until every rank's replication
is done (the gradient's last element counts the ranks still replicating, so all ranks stop on the
same step). A step's time is the slowest rank's (the all-reduce joins them anyway).

Figures: median step time without replication, mean step time while replicating, their ratio
(target: at most 1.05), the replication's wall time and rate, and the extra seconds one
replication adds to training in all. Each rank's step takes one core for its matmuls; the
replication's TCP copies, reads, writes and CRC-32C run on a background thread, which on a
machine with no spare core take that time from the training step.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import ranks
from .common import GB, Recorder, Spread, fresh_dir, log
from .train import _task_times_s

SYSTEM = "ours PeerReplicator"
#: The replicator's ``nice`` values compared (0: the training's own priority; 10: the default).
NICE = (0, 10)
TARGET_RATIO = 1.05
_DATA_FILES = 4


def _memory_root() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="dcp-bench-replication-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="dcp-bench-replication-"))


def _write_state(step_dir: Path, rank: int, nbytes: int) -> list[str]:
    import torch

    step_dir.mkdir(parents=True, exist_ok=True)
    names = []
    per_file = nbytes // _DATA_FILES
    g = torch.Generator().manual_seed(rank)
    for i in range(_DATA_FILES):
        name = f"__{rank}_{i}.distcp"
        data = torch.randint(0, 256, (per_file,), dtype=torch.uint8, generator=g)
        (step_dir / name).write_bytes(data.numpy().tobytes())
        names.append(name)
    (step_dir / ".metadata").write_bytes(b"m" * 4096)
    return [*names, ".metadata"]


def worker(rank: int, world: int, port: int, workdir: Path, args: dict[str, Any]) -> None:
    """One rank; writes ``rank{rank}.json`` and exits the process (as ``ranks.worker``)."""
    report: dict[str, Any] = {"ok": False}
    try:
        import torch
        import torch.distributed as dist

        from dcp_datastates.checkpointers.peers import PeerReplicator

        torch.set_num_threads(1)
        main_tid = threading.get_native_id()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        root = Path(args["root"]) / f"node{rank}"
        step_dir = root / "step_1"
        files = _write_state(step_dir, rank, args["bytes"] // world)
        replicators = {
            nice: PeerReplicator(ranks_per_node=1, chunk_bytes=args["chunk"], keep=1, nice=nice)
            for nice in NICE
        }
        n = args["width"]
        a, b = torch.randn(n, n), torch.randn(n, n)
        grad = torch.zeros(args["grad"] + 1)

        def step(pending: bool) -> tuple[float, bool]:
            t0 = time.perf_counter()
            c = a
            for _ in range(args["matmuls"]):
                c = torch.tanh(c @ b)
            grad[:-1] = c.mean()
            grad[-1] = float(pending)
            dist.all_reduce(grad)
            return time.perf_counter() - t0, bool(grad[-1] > 0)

        rounds = []
        for _ in range(args["warmup"]):
            step(False)
        for r in range((1 + len(NICE)) * args["rounds"]):
            nice = ([None, *NICE])[r % (1 + len(NICE))]
            times, rep_s = [], None
            cpu0, (main0, wait0) = time.process_time(), _task_times_s(main_tid)
            if nice is None:
                times = [step(False)[0] for _ in range(args["steps"])]
            else:
                future = replicators[nice].replicate(r, step_dir, files, root)
                while True:
                    dt, anyone = step(not future.done())
                    times.append(dt)
                    if not anyone:
                        break
                rep_s = future.result().seconds
            main_run, main_wait = _task_times_s(main_tid)
            rounds.append(
                {
                    "nice": nice,
                    "times": times,
                    "replication_s": rep_s,
                    # every thread's CPU but the training's (the replication's, gloo's)
                    "other_cpu_s": time.process_time() - cpu0 - (main_run - main0),
                    "training_wait_s": main_wait - wait0,  # runnable, but no core free
                }
            )
        for replicator in replicators.values():
            replicator.close()
        dist.barrier()
        dist.destroy_process_group()
        report = {
            "ok": True,
            "rounds": rounds,
            "bytes": sum((step_dir / f).stat().st_size for f in files),
        }
    except BaseException:
        report = {"ok": False, "traceback": traceback.format_exc()}
        traceback.print_exc()
    ranks.exit_with(workdir, rank, report)


def run(
    rec: Recorder,
    *,
    workdir: Path,
    nbytes: int,
    world: int,
    rounds: int,
    steps: int,
    width: int,
    timeout: float,
) -> None:
    root = _memory_root()
    try:
        args = {
            "root": str(root),
            "bytes": nbytes,
            "rounds": rounds,
            "steps": steps,
            "width": width,
            "matmuls": 4,
            "grad": 1 << 18,
            "chunk": 16 << 20,
            "warmup": 3,
        }
        log(
            f"replication: {world} gloo ranks (one per node), {nbytes / GB:.2f} GB in all, "
            f"memory roots in {root}"
        )
        reports = ranks._launch(
            fresh_dir(workdir / "replication"), world, args, timeout, worker="_replication-worker"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total = sum(r["bytes"] for r in reports)

    def step_times(i: int) -> list[float]:  # the slowest rank's, step by step
        return [max(ts) for ts in zip(*(r["rounds"][i]["times"] for r in reports), strict=True)]

    def per_step(i: int, key: str) -> float:  # all ranks together, per step of round i
        return sum(r["rounds"][i][key] for r in reports) / len(reports[0]["rounds"][i]["times"])

    for i, first in enumerate(reports[0]["rounds"]):
        if first["nice"] is None:
            base, base_other = statistics.median(step_times(i)), per_step(i, "other_cpu_s")
            base_wait = per_step(i, "training_wait_s") / world
            continue
        on = step_times(i)
        rep_s = max(r["rounds"][i]["replication_s"] for r in reports)
        rec.emit(
            "replication",
            f"{SYSTEM} nice={first['nice']}",
            {
                "step_s": base,
                "step_replicating_s": statistics.mean(on),
                "step_ratio": statistics.mean(on) / base,
                "replication_s": rep_s,
                "gb_per_s": total / GB / rep_s,
                "extra_s": max(1e-9, sum(on) - len(on) * base),
                # CPU the replication took, all ranks (beyond the baseline's other threads)
                "replication_cpu_s": max(1e-9, (per_step(i, "other_cpu_s") - base_other) * len(on)),
                # per step and rank: the training thread runnable with no core free
                "training_wait_s": max(1e-9, per_step(i, "training_wait_s") / world),
                "training_wait_base_s": max(1e-9, base_wait),
            },
            ranks=world,
            bytes=total,
            steps_replicating=len(on),
            round=i // (1 + len(NICE)),
        )


def table(rec: Recorder) -> str:
    """The scenario's summary (Markdown); empty when it did not run."""
    rows = rec.select("replication")
    if not rows:
        return ""
    lines = [
        f"### Peer replication ({rows[0]['ranks']} gloo ranks, {rows[0]['bytes'] / GB:.2f} GB)",
        "",
        "| replicator | step s | step s while replicating | ratio (target <= 1.05) "
        "| replication s | GB/s | extra training s per replication | replication CPU s "
        "| training wait for a core per step s (none: base) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system in dict.fromkeys(r["system"] for r in rows):

        def med(figure: str, system: str = system) -> Spread:
            return Spread.of(r["figures"][figure] for r in rows if r["system"] == system)

        ratio = med("step_ratio")
        verdict = "met" if ratio.median <= TARGET_RATIO else "MISSED"
        lines.append(
            f"| {system} | {med('step_s').fmt(4)} | {med('step_replicating_s').fmt(4)} "
            f"| {ratio.fmt(3)} {verdict} | {med('replication_s').fmt(3)} "
            f"| {med('gb_per_s').fmt(2)} | {med('extra_s').fmt(3)} "
            f"| {med('replication_cpu_s').fmt(2)} | {med('training_wait_s').fmt(4)} "
            f"({med('training_wait_base_s').fmt(4)}) |"
        )
    return "\n".join([*lines, ""])
