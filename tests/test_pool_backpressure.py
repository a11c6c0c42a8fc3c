"""A state larger than the host pool is still saved whole: big tensors are chunked and the snapshot
waits for the flush to hand pool blocks back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import READERS, MiB, assert_same_state, load_like

from dcp_datastates import DataStatesWriter, async_save

SMALL_POOL = {"host_pool_bytes": MiB, "chunk_bytes": 64 * 1024, "coalesce_bytes": 16 * 1024}


@pytest.mark.parametrize("reader", READERS)
def test_a_tensor_eight_times_the_pool_is_saved_whole(
    tmp_path: Path, make_writer, reader: str
) -> None:
    state = {"big": torch.randn(2 * MiB)}  # 8 MiB
    writer = make_writer(tmp_path, **SMALL_POOL)
    dcp.save(state, storage_writer=writer, no_dist=True)

    stats = writer.last_stats
    assert stats.pool_bytes == MiB
    assert 0 < stats.pool_peak_bytes <= stats.pool_bytes
    assert stats.bytes_written > 8 * MiB
    assert_same_state(state, load_like(tmp_path, state, reader))


def test_a_non_contiguous_tensor_larger_than_the_pool_is_copied_in_rows(
    tmp_path: Path, make_writer
) -> None:
    state = {"transposed": torch.randn(1024, 2048).t()}  # 8 MiB, rows of 4 KiB
    writer = make_writer(tmp_path, **SMALL_POOL)
    dcp.save(state, storage_writer=writer, no_dist=True)

    assert writer.last_stats.pool_peak_bytes <= MiB
    assert_same_state(state, load_like(tmp_path, state, "datastates"))


@pytest.mark.parametrize("reader", READERS)
def test_a_state_several_times_the_pool_streams_through_it(
    tmp_path: Path, make_writer, reader: str
) -> None:
    g = torch.Generator().manual_seed(1)
    state = {
        "layers": [torch.randn(256, 256, generator=g) for _ in range(12)],  # 12 x 256 KiB
        "embedding": torch.randn(3000, 128, generator=g).half(),
        "tiny": {f"b{i}": torch.randn(8, generator=g) for i in range(200)},
        "step": 11,
    }
    writer = make_writer(tmp_path, **SMALL_POOL, flush_workers=3)
    response = async_save(state, writer, no_dist=True)
    response.upload_completion.result()

    stats = writer.last_stats
    assert stats.bytes_written > 3 * stats.pool_bytes
    assert stats.pool_peak_bytes <= stats.pool_bytes
    assert_same_state(state, load_like(tmp_path, state, reader))


def test_consecutive_saves_reuse_one_pool(tmp_path: Path, make_writer) -> None:
    state = {"w": torch.randn(3 * MiB // 4)}  # 3 MiB through a 1 MiB pool, three times
    writer = make_writer(tmp_path, **SMALL_POOL)
    for n in range(3):
        state["w"].add_(1.0)
        dcp.save(state, storage_writer=writer, checkpoint_id=str(tmp_path / f"c{n}"), no_dist=True)

    assert writer.last_stats.pool_bytes == MiB
    assert writer._runtime is not None and writer._runtime.pool.in_use == 0
    assert_same_state(state, load_like(tmp_path / "c2", state, "datastates"))


def test_closing_a_writer_drops_a_snapshot_that_was_staged_but_never_saved(
    tmp_path: Path,
) -> None:
    writer = DataStatesWriter(tmp_path, host_pool_bytes=4 * MiB)
    state = {"w": torch.randn(MiB), "v": torch.randn(MiB)}
    with pytest.warns(RuntimeWarning, match="not called by a dcp.async_save"):
        writer.stage(state)  # no save follows: a caller that changed its mind
    writer.close()  # must not raise about blocks in use, nor hang
    assert writer._runtime.pool is None
