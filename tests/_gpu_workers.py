"""GPU worker processes (``python _gpu_workers.py SCENARIO RANK WORLD PORT DIR``), run through
``_dist_workers.launch(script=__file__)``: each rank uses its own GPU and a
``cpu:gloo,cuda:nccl`` process group, and reports what it saw in ``DIR/rank{RANK}.json``
(``_dist_workers.run_worker``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_workers import exit_without_teardown, process_group, run_worker  # noqa: E402

TIMEOUT_S = 60.0


def dtensor_nccl(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    """A sharded and a replicated DTensor on CUDA, saved with our writer, loaded with our reader."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dcp_datastates import DataStatesReader, DataStatesWriter, async_save

    mesh = init_device_mesh("cuda", (world,))
    g = torch.Generator().manual_seed(7)
    full = torch.randn(64 * world, 33, generator=g)
    replicated = torch.randn(5, generator=g, dtype=torch.float64)
    state = {
        "sharded": distribute_tensor(full.cuda(), mesh, [Shard(0)]),
        "replicated": distribute_tensor(replicated.cuda(), mesh, [Replicate()]),
        "step": 3,
    }
    path = workdir / "ckpt"
    writer = DataStatesWriter(path)
    try:
        response = async_save(state, writer, checkpoint_id=str(path))
        response.staging_completion.result(timeout=TIMEOUT_S)
        response.upload_completion.result(timeout=TIMEOUT_S)
    finally:
        writer.close()
    target = {
        "sharded": distribute_tensor(torch.zeros_like(full).cuda(), mesh, [Shard(0)]),
        "replicated": distribute_tensor(torch.zeros_like(replicated).cuda(), mesh, [Replicate()]),
        "step": 0,
    }
    dcp.load(target, storage_reader=DataStatesReader(path), checkpoint_id=str(path))
    return {
        "sharded_equal": torch.equal(target["sharded"].full_tensor().cpu(), full),
        "replicated_equal": torch.equal(target["replicated"].full_tensor().cpu(), replicated),
        "step": target["step"],
        "device": torch.cuda.current_device(),
    }


SCENARIOS = {"dtensor_nccl": dtensor_nccl}


def _scenario(scenario: str, rank: int, world: int, port: int, workdir: Path) -> dict[str, Any]:
    torch.cuda.set_device(rank)
    with process_group(
        rank, world, port, backend="cpu:gloo,cuda:nccl", device_id=torch.device("cuda", rank)
    ):
        return SCENARIOS[scenario](rank, world, workdir)


if __name__ == "__main__":
    exit_without_teardown(run_worker(sys.argv[1:], _scenario))
