"""The scaling scenario: how each system's save cost grows with state size and tensor count.

To fit the default run's time budget this uses a reduced system set (stock ``dcp.save`` with one
thread, stock ``dcp.async_save`` default, ours async with a full pool), one round, and runs in
this process. Each point builds its state once and each system saves it once, except that a
system keeping state between saves (our writer: its host pool) saves twice and reports the second
save, as the save scenario does (the first, with the pool's allocation, is in ``first_save``).

Our writer also runs once more per point as a user who calls ``DataStatesWriter.warm_up`` at
set-up would: warm-up (timed, waited for), then one save, recorded as :data:`WARM` -- issue 11's
target for the first save (time to safe at most 1.5x the steady state's) is read from it.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

from . import state, systems
from .common import GB, Recorder, alternate, fresh_dir, log

KEYS = ["stock-sync-t1", "stock-async", "ours-async-1"]
#: Our writer's first save after ``warm_up``: a fresh writer, its pool allocated and faulted in.
WARM = "ours async pool 1/1, first save after warm_up"


def run(
    rec: Recorder,
    *,
    workdir: Path,
    sizes: list[float],
    size_tensors: int,
    counts: list[int],
    count_bytes: float,
) -> None:
    workdir = fresh_dir(workdir / "scaling")
    points = [("size", nbytes, size_tensors) for nbytes in sizes]
    points += [("count", count_bytes, n) for n in counts]
    log(f"scaling: sizes {[s / GB for s in sizes]} GB, counts {counts}")
    for p, (axis, nbytes, tensors) in enumerate(points):
        sd = state.build(nbytes, tensors)
        size = state.nbytes(sd)
        count = len(state.tensors_of(sd))
        for key in alternate(KEYS, p):
            system = systems.make(key, workdir / "root", size)
            path = workdir / key
            first = None
            try:
                if system.keeps_state:
                    first = system.save(sd, path, no_dist=True).figures()
                    shutil.rmtree(path, ignore_errors=True)
                times = system.save(sd, path, no_dist=True)
            finally:
                system.close()
                shutil.rmtree(path, ignore_errors=True)
            rec.emit(
                "scaling",
                systems.SAVE_SYSTEMS[key],
                {**times.figures(), "durable_gb_per_s": size / GB / times.durable_s},
                first_save=first,
                axis=axis,
                bytes=size,
                tensors=count,
            )
        _first_after_warm_up(rec, sd, workdir, axis=axis, size=size, count=count)
        del sd
        gc.collect()


def _first_after_warm_up(
    rec: Recorder, sd: dict, workdir: Path, *, axis: str, size: int, count: int
) -> None:
    system = systems.make("ours-async-1", workdir / "root", size)
    path = workdir / "ours-warm"
    try:
        warm_up_s = system.warm_up(sd)
        times = system.save(sd, path, no_dist=True)
    finally:
        system.close()
        shutil.rmtree(path, ignore_errors=True)
    rec.emit(
        "scaling",
        WARM,
        {**times.figures(), "durable_gb_per_s": size / GB / times.durable_s},
        warm_up_s=warm_up_s,
        axis=axis,
        bytes=size,
        tensors=count,
    )
