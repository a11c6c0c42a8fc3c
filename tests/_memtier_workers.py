"""A training loop with a :class:`Checkpointer` and a memory tier, run as real processes.

``python _memtier_workers.py train RANK WORLD PORT DIR`` (the arguments of
``_dist_workers.launch``). Settings come from the environment (``MT_*``, see ``_settings``).
Every step prints ``step N digest D latest L``; a load prints ``resumed S digest D``; a flush
to disk held by ``MT_BLOCK_FLUSH`` prints ``flush blocked S`` and then never ends, so that the
test can SIGKILL every rank while the step is committed in memory and not on disk.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _checkpointer_workers import App, Model, digest, say, train_step  # noqa: E402
from _dist_workers import _init, run_worker  # noqa: E402

from dcp_datastates.checkpointers.checkpointer import Checkpointer, step_dir_name  # noqa: E402
from dcp_datastates.checkpointers.memflush import Flusher  # noqa: E402
from dcp_datastates.checkpointers.memory import MemoryTier  # noqa: E402
from dcp_datastates.storage.base import LocalStorage, Storage  # noqa: E402


def _settings() -> dict[str, Any]:
    e = os.environ
    return {
        "base": e["MT_BASE"],
        "every": int(e.get("MT_EVERY", "5")),
        "max_steps": int(e.get("MT_MAX_STEPS", "12")),
        "block": int(e.get("MT_BLOCK_FLUSH", "-1")),  # the step whose flush to disk never ends
        "job": e.get("MT_JOB") or None,
        "nodes": e.get("MT_NODES", ""),  # "a,b": rank r runs on simulated node r's entry
        "peers": int(e.get("MT_PEERS", "0")),  # peer_distance
    }


class _HeldStorage(LocalStorage):
    """The durable step directory of the held step: every rank's copy starts by making it."""

    def makedirs(self) -> None:
        say(f"flush blocked {os.path.basename(self.root)}")
        threading.Event().wait()  # until SIGKILL


class HeldFlusher(Flusher):
    """Fault injection by subclassing the real flush: the copy of one step never starts."""

    held = ""

    def storage(self, path: str) -> Storage:
        if os.path.basename(path).split(".")[0] == self.held:
            return _HeldStorage(path)
        return super().storage(path)


class HeldCheckpointer(Checkpointer):
    flusher_class = HeldFlusher


def _train(rank: int, world: int, port: int, workdir: Path) -> dict[str, Any]:
    cfg = _settings()
    if world > 1:
        _init(rank, world, port)
    HeldFlusher.held = step_dir_name(cfg["block"]) if cfg["block"] >= 0 else ""
    report: dict[str, Any] = {"digests": {}}
    model = Model()
    app = App(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    node = cfg["nodes"].split(",")[rank] if cfg["nodes"] else None
    tier = MemoryTier(base=cfg["base"], job_id=cfg["job"], node=node, peer_distance=cfg["peers"])
    ck = HeldCheckpointer(
        workdir / "ckpt", every_steps=cfg["every"], preemption_signals=(), memory=tier
    )
    try:
        start = ck.load_latest({"app": app})
        report["resumed"] = start
        say(f"resumed {start} digest {digest(app)}")
        step = start or 0
        while step < cfg["max_steps"]:
            step += 1
            train_step(app, step, world)
            report["digests"][step] = digest(app)
            say(f"step {step} digest {report['digests'][step]} latest {ck.latest_step()}")
            ck.maybe_save(step, {"app": app})
        ck.close()
        report["memory_bytes"] = ck.memory_bytes
    finally:
        if world > 1:
            dist.destroy_process_group()
    return report


def _scenario(scenario: str, rank: int, world: int, port: int, workdir: Path) -> dict[str, Any]:
    if scenario != "train":
        raise ValueError(f"unknown scenario {scenario!r}")
    return _train(rank, world, port, workdir)


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1:], _scenario))
