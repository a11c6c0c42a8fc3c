"""Crash at any moment: a process saving checkpoint after checkpoint is killed with SIGKILL at
seeded random points spread over the snapshot, the flush and the commit. After every kill the
last committed checkpoint loads bit-exactly with stock DCP and with our reader, and the save that
was cut short is refused as not committed (and stock DCP finds no ``.metadata`` in it).

The worker (``_fault_workers.py crash``) reports phase markers with timestamps; each trial picks
a phase and kills the worker a seeded random delay after that phase's marker. A restarted worker
saves the interrupted step again, into the directory the killed one left behind.
"""

from __future__ import annotations

import collections
import functools
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from _fault_workers import CRASH_STATE_MIB, start_crash_worker
from _faults_util import BOUNDED_S, state_at, wait_until
from conftest import assert_same_state, blank_like, load

from dcp_datastates import CheckpointNotCommittedError, DataStatesReader
from dcp_datastates.format import METADATA_NAME

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(300)]

SEED = 7
TRIALS = 21  # 7 per phase
#: Per target phase: the marker to count from, and the window (seconds) the kill is drawn from,
#: uniformly. Measured on this machine: the snapshot of the 24 MiB state takes ~40 ms (its flush
#: starts ~3 ms in and streams alongside), the flush ends ~15 ms after the snapshot, and the
#: commit (manifest, .metadata, their fsyncs and renames) takes ~5 ms.
KILL_AFTER = {
    "snapshot": ("snapshot", 0.030),
    "flush": ("safe", 0.012),
    "commit": ("commit", 0.005),
}


def _markers(run_dir: Path, since: int) -> dict[int, dict[str, float]]:
    """{step: {phase: monotonic time}} from the marker lines after byte ``since`` (one worker's)."""
    seen: dict[int, dict[str, float]] = collections.defaultdict(dict)
    path = run_dir / "markers"
    if path.exists():
        with open(path, "rb") as f:
            f.seek(since)
            text = f.read().decode()
        for line in text.splitlines():
            step, phase, at = line.split()
            seen[int(step)][phase] = float(at)
    return seen


def _reached(
    run_dir: Path, since: int, step: int, marker: str, worker: subprocess.Popen
) -> float | bool:
    """The time of ``marker`` for ``step``, or True if the worker exited before it."""
    return _markers(run_dir, since)[step].get(marker) or worker.poll() is not None


def _landed_in(phases: dict[str, float]) -> str:
    """Where the save was when it was killed, from the markers it left."""
    if "done" in phases:
        return "after done"
    if "commit" in phases:
        return "commit"
    if "safe" in phases:
        return "flush (snapshot complete)"
    if "flush" in phases:
        return "snapshot + flush"
    return "snapshot"


def _assert_loads_exactly(path: Path, step: int) -> None:
    expected = state_at(step, CRASH_STATE_MIB)
    for reader in ("stock", "datastates"):
        assert_same_state(expected, load(path, blank_like(expected), reader), f"{path.name}")


def _assert_refused(path: Path) -> None:
    assert not (path / METADATA_NAME).exists()
    with pytest.raises(CheckpointNotCommittedError):
        DataStatesReader(path).read_metadata()
    expected = state_at(0, CRASH_STATE_MIB)
    with pytest.raises(BaseException) as raised:  # stock DCP: CheckpointException / OSError
        dcp.load(blank_like(expected), checkpoint_id=str(path), no_dist=True)
    assert METADATA_NAME in repr(raised.value) or isinstance(raised.value, FileNotFoundError)


def test_sigkill_at_random_points_never_loses_the_last_committed_checkpoint(
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    landed: collections.Counter[str] = collections.Counter()
    first_step = 0
    committed: int | None = None
    for trial in range(TRIALS):
        phase = ("snapshot", "flush", "commit")[trial % 3]
        # The first worker must commit once before it dies; later ones may die in their first save.
        target = first_step + (1 if committed is None else rng.randrange(2))
        marker, window = KILL_AFTER[phase]
        delay = rng.uniform(0.0, window)
        since = (run_dir / "markers").stat().st_size if (run_dir / "markers").exists() else 0
        worker = start_crash_worker(run_dir, first_step)
        try:
            marked = wait_until(
                functools.partial(_reached, run_dir, since, target, marker, worker),
                BOUNDED_S,
                f"trial {trial}: marker '{target} {marker}'",
                poll=0.0005,
            )
            assert worker.poll() is None, f"the worker exited on its own:\n{_log(run_dir)}"
            pause = marked + delay - time.monotonic()
            if pause > 0:
                time.sleep(pause)  # the injection point itself: a seeded delay after the marker
            os.kill(worker.pid, signal.SIGKILL)
        finally:
            if worker.poll() is None:
                worker.kill()
            worker.wait()
        assert worker.returncode == -signal.SIGKILL

        markers = _markers(run_dir, since)
        interrupted = max(markers)
        landed[_landed_in(markers[interrupted])] += 1
        done = [s for s, phases in markers.items() if "done" in phases]
        if done:
            committed = max(done)
        ckpt = run_dir / f"ckpt_{interrupted}"
        if "commit" not in markers[interrupted]:
            # finish() never ran: there cannot be a commit record.
            _assert_refused(ckpt)
        elif (ckpt / METADATA_NAME).exists():
            # Killed after .metadata was renamed into place: committed, and whole.
            committed = interrupted
        else:
            _assert_refused(ckpt)
        assert committed is not None
        _assert_loads_exactly(run_dir / f"ckpt_{committed}", committed)
        first_step = committed + 1 if committed == interrupted else interrupted

    # Every directory left behind is either a whole checkpoint of its step or refused.
    for ckpt in sorted(run_dir.glob("ckpt_*")):
        step = int(ckpt.name.split("_")[1])
        if (ckpt / METADATA_NAME).exists():
            expected = state_at(step, CRASH_STATE_MIB)
            assert_same_state(expected, load(ckpt, blank_like(expected), "datastates"), ckpt.name)
        else:
            _assert_refused(ckpt)
    print(f"\ncrash campaign: {TRIALS} kills, landed in {dict(landed)}")
    # The kills are spread over the pipeline, not bunched in one phase.
    assert landed["snapshot"] + landed["snapshot + flush"] >= 3, landed
    assert landed["flush (snapshot complete)"] + landed["snapshot + flush"] >= 3, landed
    assert landed["commit"] >= 1, landed


def _log(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in run_dir.glob("worker-*.log"))
