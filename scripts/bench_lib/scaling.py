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
WARM_KEY = "ours-async-1-warm"


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
        point = {"axis": axis, "bytes": state.nbytes(sd), "tensors": len(state.tensors_of(sd))}
        for key in [*alternate(KEYS, p), WARM_KEY]:
            _measure(rec, key, sd, workdir, point)
        del sd
        gc.collect()


def _measure(rec: Recorder, key: str, sd: dict, workdir: Path, point: dict) -> None:
    """One system at one point: its steady save (after a first one, for systems keeping state),
    or for :data:`WARM_KEY` a fresh writer's first save after ``warm_up``."""
    size = point["bytes"]
    system = systems.make(key.removesuffix("-warm"), workdir / "root", size)
    path = workdir / key
    extra: dict = {}
    try:
        if key == WARM_KEY:
            extra["warm_up_s"] = system.warm_up(sd)
        elif system.keeps_state:
            extra["first_save"] = system.save(sd, path, no_dist=True).figures()
            shutil.rmtree(path, ignore_errors=True)
        times = system.save(sd, path, no_dist=True)
    finally:
        system.close()
        shutil.rmtree(path, ignore_errors=True)
    name = WARM if key == WARM_KEY else systems.SAVE_SYSTEMS[key]
    figures = {**times.figures(), "durable_gb_per_s": size / GB / times.durable_s}
    rec.emit("scaling", name, figures, **extra, **point)
