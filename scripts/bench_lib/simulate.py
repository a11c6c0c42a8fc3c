"""The simulate scenario: the save and load planning of jobs of 8 to 4,096 ranks, on one machine.

No tensor is allocated and no process group made: every rank's local ``SavePlan`` is built from
the shapes of a sharded transformer (:mod:`.sim_states`), and the coordinator's real code runs on
them, stock's and ours side by side:

* stock: ``DefaultSavePlanner.create_global_plan`` (dedup, global plan, metadata, validation),
  ``FileSystemWriter.prepare_global_plan`` and ``finish`` (pickles and writes ``.metadata``);
  the repeat save with DCP's ``enable_plan_caching`` (every rank's plan unchanged).
* ours: ``StagedSavePlanner.create_global_plan`` (our planner, with the writer's memo),
  ``DataStatesWriter.prepare_global_plan`` and ``finish`` (manifest, size checks, ``.metadata``
  on a real directory whose data files exist, sparse, with the sizes the ranks report); the
  repeat save, every rank's local plan the one of the save before (a replay).

DCP's ``_validate_global_plan`` compares every pair of chunks of a tensor whose largest dimension
is not the sharded one (``down_proj``, ``k_proj``, ``v_proj``): W^2/2 box checks per tensor, 16
minutes at 4,096 ranks of the 70B model. Stock's figure adds it as measured on the tensors of one
layer (and those outside the layers) times the layers, so that the run stays in minutes.

Per rank, loading with half the world size: stock reads ``.metadata`` and runs DCP's resharding
(``create_read_items_for_chunk_list`` per tensor); ours adds ``DataStatesReader``'s metadata and
manifest checks and its grouping of the reads (no byte is read).

Derived (not measured): objects per save, and requests per second against one prefix if every
rank flushes at once at :data:`RANK_GBPS` (S3 takes about 3,500 PUT/s per prefix).
"""

from __future__ import annotations

import functools
import gc
import math
import pickle
import shutil
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import default_planner as _stock_planner
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from dcp_datastates import DataStatesReader, DataStatesWriter
from dcp_datastates._dcp_private import StorageInfo
from dcp_datastates.format import RecordInfo
from dcp_datastates.save.planner import GlobalPlanMemo, StagedSavePlanner

from . import sim_states
from .common import Recorder, fresh_dir, log

SCENARIO = "simulate"
#: Flush rate of one rank assumed for the derived request rates (bytes per second).
RANK_GBPS = 1.0
#: Multipart part sizes: ours (``S3Storage``'s default) and s3fs's (stock ``FsspecWriter``).
OURS_PART, STOCK_PART = 16 << 20, 50 << 20
#: Flush files per rank: ours (``flush_workers``'s default) and stock's (``thread_count=1``).
OURS_FILES, STOCK_FILES = 4, 1
#: Bytes of a torch.save record's frame around a tensor's data (about).
FRAME = 1100
#: Per-prefix request rate S3 documents (PUT/COPY/POST/DELETE).
S3_PUT_PER_PREFIX = 3500

#: (model, layout kind, replicas, tp, world sizes, layers simulated) of the full run; None:
#: all of the model's layers. A point of fewer layers scales its per-item figures (times,
#: sizes, memory) by the ratio of the model's items to those simulated: every cost here is per
#: item (the quadratic validation is per tensor, and scales the same way), and 4,096 ranks of
#: all 723 tensors of the 70B model are 3 million items, more than this 2-core machine plans
#: in minutes.
POINTS: list[tuple[str, str, int, int, tuple[int, ...], int | None]] = [
    ("70B", "fsdp", 1, 1, (8, 64, 512, 1024, 4096), 4),
    ("70B", "fsdp", 1, 1, (64,), None),  # the check of the scaling: all 80 layers
    ("7B", "fsdp", 1, 1, (8, 64, 512), None),
    ("7B", "hsdp", 8, 1, (64, 512), None),
    ("70B", "fsdp+tp", 1, 8, (64, 512), 4),
]
QUICK_POINTS: list[tuple[str, str, int, int, tuple[int, ...], int | None]] = [
    ("7B", "fsdp", 1, 1, (16,), 2),
    ("7B", "hsdp", 4, 1, (16,), 2),
    ("7B", "fsdp+tp", 1, 4, (16,), 2),
]
#: Figures that are counts or rates of the whole job, not scaled with the simulated items.
UNSCALED = {"objects", "put_per_s"}


def _timed(fn: Callable[[], Any], memory: bool) -> tuple[Any, float, float]:
    """``(result, CPU seconds, peak MB that fn allocated)``; peak 0 when not ``memory``. CPU
    time of this process (the planning is single-threaded): the machine is shared, and wall
    time would count other processes' turns."""
    if memory:
        tracemalloc.start()
    t0 = time.process_time()
    try:
        out = fn()
        took = time.process_time() - t0
        peak = tracemalloc.get_traced_memory()[1] / 1e6 if memory else 0.0
    finally:
        if memory:
            tracemalloc.stop()
    return out, took, peak


def _validation_s(
    validate: Callable[..., Any], metadata: Metadata, global_plan: list[SavePlan], layers: int
) -> float:
    """Stock's ``_validate_global_plan`` time: measured on the tensors outside the layers and
    those of layer 0, layer 0's time counted ``layers`` times."""
    md = metadata.state_dict_metadata
    outside = {k: v for k, v in md.items() if ".layers." not in k}
    layer0 = {k: v for k, v in md.items() if ".layers.0." in k}
    took = 0.0
    for part, times in ((outside, 1), (layer0, layers)):
        t0 = time.process_time()
        validate(global_plan, Metadata(part))
        took += (time.process_time() - t0) * times
    return took


def _results(
    global_plan: list[SavePlan], files: int, ours: bool
) -> tuple[list[list[WriteResult]], dict[str, int]]:
    """Each rank's write results for its final plan (items spread over ``files`` files per
    rank), and every file's size."""
    results, sizes = [], {}
    for rank, plan in enumerate(global_plan):
        ends = [0] * files
        out = []
        for i, item in enumerate(plan.items):
            f = i % files
            name = f"__{rank}_{f}.distcp"
            data = item.tensor_storage_size() or 64
            length = data + FRAME
            at = ends[f]
            ends[f] += length
            if ours:
                info: Any = RecordInfo(name, at, length, at + FRAME - 100, data, 0, "shard")
            else:
                info = StorageInfo(name, at, length)
            out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
        results.append(out)
        sizes.update({f"__{rank}_{f}.distcp": e for f, e in enumerate(ends) if e})
    return results, sizes


def _stock_save(plans: list[SavePlan], path: Path, layers: int, memory: bool) -> dict[str, float]:
    """Stock's coordinator: the first save and a cached repeat."""
    _clear_stock_cache()
    writer = FileSystemWriter(str(path), sync_files=False)
    writer.set_up_storage_writer(True)
    validate = _stock_planner._validate_global_plan
    _stock_planner._validate_global_plan = lambda *a: []  # timed apart: _validation_s
    try:
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner.set_up_planner({}, is_coordinator=True)

        def plan() -> tuple[list[SavePlan], Metadata]:
            gp, md = planner.create_global_plan(plans)
            return writer.prepare_global_plan(gp), md

        (gp, md), plan_s, plan_mb = _timed(plan, memory)
        valid_s = _validation_s(validate, md, gp, layers)
        results, _ = _results(gp, STOCK_FILES, ours=False)
        _, commit_s, commit_mb = _timed(lambda: writer.finish(md, results), memory)
        # The repeat: every rank's plan unchanged, so each sends an empty, unusable one.
        unchanged = [SavePlan([], usable=False) for _ in plans]
        _, repeat_s, _ = _timed(
            lambda: writer.prepare_global_plan(planner.create_global_plan(unchanged)[0]), False
        )
    finally:
        _stock_planner._validate_global_plan = validate
        _clear_stock_cache()  # DCP keeps it on the class: it would outlive this save
    return {
        "plan_s": plan_s + valid_s,
        "validate_s": valid_s,
        "commit_s": commit_s,
        "repeat_plan_s": repeat_s,
        "peak_mb": max(plan_mb, commit_mb),
        "metadata_mb": (path / ".metadata").stat().st_size / 1e6,
        "manifest_mb": 0.0,
    }


def _clear_stock_cache() -> None:
    for name in dir(SavePlanner):
        if name.startswith("_cached_") and isinstance(getattr(SavePlanner, name), dict):
            getattr(SavePlanner, name).clear()


def _ours_save(plans: list[SavePlan], path: Path, memory: bool) -> dict[str, float]:
    """Our coordinator: the first save (planned and committed) and the planning of a repeat
    into a new directory whose ranks replay their plans. Each rank has its writer's memo (rank
    0's is the coordinator's); the ranks' parts run untimed."""
    memos = [GlobalPlanMemo() for _ in plans]
    writer = DataStatesWriter(str(path), sync_files=False)
    figures: dict[str, float] = {}
    try:
        for save, where in (("first", path), ("repeat", path / "repeat")):
            local = [m.local(p) for m, p in zip(memos, plans, strict=True)]
            planner = StagedSavePlanner(lambda: None, memos[0])
            planner.set_up_planner({}, is_coordinator=True)
            writer.reset(str(where))
            writer.set_up_storage_writer(True, rank=0)

            def plan(planner: StagedSavePlanner = planner, local: list = local) -> Any:
                gp, md = planner.create_global_plan(local)
                return writer.prepare_global_plan(gp), md

            measure = memory and save == "first"
            (gp, md), plan_s, plan_mb = _timed(plan, measure)
            final = [m.finish(c, p) for m, c, p in zip(memos, gp, plans, strict=True)]
            if save == "repeat":
                figures["repeat_plan_s"] = plan_s
                break
            results, sizes = _results(final, OURS_FILES, ours=True)
            for name, size in sizes.items():
                with open(path / name, "wb") as f:
                    f.truncate(size)
            commit = functools.partial(writer.finish, md, results)
            _, commit_s, commit_mb = _timed(commit, measure)
            figures.update(plan_s=plan_s, commit_s=commit_s, peak_mb=max(plan_mb, commit_mb))
            del results, gp, final
    finally:
        writer.close()
    figures["metadata_mb"] = (path / ".metadata").stat().st_size / 1e6
    figures["manifest_mb"] = (path / ".datastates.json").stat().st_size / 1e6
    return figures


class _Targets:
    """A load planner's ``resolve_tensor``/``commit_tensor`` for the read grouping: meta
    tensors, nothing allocated."""

    def resolve_tensor(self, req: Any) -> torch.Tensor:
        return torch.empty(tuple(req.lengths), device="meta")

    def commit_tensor(self, req: Any, tensor: torch.Tensor) -> None:
        pass


def _load_rank(
    model: sim_states.Model, layout: sim_states.Layout, rank: int, stock: Path, ours: Path
) -> dict[str, float]:
    """One rank's read planning when loading with ``layout`` (another world size)."""
    chunks = list(sim_states.load_chunks(model, layout, rank))

    def reshard(metadata: Metadata) -> LoadPlan:
        items = []
        for fqn, _, chunk in chunks:
            md = metadata.state_dict_metadata[fqn]
            if chunk is None:
                continue
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)

    def stock_plan() -> LoadPlan:
        with open(stock / ".metadata", "rb") as f:
            metadata = pickle.load(f)
        return reshard(metadata)

    def ours_plan() -> Any:
        reader = DataStatesReader(str(ours))
        metadata = reader.read_metadata()
        reader.set_up_storage_reader(metadata, is_coordinator=False, rank=rank)
        plan = reshard(metadata)
        return reader._plan_reads(plan.items, _Targets(), {})

    stock_items, stock_s, _ = _timed(stock_plan, False)
    (records, _), ours_s, _ = _timed(ours_plan, False)
    return {
        "stock_s": stock_s,
        "ours_s": ours_s,
        "reads": float(len(stock_items.items)),
        "records": float(len(records)),
    }


def _derived(model: sim_states.Model, world: int) -> dict[str, float]:
    """Objects per save and PUT requests per second on one prefix, every rank flushing at once."""
    per_rank = model.nbytes() / world
    flush_s = per_rank / (RANK_GBPS * 1e9)
    out = {}
    for who, files, part in (("ours", OURS_FILES, OURS_PART), ("stock", STOCK_FILES, STOCK_PART)):
        size = per_rank / files
        puts = files * (math.ceil(size / part) + 2 if size > part else 1)
        out[f"{who}_objects"] = float(world * files + (2 if who == "ours" else 1))
        out[f"{who}_put_per_s"] = world * puts / flush_s
    return out


def run(
    rec: Recorder,
    *,
    workdir: Path,
    quick: bool,
    memory_up_to: int = 512,
    png: Path | None = None,
) -> None:
    workdir = fresh_dir(workdir / SCENARIO)
    for name, kind, replicas, tp, worlds, layers in QUICK_POINTS if quick else POINTS:
        full = sim_states.MODELS[name]
        model = full if layers is None else sim_states.Model(**{**vars(full), "layers": layers})
        scale = len(full.tensors()) / len(model.tensors())
        for world in worlds:
            layout = sim_states.Layout(kind=kind, world=world, replicas=replicas, tp=tp)
            label = f"{name} {kind}" + (f" x{replicas}" if replicas > 1 else "")
            label += f" tp{tp}" if tp > 1 else ""
            label += f" ({layers} layers x{scale:.1f})" if layers is not None else ""
            log(f"simulate: {label} at {world} ranks")
            t0 = time.monotonic()
            plans = sim_states.local_plans(model, layout)
            items = sum(len(p.items) for p in plans)
            gc.collect()
            gc.freeze()  # the gathered plans: the same for both, not collected again
            memory = world <= memory_up_to
            try:
                stock_dir, ours_dir = workdir / f"stock_{world}", workdir / f"ours_{world}"
                stock_dir.mkdir()
                ours_dir.mkdir()
                stock = _stock_save(plans, stock_dir, model.layers, memory)
                ours = _ours_save(plans, ours_dir, memory)
                del plans
                gc.unfreeze()
                gc.collect()
                load = sim_states.Layout(
                    kind=kind, world=max(world // 2, replicas * tp), replicas=replicas, tp=tp
                )
                reads = _load_rank(model, load, 1, stock_dir, ours_dir)
            finally:
                gc.unfreeze()
                shutil.rmtree(stock_dir, ignore_errors=True)
                shutil.rmtree(ours_dir, ignore_errors=True)
            derived = _derived(full, world)
            common = {
                "model": label,
                "world": world,
                "local_items": round(items * scale),
                "simulated_items": items,
                "scale": scale,
            }
            for system, figures in (("stock", stock), ("ours", ours)):
                figures = {
                    **figures,
                    "load_plan_s": reads[f"{system}_s"],
                    "objects": derived[f"{system}_objects"],
                    "put_per_s": derived[f"{system}_put_per_s"],
                }
                figures = {k: v if k in UNSCALED else v * scale for k, v in figures.items()}
                rec.emit(SCENARIO, system, figures, **common)
            log(f"simulate: {label} at {world} ranks: {time.monotonic() - t0:.1f} s")
    if png is not None:
        from .sim_plot import plot

        rec.note(f"simulate picture: {plot(rec, png)}")
