"""Two-rank DCP scenarios for ``test_conformance.py``, run with the stock classes or with ours.

``python _conformance_workers.py IMPL RANK WORLD PORT DIR`` (``IMPL`` is ``stock`` or ``ours``;
started by ``_dist_workers.launch``). One launch runs every scenario in turn, so that the suite
pays for two process groups, not one per scenario. Each scenario saves with IMPL's writer and
loads with BOTH readers; the report says, per scenario and reader, which values came back
different from what was saved (the test asserts none, for both implementations).
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _dist_workers import (  # noqa: E402
    FUTURE_TIMEOUT_S,
    _init,
    exit_without_teardown,
    full_values,
    run_worker,
)


def writer_for(impl: str, path: Path, **kwargs: Any) -> Any:
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesWriter

    return (dcp.FileSystemWriter if impl == "stock" else DataStatesWriter)(path, **kwargs)


def reader_for(impl: str, path: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    from dcp_datastates import DataStatesReader

    return (dcp.FileSystemReader if impl == "stock" else DataStatesReader)(path)


def _state(mesh: Any, seed: int, shard_dim: int = 0) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    values = full_values(seed)
    return {
        "sharded": distribute_tensor(values["sharded"], mesh, [Shard(shard_dim)]),
        "replicated_dt": distribute_tensor(values["replicated_dt"], mesh, [Replicate()]),
        "plain": values["plain"].clone(),
        "meta": dict(values["meta"]),
        "losses": io.BytesIO(f"losses-{seed}".encode()),
    }


def _blank(mesh: Any, shard_dim: int = 0) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    values = full_values()
    return {
        "sharded": distribute_tensor(torch.zeros_like(values["sharded"]), mesh, [Shard(shard_dim)]),
        "replicated_dt": distribute_tensor(
            torch.zeros_like(values["replicated_dt"]), mesh, [Replicate()]
        ),
        "plain": torch.zeros_like(values["plain"]),
        "meta": {"step": 0, "tag": "", "lrs": []},
        "losses": io.BytesIO(),
    }


def _differs(loaded: dict[str, Any], seed: int) -> list[str]:
    from torch.distributed.tensor import DTensor

    values = full_values(seed)
    out = []
    for fqn in ("sharded", "replicated_dt", "plain"):
        got = loaded[fqn]
        full = got.full_tensor() if isinstance(got, DTensor) else got
        if not torch.equal(full, values[fqn]):
            out.append(fqn)
    if loaded["meta"] != values["meta"]:
        out.append("meta")
    if loaded["losses"].getvalue() != f"losses-{seed}".encode():
        out.append("losses")
    return out


def _load_both(mesh: Any, path: Path, seed: int, shard_dim: int = 0) -> dict[str, list[str]]:
    import torch.distributed.checkpoint as dcp

    out = {}
    for reader in ("stock", "ours"):
        target = _blank(mesh, shard_dim)
        dcp.load(target, storage_reader=reader_for(reader, path))
        out[reader] = _differs(target, seed)
    return out


def _local(rank: int) -> dict[str, Any]:
    """What one rank saves on its own with ``use_collectives=False``: values differ per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return {
        "w": torch.randn(4, 3, generator=g),
        "step": torch.tensor(rank),
        "note": {"rank": rank},
        "buf": io.BytesIO(f"rank-{rank}".encode()),
    }


def _run(impl: str, rank: int, world_size: int, workdir: Path) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    report: dict[str, Any] = {}

    # Sync save; loaded resharded (rows saved, columns loaded) by both readers.
    path = workdir / "sync"
    dcp.save(_state(mesh, 1), storage_writer=writer_for(impl, path))
    report["sync"] = _load_both(mesh, path, 1)
    report["sync_resharded"] = _load_both(mesh, path, 1, shard_dim=1)

    # Compressed (ZStandard, a stream transform: the test extra has zstandard); loaded resharded.
    from torch.distributed.checkpoint._extension import ZStandard

    path = workdir / "zstd"
    dcp.save(_state(mesh, 3), storage_writer=writer_for(impl, path, _extensions=[ZStandard()]))
    report["zstd_resharded"] = _load_both(mesh, path, 3, shard_dim=1)

    # dcp.async_save; the state changes in place as soon as the save is staged.
    path = workdir / "async"
    state = _state(mesh, 2)
    writer = writer_for(impl, path)
    fut = dcp.async_save(state, storage_writer=writer)
    staging = getattr(writer, "staging_future", None)  # stock has staged on return
    if staging is not None:
        staging.result(timeout=FUTURE_TIMEOUT_S)
    with torch.no_grad():
        state["sharded"].to_local().add_(1000)
        state["plain"].add_(1000)
    state["meta"]["step"] = -1  # (not the BytesIO: stock's staging keeps it by reference)
    fut.result(timeout=FUTURE_TIMEOUT_S)
    report["async"] = _load_both(mesh, path, 2)

    # Repeated async saves with plan caching: each checkpoint holds its own values.
    writer = writer_for(impl, workdir / "cached0")
    for i in range(3):
        path = workdir / f"cached{i}"
        planner = DefaultSavePlanner(enable_plan_caching=True)
        dcp.async_save(
            _state(mesh, 10 + i), checkpoint_id=path, storage_writer=writer, planner=planner
        ).result(timeout=FUTURE_TIMEOUT_S)
    for i in range(3):
        report[f"cached{i}"] = _load_both(mesh, workdir / f"cached{i}", 10 + i)
    if hasattr(writer, "close"):
        writer.close()
    dist.barrier()

    # use_collectives=False: each rank saves its own state, commits __{rank}.metadata, and
    # loads it back (dcp.load falls back to that record when there is no .metadata).
    path = workdir / "nocoll"
    dcp.save(_local(rank), storage_writer=writer_for(impl, path), use_collectives=False)
    dist.barrier()
    expected = _local(rank)
    got = {}
    for reader in ("stock", "ours"):
        target = {
            "w": torch.zeros(4, 3),
            "step": torch.tensor(-1),
            "note": {"rank": -1},
            "buf": io.BytesIO(),
        }
        dcp.load(target, storage_reader=reader_for(reader, path))
        got[reader] = [
            k
            for k in ("w", "step")
            if not torch.equal(target[k], expected[k])  # type: ignore[arg-type]
        ] + [k for k in ("note",) if target[k] != expected[k]]
        if target["buf"].getvalue() != expected["buf"].getvalue():
            got[reader].append("buf")
    report["nocoll"] = got
    report["nocoll_files"] = sorted(os.listdir(path))
    dist.barrier()
    return report


def _scenario(impl: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    import torch.distributed as dist

    _init(rank, world_size, port)
    try:
        return _run(impl, rank, world_size, workdir)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_without_teardown(run_worker(sys.argv[1:], _scenario))
