"""Two real gloo ranks save DTensors, replicated tensors and objects; this process loads them.

Every save runs in fresh worker processes (see ``_dist_workers.py``); loading happens here, in
one process with no process group, so each checkpoint is also resharded from 2 ranks to 1. The
other way round, a checkpoint saved here loads resharded onto two ranks.
"""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_workers import INJECTED, check_all_ok, empty_like_values, full_values, launch

from dcp_datastates import CheckpointNotCommittedError, DataStatesReader, DataStatesWriter
from dcp_datastates.format import (
    DATA_SUFFIX,
    MANIFEST_NAME,
    METADATA_NAME,
    decode_manifest,
    manifest_key,
)

CROSS_RANK_WORKERS = str(Path(__file__).with_name("_cross_rank_workers.py"))

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

#: sync ``dcp.save``; ``dcp.async_save`` with our writer; our ``async_save`` (with a path, and
#: with a writer whose ``warm_up`` learnt the layout first). The async modes change every tensor
#: in place as soon as staging completes.
SAVE_MODES = ["sync", "dcp_async", "ours", "ours_warm"]


@pytest.fixture(scope="module", params=SAVE_MODES)
def two_rank_checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    workdir = tmp_path_factory.mktemp(f"save-{request.param}")
    results = launch(f"save-{request.param}", workdir, timeout=45)
    check_all_ok(results)
    assert all(r.report["mutated_after_staging"] == (request.param != "sync") for r in results)
    if request.param == "ours_warm":  # the replay does not cover DTensors: the save walked
        assert [r.report["replays"] for r in results] == [0, 0]
    return workdir / "ckpt"


def _load(path: Path, reader: str) -> dict[str, Any]:
    target = empty_like_values(full_values())
    if reader == "stock":
        dcp.load(target, checkpoint_id=path, no_dist=True)
    else:
        dcp.load(target, storage_reader=DataStatesReader(path), no_dist=True)
    return target


@pytest.mark.parametrize("reader", ["stock", "datastates"])
def test_two_rank_checkpoint_loads_resharded_in_one_process(
    two_rank_checkpoint: Path, reader: str
) -> None:
    loaded = _load(two_rank_checkpoint, reader)
    expected = full_values()
    for fqn in ("sharded", "replicated_dt", "plain"):
        assert loaded[fqn].dtype == expected[fqn].dtype
        assert torch.equal(loaded[fqn], expected[fqn]), f"{fqn} differs from what the ranks saved"
    assert loaded["meta"] == expected["meta"]


@pytest.mark.parametrize("writer", ["stock", "datastates"])
@pytest.mark.parametrize("reader", ["stock", "datastates"])
def test_one_process_checkpoint_loads_resharded_onto_two_ranks(
    tmp_path: Path, writer: str, reader: str
) -> None:
    """1 -> 2: saved without a process group, loaded into DTensors sharded by rows and by
    columns (a non-contiguous local target) on two gloo ranks."""
    state = full_values()
    if writer == "stock":
        dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    else:
        dcp.save(state, storage_writer=DataStatesWriter(tmp_path / "ckpt"), no_dist=True)
    results = launch(f"load-{reader}", tmp_path, timeout=45)
    check_all_ok(results)
    for r in results:
        assert r.report["differs"] == [], f"rank {r.rank} loaded wrong values"
        assert r.report["local_shapes"] == {"sharded": [4, 6], "plain": [3, 2]}


def test_replicated_items_are_written_once(two_rank_checkpoint: Path) -> None:
    with open(two_rank_checkpoint / METADATA_NAME, "rb") as f:
        metadata = pickle.load(f)
    storage = metadata.storage_data
    per_fqn = Counter(index.fqn for index in storage)
    assert per_fqn == {
        "sharded": 2,
        "replicated_dt": 1,
        "plain": 1,
        "meta.step": 1,
        "meta.tag": 1,
        "meta.lrs": 1,
    }
    # The two shards come from the two ranks' files.
    shard_files = sorted(
        info.relative_path[:3] for index, info in storage.items() if index.fqn == "sharded"
    )
    assert shard_files == ["__0", "__1"]

    manifest = decode_manifest((two_rank_checkpoint / MANIFEST_NAME).read_bytes())
    assert set(manifest) == {manifest_key(index.fqn, index.offset) for index in storage}

    # Every byte of every data file belongs to exactly one record: no hidden second copy.
    files = {
        p.name: p.read_bytes()
        for p in two_rank_checkpoint.iterdir()
        if p.name.endswith(DATA_SUFFIX)
    }
    for name, blob in files.items():
        spans = sorted(
            (info.offset, info.length) for info in storage.values() if info.relative_path == name
        )
        covered = 0
        for offset, length in spans:
            assert offset == covered, f"{name}: gap or overlap at byte {covered}"
            covered += length
        assert covered == len(blob), f"{name}: {len(blob) - covered} bytes belong to no record"

    # And the raw bytes of each replicated tensor occur once across all files.
    everything = b"".join(files.values())
    expected = full_values()
    for fqn in ("plain", "replicated_dt"):
        raw = expected[fqn].numpy().tobytes()
        assert everything.count(raw) == 1, f"{fqn} is stored {everything.count(raw)} times"


@pytest.mark.parametrize("mode", ["dcp_async", "ours"])
def test_a_failing_rank_fails_every_rank_and_commits_nothing(tmp_path: Path, mode: str) -> None:
    results = launch(f"fail-{mode}", tmp_path, timeout=45)
    check_all_ok(results)
    for r in results:
        report = r.report
        assert report["failed"], f"rank {r.rank}'s save succeeded although rank 1's writes failed"
        assert report["failed_ranks"] == [1]
        assert report["failure_types"] == {"1": "StorageWriteError"}
        assert "rank 1" in report["message"] and INJECTED in report["message"]
        if mode == "ours":
            # An Exception (DCP's CheckpointException is not), with a readable one-line cause.
            assert report["type"] == "CheckpointSaveError" and report["is_exception"]
            assert "rank 1: StorageWriteError: " in report["message"]
        else:
            assert report["type"] == "CheckpointException"

    ckpt = tmp_path / "ckpt"
    assert not (ckpt / METADATA_NAME).exists()
    assert not (ckpt / MANIFEST_NAME).exists()
    # The failing rank removed its partial files; the healthy rank's file is an uncommitted orphan.
    assert not [p.name for p in ckpt.iterdir() if p.name.startswith("__1_")]
    with pytest.raises(CheckpointNotCommittedError):
        DataStatesReader(ckpt).read_metadata()


def test_repeat_saves_on_two_ranks_take_the_global_plan_from_the_cache_until_it_changes(
    tmp_path: Path,
) -> None:
    """Saves that replay the layout of the save before send empty plans and the coordinator
    serves the global plan it made (``save/global_plan.py``); when one rank's tensor changes
    shape, that rank sends its plan, the other its token, and the coordinator plans again from
    both, each save to its own checkpoint; a writer made anew on rank 0 alone still serves rank
    1's token. Every checkpoint loads through stock ``dcp.load`` as the state was."""
    results = launch("plan-cache", tmp_path, timeout=90, script=CROSS_RANK_WORKERS)
    check_all_ok(results)
    for r in results:
        assert r.report["differs"] == [], f"rank {r.rank}"
    coordinator = results[0].report
    # save 0 walks the state; saves 1-3 replay it; save 4 changes rank 1's shape; save 5 has a
    # new writer on rank 0 only (once, every rank failed: the token was unknown to it), which
    # plans from rank 1's cached plan and its own
    assert coordinator["made"] == [1, 1, 1, 1, 2, 1], coordinator
    assert coordinator["served"] == [0, 1, 2, 3, 3, 0], coordinator


def test_replayed_saves_on_two_ranks_reuse_their_write_items_only_where_they_hold(
    tmp_path: Path,
) -> None:
    """Each rank's writer replays the first save's layout (plain tensors: replicated ones and
    one of the rank's own, so the ranks' local plans differ) and keeps its write items; a save
    that gives a tensor another shape of the same bytes is planned again on every rank. Every
    checkpoint loads back as the state was at the call, through dcp_datastates.async_save and
    dcp.async_save alike."""

    results = launch("replayed", tmp_path, timeout=90, script=CROSS_RANK_WORKERS)
    check_all_ok(results)
    for r in results:
        assert r.report["differs"] == [], f"rank {r.rank}"
        assert r.report["replays"] == 3, f"rank {r.rank}"
        # the walk; a replay; save 2 views the tensor as 32x128 and save 3 as 64x64 again:
        # each differs from the save before, so each is planned again
        assert r.report["reused"] == [False, True, False, False], f"rank {r.rank}"
