"""The save scenario: every system saves the same state, each in its own subprocess.

A fresh process per (system, round) gives each system its own peak RSS and shows what it keeps
between saves (our host pool, DefaultStager's staging copy). A system that keeps state between
saves saves ``--saves`` times per process (4 in the full run): the first save pays one-off costs
(pool or cache allocation), the later ones are the steady state a training job sees and each is
reported, so a system's medians span rounds x 3 saves, not 2 (the first save is kept in the
process's first JSON line as ``first_save``); the others have nothing to carry over and save
once. Systems alternate within a round and reverse order between rounds, beside a raw
write+fsync of the same bytes, so the durable throughput can be compared with what the disk did
at that moment.
"""

from __future__ import annotations

import gc
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import disk_limit, limits, state, systems
from .common import GB, RESULT_PREFIX, PeakRSS, Recorder, alternate, dir_bytes, fresh_dir, log, rss

BENCH = Path(__file__).resolve().parents[1] / "bench.py"
LIMIT = "limit"
#: The systems whose save processes also time ``limits.state_copy`` (the safe target's limit).
COPY_LIMIT_KEYS = ("ours-async-1", "stock-stager")
SETTLE_S = 0.3


def _settled_rss() -> int:
    """RSS once the save's threads have let go of what they held (the future resolves a moment
    before DCP's thread drops its staged copy); between saves a job has at least this long."""
    gc.collect()
    time.sleep(SETTLE_S)
    gc.collect()
    return rss()


def worker(keys: list[str], nbytes: int, tensors: int, saves: int, workdir: Path) -> None:
    """In the subprocess: build the state, save it ``saves`` times per system, print results."""
    sd = state.build(nbytes, tensors)
    state_bytes = state.nbytes(sd)
    count = len(state.tensors_of(sd))
    for key in keys:
        gc.collect()
        base = rss()
        system = systems.make(key, workdir / f"{key}_root", state_bytes)
        results = []
        for k in range(saves if system.keeps_state else 1):
            path = workdir / f"{key}_{k}"
            with PeakRSS() as peak:
                times = system.save(sd, path, no_dist=True)
            written = dir_bytes(path)
            shutil.rmtree(path)
            held = _settled_rss() - base
            results.append(
                {
                    **times.figures(),
                    **times.extra,
                    "bytes_written": written,
                    "peak_extra_bytes": peak.peak - base,
                    "held_bytes": held,
                }
            )
        system.close()
        del system
        gc.collect()
        # The copy limit of the safe-to-mutate target, in the processes of the two systems it
        # compares, once their pool or staging copy is let go (limits.state_copy).
        copy_limit = (
            {"copy_limit_s": limits.state_copy(state.tensors_of(sd), limits.copy_workers())}
            if key in COPY_LIMIT_KEYS
            else {}
        )
        report = {
            "key": key,
            "state_bytes": state_bytes,
            "tensors": count,
            "saves": results,
            **copy_limit,
            "base_rss_bytes": base,
            # Linux updates the high-water mark lazily: it can lag the RSS read a moment ago.
            "maxrss_bytes": max(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                base,
                *(base + r["peak_extra_bytes"] for r in results),
            ),
        }
        print(RESULT_PREFIX + json.dumps(report), flush=True)


def _spawn(keys: list[str], nbytes: int, tensors: int, saves: int, workdir: Path) -> list[dict]:
    cmd = [sys.executable, str(BENCH), "_save-worker", "--systems", ",".join(keys)]
    cmd += ["--bytes", str(nbytes), "--tensors", str(tensors), "--saves", str(saves)]
    cmd += ["--dir", str(workdir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(
            f"save worker {keys} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return [
        json.loads(ln[len(RESULT_PREFIX) :])
        for ln in proc.stdout.splitlines()
        if ln.startswith(RESULT_PREFIX)
    ]


def _emit(rec: Recorder, report: dict[str, Any], r: int) -> None:
    """One record per steady save of the process (every save after the first for a system that
    keeps state between saves, else its only one): the medians then span ``rounds`` x (saves -
    1) saves, not one per round. The first save's figures and the process's copy limit ride on
    its first record only, so each process counts once in their medians."""
    saves = report["saves"]
    first = saves[0]
    steady = saves[1:] or saves
    per_process = {"first_save": {k: first[k] for k in ("blocked_s", "safe_s", "durable_s")}}
    if "copy_limit_s" in report:
        per_process["copy_limit_s"] = report["copy_limit_s"]
    for i, save in enumerate(steady):
        figures = {k: save[k] for k in ("blocked_s", "safe_s", "durable_s")}
        figures["durable_gb_per_s"] = report["state_bytes"] / GB / save["durable_s"]
        rec.emit(
            "save",
            systems.SAVE_SYSTEMS[report["key"]],
            figures,
            memory={
                "peak_extra_bytes": max(x["peak_extra_bytes"] for x in saves),
                "held_bytes": save["held_bytes"],
                "base_rss_bytes": report["base_rss_bytes"],
                "maxrss_bytes": report["maxrss_bytes"],
            },
            **(per_process if i == 0 else {}),
            library_stats=save.get("library_stats"),
            bytes=report["state_bytes"],
            bytes_written=save["bytes_written"],
            tensors=report["tensors"],
            saves_per_process=len(saves),
            save_index=len(saves) - len(steady) + i,
            round=r,
        )


def run(
    rec: Recorder,
    *,
    workdir: Path,
    nbytes: int,
    tensors: int,
    rounds: int,
    saves: int,
    isolate: bool,
    keys: list[str],
) -> None:
    workdir = fresh_dir(workdir / "save")
    state_bytes = state.layout_bytes(nbytes, tensors)
    log(
        f"save: {state_bytes / GB:.2f} GB, ~{tensors} tensors, {len(keys)} systems, {rounds} rounds"
    )
    for r in range(rounds):
        if isolate:
            batches = [[k] for k in alternate([*keys, LIMIT], r)]
        else:  # quick mode: one process for all systems, the raw limit before or after it
            together = alternate(keys, r)
            batches = [[LIMIT], together] if r % 2 == 0 else [together, [LIMIT]]
        for batch in batches:
            if batch == [LIMIT]:
                # The disk's write limit of this round: the best of a sweep of ways to write
                # and fsync the same bytes, ours among them (disk_limit.py).
                disk_limit.emit_best(rec, workdir, state_bytes, r)
                continue
            log(f"  round {r}: {', '.join(batch)}")
            for report in _spawn(batch, nbytes, tensors, saves, workdir):
                _emit(rec, report, r)
