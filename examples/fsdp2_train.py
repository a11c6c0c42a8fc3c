"""FSDP2 training with asynchronous checkpoints through dcp_datastates, resumable bit for bit.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --ckpt-dir /tmp/fsdp2 --steps 20
    torchrun --nproc-per-node 2 examples/fsdp2_train.py --ckpt-dir /tmp/fsdp2 --steps 30 --resume

Rank 0 prints the loss every ``--log-every`` steps, each checkpoint it starts, and where a run
resumed from (``resumed from step 20``); ``--report FILE`` also writes the losses and state
digests as JSON.

The model is sharded with ``fully_shard``; its state and the optimizer's go through
``get_state_dict`` / ``set_state_dict`` inside a ``Stateful`` app state; every ``--save-every``
steps ``dcp_datastates.async_save`` snapshots it lazily (training goes on; only the next
``optimizer.step()`` may wait) with one ``DataStatesWriter`` reused across saves. A checkpoint
saved on N ranks loads on M ranks: DCP reshards on load.

On CPU it runs as is with gloo: the device mesh is ``"cpu"`` and nothing else changes (FSDP2's
all-gather and reduce-scatter run on gloo in torch 2.13). On GPUs, use ``--backend
cpu:gloo,cuda:nccl`` (async saves need a CPU-capable group).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcp_datastates
from dcp_datastates import DataStatesReader, DataStatesWriter

DIM, DEPTH, GLOBAL_BATCH = 32, 3, 16


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def build_model(mesh: Any) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and every world size
    model = torch.nn.Sequential(*[Block(DIM) for _ in range(DEPTH)], torch.nn.Linear(DIM, 1))
    for block in model[:DEPTH]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class AppState(Stateful):
    """What a checkpoint holds: model and optimizer (sharded, through get/set_state_dict) and
    the step. DCP calls ``state_dict()`` when a save starts and ``load_state_dict()`` on load."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim, self.step = model, optim, 0

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.step = state_dict["step"]


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the step's global batch (a function of the step only)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def full_state_digest(app: AppState) -> str:
    """A hash of the whole (unsharded) model and optimizer state: the same for any world size."""
    opts = StateDictOptions(full_state_dict=True)
    h = hashlib.sha256()
    for name, t in sorted(get_model_state_dict(app.model, options=opts).items()):
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    osd = get_optimizer_state_dict(app.model, app.optim, options=opts)
    for name, st in sorted(osd["state"].items()):
        for key, v in sorted(st.items()):
            data = v.contiguous().view(torch.uint8).numpy().tobytes() if v.dim() else repr(v)
            h.update(
                f"{name}.{key}".encode() + (data if isinstance(data, bytes) else data.encode())
            )
    return h.hexdigest()[:16]


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def newest_checkpoint(root: str) -> str | None:
    """The newest committed checkpoint (one whose ``.metadata`` exists) under ``root``."""
    if not os.path.isdir(root):
        return None
    found = [
        n
        for n in os.listdir(root)
        if re.fullmatch(r"step_\d+", n) and os.path.exists(os.path.join(root, n, ".metadata"))
    ]
    return os.path.join(root, max(found)) if found else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=20, help="train until this step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--resume", action="store_true", help="load the newest checkpoint first")
    p.add_argument("--resume-from", help="load this checkpoint directory first")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    p.add_argument("--report", help="write losses and state digests here (JSON, rank 0)")
    args = p.parse_args(argv)
    for flag, value in (("--save-every", args.save_every), ("--log-every", args.log_every)):
        if value < 1:
            p.error(f"{flag} must be at least 1, got {value}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    # DCP's save thread runs collectives while training runs its own: give it its own group.
    ckpt_group = dist.new_group(backend="gloo")
    model = build_model(mesh)
    app = AppState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    report: dict[str, Any] = {"world": world, "losses": {}, "saved": {}}

    def say(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    source = args.resume_from or (newest_checkpoint(args.ckpt_dir) if args.resume else None)
    if source:
        dcp.load({"app": app}, storage_reader=DataStatesReader(source), process_group=ckpt_group)
        report["resumed"] = {"from": source, "step": app.step, "digest": full_state_digest(app)}
        say(f"resumed from step {app.step} ({source}) on {world} rank(s)")
    elif args.resume:
        say(f"no committed checkpoint in {args.ckpt_dir}: starting from step 0")

    writer = DataStatesWriter(args.ckpt_dir)  # one writer for the whole run: it owns the pool
    upload = None
    while app.step < args.steps:
        app.step += 1
        x, y = batch(app.step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        app.optim.step()  # waits for an in-flight snapshot, if any (the optimizer guard)
        app.optim.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        report["losses"][app.step] = (global_loss / world).item()
        if app.step % args.log_every == 0 or app.step == args.steps:
            say(f"step {app.step}  loss {report['losses'][app.step]:.6f}")
        if app.step % args.save_every == 0:
            if upload is not None:
                upload.result()  # one save in flight at a time
            report["saved"][app.step] = full_state_digest(app)
            path = step_dir(args.ckpt_dir, app.step)
            upload = dcp_datastates.async_save(
                {"app": app}, writer, checkpoint_id=path, process_group=ckpt_group
            ).upload_completion
            say(f"step {app.step}  saving checkpoint {path} in the background")
    if upload is not None:
        upload.result()
    writer.close()
    report["final"] = full_state_digest(app)
    newest = max(report["saved"], default=None)  # committed: its upload has completed
    say(
        f"done at step {app.step}"
        + (f"; checkpoint {step_dir(args.ckpt_dir, newest)} committed" if newest else "")
    )
    if args.report and rank == 0:
        with open(args.report, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
