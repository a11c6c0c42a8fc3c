"""The scaling scenario: how each system's save cost grows with state size and tensor count.

To fit the default run's time budget this uses a reduced system set (stock ``dcp.save`` with one
thread, stock ``dcp.async_save`` default, ours async with a full pool) and runs in this process.
A system keeping state between saves (our writer: its host pool) saves once untimed first, as the
save scenario does (that first save, with the pool's allocation, is in ``first_save``).

Size axis: one save per system and point (blocked times there are tenths of seconds for stock
against milliseconds for ours: one save tells them apart).

Count axis: the blocked times compared are milliseconds, where one save is noise (in one run at
99 tensors ours blocked 7 ms, and a fresh writer of ours after warm-up 2 ms), so each system
saves several times (:data:`COUNT_SAVES`), systems alternating, one record per save; the report
takes medians. The :data:`systems.FLOOR` system runs here too: ``dcp.async_save`` with a stager
that copies nothing, the least any stager can block for *through* ``dcp.async_save``; and
:data:`systems.DCP_OURS`, our writer passed to ``dcp.async_save`` itself (the drop-in call),
where ``ours async pool 1/1`` calls ``dcp_datastates.async_save``, whose saves run on the
writer's reused threads rather than on a thread started per save. A system stops repeating
once its saves at the point have taken ``repeat_s`` seconds (it always saves once): at 20,000
tensors a save of stock or of the floor takes 7-8 s on the 2-core machine, so by default each
saves once there (a larger ``--scale-repeat-s`` buys repeats at that cost); ours, whose blocked
time the targets judge in milliseconds, saves its full count (:data:`JUDGED_AT_COUNT`).

Our writer also runs as a user who calls ``DataStatesWriter.warm_up`` at set-up would: a fresh
writer, warm-up (timed, waited for), then one save, recorded as :data:`WARM`, :data:`WARM_SAVES`
times per point -- issue 11's target for the first save (time to safe at most 1.5x the steady
state's) is read from their median. At the largest size, :data:`FIRST_COPY` measures the part
of that which is the memory's: the state copied twice into memory faulted in as ``warm_up``
faults the pool in.
"""

from __future__ import annotations

import gc
import math
import shutil
from pathlib import Path

import torch

from dcp_datastates.snapshot.hostmem import SLICE_BYTES, PopulatedBuffer

from . import state, systems
from .common import GB, Recorder, alternate, fresh_dir, log, now

#: Timed saves per system at a size point and at a count point, in rotation order.
#: Ours saves 3 times at a size point: the first-save target divides by its steady time to safe,
#: a few tenths of a second that a single save on this VM can double (one of three steady
#: saves at 4 GB read 0.60 s against 0.29-0.30 s).
SIZE_SAVES = {"stock-sync-t1": 1, "stock-async": 1, "ours-async-1": 3}
COUNT_SAVES = {
    "stock-sync-t1": 1,
    "stock-async": 3,
    systems.FLOOR_KEY: 5,
    "ours-async-1": 5,
    systems.DCP_OURS_KEY: 3,
}
#: Systems whose figures at a count point the targets judge against milliseconds: they save
#: their full count whatever ``repeat_s``: at 20,000 tensors a save of ours takes 3-4 s, so the
#: default budget of 4 s left it 2 timed saves, whose median is their mean, moved by half of any
#: one slow save's excess on this VM. Stock blocks 30-40x longer there: one save tells them apart.
JUDGED_AT_COUNT = frozenset({"ours-async-1"})
#: The first save's limit, at the largest size point: the state's bytes copied twice into memory
#: faulted in as ``warm_up`` faults the pool in (``hostmem.PopulatedBuffer``).
FIRST_COPY = "raw: copy into memory faulted in as warm_up does"
#: Our writer's first save after ``warm_up``: a fresh writer, its pool allocated and faulted in.
WARM = "ours async pool 1/1, first save after warm_up"
WARM_KEY = "ours-async-1-warm"
#: Fresh writers (each: ``warm_up``, one save) per point: 3 on the size axis, whose medians the
#: first-save target reads, 1 on the count axis.
WARM_SAVES = {"size": 3, "count": 1}


def run(
    rec: Recorder,
    *,
    workdir: Path,
    sizes: list[float],
    size_tensors: int,
    counts: list[int],
    count_bytes: float,
    repeat_s: float,
) -> None:
    workdir = fresh_dir(workdir / "scaling")
    points = [("size", nbytes, size_tensors) for nbytes in sizes]
    points += [("count", count_bytes, n) for n in counts]
    log(f"scaling: sizes {[s / GB for s in sizes]} GB, counts {counts}")
    for p, (axis, nbytes, tensors) in enumerate(points):
        sd = state.build(nbytes, tensors)
        point = {"axis": axis, "bytes": state.nbytes(sd), "tensors": len(state.tensors_of(sd))}
        if axis == "size":
            _rotate(rec, sd, workdir, point, SIZE_SAVES, math.inf, p)
        else:
            _rotate(rec, sd, workdir, point, COUNT_SAVES, repeat_s, p)
        if axis == "size" and nbytes == max(sizes):
            _measure_first_copy(rec, sd, point)
        for _ in range(WARM_SAVES[axis]):
            _measure_warm(rec, sd, workdir, point)
        del sd
        gc.collect()


def _rotate(
    rec: Recorder,
    sd: dict,
    workdir: Path,
    point: dict,
    saves: dict[str, int],
    repeat_s: float,
    first_round: int,
) -> None:
    """Rounds in which each system of ``saves`` saves once, the order reversed every round, until
    each has saved its count or (after one save) spent ``repeat_s`` seconds in saves here; those
    of :data:`JUDGED_AT_COUNT` always save their count.

    A system is made at its first save and closed after its last, so that (on the size axis,
    where states are GBs) only one system's memory is held at a time besides the state."""
    open_systems: dict[str, systems.SaveSystem] = {}
    done = dict.fromkeys(saves, 0)
    spent = dict.fromkeys(saves, 0.0)
    try:
        for r in range(max(saves.values())):
            for key in alternate(list(saves), first_round + r):
                budget = math.inf if key in JUDGED_AT_COUNT else repeat_s
                if done[key] >= saves[key] or (done[key] and spent[key] >= budget):
                    continue
                extra: dict = {"round": r}
                if key not in open_systems:
                    open_systems[key] = systems.make(key, workdir / "root", point["bytes"])
                    if open_systems[key].keeps_state:
                        extra["first_save"] = _save(open_systems[key], sd, workdir / key).figures()
                times = _save(open_systems[key], sd, workdir / key)
                _emit(rec, open_systems[key].name, times, point, extra)
                done[key] += 1
                spent[key] += times.durable_s
                if done[key] == saves[key]:
                    open_systems.pop(key).close()
    finally:
        for system in open_systems.values():
            system.close()


def _measure_warm(rec: Recorder, sd: dict, workdir: Path, point: dict) -> None:
    """A fresh writer's first save after ``warm_up``, recorded as :data:`WARM`."""
    system = systems.make(WARM_KEY.removesuffix("-warm"), workdir / "root", point["bytes"])
    try:
        warm_up_s = system.warm_up(sd)
        times = _save(system, sd, workdir / WARM_KEY)
    finally:
        system.close()
    _emit(rec, WARM, times, point, {"warm_up_s": warm_up_s})


def _measure_first_copy(rec: Recorder, sd: dict, point: dict) -> None:
    """The state's tensors copied into fresh memory that was faulted in first, as ``warm_up``
    faults the pool in, twice: on this VM the first pass has been 2-3x slower than the second
    in some runs and level with it in others, whatever the writer does, which is the part of
    a first save after ``warm_up`` that no writer-side code here controls."""
    tensors = [t.reshape(-1).view(torch.uint8) for t in state.tensors_of(sd)]
    total = sum(t.numel() for t in tensors)
    buf = PopulatedBuffer(total)
    for offset in range(0, total, SLICE_BYTES):
        buf.populate(offset, min(SLICE_BYTES, total - offset))
    passes = []
    for _ in range(2):
        t0, offset = now(), 0
        for t in tensors:
            buf.tensor[offset : offset + t.numel()].copy_(t)
            offset += t.numel()
        passes.append(now() - t0)
    del buf
    rec.emit("scaling", FIRST_COPY, {"first_s": passes[0], "second_s": passes[1]}, **point)


def _save(system: systems.SaveSystem, sd: dict, path: Path) -> systems.SaveTimes:
    """One save, waited for and its files removed. Its futures (and the metadata they hold) die
    with ``system.save``'s frame, so freeing them is not in the next save's time. No
    ``gc.collect()`` here: a full collection takes 0.2-0.3 s in this process, a few seconds per
    count point; the medians take care of a collection landing in one save."""
    try:
        return system.save(sd, path, no_dist=True)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _emit(rec: Recorder, name: str, times: systems.SaveTimes, point: dict, extra: dict) -> None:
    figures = {**times.figures(), "durable_gb_per_s": point["bytes"] / GB / times.durable_s}
    rec.emit("scaling", name, figures, **extra, **point)
