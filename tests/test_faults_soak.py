"""Soak: 50 back-to-back async saves of a ~200 MB state with one writer. Resident memory, the
host pool and open file descriptors stay flat, and every checkpoint loads bit-exactly.

Tolerances (also in docs/reliability.md), measured from the end of a 5-save warm-up:
RSS grows by at most 64 MiB; open file descriptors and threads are exactly as many; the pool
keeps its size, is allocated once, and has no block in use between saves.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _faults_util import (
    BOUNDED_S,
    MiB,
    apply_step,
    base_state,
    open_fds,
    rss_bytes,
    wait_until,
)
from conftest import pool_drains

from dcp_datastates import DataStatesReader, async_save

SAVES = 50
WARMUP = 5
STATE_MIB = 200
RSS_GROWTH_LIMIT = 64 * MiB


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fifty_back_to_back_saves_keep_memory_pool_and_fds_flat(
    tmp_path: Path, make_writer
) -> None:
    base = base_state(STATE_MIB)
    state = base_state(STATE_MIB)
    target = base_state(STATE_MIB)  # one load target, reused: loading must not grow RSS either
    writer = make_writer(tmp_path / "unused")
    figures = {}
    start = time.monotonic()
    for step in range(SAVES):
        apply_step(state, step, base)
        path = tmp_path / f"ckpt_{step}"
        response = async_save(state, writer, checkpoint_id=str(path), no_dist=True)
        response.staging_completion.result(timeout=BOUNDED_S)
        response.upload_completion.result(timeout=BOUNDED_S)
        assert pool_drains(writer)

        dcp.load(target, storage_reader=DataStatesReader(path), no_dist=True)
        for group in ("model", "optim"):
            for key, value in state[group].items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(target[group][key], value), f"step {step}: {group}.{key}"
        assert target["meta"] == state["meta"] and target["optim"]["step"] == step
        shutil.rmtree(path)

        pool = writer._runtime.pool
        now = {
            "rss": rss_bytes(),
            "fds": open_fds(),
            "threads": threading.active_count(),
            "pool": (pool.capacity, pool.allocated_bytes, pool.in_use),
        }
        if step == WARMUP - 1:
            figures["warm"] = now
    elapsed = time.monotonic() - start
    warm = figures["warm"]
    growth = now["rss"] - warm["rss"]
    print(
        f"\nsoak: {SAVES} saves of {STATE_MIB} MiB in {elapsed:.1f}s "
        f"({elapsed / SAVES:.2f}s per save, load and check); RSS {warm['rss'] / MiB:.0f} -> "
        f"{now['rss'] / MiB:.0f} MiB, fds {warm['fds']} -> {now['fds']}, threads "
        f"{warm['threads']} -> {now['threads']}, pool {now['pool']}"
    )
    assert growth <= RSS_GROWTH_LIMIT, f"RSS grew by {growth / MiB:.0f} MiB after warm-up"
    assert now["fds"] == warm["fds"]
    assert now["threads"] == warm["threads"]
    assert now["pool"] == warm["pool"] and now["pool"][2] == 0


def test_writers_made_by_async_save_are_closed_when_their_save_ends(tmp_path: Path) -> None:
    """``async_save(sd, path)`` makes a writer per call; each must release its pool and threads."""
    state = {"w": torch.randn(MiB), "step": 1}
    async_save(state, tmp_path / "warm", no_dist=True).upload_completion.result(timeout=BOUNDED_S)
    # The warm-up save's DCP thread exits just after it resolves the future: count without it.
    wait_until(lambda: not _save_threads(), BOUNDED_S, "the warm-up save thread to end")
    threads, fds = threading.active_count(), open_fds()
    for i in range(5):
        response = async_save(state, tmp_path / f"c{i}", no_dist=True)
        response.upload_completion.result(timeout=BOUNDED_S)
    # DCP's save thread exits just after it resolves the future: wait for it, not for ours.
    wait_until(lambda: threading.active_count() == threads, BOUNDED_S, "the save threads to end")
    assert open_fds() == fds


def _save_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("AsyncCheckpointExecutor")]
