"""Incremental saves on several ranks, run as real processes by ``test_incremental.py``:
``python _incremental_workers.py ranks RANK WORLD PORT DIR`` (``_dist_workers.launch``).

Each rank holds a frozen tensor of its own and a changing one, and both ranks hold a frozen
replicated tensor (DCP gives it to one rank). Three saves: each rank reports the files it
linked and the bytes it wrote; then the older checkpoints are removed and each rank loads the
newest alone with stock ``FileSystemReader``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_workers import _init, exit_without_teardown, run_worker  # noqa: E402

from dcp_datastates import DataStatesWriter  # noqa: E402
from dcp_datastates.format import LINKED_DATA  # noqa: E402


def _ranks(rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    _init(rank, world_size, port)
    frozen = torch.full((128, 256), float(rank + 1))
    shared = torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256)
    adapter = torch.zeros(8, 8)
    writer = DataStatesWriter(workdir, incremental=True, flush_workers=1)
    report: dict[str, Any] = {"linked": [], "written": []}
    for step in range(3):
        adapter.add_(1.0)
        state = {f"frozen.{rank}": frozen, "shared": shared, f"adapter.{rank}": adapter}
        path = workdir / f"s{step}"
        dcp.save(state, storage_writer=writer, checkpoint_id=path)
        assert writer.last_stats is not None
        report["written"].append(writer.last_stats.bytes_written)
        dist.barrier()
        names = sorted(n for n in os.listdir(path) if LINKED_DATA.match(n))
        report["linked"].append([n for n in names if n.startswith(f"__{rank}_")])
    writer.close()
    dist.barrier()
    if rank == 0:
        for step in (0, 1):
            shutil.rmtree(workdir / f"s{step}")
    dist.barrier()
    out = {f"frozen.{rank}": torch.zeros_like(frozen), "shared": torch.zeros_like(shared)}
    out[f"adapter.{rank}"] = torch.zeros_like(adapter)
    dcp.load(out, storage_reader=dcp.FileSystemReader(workdir / "s2"))
    report["loaded_ok"] = (
        torch.equal(out[f"frozen.{rank}"], frozen)
        and torch.equal(out["shared"], shared)
        and torch.equal(out[f"adapter.{rank}"], adapter)
    )
    dist.destroy_process_group()
    return report


def _scenario(scenario: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    if scenario == "ranks":
        return _ranks(rank, world_size, port, workdir)
    raise ValueError(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    exit_without_teardown(run_worker(sys.argv[1:], _scenario))
