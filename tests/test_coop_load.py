"""Cooperative load: four gloo ranks read each record from storage once and pass it on.

Bytes read are counted through a counting subclass of the real local storage on every rank
(``_coop_workers.py``); the values must come back exact, replicated or resharded, and a rank whose
reads fail must stop every rank with an error that names the item and the file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from _coop_workers import FAIL, replicated_state
from _dist_workers import RankResult, check_all_ok, launch

from dcp_datastates import DataStatesWriter
from dcp_datastates.format import DATA_SUFFIX

COOP_WORKERS = str(Path(__file__).with_name("_coop_workers.py"))

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def _data_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.name.endswith(DATA_SUFFIX))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[RankResult]]:
    """One launch of four ranks for both tests (a launch costs ~10 s of interpreter starts)."""
    workdir = tmp_path_factory.mktemp("coop")
    dcp.save(replicated_state(), storage_writer=DataStatesWriter(workdir / "ckpt"), no_dist=True)
    results = launch("loads", workdir, world_size=4, timeout=100, script=COOP_WORKERS)
    check_all_ok(results)
    return workdir, results


def test_a_replicated_state_is_read_once_by_four_ranks_and_loads_exactly(
    four_ranks: tuple[Path, list[RankResult]],
) -> None:
    workdir, every = four_ranks
    ckpt = workdir / "ckpt"
    total = _data_bytes(ckpt)
    results = [dataclasses.replace(r, report=r.report["replicated"]) for r in every]
    for r in results:
        assert r.report["differs"] == {"plain": [], "coop": [], "rounds": []}, r.report
    plain = sum(r.report["read"]["plain"] for r in results)
    coop = sum(r.report["read"]["coop"] for r in results)
    assert plain >= 4 * 0.99 * total  # every rank reads the whole state
    # In rounds of 256 KiB, rank 3 needing nothing: the three others share the reads.
    assert 0.99 * total <= sum(r.report["read"]["rounds"] for r in results) <= 1.01 * total
    assert results[3].report["read"]["rounds"] == 0
    assert 0.99 * total <= coop <= 1.01 * total, (coop, total)  # each byte once
    # Spread: no rank reads more than half of the state (the three big records go to three ranks).
    assert max(r.report["read"]["coop"] for r in results) <= total / 2
    # Rank 1's reads fail: it raises its own error, every other rank one naming it, an item and
    # the file, and none hangs.
    for r in results:
        failed = r.report["failed"]
        assert failed and FAIL in failed, (r.rank, failed)
        if r.rank != 1:
            assert "CooperativeLoadError" in failed and "rank 1 of this cooperative" in failed
            assert "item '" in failed and str(ckpt) in failed, failed
            # the cause first, then what else that round read (which need not include it)
            assert failed.index(FAIL) < failed.index("that round it read"), failed


def test_row_shards_of_two_ranks_load_resharded_on_four_reading_each_record_once(
    four_ranks: tuple[Path, list[RankResult]],
) -> None:
    workdir, every = four_ranks
    total = _data_bytes(workdir / "sharded")
    results = [dataclasses.replace(r, report=r.report["reshard"]) for r in every]
    for r in results:
        assert r.report["differs"] == {"plain": [], "coop": []}, (r.rank, r.report)
    plain = sum(r.report["read"]["plain"] for r in results)
    coop = sum(r.report["read"]["coop"] for r in results)
    # Plain: each of the two row records is read by two ranks (one uneven shard by three), each
    # column and replicated record by all four.
    assert plain >= 2 * total, (plain, total)
    assert 0.99 * total <= coop <= 1.01 * total, (coop, total)


def test_the_plan_gives_each_record_one_reader_spread_over_ranks_in_bounded_rounds(
    tmp_path: Path,
) -> None:
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    from dcp_datastates import DataStatesReader
    from dcp_datastates.load.coop_plan import plan_cooperative

    state = {k: v for k, v in replicated_state().items() if k != "meta"}
    dcp.save(state, storage_writer=DataStatesWriter(tmp_path), no_dist=True)
    reader = DataStatesReader(tmp_path)
    metadata = reader.read_metadata()
    plans = [create_default_local_load_plan(state, metadata) for _ in range(4)]
    out = plan_cooperative(plans, metadata, reader.record_length, round_bytes=256 << 10)
    schedules = [p.storage_data for p in out]
    readers: dict[tuple[str, int], list[int]] = {}
    for rank, s in enumerate(schedules):
        for key in s.reads:
            readers.setdefault(key, []).append(rank)
    assert len(readers) == len(state) and all(len(r) == 1 for r in readers.values())
    length = {
        (sinfo.relative_path, sinfo.offset): reader.record_length(index)
        for index, sinfo in metadata.storage_data.items()
    }
    per_rank = [sum(length[key] for key in s.reads) for s in schedules]
    assert max(per_rank) <= sum(per_rank) / 2  # the big records go to different ranks
    assert schedules[0].rounds >= 2  # 256 KiB rounds: the bf16 record apart from the small ones
    sent = sorted((t.tag, rank, t.peer) for rank, s in enumerate(schedules) for t in s.sends)
    got = sorted((t.tag, t.peer, rank) for rank, s in enumerate(schedules) for t in s.recvs)
    assert sent == got and len(sent) == 3 * len(state)  # every item to the three other ranks
