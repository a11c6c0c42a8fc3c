"""Saves to one checkpoint directory take turns (``path_turns.py``): overlapping saves to the
same path all commit, in call order, and a save that never runs does not hold the next back.

Before turns, three overlapping ``dcp.async_save`` calls to one path failed some saves and could
commit one whose data a later, failed save had overwritten (a future said ok, the load failed
its checksums)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import EVENT_TIMEOUT_S, assert_same_state, load_like

from dcp_datastates import DataStatesWriter, async_save
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.save import path_turns
from dcp_datastates.save.path_turns import directory_key


def states(n: int) -> list[dict]:
    """``n`` states of one layout, each value its own (4 MB tensors: the saves overlap)."""
    return [
        {"w": torch.full((1 << 20,), float(i)), "x": torch.randn(1000), "step": i} for i in range(n)
    ]


def copies(sds: list[dict]) -> list[dict]:
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in sds]


@pytest.mark.parametrize("how", ["dcp.async_save", "async_save"])
def test_overlapping_saves_to_one_path_all_commit_and_the_last_call_wins(
    tmp_path: Path, how: str
) -> None:
    path = tmp_path / "latest"
    sds = states(3)
    expected = copies(sds)
    writer = DataStatesWriter(tmp_path / "w")
    try:
        if how == "dcp.async_save":
            futures = [
                dcp.async_save(sd, storage_writer=writer, checkpoint_id=path, no_dist=True)
                for sd in sds
            ]
        else:
            futures = [
                async_save(sd, writer, checkpoint_id=path, no_dist=True).upload_completion
                for sd in sds
            ]
        for future in futures:
            future.result(timeout=EVENT_TIMEOUT_S)  # every save succeeds
    finally:
        writer.close()
    assert_same_state(expected[-1], load_like(path, expected[-1], "ours"))
    assert_same_state(expected[-1], load_like(path, expected[-1], "stock"))


def test_overlapping_saves_of_writers_made_per_save_and_dropped_take_turns(
    tmp_path: Path,
) -> None:
    """DCP's idiom, a new writer per save, never closed: turns are the process's, not a
    writer's, so their saves to one path take turns too."""
    path = tmp_path / "latest"
    sds = states(3)
    expected = copies(sds)
    futures = [
        dcp.async_save(
            sd, storage_writer=DataStatesWriter(tmp_path / "w"), checkpoint_id=path, no_dist=True
        )
        for sd in sds
    ]
    for future in futures:
        future.result(timeout=EVENT_TIMEOUT_S)
    gc.collect()
    assert_same_state(expected[-1], load_like(path, expected[-1], "ours"))


def test_a_plain_save_after_an_async_one_to_the_same_path_waits_for_it(tmp_path: Path) -> None:
    """The caller's own ``dcp.save`` waits for the save in flight, then commits over it; an
    async save after that plain save (same thread) does not wait for it."""
    path = tmp_path / "ckpt"
    first, second, third = states(3)
    expected = copies([first, second, third])
    writer = DataStatesWriter(tmp_path / "w")
    try:
        future = dcp.async_save(first, storage_writer=writer, checkpoint_id=path, no_dist=True)
        dcp.save(second, storage_writer=writer, checkpoint_id=path, no_dist=True)
        assert future.done(), "dcp.save returned while the save before it was still writing"
        future.result(timeout=0)
        assert_same_state(expected[1], load_like(path, expected[1], "ours"))
        dcp.async_save(third, storage_writer=writer, checkpoint_id=path, no_dist=True).result(
            timeout=EVENT_TIMEOUT_S
        )
    finally:
        writer.close()
    assert_same_state(expected[2], load_like(path, expected[2], "ours"))


def test_a_save_that_failed_at_the_call_does_not_hold_back_the_next(tmp_path: Path) -> None:
    """Refused after staging (an argument DCP refuses) and refused in ``stage()`` (a state it
    cannot save): the next save to the same path runs at once."""
    path = tmp_path / "ckpt"
    sd = states(1)[0]
    expected = copies([sd])[0]
    writer = DataStatesWriter(tmp_path / "w")
    try:
        with pytest.raises(TypeError, match="compression"):
            async_save(sd, writer, checkpoint_id=path, no_dist=True, compression=True)
        with pytest.raises(ValueError):
            async_save({}, writer, checkpoint_id=path, no_dist=True)
        future = async_save(sd, writer, checkpoint_id=path, no_dist=True).upload_completion
        future.result(timeout=EVENT_TIMEOUT_S)
    finally:
        writer.close()
    assert (path / METADATA_NAME).exists()
    assert_same_state(expected, load_like(path, expected, "ours"))


def test_a_directory_is_one_key_however_it_is_spelled(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    same = {
        directory_key("ckpt"),
        directory_key(str(tmp_path / "ckpt")),
        directory_key(f"file://{tmp_path / 'ckpt'}"),
        directory_key(str(tmp_path / "x" / ".." / "ckpt")),
    }
    assert same == {str(tmp_path / "ckpt")}
    assert directory_key("s3://bucket/run/") == directory_key("s3://bucket/run")
    assert directory_key("s3://bucket/run") != directory_key("s3://bucket/run2")


def test_the_line_of_directories_stays_bounded_when_saves_end_with_their_threads() -> None:
    """A save that ends with its thread never leaves its line: ``take`` sweeps such lines once
    there are more than ``SWEEP_AT`` directories, so a run saving to a new path each time does
    not keep one entry per path."""
    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    for i in range(3 * path_turns.SWEEP_AT):
        path_turns.take(f"/nonexistent/step_{i}").owner = ended  # over: its thread ended
        assert len(path_turns._turns) <= path_turns.SWEEP_AT + 1
