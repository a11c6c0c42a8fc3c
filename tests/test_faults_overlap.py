"""Overlapping saves: ``async_save`` called again while earlier saves are still flushing.

What happens (and what ``docs/reliability.md`` says): the new save **queues**. ``stage()`` waits
only until the previous snapshot was claimed by its DCP save thread (milliseconds); its pieces
are admitted to the shared host pool after all of the earlier save's pieces, in order, by the one
scheduler thread; each save flushes its own files on its own DCP thread, concurrently. Every
checkpoint holds exactly the state of its own step, and the pool accounting returns to zero.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _faults_util import BOUNDED_S, MiB
from conftest import READERS, assert_same_state, load_like, pool_drains

from dcp_datastates import DataStatesWriter, async_save

pytestmark = pytest.mark.timeout(120)

SAVES = 5
STATE_MIB = 32


def _state() -> dict:
    return {f"t{i}": torch.zeros(STATE_MIB * MiB // 4 // 8) for i in range(8)} | {"step": -1}


def _set_step(state: dict, step: int) -> None:
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            value.fill_(step * 10 + int(key[1:]))
    state["step"] = step


@pytest.mark.parametrize(
    "pool_mib", [48, 8], ids=["pool-holds-one-state", "pool-smaller-than-a-state"]
)
def test_saves_started_while_earlier_ones_flush_all_commit_their_own_state(
    tmp_path: Path, make_writer, pool_mib: int
) -> None:
    writer = make_writer(tmp_path / "unused", host_pool_bytes=pool_mib * MiB, chunk_bytes=MiB)
    state = _state()
    responses, overlapped = [], 0
    for step in range(SAVES):
        _set_step(state, step)
        overlapped += any(not r.upload_completion.done() for r in responses)
        responses.append(
            async_save(state, writer, checkpoint_id=str(tmp_path / f"c{step}"), no_dist=True)
        )
        responses[-1].staging_completion.result(timeout=BOUNDED_S)  # safe to change the state
    for response in responses:
        response.upload_completion.result(timeout=BOUNDED_S)

    if pool_mib > STATE_MIB:
        # The snapshot finishes long before the flush: the next save really starts mid-flush.
        assert overlapped >= 2, f"only {overlapped} saves overlapped an earlier one"
    pool = writer._runtime.pool
    assert pool_drains(writer) and pool.peak_in_use <= pool.capacity
    for step in range(SAVES):
        expected = _state()
        _set_step(expected, step)
        for reader in READERS:
            assert_same_state(expected, load_like(tmp_path / f"c{step}", expected, reader))


def test_an_earlier_save_flushing_after_two_later_ones_is_not_starved(tmp_path: Path) -> None:
    """Three overlapping saves through a pool smaller than one state, the later two reaching
    ``write_data`` first. The first save's pieces hold the pool, so the later saves' flushes wait
    for pieces only the first save's flush can free: with flush threads shared from a bounded
    pool (as once), the later flushes held every thread and this deadlocked."""
    later_flushing = threading.Event()
    lock = threading.Lock()
    entered: list[str] = []

    class FirstFlushesLast(DataStatesWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            name = Path(self._save().storage.root).name
            if name == "ckpt_0":
                assert later_flushing.wait(BOUNDED_S), "the later saves never reached write_data"
            result = super().write_data(plan, planner)
            if name != "ckpt_0":
                with lock:
                    entered.append(name)
                    if len(entered) == 2:
                        later_flushing.set()
            return result

    writer = FirstFlushesLast(tmp_path / "unused", host_pool_bytes=2 * MiB, flush_workers=2)
    try:
        states, uploads = [], []
        for step in range(3):
            state = _state()
            _set_step(state, step)
            states.append(state)
            path = tmp_path / f"ckpt_{step}"
            response = async_save(state, writer, checkpoint_id=str(path), no_dist=True)
            uploads.append(response.upload_completion)
        for upload in uploads:
            upload.result(timeout=BOUNDED_S)
        assert pool_drains(writer)
    finally:
        writer.close()
    for step, state in enumerate(states):
        assert_same_state(state, load_like(tmp_path / f"ckpt_{step}", state, "datastates"))


def test_many_small_overlapping_saves_of_one_writer_each_commit_their_own_step(
    tmp_path: Path, make_writer
) -> None:
    """A user loop of small saves, four in flight at a time: their plannings overlap, and
    each replays the layout of the save before (the cross-rank plan cache,
    ``save/global_plan.py``). Before b2300e6 one save's planning could make the token another
    had sent unknown: 4 of 240 saves failed with ``WriterUsageError`` (a user sweep)."""
    writer = make_writer(tmp_path / "unused")
    state = {f"t{i}": torch.zeros(64) for i in range(20)} | {"step": -1}
    errors, step = [], 0
    for _ in range(40):
        responses = []
        for _ in range(4):
            _set_step(state, step)
            path = str(tmp_path / f"c{step}")
            responses.append(async_save(state, writer, checkpoint_id=path, no_dist=True))
            responses[-1].staging_completion.result(timeout=BOUNDED_S)
            step += 1
        for response in responses:
            try:
                response.upload_completion.result(timeout=BOUNDED_S)
            except Exception as exc:  # noqa: BLE001 - counted, asserted below
                errors.append(repr(exc))
    assert errors == []
    for step in (0, 77, 159):
        expected = {f"t{i}": torch.zeros(64) for i in range(20)} | {"step": -1}
        _set_step(expected, step)
        assert_same_state(expected, load_like(tmp_path / f"c{step}", expected, READERS[0]))
