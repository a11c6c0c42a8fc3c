"""Failing rank, beyond ``test_distributed.py::test_a_failing_rank_fails_every_rank_and_commits_
nothing`` (rank 1, a tiny state): here each of the two gloo ranks in turn, the coordinator
included, fails mid-write while the other is still streaming 16 MiB through a 4 MiB pool. Both
futures fail within a bounded time naming the failing rank, no ``.metadata`` appears, both pools
drain, and a second save with the same writers (the fault gone) commits and loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_workers import INJECTED, check_all_ok, launch
from _faults_util import BOUNDED_S, base_state

from dcp_datastates import CheckpointNotCommittedError, DataStatesReader
from dcp_datastates.format import METADATA_NAME

WORKERS = str(Path(__file__).with_name("_fault_workers.py"))

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


@pytest.mark.parametrize("failing", [0, 1], ids=["coordinator-fails", "other-rank-fails"])
def test_one_rank_failing_mid_write_fails_both_in_bounded_time_and_both_recover(
    tmp_path: Path, failing: int
) -> None:
    results = launch(f"rank-fails-{failing}", tmp_path, timeout=120, script=WORKERS)
    check_all_ok(results)
    for r in results:
        report = r.report
        assert report["failed"], f"rank {r.rank}'s save succeeded although rank {failing} failed"
        assert report["type"] == "CheckpointSaveError"
        assert report["failed_ranks"] == [failing]
        assert f"rank {failing}" in report["message"] and INJECTED in report["message"]
        assert report["seconds"] < BOUNDED_S, f"rank {r.rank} took {report['seconds']:.1f}s"
        assert report["pool_drained"] and report["retry_ok"]

    assert not (tmp_path / "ckpt" / METADATA_NAME).exists()
    with pytest.raises(CheckpointNotCommittedError):
        DataStatesReader(tmp_path / "ckpt").read_metadata()

    expected = {f"rank{rank}": base_state(16, seed=rank)["model"] for rank in range(2)}
    target = {key: {k: torch.zeros_like(v) for k, v in m.items()} for key, m in expected.items()}
    dcp.load(target, storage_reader=DataStatesReader(tmp_path / "retry"), no_dist=True)
    for key, model in expected.items():
        for name, value in model.items():
            assert torch.equal(target[key][name], value), f"{key}.{name}"
