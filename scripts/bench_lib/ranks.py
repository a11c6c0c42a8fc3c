"""The save scenario on several ranks (2 and 4 by default): real gloo process groups on 127.0.0.1,
DTensor-sharded state.

All ranks run in fresh processes (``bench.py _rank-worker``, as ``tests/_dist_workers.py``
does), hold 1/world of the state each as ``Shard(0)`` DTensors, and save it with each system in
turn after a barrier; a save's figure is the slowest rank's. One untimed warm-up round lets our
writer allocate its pool. Workers leave through ``os._exit`` once their report is written,
because torch's gloo teardown can abort the interpreter (pytorch/pytorch#190489).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from . import state, systems
from .common import GB, Recorder, alternate, fresh_dir, log

BENCH = Path(__file__).resolve().parents[1] / "bench.py"
KEYS = ["stock-sync-t1", "stock-async", "ours-async-1"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded(local: Any, mesh: Any) -> Any:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(local, torch.Tensor):
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    if isinstance(local, dict):
        return {k: _sharded(v, mesh) for k, v in local.items()}
    return local


def worker(rank: int, world: int, port: int, workdir: Path, args: dict[str, Any]) -> None:
    """Runs in each rank's process; writes ``rank{rank}.json`` and exits the process."""
    report: dict[str, Any] = {"ok": False}
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        mesh = init_device_mesh("cpu", (world,))
        local = state.build(args["bytes"] / world, args["tensors"], seed=rank)
        local["rng"] = {"seed": 1234}  # objects are replicated: the same on every rank
        sd = _sharded(local, mesh)
        nbytes = state.nbytes(local)
        made = {k: systems.make(k, workdir / f"{k}_root", nbytes) for k in args["systems"]}
        results = []
        for r in range(-1, args["rounds"]):  # round -1: warm-up, not reported
            for key in alternate(args["systems"], r + 1):
                path = workdir / f"{key}_{r}"
                dist.barrier()
                times = made[key].save(sd, path)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                if r >= 0:
                    results.append({"key": key, "round": r, **times.figures()})
        for system in made.values():
            system.close()
        dist.barrier()
        dist.destroy_process_group()
        report = {"ok": True, "results": results, "bytes": nbytes}
    except BaseException:
        report = {"ok": False, "traceback": traceback.format_exc()}
        traceback.print_exc()
    exit_with(workdir, rank, report)


def exit_with(workdir: Path, rank: int, report: dict[str, Any]) -> NoReturn:
    """End a rank's worker process: its report where ``_launch`` reads it, then ``os._exit``
    (no atexit or process-group teardown to hang on)."""
    (workdir / f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report["ok"] else 1)


def _launch(
    workdir: Path, world: int, args: dict[str, Any], timeout: float, worker: str = "_rank-worker"
) -> list[dict]:
    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = []
    for rank in range(world):
        log_file = open(workdir / f"rank{rank}.log", "w+b")  # noqa: SIM115 - closed below
        cmd = [sys.executable, str(BENCH), worker, str(rank), str(world), str(port)]
        cmd += [str(workdir), json.dumps(args)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log_file, stderr=log_file), log_file))
    deadline = time.monotonic() + timeout
    try:
        for proc, _ in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                if proc.wait(timeout=max(0.1, deadline - time.monotonic())) != 0:
                    deadline = min(deadline, time.monotonic() + 10)  # peers would block forever
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = []
    for rank, (proc, log_file) in enumerate(procs):
        log_file.seek(0)
        output = log_file.read().decode(errors="replace")
        log_file.close()
        path = workdir / f"rank{rank}.json"
        report = json.loads(path.read_text()) if path.exists() else {"ok": False}
        if proc.returncode != 0 or not report.get("ok"):
            raise RuntimeError(f"rank {rank} failed (rc={proc.returncode}):\n{output[-3000:]}")
        reports.append(report)
    return reports


def run(
    rec: Recorder,
    *,
    workdir: Path,
    nbytes: int,
    tensors: int,
    rounds: int,
    timeout: float,
    worlds: tuple[int, ...] = (2,),
) -> None:
    """One launch per world size in ``worlds``; the same total state is split across ranks, so
    the figures show how blocked, safe and durable times grow with the rank count."""
    root = fresh_dir(workdir / "ranks")
    for world in worlds:
        _run_world(
            rec,
            workdir=fresh_dir(root / str(world)),
            world=world,
            nbytes=nbytes,
            tensors=tensors,
            rounds=rounds,
            timeout=timeout,
        )


def _run_world(
    rec: Recorder,
    *,
    workdir: Path,
    world: int,
    nbytes: int,
    tensors: int,
    rounds: int,
    timeout: float,
) -> None:
    log(f"ranks: {world} gloo ranks, {nbytes / GB:.2f} GB in all, {rounds} rounds")
    args = {"bytes": nbytes, "tensors": tensors, "rounds": rounds, "systems": KEYS}
    reports = _launch(workdir, world, args, timeout)
    total = sum(r["bytes"] for r in reports)
    for i, first in enumerate(reports[0]["results"]):
        per_rank = [r["results"][i] for r in reports]
        figures = {k: max(p[k] for p in per_rank) for k in ("blocked_s", "safe_s", "durable_s")}
        figures["durable_gb_per_s"] = total / GB / figures["durable_s"]
        rec.emit(
            "ranks",
            systems.SAVE_SYSTEMS[first["key"]],
            figures,
            ranks=world,
            per_rank=[{k: p[k] for k in ("blocked_s", "safe_s", "durable_s")} for p in per_rank],
            bytes=total,
            tensors=len(state.layout(nbytes / world, tensors)) * 3,
            round=first["round"],
        )
