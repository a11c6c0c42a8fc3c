"""The memory tier as demanding users drive it: ``load(step=N)`` of a step held only in memory,
and a memory file system too small for the steps it is asked to keep."""

from __future__ import annotations

from pathlib import Path

from _checkpointer_workers import digest
from test_memtier import _app, _crashed_run

from dcp_datastates.checkpointers.checkpointer import Checkpointer, step_dir_name
from dcp_datastates.checkpointers.memory import MemoryTier


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
