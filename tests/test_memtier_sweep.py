"""The memory tier as demanding users drive it: ``load(step=N)`` of a step held only in memory,
and a memory file system too small for the steps it is asked to keep."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _checkpointer_workers import digest, train_step
from _faults_util import mounted_tmpfs
from test_memtier import LOGGER, _app, _crashed_run

from dcp_datastates import CheckpointSaveError
from dcp_datastates.checkpointers import steps
from dcp_datastates.checkpointers.checkpointer import Checkpointer, step_dir_name
from dcp_datastates.checkpointers.memory import MemoryTier, segment_path


def test_load_of_a_step_held_only_in_memory_loads_it_from_there_and_makes_it_durable(
    tmp_path: Path,
) -> None:
    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="j1")
    root = tmp_path / "ckpt"
    seen = _crashed_run(root, tier)  # step 3 committed in memory, not on disk
    assert not (root / step_dir_name(3) / ".metadata").exists()
    app = _app()
    with Checkpointer(root, preemption_signals=(), memory=tier) as ck:
        assert ck.load({"app": app}, step=3) == 3
        assert digest(app) == seen[3]
        assert ck.load({"app": app}, step=2) == 2  # durable (and in memory): either way
        assert digest(app) == seen[2]
    assert (root / step_dir_name(3) / ".metadata").exists()  # flushed before the clean exit


@pytest.mark.parametrize(
    ("floats", "then_held"),
    [(400_000, 1), (900_000, 0)],  # 1.6 MB: one copy fits, two do not; 3.6 MB: none fits
    ids=["two-copies-do-not-fit", "one-copy-does-not-fit"],
)
def test_a_full_memory_tier_fails_one_save_clearly_then_saves_go_on_to_disk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, floats: int, then_held: int
) -> None:
    root = tmp_path / "ckpt"
    raised = []
    with mounted_tmpfs(tmp_path, "3m") as small:
        tier = MemoryTier(base=str(small), job_id="j1", keep=1)
        with (
            caplog.at_level(logging.WARNING, logger=LOGGER),
            Checkpointer(root, every_steps=1, preemption_signals=(), memory=tier) as ck,
        ):
            for step in range(1, 8):
                try:
                    ck.maybe_save(step, {"w": torch.full((floats,), float(step))})
                except CheckpointSaveError as exc:
                    raised.append((step, exc))
            ck.wait()
            (node,) = Path(segment_path(tier.base, "j1")).glob("node_*")
            assert len(list(node.glob("step_*"))) == then_held  # the failed one's files gone
        assert len(raised) == 1, raised  # once, naming the full device and the memory tier
        assert "ENOSPC" in str(raised[0][1]) and str(small) in str(raised[0][1])
        assert any("memory tier" in r.getMessage() and "full" in r.message for r in caplog.records)
        # Every later save was made durable: the run is never stuck on the step before.
        assert steps.read_latest(str(root)) == 7
        assert set(range(raised[0][0] + 1, 8)) <= set(ck.committed_steps())
        state = {"w": torch.zeros(floats)}
        dcp.load(state, checkpoint_id=str(root / step_dir_name(7)), no_dist=True)
        assert torch.equal(state["w"], torch.full((floats,), 7.0))


def test_two_checkpointers_given_one_job_id_never_share_a_segment(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model's and an EMA's checkpointer (or two jobs) with one ``job_id``: the second would
    have written its steps over the first's in memory, and each flushed or resumed the other's."""
    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="train")
    model, ema = {"w": torch.ones(8)}, {"w": -torch.ones(8)}
    kw = {"every_steps": 1, "preemption_signals": (), "memory": tier}
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        Checkpointer(tmp_path / "a", **kw) as a,
        Checkpointer(tmp_path / "b", **kw) as b,
    ):
        assert b._memory is None  # noqa: SLF001 - off, saying why; `a` keeps the segment
        for step in (1, 2):
            a.maybe_save(step, model)
            b.maybe_save(step, ema)
        a.wait()
        b.wait()
        held = dcp_load_w(Path(a._memory.step_path(2)))  # noqa: SLF001
        assert torch.equal(held, model["w"])
    assert any("holds the checkpoints of root" in r.getMessage() for r in caplog.records)
    for root, state in ((tmp_path / "a", model), (tmp_path / "b", ema)):
        assert torch.equal(dcp_load_w(root / step_dir_name(2)), state["w"])


def dcp_load_w(path: Path) -> torch.Tensor:
    state = {"w": torch.zeros(8)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["w"]


def test_after_load_of_an_older_step_a_restart_never_resumes_from_a_newer_memory_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run that went back to step 2 (``load(step=2)``) after a crash that left step 3 in
    memory: the restart after its next crash resumes from its own course, not step 3."""
    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="j1")
    root = tmp_path / "ckpt"
    seen = _crashed_run(root, tier)  # step 3 in memory only
    app = _app()
    ck = Checkpointer(root, preemption_signals=(), memory=tier)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert ck.load({"app": app}, step=2) == 2 and digest(app) == seen[2]
    assert any("deleting step 3 from" in r.getMessage() for r in caplog.records), caplog.text
    ck._memory.flusher.close()  # noqa: SLF001 - killed before its next save
    app = _app()
    with Checkpointer(root, preemption_signals=(), memory=tier) as again:
        assert again.load_latest({"app": app}) == 2
    assert digest(app) == seen[2]


def test_a_run_that_starts_afresh_in_a_crashed_runs_root_never_resumes_its_memory_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run started from scratch (no load) where a crashed run left step 3 in memory: step 3
    was kept in preference to the new run's steps and was what its restart resumed from."""
    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="j1")
    root = tmp_path / "ckpt"
    _crashed_run(root, tier)  # step 3 in memory only
    fresh = _app()  # the same model, untrained: step 1 of the new run
    ck = Checkpointer(root, every_steps=1, preemption_signals=(), memory=tier)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ck.maybe_save(1, {"app": fresh})
        ck.wait()
    assert any("did not resume from them" in r.getMessage() for r in caplog.records)
    ck._memory.flusher.close()  # noqa: SLF001 - killed
    app = _app()
    train_step(app, 1, 1)  # something else than `fresh`
    with Checkpointer(root, preemption_signals=(), memory=tier) as again:
        assert again.load_latest({"app": app}) == 1
    assert digest(app) == digest(fresh)


def test_cli_clean_goes_on_past_a_segment_it_may_not_remove(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another user's directory named like this user's segments stopped ``clean`` with a
    traceback before the dead segments after it."""
    from dcp_datastates.cli import main

    base = tmp_path / "shm"
    planted, dead = Path(segment_path(str(base), "a-planted")), Path(segment_path(str(base), "b"))
    for seg in (planted, dead):
        (seg / "node_x").mkdir(parents=True, mode=0o700)
    os.chown(planted, 4242, -1)
    try:
        assert main(["memory", "clean", "--base", str(base)]) == 1
        out = capsys.readouterr().out
        assert f"could not remove {planted}" in out and "owned by uid 4242" in out, out
        assert f"removed {dead}" in out and not dead.exists() and planted.exists()
    finally:
        os.chown(planted, os.getuid(), -1)


def test_a_segment_another_rank_of_the_node_is_making_is_used(tmp_path: Path) -> None:
    """Ranks of one node start at once: one finds the segment made by another but its
    ``segment.json`` not written yet. It turned the memory tier off for the whole run."""
    tier = MemoryTier(base=str(tmp_path / "shm"), job_id="j1")
    (Path(segment_path(tier.base, "j1")) / "node_x").mkdir(parents=True, mode=0o700)
    Path(segment_path(tier.base, "j1")).chmod(0o700)
    with Checkpointer(tmp_path / "ckpt", preemption_signals=(), memory=tier) as ck:
        assert ck._memory is not None  # noqa: SLF001
