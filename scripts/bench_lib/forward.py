"""The forward-updated-state scenario: an unmodified loop over a BatchNorm model with an EMA hook.

The model is ``blocks`` x (Linear, BatchNorm1d, ReLU) and a head; a forward hook keeps an EMA of
the first weight and a call counter in buffers, so forward updates BatchNorm statistics, the EMA
and the counter in place. The loop checkpoints with ``dcp_datastates.async_save`` and at once runs
the next forward, backward and ``optimizer.step()``; it waits for the previous save before the
next one. Each system is one way to protect what forward updates:

* ``ours default``: the forward gate and small tensors copied during ``stage()``;
* ``ours eager only``: ``guard_forward=False`` (small tensors only);
* ``ours gate only``: ``eager_copy_bytes=0`` (the forward gate only);
* ``ours unprotected``: both off (the behaviour before the forward gate).

Per system: how many saves committed, and every committed one is loaded back and compared with a
copy of the state taken at the call (``correct``); the time ``async_save`` blocked; the first
forward after the call next to a forward with no save in flight (what the gate costs); the bytes
copied during ``stage()`` and by the gate.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from dcp_datastates import DataStatesReader, DataStatesWriter, async_save

from .common import Recorder, fresh_dir, log

SYSTEMS: dict[str, dict[str, Any]] = {
    "ours default": {},
    "ours eager only": {"guard_forward": False},
    "ours gate only": {"eager_copy_bytes": 0},
    "ours unprotected": {"guard_forward": False, "eager_copy_bytes": 0},
}


class BNNet(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Linear(width, 16))
        self.register_buffer("ema", self.body[0].weight.detach().clone())
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_forward_hook(BNNet._ema_hook)

    @staticmethod
    def _ema_hook(module: BNNet, args: Any, out: torch.Tensor) -> None:
        with torch.no_grad():
            module.ema.lerp_(module.body[0].weight, 0.01)
            module.calls.add_(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _expected(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in sd["model"].items()},
        "optim": {"state": copy.deepcopy(sd["optim"]["state"])},
    }


def _matches(path: Path, expected: dict[str, Any]) -> bool:
    target = {
        "model": {k: torch.zeros_like(v) for k, v in expected["model"].items()},
        "optim": {
            "state": {
                p: {
                    k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                    for k, v in s.items()
                }
                for p, s in expected["optim"]["state"].items()
            }
        },
    }
    dcp.load(target, storage_reader=DataStatesReader(path), no_dist=True)
    same = all(torch.equal(target["model"][k], v) for k, v in expected["model"].items())
    for p, s in expected["optim"]["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                same = same and torch.equal(target["optim"]["state"][p][k], v)
    return same


def run(rec: Recorder, *, workdir: Path, width: int, blocks: int, batch: int, saves: int) -> None:
    root = fresh_dir(workdir / "forward")
    torch.manual_seed(0)
    model = BNNet(width, blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)

    def forward_backward() -> float:
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        fwd = time.perf_counter() - t0
        loss.backward()
        return fwd

    def step() -> float:
        opt.zero_grad()
        fwd = forward_backward()
        opt.step()
        return fwd

    for _ in range(3):
        step()  # warm up, and create the optimizer state
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    plain = [step() for _ in range(5)]
    for system, options in SYSTEMS.items():
        writer = DataStatesWriter(root / "unused", **options)
        committed = correct = 0
        blocked: list[float] = []
        first: list[float] = []
        eager = frozen = 0
        gate_s = 0.0
        for n in range(saves):
            path = root / system.replace(" ", "_") / f"step_{n}"
            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            expected = _expected(sd)
            t0 = time.perf_counter()
            response = async_save(sd, writer, checkpoint_id=str(path), no_dist=True)
            blocked.append(time.perf_counter() - t0)
            first.append(step())  # the next forward, backward and step, right away
            step()
            try:
                response.upload_completion.result()
            except Exception:  # a torn snapshot is refused; that is what we count
                continue
            committed += 1
            correct += _matches(path, expected)
            stats = writer.last_stats
            eager += stats.eager_bytes
            frozen += stats.forward_frozen_bytes
            gate_s += stats.forward_blocked_s
        writer.close()
        rec.emit(
            "forward",
            system,
            {
                "blocked_s": statistics.median(blocked),
                "first_forward_s": statistics.median(first),
                "plain_forward_s": statistics.median(plain),
            },
            saves=saves,
            committed=committed,
            correct=correct,
            eager_bytes=eager // max(committed, 1),
            forward_frozen_bytes=frozen // max(committed, 1),
            forward_gate_s=gate_s / max(committed, 1),
            bytes=state_bytes,
            width=width,
            blocks=blocks,
        )
        log(f"forward: {system}: {committed}/{saves} committed, {correct} correct")
