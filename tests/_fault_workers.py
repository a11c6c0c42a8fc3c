"""Worker processes of the fault campaign.

``python _fault_workers.py crash RUN_DIR FIRST_STEP`` saves steps FIRST_STEP, FIRST_STEP+1, ...
into ``RUN_DIR/ckpt_{step}`` with one reused writer until it is killed, and appends a marker line
``"{step} {phase} {time.monotonic()}"`` to ``RUN_DIR/markers`` at each phase of each save
(written with one ``os.write`` on an ``O_APPEND`` descriptor, so a line is either there whole or
not at all, and a line that is there happened before the kill):

    snapshot   stage() was called: the lazy snapshot starts
    flush      write_data() was called: the flush stage starts (the snapshot may still run)
    safe       the snapshot is complete (staging_completion resolved)
    commit     finish() was called: manifest, then .metadata
    done       upload_completion resolved: the checkpoint is committed

The markers come from a subclass of the real writer defined here; the library has no test hooks.

``python _fault_workers.py rank-fails-R RANK WORLD PORT DIR`` runs on two gloo ranks; rank R's
data files fail part-way through (like a device error) on the first save. Every rank reports how
its future failed and how long that took, whether its pool drained, and whether a second save with
the same writers (the fault gone) succeeded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_workers import (  # noqa: E402
    _failing_writer_class,
    _init,
    exit_without_teardown,
    run_worker,
)
from _faults_util import BOUNDED_S, apply_step, base_state  # noqa: E402

#: Size of the crash worker's state, and its writer: a pool smaller than the state makes the
#: snapshot stream behind the flush, so snapshot and flush overlap as they do for big models.
CRASH_STATE_MIB = 24
CRASH_WRITER_OPTIONS = {"host_pool_bytes": 8 << 20, "chunk_bytes": 1 << 20, "flush_workers": 2}


# -- crash worker --------------------------------------------------------------------------------
def _crash(run_dir: Path, first_step: int) -> None:
    from dcp_datastates import DataStatesWriter, async_save

    fd = os.open(run_dir / "markers", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    current = [first_step]

    def mark(phase: str, step: int | None = None) -> None:
        step = current[0] if step is None else step
        os.write(fd, f"{step} {phase} {time.monotonic():.6f}\n".encode())

    class MarkingWriter(DataStatesWriter):
        def stage(self, state_dict: Any) -> Any:
            mark("snapshot")
            return super().stage(state_dict)

        def write_data(self, plan: Any, planner: Any) -> Any:
            mark("flush")
            return super().write_data(plan, planner)

        def finish(self, metadata: Any, results: Any) -> None:
            mark("commit")
            super().finish(metadata, results)

    base = base_state(CRASH_STATE_MIB)
    state = base_state(CRASH_STATE_MIB)
    writer = MarkingWriter(run_dir / "unused", **CRASH_WRITER_OPTIONS)
    step = first_step
    while True:
        current[0] = step
        apply_step(state, step, base)
        response = async_save(
            state, writer, checkpoint_id=str(run_dir / f"ckpt_{step}"), no_dist=True
        )
        response.staging_completion.result(timeout=BOUNDED_S)
        mark("safe", step)
        response.upload_completion.result(timeout=BOUNDED_S)
        mark("done", step)
        step += 1


# -- failing-rank worker -------------------------------------------------------------------------
def _rank_fails(failing: int, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    import torch.distributed as dist

    from dcp_datastates import DataStatesWriter, async_save

    _init(rank, world_size, port)
    armed = [True]
    options = {"host_pool_bytes": 4 << 20, "chunk_bytes": 1 << 20}
    if rank == failing:
        writer = _failing_writer_class(armed)(workdir / "unused", **options)
    else:
        writer = DataStatesWriter(workdir / "unused", **options)
    # 16 MiB per rank through a 4 MiB pool: the healthy rank is mid-flush when the other fails.
    # Per-rank keys: nothing is replicated, so each rank writes all of its 16 MiB itself.
    state = {f"rank{rank}": base_state(16, seed=rank)["model"], f"meta{rank}": {"rank": rank}}
    report: dict[str, Any] = {}
    start = time.monotonic()
    response = async_save(state, writer, checkpoint_id=str(workdir / "ckpt"))
    try:
        response.upload_completion.result(timeout=BOUNDED_S)
        report["failed"] = False
    except BaseException as exc:
        report.update(
            failed=True,
            type=type(exc).__name__,
            message=str(exc),
            failed_ranks=sorted(int(r) for r in getattr(exc, "failures", {})),
        )
    report["seconds"] = time.monotonic() - start
    pool = writer._runtime.pool
    with pool._cond:
        report["pool_drained"] = pool._cond.wait_for(lambda: pool.in_use == 0, timeout=BOUNDED_S)
    armed[0] = False
    dist.barrier()
    retry = async_save(state, writer, checkpoint_id=str(workdir / "retry"))
    retry.upload_completion.result(timeout=BOUNDED_S)
    report["retry_ok"] = True
    dist.barrier()
    writer.close()
    dist.destroy_process_group()
    return report


# -- launcher (runs in pytest) -------------------------------------------------------------------
def start_crash_worker(run_dir: Path, first_step: int) -> subprocess.Popen:
    log = open(run_dir / f"worker-{first_step}.log", "ab")  # noqa: SIM115 - the child owns it
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "crash", str(run_dir), str(first_step)]
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def _scenario(scenario: str, rank: int, world_size: int, port: int, workdir: Path) -> dict:
    if not scenario.startswith("rank-fails-"):
        raise ValueError(f"unknown scenario {scenario!r}")
    return _rank_fails(int(scenario.rsplit("-", 1)[1]), rank, world_size, port, workdir)


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        _crash(Path(sys.argv[2]), int(sys.argv[3]))  # runs until killed
        sys.exit(1)
    exit_without_teardown(run_worker(sys.argv[1:], _scenario))
