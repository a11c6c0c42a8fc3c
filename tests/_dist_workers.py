"""Worker processes for the multi-process tests, and the launcher the tests use to run them.

Each scenario runs in fresh interpreters (``python _dist_workers.py SCENARIO RANK WORLD PORT DIR``)
that join a real gloo process group on 127.0.0.1, so nothing distributed (process groups, DCP's
checkpoint daemon, writer threads) leaks into the pytest process. A worker reports what it saw as
JSON in ``DIR/rank{RANK}.json``; the tests judge it and load the checkpoint themselves.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch

#: Seconds a worker waits on one future; the tests' pytest-timeout bounds the whole run.
FUTURE_TIMEOUT_S = 30.0
#: How long the other ranks may still run once one rank has exited with an error.
FAILED_PEER_GRACE_S = 10.0
SEED = 1234
INJECTED = "injected write failure"


def full_values(seed: int = SEED) -> dict[str, Any]:
    """The whole (unsharded) state every rank starts from, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return {
        "sharded": torch.randn(8, 6, generator=g),
        "replicated_dt": torch.randn(5, generator=g, dtype=torch.float64),
        "plain": torch.randint(0, 1 << 20, (3, 4), generator=g),
        "meta": {"step": 7, "tag": f"seed-{seed}", "lrs": [0.1, 0.01]},
    }


def empty_like_values(values: dict[str, Any]) -> dict[str, Any]:
    """A load target of full-size plain tensors (zeros) and placeholder objects."""
    return {
        "sharded": torch.zeros_like(values["sharded"]),
        "replicated_dt": torch.zeros_like(values["replicated_dt"]),
        "plain": torch.zeros_like(values["plain"]),
        "meta": {"step": 0, "tag": "", "lrs": []},
    }


# -- launcher (runs in pytest) ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str
    report: dict[str, Any]


def launch(
    scenario: str,
    workdir: Path,
    *,
    world_size: int = 2,
    timeout: float = 60.0,
    script: str = __file__,
) -> list[RankResult]:
    """Run ``scenario`` of ``script`` (this module, or another worker module taking the same
    arguments) on ``world_size`` fresh processes; every process is gone on return."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = []
    for rank in range(world_size):
        log = open(workdir / f"rank{rank}.log", "w+b")  # noqa: SIM115 - closed below
        cmd = [
            sys.executable,
            script,
            scenario,
            str(rank),
            str(world_size),
            str(port),
            str(workdir),
        ]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    try:
        for proc, _ in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                if proc.wait(timeout=max(0.1, deadline - time.monotonic())) != 0:
                    # A dead rank leaves its peers blocked in a collective: don't wait it out.
                    deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE_S)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out = []
    for rank, (proc, log) in enumerate(procs):
        log.seek(0)
        text = log.read().decode(errors="replace")
        log.close()
        report_path = workdir / f"rank{rank}.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        out.append(RankResult(rank, proc.returncode, text, report))
    return out


def check_all_ok(results: list[RankResult]) -> None:
    for r in results:
        assert r.returncode == 0 and r.report.get("ok"), (
            f"rank {r.rank} failed (rc={r.returncode}):\n{r.output[-4000:]}"
        )


# -- workers -----------------------------------------------------------------------------------
def rendezvous_env(rank: int, world_size: int, port: int) -> None:
    """The environment ``init_process_group`` reads (``env://``), for this worker's rank."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )


def _init(rank: int, world_size: int, port: int, *, backend: str = "gloo", **kwargs: Any) -> None:
    """Join the job's process group on 127.0.0.1 (``kwargs`` go to ``init_process_group``)."""
    import torch.distributed as dist

    rendezvous_env(rank, world_size, port)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=60), **kwargs
    )


@contextlib.contextmanager
def process_group(rank: int, world_size: int, port: int, **kwargs: Any) -> Iterator[None]:
    """:func:`_init` for the block, and the group destroyed when it ends, however it ends."""
    import torch.distributed as dist

    _init(rank, world_size, port, **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank_state(world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    values = full_values()
    return {
        "sharded": distribute_tensor(values["sharded"], mesh, [Shard(0)]),
        "replicated_dt": distribute_tensor(values["replicated_dt"], mesh, [Replicate()]),
        "plain": values["plain"].clone(),
        "meta": copy.deepcopy(values["meta"]),
    }


def _mutate(state: dict[str, Any]) -> None:
    """What a training step would do once staging is complete: change every tensor in place."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for value in state.values():
            if isinstance(value, DTensor):
                value.to_local().add_(1000)
            elif isinstance(value, torch.Tensor):
                value.add_(1000)
    state["meta"]["step"] = -1


def _save(mode: str, state: dict[str, Any], path: Path) -> dict[str, Any]:
    """Save ``state`` with one of the three entry points; returns what the caller observed."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter, async_save

    if mode == "sync":
        dcp.save(state, storage_writer=DataStatesWriter(path))
        return {"mutated_after_staging": False}
    if mode == "dcp_async":
        writer = DataStatesWriter(path)
        upload = dcp.async_save(state, storage_writer=writer)
        staging = writer.staging_future
        assert staging is not None, "stage() was not called by dcp.async_save"
    elif mode == "ours":
        response = async_save(state, path)
        staging, upload = response.staging_completion, response.upload_completion
    elif mode == "ours_warm":  # warm_up on DTensor shards, then a save with that writer
        writer = DataStatesWriter(path)
        writer.warm_up(state)
        response = async_save(state, writer)
        staging, upload = response.staging_completion, response.upload_completion
        staging.result(timeout=FUTURE_TIMEOUT_S)
        _mutate(state)
        upload.result(timeout=FUTURE_TIMEOUT_S)
        replays = writer._staging.captures.replays
        writer.close()
        return {"mutated_after_staging": True, "replays": replays}
    else:
        raise ValueError(mode)
    staging.result(timeout=FUTURE_TIMEOUT_S)
    _mutate(state)
    upload.result(timeout=FUTURE_TIMEOUT_S)
    return {"mutated_after_staging": True}


def _scenario_save(
    mode: str, rank: int, world_size: int, port: int, workdir: Path
) -> dict[str, Any]:
    import torch.distributed as dist

    _init(rank, world_size, port)
    try:
        report = _save(mode, _rank_state(world_size), workdir / "ckpt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return report


def _scenario_load(reader: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    """Load a checkpoint saved by ONE process into DTensors sharded over ``world_size`` ranks
    (rows, and columns: a non-contiguous local target); report what differs from the saved values.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dcp_datastates import DataStatesReader

    _init(rank, world_size, port)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        values = full_values()
        blank = empty_like_values(values)
        target = {
            "sharded": distribute_tensor(blank["sharded"], mesh, [Shard(0)]),
            "replicated_dt": distribute_tensor(blank["replicated_dt"], mesh, [Replicate()]),
            "plain": distribute_tensor(blank["plain"], mesh, [Shard(1)]),
            "meta": blank["meta"],
        }
        path = workdir / "ckpt"
        if reader == "stock":
            dcp.load(target, checkpoint_id=path)
        else:
            dcp.load(target, storage_reader=DataStatesReader(path))
        differs = []
        for fqn in ("sharded", "replicated_dt", "plain"):
            expected = distribute_tensor(values[fqn], mesh, target[fqn].placements).to_local()
            if not torch.equal(target[fqn].to_local(), expected):
                differs.append(fqn)
        if target["meta"] != values["meta"]:
            differs.append("meta")
        local_shapes = {k: list(target[k].to_local().shape) for k in ("sharded", "plain")}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"differs": differs, "local_shapes": local_shapes}


def _failing_writer_class(armed: list[bool] | None = None) -> type:
    """A ``DataStatesWriter`` whose data files fail after their first write, like a failing
    device would; only while ``armed[0]`` when ``armed`` is given (so a retry can succeed)."""
    from dcp_datastates import DataStatesWriter
    from dcp_datastates.format import DATA_SUFFIX
    from dcp_datastates.storage.base import LocalStorage

    class _FailingFile:
        def __init__(self, f: Any) -> None:
            self._f = f
            self._writes = 0

        def write(self, data: Any) -> int:
            self._writes += 1
            if self._writes > 1:  # the first record's head lands, then the device "fails"
                raise OSError(errno.EIO, INJECTED)
            return self._f.write(data)

    class FailingStorage(LocalStorage):
        @contextlib.contextmanager
        def open_write(self, name: str, *, sync: bool) -> Iterator[Any]:
            with super().open_write(name, sync=sync) as f:
                failing = armed is None or armed[0]
                yield _FailingFile(f) if failing and name.endswith(DATA_SUFFIX) else f

    class FailingWriter(DataStatesWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            save = self._save()
            save.storage = FailingStorage(save.storage.root)
            return super().write_data(plan, planner)

    return FailingWriter


def _scenario_fail(
    mode: str, rank: int, world_size: int, port: int, workdir: Path
) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter, async_save

    _init(rank, world_size, port)
    path = workdir / "ckpt"
    writer = _failing_writer_class()(path) if rank == 1 else DataStatesWriter(path)
    state = _rank_state(world_size)
    start = time.monotonic()
    if mode == "dcp_async":
        upload = dcp.async_save(state, storage_writer=writer)
    else:
        upload = async_save(state, writer).upload_completion
    report: dict[str, Any] = {"failed": False}
    try:
        upload.result(timeout=FUTURE_TIMEOUT_S)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        failures = getattr(exc, "failures", None) or {}
        report = {
            "failed": True,
            "type": type(exc).__name__,
            "is_exception": isinstance(exc, Exception),
            "message": str(exc),
            "failed_ranks": sorted(int(r) for r in failures),
            # DCP keeps (exception, stack) pairs; our CheckpointSaveError keeps the exceptions.
            "failure_types": {
                str(r): type(e[0] if mode == "dcp_async" else e).__name__
                for r, e in failures.items()
            },
        }
    report["seconds"] = time.monotonic() - start
    dist.barrier()
    dist.destroy_process_group()
    return report


def _scenario_process(rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    """One rank saves through DCP's PROCESS executor (a daemon); mutates right after staging."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import (
        AsyncCheckpointerType,
        AsyncSaveResponse,
    )

    from dcp_datastates import DataStatesWriter, async_save

    _init(rank, world_size, port)
    report: dict[str, Any] = {}
    try:
        for mode in ("dcp_async", "ours"):
            state = full_values()
            path = workdir / mode
            kind = AsyncCheckpointerType.PROCESS
            if mode == "dcp_async":  # compressed: the daemon's writer gets the transforms
                from torch.distributed.checkpoint._extension import ZStandard

                writer = DataStatesWriter(path, _extensions=[ZStandard()])
                response = dcp.async_save(
                    state, storage_writer=writer, async_checkpointer_type=kind
                )
            else:
                response = async_save(state, path, async_checkpointer_type=kind)
            report[f"{mode}_response"] = type(response).__name__
            assert isinstance(response, AsyncSaveResponse)
            response.staging_completion.result(timeout=FUTURE_TIMEOUT_S)
            _mutate(state)
            response.upload_completion.result(timeout=FUTURE_TIMEOUT_S)
        # Proof the save ran in DCP's checkpoint daemon, not on a thread of this process.
        report["daemon_pids"] = [p.pid for p in multiprocessing.active_children()]
    finally:
        dist.destroy_process_group()
    return report


def run_worker(argv: list[str], run: Callable[[str, int, int, int, Path], dict]) -> int:
    """A worker process's body, shared by every ``tests/_*_workers.py``: parse ``scenario rank
    world_size port workdir``, run ``run`` with them, and write its report (or the traceback)
    to ``workdir/rank{rank}.json``, which the test reads. Returns the exit code."""
    scenario, rank, world_size, port, workdir = (
        argv[0],
        int(argv[1]),
        int(argv[2]),
        int(argv[3]),
        Path(argv[4]),
    )
    try:
        report = run(scenario, rank, world_size, port, workdir)
        report["ok"] = True
    except BaseException:
        traceback.print_exc()
        report = {"ok": False, "traceback": traceback.format_exc()}
    (workdir / f"rank{rank}.json").write_text(json.dumps(report))
    return 0 if report["ok"] else 1


def exit_without_teardown(code: int) -> NoReturn:
    """Exit a worker whose report is written and process groups destroyed. What is left is
    interpreter teardown, where torch's gloo threads can still abort the process ("terminate
    called without an active exception", pytorch/pytorch#190489); it hit one CI run after a clean
    report. The tests judge the report and the files, not torch's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _scenario(scenario: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    if scenario.startswith("save-"):
        return _scenario_save(scenario[5:], rank, world_size, port, workdir)
    if scenario.startswith("load-"):
        return _scenario_load(scenario[5:], rank, world_size, port, workdir)
    if scenario.startswith("fail-"):
        return _scenario_fail(scenario[5:], rank, world_size, port, workdir)
    if scenario == "process":
        return _scenario_process(rank, world_size, port, workdir)
    raise ValueError(f"unknown scenario {scenario!r}")


if __name__ == "__main__":  # the guard also keeps DCP's spawned daemon from re-running a scenario
    code = run_worker(sys.argv[1:], _scenario)
    if sys.argv[1] == "process":
        # Normal teardown is part of what this scenario checks: DCP's daemon must not outlive us.
        sys.exit(code)
    exit_without_teardown(code)
