"""The one module that touches DCP's private names, and how the writer learns which save called
``stage()``: recognised through DCP's frame, told directly by our ``async_save``, and loud (never
silent) when it cannot tell."""

from __future__ import annotations

import ast
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import EVENT_TIMEOUT_S

from dcp_datastates import DataStatesWriter, WriterUsageError, _dcp_private, async_save
from dcp_datastates.snapshot import guard


class Recorder(DataStatesWriter):
    """A writer that records what stage() learned about its call."""

    def _which_call(self):
        self.seen = super()._which_call()
        return self.seen


def test_every_private_dcp_name_is_used_only_in_the_one_module() -> None:
    """No other module of the package imports a private DCP module, names a private DCP symbol
    or reads stack frames (docstrings may mention them)."""
    private = {
        "_StorageInfo",
        "_synchronize_after_execute",
        "_traverse",
        "_getframe",
        "_cached_all_plans",
    }
    root = Path(__file__).resolve().parent.parent / "dcp_datastates"
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "_dcp_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            for name in names:
                if name in private or name.startswith("torch.distributed.checkpoint._"):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    assert not offenders, offenders


def test_the_private_names_still_resolve_in_this_torch() -> None:
    assert _dcp_private._ASYNC_SAVE_CODE is not None
    assert _dcp_private.StorageInfo.__name__ == "_StorageInfo"
    assert DataStatesWriter("/tmp/unused").should_synchronize_after_execute is False
    from torch.distributed.checkpoint.planner import SavePlanner

    assert isinstance(SavePlanner._cached_all_plans, dict)  # plan_caching_in_use() reads it
    assert callable(_dcp_private.dedup_save_plans)  # save/global_plan.py plans with it


def test_the_probe_recognises_dcp_async_save_and_its_arguments(tmp_path: Path) -> None:
    writer = Recorder(tmp_path)
    future = dcp.async_save({"w": torch.zeros(4)}, storage_writer=writer, no_dist=True)
    future.result(timeout=EVENT_TIMEOUT_S)
    writer.close()
    seen = writer.seen
    assert seen.found and seen.mode == "thread" and seen.storage_writer is writer
    assert seen.no_dist is True


def test_our_async_save_tells_the_writer_without_the_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args, **kwargs):
        raise AssertionError("the frame probe was used")

    monkeypatch.setattr(_dcp_private, "async_save_call", broken)
    writer = Recorder(tmp_path)
    async_save({"w": torch.zeros(4)}, writer, no_dist=True).upload_completion.result(
        timeout=EVENT_TIMEOUT_S
    )
    writer.close()
    assert writer.seen.found and writer.seen.mode == "thread"


def test_our_async_save_calls_a_subclass_stage(tmp_path: Path) -> None:
    """``dcp_datastates.async_save`` stages through ``stage()`` as ``dcp.async_save`` does, so a
    subclass that wraps it (to mark or time the snapshot) sees every save."""
    staged = []

    class Marking(DataStatesWriter):
        def stage(self, state_dict):
            staged.append(sorted(state_dict))
            return super().stage(state_dict)

    writer = Marking(tmp_path)
    for step in range(2):
        async_save(
            {"w": torch.zeros(4), "step": step}, writer, checkpoint_id=tmp_path / str(step)
        ).upload_completion.result(timeout=EVENT_TIMEOUT_S)
    writer.close()
    assert staged == [["step", "w"], ["step", "w"]]


def test_a_probe_that_no_longer_recognises_dcp_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_dcp_private, "_is_async_save", lambda code: False)
    writer = DataStatesWriter(tmp_path)
    with pytest.warns(RuntimeWarning, match="not called by a dcp.async_save"):
        dcp.async_save({"w": torch.zeros(4)}, storage_writer=writer, no_dist=True).result(
            timeout=EVENT_TIMEOUT_S
        )
    writer.close()


def test_a_dcp_frame_without_the_arguments_we_read_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def async_save(state_dict, stager):  # DCP's entry point, had it renamed its arguments
        return stager.stage(state_dict)

    monkeypatch.setattr(_dcp_private, "_ASYNC_SAVE_CODE", async_save.__code__)
    writer = DataStatesWriter(tmp_path)
    with pytest.raises(RuntimeError, match="cannot read dcp.async_save's arguments"):
        async_save({"w": torch.zeros(4)}, writer)
    writer.close()


def test_a_writer_pickled_with_a_live_snapshot_pending_refuses_loudly(tmp_path: Path) -> None:
    """What DCP's PROCESS executor would do had stage() mistaken it for the THREAD one."""
    writer = DataStatesWriter(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        writer.stage({"w": torch.zeros(1000)})  # not through any async_save: nobody claims it
    with pytest.raises(WriterUsageError, match="PROCESS executor"):
        pickle.dumps(writer)
    assert not writer._runtime.has_unclaimed()  # dropped: the guard no longer waits for it
    writer.staging_future.result(timeout=EVENT_TIMEOUT_S)
    assert guard.pending_snapshots() == 0
    clone = pickle.loads(pickle.dumps(writer))  # with nothing pending it pickles as before
    assert clone.options == writer.options
    writer.close()
    clone.close()
