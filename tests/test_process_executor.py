"""``async_checkpointer_type=PROCESS``: DCP pickles the writer into its checkpoint daemon.

DCP's process executor needs an initialized process group (it broadcasts the daemon's store
address), so one worker process joins a world-size-1 gloo group and saves twice there:
through ``dcp.async_save`` and through our ``async_save``. The daemon lives and dies with that
worker, never with pytest. The worker changes every tensor as soon as ``staging_completion``
resolves; the checkpoints must still hold the values at call time.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_workers import check_all_ok, empty_like_values, full_values, launch

from dcp_datastates import DataStatesReader
from dcp_datastates.save.process_staging import shared_bytes

CROSS_RANK_WORKERS = str(Path(__file__).with_name("_cross_rank_workers.py"))

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def process_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("process")
    results = launch("process", workdir, world_size=1, timeout=45)
    check_all_ok(results)
    report = results[0].report
    assert report["dcp_async_response"] == report["ours_response"] == "AsyncSaveResponse"
    assert report["daemon_pids"], "no checkpoint daemon: the PROCESS executor was not used"
    for pid in report["daemon_pids"]:
        assert not os.path.exists(f"/proc/{pid}"), f"checkpoint daemon {pid} outlived its trainer"
    return workdir


@pytest.mark.parametrize("reader", ["stock", "datastates"])
@pytest.mark.parametrize("entry_point", ["dcp_async", "ours"])
def test_process_executor_save_holds_values_at_call_time(
    process_checkpoints: Path, entry_point: str, reader: str
) -> None:
    path = process_checkpoints / entry_point
    with open(path / ".metadata", "rb") as f:  # dcp.async_save's writer compresses (ZStandard)
        infos = pickle.load(f).storage_data.values()
    compressed = ["stream.zstd/1"] if entry_point == "dcp_async" else None
    assert all(i.transform_descriptors == compressed for i in infos)
    target = empty_like_values(full_values())
    if reader == "stock":
        dcp.load(target, checkpoint_id=path, no_dist=True)
    else:
        dcp.load(target, storage_reader=DataStatesReader(path), no_dist=True)
    expected = full_values()
    for fqn in ("sharded", "replicated_dt", "plain"):
        assert torch.equal(target[fqn], expected[fqn]), f"{fqn}: the save saw a later mutation"
    assert target["meta"] == expected["meta"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_process_executor_saves_dtensors_on_two_ranks_and_the_daemon_stays_flat(
    tmp_path: Path,
) -> None:
    """DTensors staged for the daemon used to crash every rank (SIGSEGV while DCP pickled them),
    and the daemon kept a pool and threads per request. Four saves on two gloo ranks, each
    mutated as soon as staging completes, each loaded back and compared on its rank."""

    results = launch("process-dtensor", tmp_path, timeout=170, script=CROSS_RANK_WORKERS)
    check_all_ok(results)
    for r in results:
        assert r.report["differs"] == [], f"rank {r.rank}: {r.report['differs']}"
    daemon = results[0].report["daemon"]
    assert len(daemon) == 4 and len({d["pid"] for d in daemon}) == 1
    threads = [d["threads"] for d in daemon]
    assert threads == [threads[0]] * len(threads), f"daemon threads grew per save: {threads}"
    growth = daemon[-1]["rss"] - daemon[0]["rss"]
    assert growth < 16 << 20, f"daemon RSS grew {growth / 2**20:.0f} MiB over 3 saves"


def test_the_staging_segment_is_fresh_shared_memory_of_the_size_asked() -> None:
    # The segment the staging thread copies into, handed to the daemon by file descriptor;
    # made without the whole-state copy of torch.empty(n).share_memory_().
    buf = shared_bytes(3 << 20)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 << 20
    assert buf.is_shared() and buf.untyped_storage().nbytes() == 3 << 20
    buf[-1] = 7  # writable to its last byte
    assert int(buf[-1]) == 7


def test_a_failed_staging_in_a_save_of_several_ranks_is_raised_by_the_daemons_write() -> None:
    """In a save of several ranks a staging failure is relayed: the staged state names it, and
    the daemon's writer raises it in the local planning step (DCP then reports it to every
    rank); the caller's staging does not raise."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_datastates.errors import InvalidStateDictError
    from dcp_datastates.save.process_staging import FAILED_KEY, raise_relayed, stage_for_process

    class Odd(torch.Tensor):
        pass

    state = {"w": torch.ones(4).as_subclass(Odd)}
    with pytest.raises(InvalidStateDictError, match="'w'"):  # one rank: raised at the call
        stage_for_process(state, guard=False)
    staging = stage_for_process(state, guard=False, relay=lambda exc: True)  # several ranks
    staged = staging.result.result(timeout=10)
    assert staging.staged.done() and [k.split("/")[0] for k in staged] == [FAILED_KEY]
    staged = pickle.loads(pickle.dumps(staged))  # as DCP hands it to its daemon
    planner = DefaultSavePlanner()
    planner.set_up_planner(staged, is_coordinator=True)
    plan = planner.create_local_plan()
    with pytest.raises(InvalidStateDictError, match="'w'"):
        raise_relayed(plan)
    planner.set_up_planner({"w": torch.ones(4)}, is_coordinator=True)  # a good rank's plan
    raise_relayed(planner.create_local_plan())
