"""The copy-on-write scenario: what the dispatch mode costs a training step, and what it buys a
loop that writes the weights right after a save (issue 38; ``snapshot/cow.py``).

The model is the train scenario's (``train.TinyLM``, AdamW), trained on throughout. Two parts:

- Step time, in paired cycles: each cycle runs one training step (forward+backward, then
  ``optimizer.step()``) per system, in an order that rotates every cycle. ``no snapshot``: a plain
  step. ``no snapshot, pass-through mode``: a plain step under a :class:`TorchDispatchMode` that
  only calls the operator (what a Python dispatch mode costs per operator). ``ours
  copy_on_write`` and ``ours copy_on_write=False``: the first step right after
  ``dcp_datastates.async_save`` (one writer each, the pool sized to the state, as in the train
  scenario), then the wait until that save is durable and one untimed step, so that the next
  system starts with nothing in flight. The mode runs on forward+backward until the snapshot's
  copies end (it is popped at the next module forward); the optimizer step holds the guard's
  wait for the snapshot. Forward+backward is also timed in the training thread's CPU, which
  the mode's Python calls add to whatever else takes the cores. A counting mode counts the aten
  operators of one forward+backward.
- EMA evaluation right after a save (torch_ema's ``store``, ``copy_to``, evaluate,
  ``restore``: ``p.data.copy_(shadow)`` then ``p.data.copy_(backup)``), with a host pool of a
  quarter of the state and the model last in the state, so its weights are not copied yet when
  evaluation writes them. ``ours copy_on_write``, ``ours copy_on_write=False`` and ``stock
  dcp.async_save`` (its default stager copies before returning) alternate save by save; every
  committed save is loaded back and compared with a clone of the state at the call. Per save:
  the time the call blocked, the evaluation right after it and one just before it, and the
  bytes copy-on-write copied and the time writes waited for it (``SaveStats.cow_bytes``,
  ``cow_blocked_s``).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from dcp_datastates import DataStatesReader, DataStatesWriter, async_save

from .common import Recorder, alternate, fresh_dir, log, now
from .train import TrainConfig, _Trainee

NONE = "no snapshot"
PASS_THROUGH = "no snapshot, pass-through mode"
COW = "ours copy_on_write"
NO_COW = "ours copy_on_write=False"
STOCK = "stock dcp.async_save"
STEP_SYSTEMS = [NONE, PASS_THROUGH, COW, NO_COW]
EMA_SYSTEMS = [COW, NO_COW, STOCK]
OPTIONS: dict[str, dict[str, Any]] = {COW: {}, NO_COW: {"copy_on_write": False}}


class _PassThrough(TorchDispatchMode):
    """Calls each operator and nothing else; with ``count``, counts them."""

    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.count = count
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.count:
            self.ops += 1
        return func(*args, **(kwargs or {}))


class _EMA:
    """torch_ema's ``ExponentialMovingAverage`` in the calls a loop makes: ``update`` after the
    optimizer step, ``store`` / ``copy_to`` / ``restore`` around an evaluation."""

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay = decay
        self.backup: list[torch.Tensor] = []

    def state(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow, strict=True))

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params, strict=True):
            s.sub_((1.0 - self.decay) * (s - p))

    def store(self) -> None:
        self.backup = [p.clone() for p in self.params]

    def copy_to(self) -> None:
        for s, p in zip(self.shadow, self.params, strict=True):
            p.data.copy_(s.data)

    def restore(self) -> None:
        for b, p in zip(self.backup, self.params, strict=True):
            p.data.copy_(b.data)
        self.backup = []


def _nbytes(tree: Any) -> int:
    return sum(t.nbytes for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _clone(tree: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


def _matches(path: Path, expected: dict[str, Any], reader: Any) -> bool:
    """Whether the checkpoint at ``path`` loads to ``expected``, tensor for tensor."""
    target = tree_map_only(torch.Tensor, torch.zeros_like, expected)
    dcp.load(target, storage_reader=reader(path), no_dist=True)
    got = [t for t in tree_leaves(target) if isinstance(t, torch.Tensor)]
    want = [t for t in tree_leaves(expected) if isinstance(t, torch.Tensor)]
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class _Bench:
    """One model trained on through both parts; writers reused across saves, as a job does."""

    def __init__(self, rec: Recorder, root: Path, cfg: TrainConfig) -> None:
        self.rec, self.root, self.cfg = rec, root, cfg
        self.trainee = _Trainee.make(cfg)
        for _ in range(3):
            self.trainee.step()  # the optimizer state, the allocator
        self.ops = self.count_ops()
        self.ema = _EMA(self.trainee.model)

    def count_ops(self) -> int:
        """Aten operators one forward+backward dispatches (what a dispatch mode sees)."""
        t, mode = self.trainee, _PassThrough(count=True)
        with mode:
            logits = t.model(t.tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), t.tokens[:, 1:].flatten())
            loss.backward()
        t.opt.zero_grad(set_to_none=True)
        return mode.ops

    def state(self, ema: bool = False) -> dict[str, Any]:
        """The training state. With the EMA, the model comes last: a loop that writes the
        weights right after the call then writes tensors the snapshot has not reached yet
        while it waits for pool space (the case copy-on-write is for; first in the state, the
        weights fit the pool and are copied within milliseconds)."""
        msd, osd = get_state_dict(self.trainee.model, self.trainee.opt)
        if not ema:
            return {"model": msd, "optim": osd}
        return {"optim": osd, "ema": self.ema.state(), "model": msd}

    def timed_step(self) -> dict[str, float]:
        """One training step (``train._Trainee.step``, split): forward+backward and the
        optimizer step (zero_grad included) in seconds, and the CPU seconds this thread spent
        in forward+backward, which a dispatch mode's Python calls add to whether or not other
        work takes the cores (the seconds also hold the thread's waits for a core)."""
        t = self.trainee
        t0, cpu0 = now(), time.thread_time()
        logits = t.model(t.tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), t.tokens[:, 1:].flatten())
        loss.backward()
        mid, cpu = now(), time.thread_time() - cpu0
        t.opt.step()
        t.opt.zero_grad(set_to_none=True)
        end = now()
        return {"step_s": end - t0, "fwd_bwd_s": mid - t0, "opt_s": end - mid, "fwd_bwd_cpu_s": cpu}

    def evaluate(self) -> float:
        """Evaluation with the EMA weights, as torch_ema's docs write it; returns its seconds."""
        model = self.trainee.model
        t0 = now()
        self.ema.store()
        self.ema.copy_to()
        model.eval()
        with torch.no_grad():
            model(self.trainee.tokens[:, :-1])
        model.train()
        self.ema.restore()
        return now() - t0

    def save(self, writer: DataStatesWriter | None, sd: dict[str, Any], path: Path) -> Any:
        """Start a save (stock's default ``dcp.async_save`` without a writer); its upload future."""
        if writer is None:
            future = dcp.async_save(sd, checkpoint_id=str(path), no_dist=True)
            return getattr(future, "upload_completion", future)
        return async_save(sd, writer, checkpoint_id=str(path), no_dist=True).upload_completion

    # -- step time ------------------------------------------------------------------------------
    def steps(self, cycles: int) -> None:
        writers = {s: DataStatesWriter(self.root / "unused", **o) for s, o in OPTIONS.items()}
        try:
            for writer in writers.values():  # untimed: each writer's pool and threads
                future = self.save(writer, self.state(), self.root / "warm")
                self.trainee.step()
                future.result()
                self.trainee.step()
                shutil.rmtree(self.root / "warm", ignore_errors=True)
            for c in range(cycles):
                k = c % len(STEP_SYSTEMS)
                for system in STEP_SYSTEMS[k:] + STEP_SYSTEMS[:k]:
                    self.step(system, writers.get(system), c)
        finally:
            for writer in writers.values():
                writer.close()

    def step(self, system: str, writer: DataStatesWriter | None, cycle: int) -> None:
        extra: dict[str, Any] = {}
        sd = self.state()
        if writer is None:
            with _PassThrough() if system == PASS_THROUGH else contextlib.nullcontext():
                figures = self.timed_step()
        else:
            path = self.root / f"step_{cycle}"
            t0 = now()
            future = self.save(writer, sd, path)
            blocked = now() - t0
            figures = self.timed_step()
            future.result()
            self.trainee.step()  # untimed: our mode pops at its end if it had not already
            shutil.rmtree(path, ignore_errors=True)
            stats = writer.last_stats
            assert stats is not None
            extra = {
                "blocked_s": blocked,
                "cow_bytes": stats.cow_bytes,
                "cow_blocked_s": stats.cow_blocked_s,
                "optimizer_wait_s": stats.optimizer_wait_s,
                "forward_frozen_bytes": stats.forward_frozen_bytes,
            }
        self.rec.emit(
            "cow_step",
            system,
            figures,
            cycle=cycle,
            ops=self.ops,
            bytes=_nbytes(sd),
            config=self.cfg.__dict__,
            **extra,
        )

    # -- EMA evaluation right after a save -------------------------------------------------------
    def ema_loop(self, saves: int) -> None:
        state_bytes = _nbytes(self.state(ema=True))
        pool = max(1 << 20, state_bytes // 4)
        writers = {
            s: DataStatesWriter(self.root / "unused", host_pool_bytes=pool, **o)
            for s, o in OPTIONS.items()
        }
        try:
            for system, writer in writers.items():  # untimed: each writer's pool and threads
                self.ema_save(system, writer, -1)
            for n in range(saves):
                for system in alternate(EMA_SYSTEMS, n):
                    fields = self.ema_save(system, writers.get(system), n)
                    figures = ("blocked_s", "eval_after_save_s", "plain_eval_s")
                    self.rec.emit(
                        "cow_ema",
                        system,
                        {k: fields.pop(k) for k in figures},
                        save=n,
                        pool_bytes=pool if system in OPTIONS else None,
                        bytes=state_bytes,
                        config=self.cfg.__dict__,
                        **fields,
                    )
        finally:
            for writer in writers.values():
                writer.close()
        for system in EMA_SYSTEMS:
            done = self.rec.select("cow_ema", system=system)
            committed = sum(r["committed"] for r in done)
            correct = sum(r["correct"] for r in done)
            log(f"cow: {system}: {committed}/{len(done)} committed, {correct} equal to the call")

    def ema_save(self, system: str, writer: DataStatesWriter | None, n: int) -> dict[str, Any]:
        """One save of the EMA loop: a step and the EMA update, an evaluation with nothing in
        flight (the pair of the one after the save), the save, the evaluation right after it,
        a step, the wait until the save is durable, then the load and the comparison."""
        self.trainee.step()
        self.ema.update()
        plain = self.evaluate()
        path = self.root / system.replace(" ", "_").replace("=", "_") / f"save_{n}"
        sd = self.state(ema=True)
        expected = _clone(sd)
        t0 = now()
        future = self.save(writer, sd, path)
        blocked = now() - t0
        after = self.evaluate()
        self.trainee.step()
        self.ema.update()
        out: dict[str, Any] = {
            "blocked_s": blocked,
            "eval_after_save_s": after,
            "plain_eval_s": plain,
        }
        try:
            future.result()
        except Exception as e:  # a save that saw a write it could not protect fails: counted
            out.update(committed=False, correct=False, error=type(e).__name__)
        else:
            reader = FileSystemReader if writer is None else DataStatesReader
            out.update(committed=True, correct=_matches(path, expected, reader))
        if writer is not None:
            stats = writer.last_stats if out["committed"] else writer.last_failed_stats
            assert stats is not None
            out.update(cow_bytes=stats.cow_bytes, cow_blocked_s=stats.cow_blocked_s)
        shutil.rmtree(path, ignore_errors=True)
        return out


def run(rec: Recorder, *, workdir: Path, cfg: TrainConfig, cycles: int, saves: int) -> None:
    log(f"cow: {cfg}, {cycles} cycles of paired steps, {saves} saves per system with EMA")
    bench = _Bench(rec, fresh_dir(workdir / "cow"), cfg)
    t0 = now()
    bench.steps(cycles)
    log(f"cow: paired steps {now() - t0:.1f} s")
    t0 = now()
    bench.ema_loop(saves)
    log(f"cow: EMA loop {now() - t0:.1f} s")
