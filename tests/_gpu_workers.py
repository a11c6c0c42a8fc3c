"""GPU worker processes (``python _gpu_workers.py SCENARIO RANK WORLD PORT DIR``), run through
``_dist_workers.launch(script=__file__)``: each rank uses its own GPU and a
``cpu:gloo,cuda:nccl`` process group, and reports what it saw in ``DIR/rank{RANK}.json``."""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

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


def main(argv: list[str]) -> int:
    scenario, rank, world, port, workdir = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4]
    report: dict[str, Any] = {"ok": False}
    try:
        torch.cuda.set_device(rank)
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world)
        )
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=TIMEOUT_S),
            device_id=torch.device("cuda", rank),
        )
        report.update(SCENARIOS[scenario](rank, world, Path(workdir)))
        report["ok"] = True
    except BaseException:
        report["error"] = traceback.format_exc()
    finally:
        (Path(workdir) / f"rank{rank}.json").write_text(json.dumps(report))
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # see _dist_workers.py: torch's teardown threads may abort a clean exit
