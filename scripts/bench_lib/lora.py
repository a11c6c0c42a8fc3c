"""The LoRA scenario: a frozen base (``--lora-gb``, 1 GB by default) and small trainable adapters
with their AdamW state, saved ``--lora-saves`` times with a training step between saves, by
stock ``FileSystemWriter``, ours in full, ours with ``incremental=True`` and ours compressed
(``_extensions=[ZStandard()]``; "refused" where the writer refuses it).

Per save: the bytes that reached the disk (files of the new checkpoint whose inode the one
before did not have: a hard link costs none) and the durable time (a synchronous ``dcp.save``,
files fsynced). Then, for each system, the older checkpoints are deleted one by one and each
checkpoint is loaded alone with stock ``dcp.load`` and compared with what was saved.
Targets (issue 40): incremental saves after the first write at most 1.1x the changed bytes and
take at most 0.2x the full save's durable time.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_datastates import DataStatesWriter

from .common import GB, Recorder, Spread, fresh_dir, log

STOCK, FULL, INCREMENTAL, COMPRESSED = (
    "stock FileSystemWriter",
    "ours full",
    "ours incremental",
    "ours compressed (ZStandard)",
)
SYSTEMS = (STOCK, FULL, INCREMENTAL, COMPRESSED)
_WIDTH = 4096
_RANK = 16


def _base(nbytes: int) -> dict[str, torch.Tensor]:
    rows = max(1, nbytes // (_WIDTH * 4 * 16))
    g = torch.Generator().manual_seed(0)
    return {f"base.{i}.weight": torch.randn(rows, _WIDTH, generator=g) for i in range(16)}


class _Adapters(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.a = nn.ParameterList(
            nn.Parameter(torch.randn(_RANK, _WIDTH, generator=g) * 0.01) for _ in range(layers)
        )
        self.b = nn.ParameterList(
            nn.Parameter(torch.randn(_WIDTH, _RANK, generator=g) * 0.01) for _ in range(layers)
        )

    def step(self, opt: torch.optim.Optimizer) -> None:
        loss = sum((a.sum() * 1e-3 + (b**2).sum()) for a, b in zip(self.a, self.b, strict=True))
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()


def _writer(system: str, path: Path) -> Any:
    if system == STOCK:
        return FileSystemWriter(path)
    if system == FULL:
        return DataStatesWriter(path)
    if system == INCREMENTAL:
        return DataStatesWriter(path, incremental=True)
    from torch.distributed.checkpoint._extension import ZStandard

    return DataStatesWriter(path, _extensions=[ZStandard()])


def _new_bytes(path: Path, before: set[int]) -> tuple[int, set[int]]:
    inodes, total = set(), 0
    for p in path.iterdir():
        st = p.stat()
        inodes.add(st.st_ino)
        if st.st_ino not in before:
            total += st.st_size
    return total, inodes


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _one(
    rec: Recorder, system: str, root: Path, base: dict[str, torch.Tensor], saves: int, layers: int
) -> None:
    adapters = _Adapters(layers)
    opt = torch.optim.AdamW(adapters.parameters(), lr=1e-3)
    root = fresh_dir(root)
    try:
        writer = _writer(system, root)
    except Exception as exc:  # the compressed row on a writer that refuses _extensions
        log(f"lora: {system}: refused ({type(exc).__name__}: {exc})")
        rec.emit("lora", system, {}, refused=f"{type(exc).__name__}: {exc}")
        return
    inodes: set[int] = set()
    changed_part: list[Any] = []
    for i in range(saves):
        adapters.step(opt)
        state = {"model": {**base, **adapters.state_dict()}, "optim": opt.state_dict()}
        changed = sum(
            t.numel() * t.element_size()
            for t in [*adapters.parameters(), *_tensors(opt.state_dict()["state"])]
        )
        path = root / f"step{i}"
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer, checkpoint_id=path)
        durable = time.perf_counter() - start
        written, inodes = _new_bytes(path, inodes)
        figures = {"durable_s": durable, "written_gb": written / GB, "changed_gb": changed / GB}
        stats = getattr(writer, "last_stats", None)
        if stats is not None:  # ours: where the time went (planning = wall - the stats' durable)
            figures["planning_s"] = max(1e-6, durable - stats.durable_s)
            figures["flushed_s"], figures["commit_s"] = stats.flushed_s, stats.commit_s
        rec.emit("lora", system, figures, save=i)
        log(f"lora: {system} save {i}: {durable:.3f} s, {written / 1e6:.1f} MB written")
        changed_part.append(_clone({"adapters": adapters.state_dict(), "optim": opt.state_dict()}))
    if hasattr(writer, "close"):
        writer.close()
    loads_ok = True
    for i in range(saves):  # older checkpoints deleted first: each loads alone
        for j in range(i):
            shutil.rmtree(root / f"step{j}", ignore_errors=True)
        target = {
            "model": {
                **{k: torch.empty_like(v) for k, v in base.items()},
                **{k: torch.empty_like(v) for k, v in adapters.state_dict().items()},
            }
        }
        dcp.load(target, storage_reader=FileSystemReader(root / f"step{i}"))
        same_base = all(torch.equal(target["model"][k], v) for k, v in base.items())
        want = changed_part[i]["adapters"]
        loads_ok &= same_base and all(torch.equal(target["model"][k], v) for k, v in want.items())
    rec.emit("lora", system, {}, loads_alone=loads_ok)
    shutil.rmtree(root, ignore_errors=True)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def run(rec: Recorder, *, workdir: Path, nbytes: int, saves: int = 5, layers: int = 24) -> None:
    base = _base(nbytes)
    for system in SYSTEMS:
        _one(rec, system, workdir / "lora" / system.split()[1], base, saves, layers)
        os.sync()


def table(rec: Recorder) -> str:
    """The scenario's summary (Markdown); empty when it did not run."""
    if not rec.select("lora"):
        return ""
    lines = [
        "### LoRA: frozen base, saves with training between",
        "",
        "| system | first save: s, GB written | later saves: s (median), GB written (median) "
        "| later/full durable | later written / changed | each loads alone (stock) |",
        "|---|---|---|---|---|---|",
    ]
    full_later = _later(rec, FULL, "durable_s")
    for system in SYSTEMS:
        refused = [r for r in rec.select("lora", system=system) if "refused" in r]
        if refused:
            lines.append(f"| {system} | refused: {refused[0]['refused'][:60]} | | | | |")
            continue
        first = [r for r in rec.select("lora", system=system, save=0)]
        if not first:
            continue
        f0 = first[0]["figures"]
        durable, written = _later(rec, system, "durable_s"), _later(rec, system, "written_gb")
        changed = _later(rec, system, "changed_gb")
        loads = [r["loads_alone"] for r in rec.select("lora", system=system) if "loads_alone" in r]
        ratio_t = durable.median / full_later.median if durable and full_later else None
        ratio_b = written.median / changed.median if written and changed else None
        lines.append(
            f"| {system} | {f0['durable_s']:.2f} s, {f0['written_gb']:.3f} | "
            f"{durable.fmt(3) if durable else '-'} s, {written.median if written else 0:.4f} | "
            f"{'-' if ratio_t is None else f'{ratio_t:.3f}x'} | "
            f"{'-' if ratio_b is None else f'{ratio_b:.3f}x'} | {loads and all(loads)} |"
        )
    return "\n".join(lines) + "\n"


def _later(rec: Recorder, system: str, figure: str) -> Spread | None:
    rows = [r for r in rec.select("lora", system=system) if r.get("save", 0) > 0]
    return Spread.of(r["figures"][figure] for r in rows if figure in r["figures"])
