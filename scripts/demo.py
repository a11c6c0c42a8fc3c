"""Train a small MLP with AdamW, checkpoint it asynchronously, restart from a checkpoint and check
that the resumed run is bit-exactly the uninterrupted one.

    python scripts/demo.py [--dir DIR] [--steps 40] [--every 10] [--reader {stock,datastates}]

One ``DataStatesWriter`` (and so one host pool) is reused for every save. Each save returns in
about a millisecond; the next ``optimizer.step()`` waits only if the snapshot is still copying,
and the flush overlaps the steps that follow. Runs on CPU in a few seconds, without
``torch.distributed`` being initialized. Exits with status 1 if the resumed run differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import dcp_datastates
from dcp_datastates import DataStatesReader, DataStatesWriter

SEED = 1234
BATCH, IN, HIDDEN, OUT = 64, 256, 1024, 16


def make_model_and_optimizer(init_seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(init_seed)
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, OUT),
    )  # about 1.3 M parameters: 5 MB of weights, 15 MB with AdamW's moments
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return model, optimizer


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data, a pure function of the step (so a resumed run sees the same)."""
    g = torch.Generator().manual_seed(SEED + step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 3) + 0.1 * torch.randn(BATCH, OUT, generator=g)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    x, y = batch(step)
    loss = nn.functional.mse_loss(model(x), y)  # dropout draws from the global RNG
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()  # waits here (the guard) only while a snapshot is still copying
    return loss.item()


def checkpoint_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "step": step,  # a Python object: serialized eagerly at stage time
        "rng": torch.get_rng_state(),  # a uint8 tensor: snapshotted like the weights
    }


def train(args: argparse.Namespace) -> tuple[list[float], nn.Module, list[str]]:
    """The uninterrupted reference run, checkpointing every ``args.every`` steps on the way."""
    model, optimizer = make_model_and_optimizer(SEED)
    writer = DataStatesWriter(args.dir)
    losses: list[float] = []
    saved: list[str] = []
    pending: Future[Any] | None = None

    def report(fut: Future[Any]) -> None:
        fut.result()  # raises CheckpointSaveError if the save failed
        assert writer.last_stats is not None
        print(f"  {writer.last_stats.summary()}")

    try:
        for step in range(args.steps):
            if step and step % args.every == 0:
                if pending is not None:  # the previous save flushed while we trained
                    report(pending)
                path = os.path.join(args.dir, f"step_{step}")
                start = time.perf_counter()
                response = dcp_datastates.async_save(
                    checkpoint_state(model, optimizer, step),
                    writer,
                    checkpoint_id=path,
                    no_dist=True,
                )
                blocked_ms = (time.perf_counter() - start) * 1e3
                print(f"step {step:3d}: async_save returned after {blocked_ms:.1f} ms -> {path}")
                pending = response.upload_completion
                saved.append(path)
            losses.append(train_step(model, optimizer, step))
        if pending is not None:
            report(pending)
    finally:
        writer.close()
    return losses, model, saved


def resume(args: argparse.Namespace, path: str) -> tuple[int, list[float], nn.Module]:
    """A fresh process would do this: new model and optimizer, load, continue."""
    model, optimizer = make_model_and_optimizer(SEED + 1)  # different weights until loaded
    state = checkpoint_state(model, optimizer, step=-1)
    reader = DataStatesReader(path) if args.reader == "datastates" else None
    start = time.perf_counter()
    dcp.load(state, checkpoint_id=path, storage_reader=reader, no_dist=True)
    print(f"loaded {path} with the {args.reader} reader in {time.perf_counter() - start:.3f}s")
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    torch.set_rng_state(state["rng"])
    first = state["step"]
    losses = [train_step(model, optimizer, step) for step in range(first, args.steps)]
    return first, losses, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--every", type=int, default=10, help="save every N steps (default 10)")
    parser.add_argument(
        "--reader",
        choices=("stock", "datastates"),
        default="stock",
        help="load with stock DCP (FileSystemReader) or DataStatesReader (default stock)",
    )
    args = parser.parse_args(argv)
    if not 0 < args.every < args.steps:
        parser.error(f"--every={args.every} must be between 1 and --steps={args.steps} - 1")
    torch.use_deterministic_algorithms(True)
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)

    with tempfile.TemporaryDirectory(prefix="dcp_datastates_demo_") as tmp:
        args.dir = args.dir or tmp
        print(f"training {args.steps} steps, saving every {args.every} to {args.dir}")
        t0 = time.perf_counter()
        ref_losses, ref_model, saved = train(args)
        print(
            f"reference run: {args.steps} steps in {time.perf_counter() - t0:.2f}s, "
            f"final loss {ref_losses[-1]:.6f}"
        )

        first, losses, model = resume(args, saved[-1])
        same_losses = losses == ref_losses[first:]
        ref_params, params = ref_model.state_dict(), model.state_dict()
        differing = [k for k in ref_params if not torch.equal(ref_params[k], params[k])]
        print(
            f"resumed at step {first}, ran {len(losses)} steps: losses "
            f"{'bit-exactly equal' if same_losses else 'DIFFER'}, parameters "
            f"{'bit-exactly equal' if not differing else 'DIFFER: ' + ', '.join(differing)}"
        )
    if not same_losses or differing:
        for step, (a, b) in enumerate(zip(ref_losses[first:], losses, strict=True), start=first):
            if a != b:
                print(f"  step {step}: reference {a!r}, resumed {b!r}", file=sys.stderr)
        return 1
    print("OK: the resumed run matches the uninterrupted run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
