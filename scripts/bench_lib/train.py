"""The training-loop scenario: a small transformer trained on CPU, a checkpoint every K steps.

One model and optimizer are trained on through every run (a step costs the same whatever the
weights), so runs are short and many. Two parts:

- Full runs (for the timeline picture and the blocked/drain figures): each system runs N timed
  steps and checkpoints after every K-th step (not after the last one); an async system waits
  for its previous save before starting the next, as TorchTitan does.
- Paired blocks (for the overhead): a block is one checkpoint, K steps, and the wait until that
  checkpoint is durable. Each cycle runs one block per system, round-robin; a checkpoint's
  overhead is its block minus the no-checkpoint block of the same cycle, median over cycles. A
  no-checkpoint run's spread between rounds on a shared two-core machine is larger than the
  overhead of two checkpoints; neighbouring blocks a second apart see the same load.

Each block also splits the process's CPU between the training's threads and the checkpoint's,
and reads the machine's idle CPU: report.py turns these into a lower bound of the overhead.

The stock async run calls ``dcp.async_save`` with the stager DCP builds by default
(``DefaultStager`` with every option off) passed explicitly, and a ``FileSystemWriter`` that only
adds timestamps, so its flush and commit can be drawn; it behaves as the plain default call.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict import get_state_dict

from dcp_datastates import async_save

from .common import Recorder, alternate, fresh_dir, log, now
from .floor import LazyFloor
from .systems import DEFAULT_STAGING, PhaseLog, TimedDataStatesWriter, TimedFileSystemWriter

NONE = "no checkpoint"
STOCK_SYNC = "stock dcp.save"
STOCK_ASYNC = "stock async_save"
OURS = "ours async_save"
#: The least a lazy, verified, durable checkpoint does (``floor.py``): the target's limit.
FLOOR = "floor: copy + crc32c + direct write"
SYSTEMS = [NONE, STOCK_SYNC, STOCK_ASYNC, OURS]
#: Systems of the paired blocks: the target's two, the baseline and the floor (stock dcp.save
#: blocks for a second and says nothing the full runs do not; leaving it out buys more cycles).
BLOCK_SYSTEMS = [NONE, STOCK_ASYNC, OURS, FLOOR]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Attributes:
    width: Model width; heads are width / 64.
    layers: Transformer blocks.
    vocab: Vocabulary (embedding and output head).
    seq: Tokens per sequence.
    batch: Sequences per step.
    steps: Timed steps per run.
    every: Checkpoint after every ``every``-th step; also the steps of a paired block.
    cycles: Cycles of paired blocks (one block per system in ``BLOCK_SYSTEMS`` each).
    """

    width: int = 512
    layers: int = 6
    vocab: int = 8192
    seq: int = 32
    batch: int = 2
    steps: int = 12
    every: int = 4
    cycles: int = 20

    def __post_init__(self) -> None:
        for name in ("width", "layers", "vocab", "seq", "batch", "steps", "every", "cycles"):
            if getattr(self, name) < 1:
                raise ValueError(f"train {name} must be at least 1, got {getattr(self, name)}")


class TinyLM(nn.Module):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        d = cfg.width
        self.embed = nn.Embedding(cfg.vocab, d)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, d))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, max(1, d // 64), 4 * d, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(cfg.seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        for block in self.blocks:
            h = block(h, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


@dataclass
class Run:
    """One training run: step spans, save phases (all seconds from the first timed step)."""

    system: str
    steps: list[tuple[float, float, float]] = field(default_factory=list)  # start, fwd+bwd, end
    phases: list[tuple[str, int, float, float]] = field(default_factory=list)
    total_s: float = 0.0
    drain_s: float = 0.0
    state_bytes: int = 0


class _Saver:
    """Checkpoints for one run of one system; every span goes into ``log``. Ours reuses one writer
    (so one host pool) across runs, as a training job does across its checkpoints."""

    def __init__(
        self,
        system: str,
        root: Path,
        log_: PhaseLog,
        writer: TimedDataStatesWriter,
        floor: LazyFloor | None = None,
    ) -> None:
        self.system, self.root, self.log = system, root, log_
        self.pending: Any = None
        self.writer = writer
        writer.phases = log_
        self.floor = floor
        self.hook: Any = None  # the floor's optimizer hook, removed once its save is durable

    def wait_previous(self, index: int) -> None:
        if self.pending is not None and not self.pending.done():
            t0 = now()
            self.pending.result()
            self.log.add("wait previous", index, t0, now())
        elif self.pending is not None:
            self.pending.result()  # raise a failed save now
        self.pending = None
        if self.hook is not None:
            self.hook.remove()
            self.hook = None

    def save(self, index: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.wait_previous(index)
        path = self.root / f"step_{index}"
        t0 = now()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, "step": index, "rng": {"seed": 0}}
        if self.system == STOCK_SYNC:
            dcp.save(sd, storage_writer=TimedFileSystemWriter(path, self.log, index), no_dist=True)
            self.log.add("blocked", index, t0, now())
            return
        if self.system == FLOOR:
            assert self.floor is not None
            path.mkdir(parents=True, exist_ok=True)
            self.pending, self.hook = self.floor.save(sd, path / "floor.bin", opt)
            self.log.add("blocked", index, t0, now())
            return
        if self.system == STOCK_ASYNC:
            stager = DefaultStager(DEFAULT_STAGING)
            fut = dcp.async_save(
                sd,
                storage_writer=TimedFileSystemWriter(path, self.log, index),
                async_stager=stager,
                no_dist=True,
            )
            t1 = now()
            self.log.add("blocked", index, t0, t1)
            self.log.add("snapshot", index, t0, t1)
            fut.add_done_callback(lambda _f: stager.close())
            self.pending = fut
            return
        self.writer.save_index = index
        resp = async_save(sd, self.writer, checkpoint_id=path, no_dist=True)
        self.log.add("blocked", index, t0, now())
        resp.staging_completion.add_done_callback(
            lambda _f: self.log.add("snapshot", index, t0, now())
        )
        self.pending = resp.upload_completion


@dataclass
class _Trainee:
    """One model, optimizer and batch, trained on across every run of the scenario: a step costs
    the same whatever the weights are, and nothing is rebuilt or re-warmed between runs."""

    model: nn.Module
    opt: torch.optim.Optimizer
    tokens: torch.Tensor

    @classmethod
    def make(cls, cfg: TrainConfig) -> _Trainee:
        torch.manual_seed(0)
        model = TinyLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=torch.Generator())
        return cls(model, opt, tokens)

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.parameters()) * 3

    def step(self) -> float:
        """One training step; returns when forward and backward ended (the optimizer step
        follows, and is where our optimizer guard waits for a snapshot in flight)."""
        logits = self.model(self.tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), self.tokens[:, 1:].flatten())
        loss.backward()
        mid = now()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return mid


def run_one(
    system: str, cfg: TrainConfig, trainee: _Trainee, workdir: Path, writer: TimedDataStatesWriter
) -> Run:
    root = fresh_dir(workdir / system.replace(" ", "_").replace(".", "_"))
    log_ = PhaseLog()
    saver = None if system == NONE else _Saver(system, root, log_, writer)
    out = Run(system, state_bytes=trainee.state_bytes)
    begin = now()
    for i in range(1, cfg.steps + 1):
        s0 = now()
        mid = trainee.step()
        out.steps.append((s0 - begin, mid - begin, now() - begin))
        if saver is not None and i % cfg.every == 0 and i < cfg.steps:
            saver.save(i, trainee.model, trainee.opt)
    out.total_s = now() - begin
    if saver is not None:
        t0 = now()
        saver.wait_previous(cfg.steps)
        out.drain_s = now() - t0
    out.phases = sorted((p, i, a - begin, b - begin) for p, i, a, b in log_.spans)
    shutil.rmtree(root, ignore_errors=True)
    return out


# -- CPU accounting of a block ------------------------------------------------------------------
def _training_tids() -> set[int]:
    """The threads that train: the main thread and the native threads Python does not know
    (torch's OpenMP pool). Every other Python thread belongs to a checkpoint (ours: the
    ``datastates-*`` threads; stock: its executor), so its CPU is the checkpoint's."""
    main = threading.main_thread()
    python = {t.native_id for t in threading.enumerate() if t is not main}
    return {int(t) for t in os.listdir("/proc/self/task")} - python


def _task_times_s(tid: int) -> tuple[float, float]:
    """(CPU seconds run, seconds spent runnable but waiting for a core) of thread ``tid``, from
    schedstat (nanoseconds; /proc stat ticks are 10 ms, too coarse for 1 s blocks). Zeros for a
    thread that has gone."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            run, wait = f.read().split()[:2]
        return int(run) / 1e9, int(wait) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def _machine_idle_s() -> float:
    """Idle (and I/O-wait) CPU seconds of the whole machine since boot, all cores together."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class _Clocks:
    wall: float
    process: float  # every thread of this process, ended ones included
    training: float
    training_wait: float  # the training threads' time runnable but off a core
    idle: float

    @classmethod
    def read(cls, tids: set[int]) -> _Clocks:
        times = [_task_times_s(t) for t in tids]
        return cls(
            now(),
            time.process_time(),
            sum(run for run, _ in times),
            sum(wait for _, wait in times),
            _machine_idle_s(),
        )


def cpu_supported() -> bool:
    return os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")


@dataclass
class Block:
    """One paired block: the checkpoint (none for the baseline), ``every`` steps, and the wait
    until that checkpoint is durable, as the next checkpoint of a loop would wait for it.

    CPU seconds over the block: ``checkpoint_cpu_s`` is what every thread but the training's
    used, plus the save call on the caller; ``training_cpu_s`` the rest of the process;
    ``machine_idle_s`` what no process on the machine used; ``training_wait_s`` how long the
    training threads were ready to run but had no core (the checkpoint's, or other jobs')."""

    system: str
    cycle: int
    block_s: float
    blocked_s: float = 0.0
    checkpoint_cpu_s: float = 0.0
    training_cpu_s: float = 0.0
    machine_idle_s: float = 0.0
    training_wait_s: float = 0.0


def run_block(
    system: str,
    cycle: int,
    cfg: TrainConfig,
    trainee: _Trainee,
    root: Path,
    writer: Any,
    floor: LazyFloor | None = None,
) -> Block:
    saver = None if system == NONE else _Saver(system, root, PhaseLog(), writer, floor)
    tids = _training_tids()
    c0 = _Clocks.read(tids)
    blocked = call_cpu = 0.0
    if saver is not None:
        t0, cpu0 = now(), time.thread_time()
        saver.save(cycle, trainee.model, trainee.opt)
        blocked, call_cpu = now() - t0, time.thread_time() - cpu0
    for _ in range(cfg.every):
        trainee.step()
    if saver is not None:
        saver.wait_previous(cycle)
    c1 = _Clocks.read(tids)
    training = c1.training - c0.training - call_cpu
    shutil.rmtree(root / f"step_{cycle}", ignore_errors=True)
    return Block(
        system,
        cycle,
        c1.wall - c0.wall,
        blocked,
        checkpoint_cpu_s=c1.process - c0.process - training,
        training_cpu_s=training,
        machine_idle_s=c1.idle - c0.idle,
        training_wait_s=c1.training_wait - c0.training_wait,
    )


def _cycle_order(systems: list[str], cycle: int) -> list[str]:
    """Round-robin: each cycle starts one system later, so every system follows every other
    one and none always runs first after the previous cycle's drain."""
    k = cycle % len(systems)
    return systems[k:] + systems[:k]


def run(rec: Recorder, *, workdir: Path, cfg: TrainConfig, rounds: int) -> dict[str, Run]:
    """Full runs for the picture and the blocked/drain figures (``rounds`` of each system),
    then ``cfg.cycles`` cycles of paired blocks for the overheads. Returns each system's median
    full run (by total time), for the timeline."""
    workdir = fresh_dir(workdir / "train")
    log(f"train: {cfg}, {rounds} rounds, {cfg.cycles} cycles of paired blocks")
    trainee = _Trainee.make(cfg)
    writer = TimedDataStatesWriter(workdir / "ours", PhaseLog())
    floor = LazyFloor()
    try:
        # Warm-up, untimed: the optimizer state and allocator, and our writer's pool (a job
        # allocates it at its first checkpoint, once); the floor's buffer likewise.
        warm = TrainConfig(**{**cfg.__dict__, "steps": 3, "every": 2})
        run_one(OURS, warm, trainee, workdir, writer)
        floor.prepare(get_state_dict(trainee.model, trainee.opt))
        runs: dict[str, list[Run]] = {s: [] for s in SYSTEMS}
        for r in range(rounds):
            for system in alternate(SYSTEMS, r):
                result = run_one(system, cfg, trainee, workdir, writer)
                runs[system].append(result)
                _emit(rec, result, cfg, r)
        blocks = fresh_dir(workdir / "blocks")
        cpu = cpu_supported()
        for c in range(cfg.cycles):
            for system in _cycle_order(BLOCK_SYSTEMS, c):
                block = run_block(system, c, cfg, trainee, blocks, writer, floor)
                _emit_block(rec, block, cfg, cpu)
    finally:
        writer.close()
        floor.close()
    return {s: sorted(rs, key=lambda x: x.total_s)[(len(rs) - 1) // 2] for s, rs in runs.items()}


def _emit_block(rec: Recorder, b: Block, cfg: TrainConfig, cpu: bool) -> None:
    # CPU figures can be 0 (an idle machine, no checkpoint): fields, not (positive) figures.
    extra: dict[str, Any] = {}
    if cpu:
        extra["cpu"] = {
            "checkpoint_s": round(b.checkpoint_cpu_s, 5),
            "training_s": round(b.training_cpu_s, 5),
            "machine_idle_s": round(b.machine_idle_s, 5),
            "training_wait_s": round(b.training_wait_s, 5),
        }
    rec.emit(
        "train_block",
        b.system,
        {"block_s": b.block_s},
        blocked_s=b.blocked_s,
        cycle=b.cycle,
        steps=cfg.every,
        cores=len(os.sched_getaffinity(0)),
        **extra,
    )


def _emit(rec: Recorder, result: Run, cfg: TrainConfig, r: int) -> None:
    step_s = sorted(e - s for s, _, e in result.steps)
    rec.emit(
        "train",
        result.system,
        {
            "total_s": result.total_s,
            "step_median_s": step_s[len(step_s) // 2],
            "step_max_s": step_s[-1],
        },
        drain_s=result.drain_s,
        blocked_s=sum(b - a for p, _, a, b in result.phases if p == "blocked"),
        steps=cfg.steps,
        every=cfg.every,
        saves=(cfg.steps - 1) // cfg.every if result.system != NONE else 0,
        bytes=result.state_bytes,
        config=cfg.__dict__,
        step_s=[round(e - s, 5) for s, _, e in result.steps],
        phases=[(p, i, round(a, 5), round(b, 5)) for p, i, a, b in result.phases],
        round=r,
    )
