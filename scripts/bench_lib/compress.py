"""The compression scenario: what ``_extensions=[ZStandard()]`` saves in bytes and costs in
durable time, for stock ``FileSystemWriter`` and for ``DataStatesWriter``.

The state is a mixed-precision training state after a few AdamW steps: bf16 model weights, and
the optimizer's fp32 master weights, ``exp_avg`` and ``exp_avg_sq`` (14 bytes a parameter).
Each system saves it with ``dcp.save`` (returns once the checkpoint is durable and committed):
stock and ours, plain and compressed; stock writes ``thread_count`` files per rank, as many as
ours (``flush_workers``), so both compress that many records at once. Figures: durable seconds,
bytes on disk, and their ratios to the same writer's plain save. Systems alternate order between
rounds; every checkpoint is loaded back with stock ``dcp.load`` once and compared.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_datastates import DataStatesWriter

from .common import GB, Recorder, Spread, alternate, dir_bytes, fresh_dir, log

STOCK, STOCK_Z = "stock FileSystemWriter", "stock FileSystemWriter + ZStandard"
OURS, OURS_Z = "ours DataStatesWriter", "ours DataStatesWriter + ZStandard"
SYSTEMS = [STOCK, STOCK_Z, OURS, OURS_Z]
_MATRIX_ROWS = 1024


def training_state(params: int, *, layers: int = 16, steps: int = 3) -> dict[str, Any]:
    """bf16 weights and AdamW's fp32 state (master weights, moments) after ``steps`` steps on
    gradients of a realistic scale; ``params`` parameters in ``layers`` matrices."""
    g = torch.Generator().manual_seed(0)
    cols = max(1, params // layers // _MATRIX_ROWS)
    master = [
        torch.nn.Parameter(torch.randn(_MATRIX_ROWS, cols, generator=g) * 0.02)
        for _ in range(layers)
    ]
    opt = torch.optim.AdamW(master, lr=1e-4, weight_decay=0.1)
    for _ in range(steps):
        for p in master:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
    model = {f"layer{i}.weight": p.detach().to(torch.bfloat16) for i, p in enumerate(master)}
    optim = {
        f"layer{i}": {
            "master": p.detach().clone(),
            "exp_avg": opt.state[p]["exp_avg"],
            "exp_avg_sq": opt.state[p]["exp_avg_sq"],
            "step": opt.state[p]["step"],
        }
        for i, p in enumerate(master)
    }
    return {"model": model, "optim": optim}


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    return [t for v in state.values() for t in _tensors(v)]


def _writer(name: str, path: Path, threads: int) -> Any:
    from torch.distributed.checkpoint._extension import ZStandard

    extensions = [ZStandard()] if name in (STOCK_Z, OURS_Z) else None
    if name in (STOCK, STOCK_Z):
        return dcp.FileSystemWriter(path, thread_count=threads, _extensions=extensions)
    return DataStatesWriter(path, thread_count=threads, _extensions=extensions)


def run(rec: Recorder, *, workdir: Path, params: int, rounds: int, threads: int = 4) -> None:
    workdir = fresh_dir(workdir / "compress")
    log(f"compress: building the training state ({params / 1e6:.0f} M parameters)")
    state = training_state(params)
    raw = sum(t.numel() * t.element_size() for t in _tensors(state))
    log(f"compress: {raw / GB:.2f} GB, {rounds} rounds of {', '.join(SYSTEMS)}")
    checked: set[str] = set()
    for r in range(rounds):
        for name in alternate(SYSTEMS, r):
            path = fresh_dir(workdir / name.replace(" ", "_").replace("+", ""))
            writer = _writer(name, path, threads)
            t0 = time.monotonic()
            try:
                dcp.save(state, storage_writer=writer, no_dist=True)
            finally:
                if hasattr(writer, "close"):
                    writer.close()
            seconds = time.monotonic() - t0
            stored = dir_bytes(path)
            rec.emit(
                "compress",
                name,
                {"durable_s": seconds, "bytes": stored, "stored_fraction": stored / raw},
                round=r,
                raw_bytes=raw,
                threads=threads,
            )
            if name not in checked:  # stock reads every checkpoint back, bit for bit
                target = {
                    "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
                    "optim": {
                        k: {n: torch.empty_like(t) for n, t in v.items()}
                        for k, v in state["optim"].items()
                    },
                }
                dcp.load(target, checkpoint_id=path, no_dist=True)
                for a, b in zip(_tensors(state), _tensors(target), strict=True):
                    if not torch.equal(a, b):
                        raise AssertionError(f"{name}: the checkpoint does not load back")
                checked.add(name)
            fresh_dir(path)


def table(rec: Recorder) -> str:
    """The scenario's summary (Markdown); empty when it did not run."""
    if not rec.select("compress"):
        return ""

    def med(system: str, figure: str) -> Spread | None:
        return Spread.of(r["figures"][figure] for r in rec.select("compress", system=system))

    raw = rec.select("compress")[0]["raw_bytes"]
    lines = [
        f"### Compression (ZStandard), {raw / GB:.2f} GB bf16 weights + fp32 AdamW state",
        "",
        "| system | durable s | GB on disk | stored / raw | durable / same writer plain |",
        "|---|---|---|---|---|",
    ]
    for name, plain in ((STOCK, STOCK), (STOCK_Z, STOCK), (OURS, OURS), (OURS_Z, OURS)):
        d, b, p = med(name, "durable_s"), med(name, "bytes"), med(plain, "durable_s")
        if d is None or b is None or p is None:
            continue
        lines.append(
            f"| {name} | {d.fmt(2)} | {b.median / GB:.3f} | {b.median / raw:.3f} | "
            f"{d.median / p.median:.2f}x |"
        )
    sz, oz = med(STOCK_Z, "durable_s"), med(OURS_Z, "durable_s")
    if sz is not None and oz is not None:
        lines += ["", f"Compressed, ours/stock durable time: {oz.median / sz.median:.2f}x."]
    return "\n".join(lines) + "\n"
