"""The host pool is faulted in ahead of the copies (``snapshot/hostmem.py``), front first, and a
copy into a block starts only once that block is populated; ``warm_up`` does it before any save.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import EVENT_TIMEOUT_S, MiB, load_like

from dcp_datastates import async_save
from dcp_datastates.snapshot import pool as pool_module
from dcp_datastates.snapshot.hostmem import PopulatedBuffer


class GatedBuffer(PopulatedBuffer):
    """Populates its first slice at once and the rest only once ``gate`` is set."""

    gate = threading.Event()

    def populate(self, offset: int, nbytes: int) -> None:
        if offset > 0:
            assert self.gate.wait(EVENT_TIMEOUT_S)
        super().populate(offset, nbytes)


@pytest.fixture
def gated_pool(monkeypatch: pytest.MonkeyPatch) -> Any:
    GatedBuffer.gate = threading.Event()
    monkeypatch.setattr(pool_module, "SLICE_BYTES", MiB)
    monkeypatch.setattr(pool_module, "PopulatedBuffer", GatedBuffer)
    pool = pool_module.HostPool(4 * MiB, populate=True)
    yield pool
    GatedBuffer.gate.set()
    pool.close()


def test_a_block_in_the_populated_front_is_reserved_at_once(gated_pool: Any) -> None:
    first = gated_pool.reserve(MiB // 2, cancelled=lambda: False)
    assert first == 0 and gated_pool.populated_bytes == MiB
    gated_pool.release(first)


def test_a_block_past_the_populated_front_waits_for_it(gated_pool: Any) -> None:
    got: list[int | None] = []
    reserver = threading.Thread(
        target=lambda: got.append(gated_pool.reserve(2 * MiB, cancelled=lambda: False))
    )
    reserver.start()
    reserver.join(0.2)
    assert reserver.is_alive() and not got  # held: only the first MiB is populated
    GatedBuffer.gate.set()
    reserver.join(EVENT_TIMEOUT_S)
    assert got == [0] and gated_pool.populated_bytes >= 2 * MiB
    assert gated_pool.wait_populated(EVENT_TIMEOUT_S)
    assert gated_pool.populated_bytes == gated_pool.capacity
    gated_pool.release(0)


def test_threads_populate_slices_at_once_and_the_front_grows_only_over_those_done_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Several threads fault the pool in (stock's first copy faults on every core), helpers from
    the back; a slice done before the one ahead of it does not let a copy into the unpopulated
    one."""
    started: list[int] = []
    later_done = threading.Event()
    first_gate = threading.Event()

    class FirstHeld(PopulatedBuffer):
        def populate(self, offset: int, nbytes: int) -> None:
            started.append(offset)
            if offset == 0:
                assert first_gate.wait(EVENT_TIMEOUT_S)
            super().populate(offset, nbytes)
            if offset == 3 * MiB:  # a helper's first slice: the last
                later_done.set()

    monkeypatch.setattr(pool_module, "SLICE_BYTES", MiB)
    monkeypatch.setattr(pool_module, "POPULATE_THREADS", 3)
    monkeypatch.setattr(pool_module, "PopulatedBuffer", FirstHeld)
    pool = pool_module.HostPool(4 * MiB, populate=True)
    try:
        assert later_done.wait(EVENT_TIMEOUT_S)  # the last slice done while slice 0 is held
        assert pool.populated_bytes == 0
        first_gate.set()
        assert pool.wait_populated(EVENT_TIMEOUT_S)
        assert sorted(started) == [0, MiB, 2 * MiB, 3 * MiB]
    finally:
        first_gate.set()
        pool.close()


def test_populating_without_the_kernel_advice_touches_the_pages() -> None:
    buffer = PopulatedBuffer(3 * MiB)
    buffer._populate_call = False  # as on a kernel without MADV_POPULATE_WRITE
    buffer.tensor[:16].fill_(7)
    buffer.populate(0, MiB)
    assert int(buffer.tensor[:MiB].sum()) == 0


def test_warm_up_sizes_and_populates_the_pool_the_first_save_then_uses(
    tmp_path: Path, make_writer: Any
) -> None:
    state = {"w": torch.randn(MiB), "b": torch.arange(10.0), "step": 3}
    writer = make_writer(tmp_path / "ckpt")
    writer.warm_up(state, wait=True)
    pool = writer._runtime.pool
    assert pool is not None and pool.capacity >= 4 * MiB + 40
    assert pool.populated_bytes == pool.capacity

    async_save(state, writer, no_dist=True).upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert writer._runtime.pool is pool  # the save reused it
    loaded = load_like(tmp_path / "ckpt", state, "datastates")
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])


def test_after_warm_up_the_first_save_starts_no_thread_on_its_way_to_the_copies(
    tmp_path: Path, make_writer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A thread's start waits for it to run: on the caller (planning, save thread) it was
    # blocked time, and the copy workers' start came before the first copy (item 24).
    state = {"w": torch.randn(MiB), "b": torch.arange(10.0), "step": 3}
    writer = make_writer(tmp_path / "ckpt")
    writer.warm_up(state, wait=True)
    started: list[str] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    response = async_save(state, writer, no_dist=True)
    response.staging_completion.result(timeout=EVENT_TIMEOUT_S)
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    # The flush's file threads start per save, on the save thread, once the copies are under
    # way; nothing else starts.
    assert started and all(name.startswith("datastates-flush") for name in started), started


def test_copy_workers_default_to_this_ranks_share_of_the_cores(monkeypatch: Any) -> None:
    from dcp_datastates import WriterOptions

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert WriterOptions().effective_copy_workers() == 4  # capped: memory bandwidth
    assert WriterOptions().effective_copy_workers(local_ranks=8) == 2
    assert WriterOptions().effective_copy_workers(local_ranks=32) == 1
    assert WriterOptions(copy_workers=7).effective_copy_workers(local_ranks=8) == 7


def test_live_flush_defaults_to_on_where_cores_outnumber_the_copy_workers(monkeypatch: Any) -> None:
    from dcp_datastates import WriterOptions

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert WriterOptions().effective_live_flush()  # 4 workers, 16 cores
    assert not WriterOptions().effective_live_flush(local_ranks=8)  # 2 workers, 2 cores each
    assert WriterOptions(copy_workers=1).effective_live_flush(local_ranks=8)
    assert not WriterOptions(live_flush=False).effective_live_flush()
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert not WriterOptions().effective_live_flush()  # 2 workers take both cores
    assert WriterOptions(live_flush=True).effective_live_flush()
