"""GPU benchmark of the CUDA snapshot path: one JSON line per figure (run by gpu_check.sh).

    python scripts/gpu_bench.py                  # sized to the GPU, about two minutes
    python scripts/gpu_bench.py --gb 1 --quick   # seconds: checks the script works

Three measurements, each against stock DCP in the same run:

* ``d2h``: device-to-host GB/s of our snapshot (``async_save`` call to safe-to-mutate, pool
  already pinned) against a plain pinned ``copy_(non_blocking=True)`` of the same tensors on a
  side stream (target: at least 80%), and against stock ``DefaultStager`` with pinned memory.
* ``save``: blocked time and time to safe-to-mutate of ours, stock ``async_save`` with its
  default stager, and ``DefaultStager`` with pinned memory and non-blocking copies.
* ``train``: a transformer sized to the GPU trains with a checkpoint every K steps; the step-time
  dip is the time of the K steps after each save call (the save call included) over K
  checkpoint-free steps (target: at most 5%), for ours with the step fenced on the device (the
  default) and waiting on the host, and for the stock systems.

Progress goes to stderr; a figure's ``target_met`` says whether its target held.
``--cpu-dry-run`` runs the same code on CPU tensors at tiny sizes (no figure means anything): CI
uses it so that the script cannot rot on machines without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict

from dcp_datastates import DataStatesWriter, async_save

GiB = 1 << 30
#: Where the benchmark's state lives; cpu only for --cpu-dry-run.
DEVICE = torch.device("cuda")


def pinned_staging() -> StagingOptions:
    on_gpu = DEVICE.type == "cuda"
    return StagingOptions(
        use_pinned_memory=on_gpu,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=on_gpu,
    )


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def log(msg: str) -> None:
    print(f"[gpu_bench] {msg}", file=sys.stderr, flush=True)


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    return 0


class Timed:
    """Blocked and safe-to-mutate times of one save call, from the caller's side."""

    def __init__(self, call: Callable[[], Any], staging: Callable[[Any], Any]) -> None:
        sync()
        safe_at: list[float] = []
        t0 = time.perf_counter()
        returned = call()
        self.blocked_s = time.perf_counter() - t0
        fut = staging(returned)
        if fut is None:  # copied before returning
            self.safe_s = self.blocked_s
        else:
            done = threading.Event()
            fut.add_done_callback(lambda _: (safe_at.append(time.perf_counter()), done.set()))
            done.wait()
            self.safe_s = max(safe_at[0] - t0, self.blocked_s)
        self.returned = returned


def _upload(returned: Any) -> Any:
    return getattr(returned, "upload_completion", returned)


def _staging(returned: Any) -> Any:
    return getattr(returned, "staging_completion", None)


class Systems:
    """The save systems (``name(state, path) -> Timed``) and what they keep between saves."""

    def __init__(self, pool_bytes: int, root: Path) -> None:
        self.pool_bytes, self.root = pool_bytes, root
        self.writer = DataStatesWriter(root, host_pool_bytes=pool_bytes)
        self.host_writer: DataStatesWriter | None = None
        self.stager = DefaultStager(pinned_staging())

    def ours(self, state: dict, path: Path) -> Timed:
        return Timed(
            lambda: async_save(state, self.writer, checkpoint_id=str(path), no_dist=True),
            _staging,
        )

    def ours_host_wait(self, state: dict, path: Path) -> Timed:
        """Ours with the optimizer step waiting on the host (``guard_on_device=False``)."""
        if self.host_writer is None:
            self.host_writer = DataStatesWriter(
                self.root, host_pool_bytes=self.pool_bytes, guard_on_device=False
            )
        writer = self.host_writer
        return Timed(
            lambda: async_save(state, writer, checkpoint_id=str(path), no_dist=True), _staging
        )

    def stock_default(self, state: dict, path: Path) -> Timed:
        return Timed(
            lambda: dcp.async_save(state, checkpoint_id=str(path), no_dist=True), lambda _: None
        )

    def stock_pinned(self, state: dict, path: Path) -> Timed:
        return Timed(
            lambda: dcp.async_save(
                state, checkpoint_id=str(path), async_stager=self.stager, no_dist=True
            ),
            _staging,
        )

    def close(self) -> None:
        self.writer.close()
        if self.host_writer is not None:
            self.host_writer.close()
        self.stager.close()


def plain_pinned_copy_s(state: dict[str, torch.Tensor], rounds: int) -> float:
    """Best time of one pinned non-blocking copy of every tensor on a side stream."""
    on_gpu = DEVICE.type == "cuda"
    bufs = {
        k: torch.empty(state_bytes(v), dtype=torch.uint8, pin_memory=on_gpu)
        for k, v in state.items()
    }
    stream = torch.cuda.Stream() if on_gpu else None
    best = float("inf")
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for k, v in state.items():
                bufs[k].copy_(v.reshape(-1).view(torch.uint8), non_blocking=on_gpu)
        if stream is not None:
            stream.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_d2h_and_save(gb: float, tensors: int, rounds: int, root: Path) -> None:
    per = max(1, int(gb * GiB) // tensors // 4)
    state = {f"t{i}": torch.randn(per, device=DEVICE) for i in range(tensors)}
    nbytes = state_bytes(state)
    log(f"d2h/save: {tensors} tensors, {nbytes / GiB:.2f} GiB")
    plain = plain_pinned_copy_s(state, rounds)
    systems = Systems(nbytes + (64 << 20), root)
    results: dict[str, list[Timed]] = {"ours": [], "stock_default": [], "stock_pinned": []}
    try:
        for r in range(rounds + 1):  # the first round pins pools and caches: not counted
            for name in results:
                path = root / f"{name}_{r}"
                timed = getattr(systems, name)(state, path)
                _upload(timed.returned).result()
                shutil.rmtree(path, ignore_errors=True)
                if r:
                    results[name].append(timed)
    finally:
        systems.close()
    gbps = {name: nbytes / 1e9 / min(t.safe_s for t in runs) for name, runs in results.items()}
    plain_gbps = nbytes / 1e9 / plain
    emit(
        figure="d2h_gbps",
        bytes=nbytes,
        tensors=tensors,
        plain_pinned_copy=plain_gbps,
        ours=gbps["ours"],
        stock_default_stager_pinned=gbps["stock_pinned"],
        ours_over_plain=gbps["ours"] / plain_gbps,
        ours_over_stock_pinned=gbps["ours"] / gbps["stock_pinned"],
        target=">= 0.8 of plain",
        target_met=gbps["ours"] / plain_gbps >= 0.8,
    )
    for name, runs in results.items():
        emit(
            figure="save_times",
            system=name,
            bytes=nbytes,
            blocked_s=statistics.median(t.blocked_s for t in runs),
            safe_s=statistics.median(t.safe_s for t in runs),
        )


class LM(nn.Module):
    def __init__(self, width: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                max(1, width // 128),
                4 * width,
                dropout=0.0,
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, is_causal=False)
        return self.head(h)


def bench_train(
    width: int, layers: int, steps: int, every: int, root: Path, tokens_shape=(8, 1024)
) -> None:
    vocab = 32000 if DEVICE.type == "cuda" else 512
    batch, seq = tokens_shape
    model = LM(width, layers, vocab).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (batch, seq), device=DEVICE)

    def step() -> float:
        t0 = time.perf_counter()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    msd, osd = get_state_dict(model, opt)
    nbytes = state_bytes({"model": msd, "optim": osd["state"]})
    log(f"train: width {width}, {layers} layers, state {nbytes / GiB:.2f} GiB")
    systems = Systems(int(nbytes * 1.1) + (64 << 20), root)
    try:
        baseline = [step() for _ in range(steps)]
        base = statistics.median(baseline)
        emit(figure="train_step", system="no checkpoint", median_step_s=base, state_bytes=nbytes)
        for name in ("ours", "ours_host_wait", "stock_default", "stock_pinned"):
            warm = getattr(systems, name)(_sd(model, opt), root / "warm")  # pins, caches
            _upload(warm.returned).result()
            shutil.rmtree(root / "warm", ignore_errors=True)
            windows, blocked = [], []
            pending = None
            for k in range(steps // every):
                if pending is not None:
                    _upload(pending.returned).result()
                    shutil.rmtree(root / f"{name}_{k - 1}", ignore_errors=True)
                sync()
                t0 = time.perf_counter()
                pending = getattr(systems, name)(_sd(model, opt), root / f"{name}_{k}")
                blocked.append(pending.blocked_s)
                save_s = time.perf_counter() - t0
                windows.append(save_s + sum(step() for _ in range(every)))
            if pending is not None:
                _upload(pending.returned).result()
            dip = statistics.median(windows) / (every * base) - 1
            emit(
                figure="train_step_dip",
                system=name,
                every=every,
                median_step_s=base,
                median_blocked_s=statistics.median(blocked),
                dip=dip,
                target="<= 0.05" if name.startswith("ours") else None,
                target_met=(dip <= 0.05) if name.startswith("ours") else None,
            )
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
    finally:
        systems.close()


def _sd(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=None, help="d2h state size (default: sized)")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints are written")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script")
    parser.add_argument("--cpu-dry-run", action="store_true", help="CPU tensors, tiny sizes")
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        global DEVICE
        DEVICE = torch.device("cpu")
        root = Path(tempfile.mkdtemp(prefix="dcp-datastates-gpu-", dir=args.dir))
        try:
            bench_d2h_and_save(0.01, 8, 1, root / "d2h")
            bench_train(64, 1, 4, 2, root / "train", tokens_shape=(2, 16))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to measure")
        return 0
    props = torch.cuda.get_device_properties(0)
    total = props.total_memory
    gb = args.gb if args.gb is not None else (0.25 if args.quick else min(4.0, total / GiB / 16))
    width, layers = (512, 2) if args.quick else ((2048, 4) if total >= 60 * GiB else (1024, 6))
    steps, every = (6, 3) if args.quick else (20, 10)
    emit(figure="machine", gpu=props.name, gpu_memory=total, torch=torch.__version__)
    root = Path(tempfile.mkdtemp(prefix="dcp-datastates-gpu-", dir=args.dir))
    try:
        bench_d2h_and_save(gb, args.tensors, 1 if args.quick else args.rounds, root / "d2h")
        bench_train(width, layers, steps, every, root / "train")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
