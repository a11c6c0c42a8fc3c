"""The memory tier: a step committed in host memory survives SIGKILL of every rank, resumes at
memory speed and is then made durable; a damaged memory copy falls back to disk, saying so; a
segment of another job, another user or with loose permissions is never read; a clean exit
removes it; the CLI lists and cleans segments."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _checkpointer_workers import App, Model, damage, digest, train_step
from _dist_workers import free_port
from _faults_util import BOUNDED_S, wait_until

from dcp_datastates.checkpointers.checkpointer import Checkpointer, step_dir_name
from dcp_datastates.checkpointers.memflush import Flusher, FlushError
from dcp_datastates.checkpointers.memory import MemoryTier, segment_path, segments
from dcp_datastates.storage.base import Storage

WORKER = str(Path(__file__).with_name("_memtier_workers.py"))
LOGGER = "dcp_datastates.checkpointers"


def _app() -> App:
    model = Model()
    return App(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _start(workdir: Path, world: int, **env: str) -> list[subprocess.Popen]:
    workdir.mkdir(parents=True, exist_ok=True)
    full = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full.update({f"MT_{k.upper()}": v for k, v in env.items()})
    port, procs = free_port(), []
    for rank in range(world):
        log = open(workdir / f"out{rank}.log", "w")  # noqa: SIM115 - the child holds it
        cmd = [sys.executable, WORKER, "train", str(rank), str(world), str(port), str(workdir)]
        procs.append(subprocess.Popen(cmd, env=full, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def _out(workdir: Path, rank: int) -> str:
    return (workdir / f"out{rank}.log").read_text(errors="replace")


def _lines(workdir: Path, rank: int, first: str) -> dict[int, str]:
    """{step: digest} of the lines starting with ``first`` (``step``, ``resumed``)."""
    found = {}
    for line in _out(workdir, rank).splitlines():
        p = line.split()
        if p[:1] == [first] and p[1] != "None":
            found[int(p[1])] = p[3]
    return found


# -- item 1: SIGKILL of every rank while the flush to disk is under way ----------------------
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_sigkill_mid_flush_resumes_from_memory_bit_exactly_and_then_makes_it_durable(
    tmp_path: Path,
) -> None:
    base, run = tmp_path / "shm", tmp_path / "run"
    root = run / "ckpt"
    procs = _start(run, 2, base=str(base), block_flush="10", max_steps="12")
    try:
        wait_until(
            lambda: (
                all(f"flush blocked {step_dir_name(10)}" in _out(run, r) for r in (0, 1))
                # and trained on to step 12, what the restart is compared with
                and all(12 in _lines(run, r, "step") for r in (0, 1))
                or any(p.poll() is not None for p in procs)
            ),
            BOUNDED_S,
            "both ranks holding step 10's flush, at step 12",
            poll=0.02,
        )
        assert all(p.poll() is None for p in procs), _out(run, 0) + _out(run, 1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    # On disk: step 5 only. In memory: step 10, committed.
    assert (root / "latest").read_text().strip() == "5"
    assert not (root / step_dir_name(10) / ".metadata").exists()
    first = _lines(run, 0, "step")
    assert _lines(run, 1, "step") == first

    rerun = tmp_path / "rerun"
    rerun.mkdir()
    (rerun / "ckpt").symlink_to(root)  # the same durable root (the worker uses DIR/ckpt)
    procs = _start(rerun, 2, base=str(base), max_steps="12")
    for p in procs:
        p.wait(timeout=120)
    assert [p.returncode for p in procs] == [0, 0], _out(rerun, 0)[-3000:] + _out(rerun, 1)
    for rank in (0, 1):
        assert _lines(rerun, rank, "resumed") == {10: first[10]}  # bit-exact, from memory
        then = _lines(rerun, rank, "step")
        assert then == {11: first[11], 12: first[12]}  # and goes on as the first run did
    # Step 10 is durable on disk now, a plain DCP checkpoint stock DCP loads.
    assert (root / step_dir_name(10) / ".metadata").exists()
    fresh = _app()
    dcp.load({"app": fresh}, checkpoint_id=str(root / step_dir_name(10)), no_dist=True)
    assert digest(fresh) == first[10]
    assert (root / "latest").read_text().strip() == "10"
    assert segments(str(base)) == []  # the clean exit removed the segment


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_lost_node_gets_its_files_back_from_its_peer_and_the_step_resumes_bit_exactly(
    tmp_path: Path,
) -> None:
    """Four ranks on two simulated nodes (a: ranks 0, 1; b: ranks 2, 3), one memory root each,
    peer copies one node along. Every rank is killed while step 10 is committed in memory (and
    copied to the peers) but not on disk; node b's memory is then removed. The restart gives
    ranks 2 and 3 their files back from node a, finishes step 10 on disk and resumes from it.
    A copy of the same wreck whose replicas on node a are one corrupt, one missing resumes from
    the durable step 5 instead, saying why, and trains on bit-exactly."""
    base, run = tmp_path / "shm", tmp_path / "run"
    root = run / "ckpt"
    env = {"base": str(base), "nodes": "a,a,b,b", "peers": "1", "job": "nl", "max_steps": "12"}
    segment = Path(segment_path(str(base), "nl"))
    held = {"a": (2, 3), "b": (0, 1)}  # the peer copies each node holds
    replicas = [segment / f"node_{n}/peer/rank_{r}/step_10" for n in held for r in held[n]]
    procs = _start(run, 4, block_flush="10", **env)
    try:
        wait_until(
            lambda: (
                all(f"flush blocked {step_dir_name(10)}" in _out(run, r) for r in range(4))
                and all((r / ".replica.json").exists() for r in replicas)
                # and trained on to step 12, what the restart is compared with
                and all(12 in _lines(run, r, "step") for r in range(4))
                or any(p.poll() is not None for p in procs)
            ),
            BOUNDED_S,
            "every rank holding step 10's flush, its peer copies made, at step 12",
            poll=0.02,
        )
        assert all(p.poll() is None for p in procs), "".join(_out(run, r) for r in range(4))
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
    first = {r: _lines(run, r, "step") for r in range(4)}
    assert not (root / step_dir_name(10) / ".metadata").exists()
    shutil.rmtree(segment / "node_b")  # the node is lost, and its memory with it
    # The same wreck, its replicas of ranks 2 and 3 corrupt and missing.
    base2 = tmp_path / "shm2"
    shutil.copytree(base, base2, symlinks=True)
    root2 = tmp_path / "root2"
    shutil.copytree(root, root2, symlinks=True)
    segment2 = Path(segment_path(str(base2), "nl"))
    info = json.loads((segment2 / "segment.json").read_text())  # the copy's own durable root
    (segment2 / "segment.json").write_text(json.dumps({**info, "durable_root": str(root2)}))
    damage(segment2 / "node_a/peer/rank_2/step_10")
    shutil.rmtree(segment2 / "node_a/peer/rank_3/step_10")

    outs = _rerun(tmp_path / "rerun", root, env)
    for rank in (2, 3):
        assert "this node's memory had lost step 10; restored" in outs[rank], outs[rank]
    for rank in range(4):
        assert _lines(tmp_path / "rerun", rank, "resumed") == {10: first[rank][10]}, outs[rank]
        want = {s: first[rank][s] for s in (11, 12)}
        assert _lines(tmp_path / "rerun", rank, "step") == want, outs[rank]
    fresh = _app()
    dcp.load({"app": fresh}, checkpoint_id=str(root / step_dir_name(10)), no_dist=True)
    assert digest(fresh) == first[0][10]

    outs = _rerun(tmp_path / "rerun2", root2, {**env, "base": str(base2)})
    for rank in range(4):
        said = "step 10 not restored from peers"
        assert said in outs[rank] and "rank 2" in outs[rank] and "rank 3" in outs[rank], outs[rank]
        assert _lines(tmp_path / "rerun2", rank, "resumed") == {5: first[rank][5]}, outs[rank]
        want = {s: first[rank][s] for s in range(6, 13)}
        assert _lines(tmp_path / "rerun2", rank, "step") == want, outs[rank]


def _rerun(workdir: Path, root: Path, env: dict[str, str]) -> list[str]:
    """The 4 ranks of the node-loss test restarted on the durable root ``root``; their logs."""
    workdir.mkdir()
    (workdir / "ckpt").symlink_to(root)
    procs = _start(workdir, 4, **env)
    for p in procs:
        p.wait(timeout=120)
    outs = [_out(workdir, r) for r in range(4)]
    assert [p.returncode for p in procs] == [0] * 4, "".join(o[-2000:] for o in outs)
    return outs


# -- in one process --------------------------------------------------------------------------
class _FailingFlusher(Flusher):
    """The flush of one step to disk fails: it stays in memory only (as a killed flush)."""

    failing = ""

    def storage(self, path: str) -> Storage:
        if os.path.basename(path) == self.failing:
            raise OSError(5, "injected: the disk is gone")
        return super().storage(path)


class _FailingCheckpointer(Checkpointer):
    flusher_class = _FailingFlusher


def _crashed_run(root: Path, tier: MemoryTier) -> dict[int, str]:
    """Steps 1 to 3, step 3's flush to disk failing; left as a killed process leaves it (no
    close: its segment stays). Returns the digests."""
    _FailingFlusher.failing = step_dir_name(3)
    app, seen = _app(), {}
    ck = _FailingCheckpointer(root, every_steps=1, preemption_signals=(), memory=tier)
    for step in (1, 2, 3):
        train_step(app, step, 1)
        seen[step] = digest(app)
        ck.maybe_save(step, {"app": app})
    with pytest.raises(FlushError, match="injected: the disk is gone"):
        ck.wait()
    ck._memory.flusher.close()  # noqa: SLF001 - what a crash leaves: the segment, no close
    return seen


def _resume(root: Path, tier: MemoryTier) -> tuple[int | None, str]:
    app = _app()
    with Checkpointer(root, preemption_signals=(), memory=tier) as ck:
        step = ck.load_latest({"app": app})
    return step, digest(app)


def test_a_damaged_memory_step_falls_back_to_disk_naming_the_segment(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="j1", keep=2)
    root = tmp_path / "ckpt"
    seen = _crashed_run(root, tier)
    memory = Path(segment_path(tier.base, "j1"))
    (node,) = memory.glob("node_*")
    damage(node / step_dir_name(3))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _resume(root, tier) == (2, seen[2])
    skipped = [r.getMessage() for r in caplog.records if "cannot resume from step 3" in r.message]
    assert len(skipped) == 1 and "(memory tier)" in skipped[0], skipped
    assert str(node) in skipped[0] and "ChecksumMismatchError" in skipped[0], skipped
    assert not memory.exists()  # the clean exit removed it


def test_a_segment_of_another_job_user_or_mode_is_never_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="j1")
    root = tmp_path / "ckpt"
    seen = _crashed_run(root, tier)  # step 3 in memory only
    memory = Path(segment_path(tier.base, "j1"))
    other_job = MemoryTier(base=tier.base, job_id="j2")
    assert _resume(root, other_job) == (2, seen[2])  # its own (empty) segment; j1's untouched
    assert memory.is_dir()

    memory.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _resume(root, tier) == (2, seen[2])
    assert any("has mode 755" in r.getMessage() for r in caplog.records), caplog.text
    memory.chmod(0o700)

    info = json.loads((memory / "segment.json").read_text())
    (memory / "segment.json").write_text(json.dumps({**info, "job": "j9"}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _resume(root, tier) == (2, seen[2])
    assert any("belongs to job 'j9'" in r.getMessage() for r in caplog.records), caplog.text
    (memory / "segment.json").write_text(json.dumps(info))

    if os.getuid() == 0:  # only root can give it away
        os.chown(memory, 4242, -1)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert _resume(root, tier) == (2, seen[2])
        assert any("owned by uid 4242" in r.getMessage() for r in caplog.records)
        os.chown(memory, 0, -1)

    assert _resume(root, tier) == (3, seen[3])  # its own job: the memory step, then durable
    assert (root / step_dir_name(3) / ".metadata").exists()
    assert not memory.exists()


def test_close_keeps_the_segment_when_a_step_is_in_memory_only(tmp_path: Path) -> None:
    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="j1")
    _FailingFlusher.failing = step_dir_name(2)
    app = _app()
    ck = _FailingCheckpointer(tmp_path / "ckpt", every_steps=1, preemption_signals=(), memory=tier)
    for step in (1, 2):
        train_step(app, step, 1)
        ck.maybe_save(step, {"app": app})
    with pytest.raises(FlushError, match="injected"):
        ck.close()
    (node,) = Path(segment_path(tier.base, "j1")).glob("node_*")
    assert (node / step_dir_name(2) / ".metadata").exists()  # a restart still finds it


def test_a_restart_with_another_world_size_resumes_from_disk_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="j1")
    root = tmp_path / "ckpt"
    seen = _crashed_run(root, tier)
    info_path = Path(segment_path(tier.base, "j1")) / "segment.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "world_size": 4}))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _resume(root, tier) == (2, seen[2])
    (line,) = [r.getMessage() for r in caplog.records if "memory tier" in r.getMessage()]
    assert "a save of 4 ranks and this run has 1" in line and "durable tier" in line, line


def test_memory_holds_at_most_keep_plus_one_steps_and_reports_its_bytes(tmp_path: Path) -> None:
    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="j1", keep=1)
    app = _app()
    node = None
    with Checkpointer(tmp_path / "ckpt", every_steps=1, preemption_signals=(), memory=tier) as ck:
        for step in range(1, 6):
            train_step(app, step, 1)
            ck.maybe_save(step, {"app": app})
            ck.wait()
            (node,) = Path(segment_path(tier.base, "j1")).glob("node_*")
            held = sorted(p.name for p in node.glob("step_*"))
            assert held == [step_dir_name(s) for s in range(max(1, step - 1), step + 1)]
            assert ck.memory_bytes == sum(f.stat().st_size for f in node.rglob("*") if f.is_file())
            assert "held in memory on this node" in ck.last_summary
        assert ck.committed_steps() == [1, 2, 3, 4, 5]
    assert node is not None and not node.exists()


def test_cli_lists_and_cleans_segments_of_dead_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dcp_datastates.cli import main

    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="j1")
    _crashed_run(tmp_path / "ckpt", tier)
    memory = Path(segment_path(tier.base, "j1"))
    assert main(["memory", "list", "--base", tier.base]) == 0
    out = capsys.readouterr().out
    assert "j1" in out and "alive" in out and "step(s) [2, 3]" in out, out  # this process holds it
    assert main(["memory", "clean", "--base", tier.base]) == 0
    assert memory.exists()  # a live job's segment is kept
    assert "kept 1 segment(s) of running jobs" in capsys.readouterr().out
    for pid_file in memory.glob("node_*/rank_*.pid"):
        pid_file.write_text("999999999\n")  # its processes are gone
    assert main(["memory", "list", "--base", tier.base, "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["job"] == "j1" and listed["live_pids"] == []
    assert main(["memory", "clean", "--base", tier.base]) == 0
    assert not memory.exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_restart_bench_times_memory_disk_and_s3_for_one_state(tmp_path: Path) -> None:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    bench = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
    cmd = [sys.executable, str(bench), "restart", "--quick", "--out", str(tmp_path / "out")]
    cmd += ["--dir", str(tmp_path / "d")]
    before = set(Path("/dev/shm").glob("dcp_datastates-*-bench-*"))
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    records = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    systems = {r["system"].split(" (cache")[0] for r in records if r["scenario"] == "restart"}
    assert systems == {
        "memory tier (/dev/shm)",
        "local disk, cold",
        "local disk, warm",
        "s3 (moto)",
    }
    assert all(r["figures"]["resume_s"] > 0 for r in records if r["scenario"] == "restart")
    assert "### Restart" in (tmp_path / "out" / "summary.md").read_text()
    assert set(Path("/dev/shm").glob("dcp_datastates-*-bench-*")) <= before  # its segment is gone
