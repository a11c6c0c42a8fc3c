"""A training loop with a :class:`TieredCheckpointer` on several ranks, run as real processes by
the tier tests: ``python _tiers_workers.py train RANK WORLD PORT DIR`` (``_dist_workers.launch``).

Every rank joins a gloo group, all-reduces a tensor each step on the default group (the
training's collective), and saves each step through one checkpointer into ``DIR/local`` (shared
by the ranks) mirrored to ``$TIERS_REMOTE`` (S3 options from ``$TIERS_ENDPOINT``). The report
lists what each save's ``remote`` resolved to and, on rank 0, the steps each tier holds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_workers import FUTURE_TIMEOUT_S, _init, exit_without_teardown, run_worker  # noqa: E402

from dcp_datastates.checkpointers.tiers import Tier, TieredCheckpointer  # noqa: E402

STEPS = 6


def rank_values(rank: int, step: int) -> torch.Tensor:
    return torch.full((64, 256), float(100 * rank + step))


def _train(rank: int, world_size: int, port: int, workdir: Path) -> dict[str, Any]:
    _init(rank, world_size, port)
    options = {"endpoint_url": os.environ["TIERS_ENDPOINT"], "key": "testing", "secret": "testing"}
    tiers = TieredCheckpointer(
        Tier(url=str(workdir / "local"), keep=2),
        Tier(url=os.environ["TIERS_REMOTE"], keep=None, storage_options=options),
        host_pool_bytes=4 << 20,
    )
    remote: list[Any] = []
    try:
        handles = []
        for step in range(1, STEPS + 1):
            grad = torch.ones(4)
            dist.all_reduce(grad)  # the training's own collective, on the default group
            assert grad[0].item() == world_size
            handle = tiers.save({f"rank{rank}": rank_values(rank, step), "step": step}, step)
            handle.staged.result(FUTURE_TIMEOUT_S)
            handles.append(handle)
        for handle in handles:
            remote.append(handle.remote.result(FUTURE_TIMEOUT_S))
        tiers.wait()
        held = {}
        if rank == 0:
            held = {t.url: tiers.committed_steps(t) for t in tiers.tiers}
        else:
            try:
                tiers.retain(tiers.local)
            except ValueError as exc:
                held = {"retain": str(exc)}
        target = {f"rank{rank}": torch.zeros(64, 256), "step": 0}
        loaded = tiers.load(target, step=3)  # every rank, from the remote: local keeps 2
        assert loaded == 3 and target["step"] == 3
        assert torch.equal(target[f"rank{rank}"], rank_values(rank, 3))
        try:
            tiers.load(target, step=99)  # in no tier: every rank raises, none waits
            missing = ""
        except FileNotFoundError as exc:
            missing = str(exc)
    finally:
        tiers.close()
    dist.destroy_process_group()
    return {"remote": remote, "held": held, "missing": missing}


def _scenario(scenario: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    if scenario == "train":
        return _train(rank, world_size, port, workdir)
    raise ValueError(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    exit_without_teardown(run_worker(sys.argv[1:], _scenario))
