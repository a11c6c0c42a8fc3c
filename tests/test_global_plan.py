"""The coordinator's global plan at scale (``save/global_plan.py``): DCP's checks in time that
grows with the chunks, and the writer's plan cache across ranks (simulated here; two gloo ranks
in ``test_distributed``)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.metadata import TensorProperties as Props
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem
from torch.distributed.checkpoint.planner import WriteItemType as Kind

from dcp_datastates import WriterUsageError
from dcp_datastates.format import RecordInfo, encode_manifest
from dcp_datastates.save import global_plan
from dcp_datastates.save.global_plan import (
    GlobalPlanMemo,
    PlanToken,
    plan_globally,
    validate_global_plan,
)


def _item(fqn: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]):
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=Kind.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=Props(dtype=torch.float32),
            size=torch.Size(shape),
        ),
    )


def _fsdp(world: int, shape: tuple[int, int] = (64, 256), fqn: str = "w") -> list[SavePlan]:
    """Each rank's plan of one weight sharded on its first dimension (FSDP2), as DCP makes it;
    the weight is wider than tall, where DCP's overlap sweep compares every pair."""
    rows = shape[0] // world
    return [
        SavePlan([_item(fqn, shape, (r * rows, 0), (rows, shape[1]))], planner_data={fqn: (fqn,)})
        for r in range(world)
    ]


def _metadata_of(plans: list[SavePlan]):
    return default_planner.create_default_global_save_plan(plans)


@pytest.mark.parametrize(
    "case",
    ["sharded", "overlap", "out-of-bounds", "gap", "2d-grid"],
)
def test_our_validation_finds_what_dcps_finds(case: str) -> None:
    plans = _fsdp(4)
    if case == "overlap":
        plans[2] = SavePlan([_item("w", (64, 256), (8, 0), (16, 256))])
    elif case == "out-of-bounds":
        plans[3] = SavePlan([_item("w", (64, 256), (48, 0), (17, 256))])
    elif case == "gap":
        plans = plans[:3]
    elif case == "2d-grid":  # FSDP x TP: 4 rows x 2 columns, then one piece moved over another
        plans = [
            SavePlan([_item("w", (64, 256), (r * 16, c * 128), (16, 128))])
            for r in range(4)
            for c in range(2)
        ]
    global_plan, metadata = _metadata_of(plans)
    ours = validate_global_plan(global_plan, metadata)
    assert ours == default_planner._validate_global_plan(global_plan, metadata)
    assert bool(ours) == (case in ("overlap", "out-of-bounds", "gap"))


def test_validating_many_shards_of_a_wide_tensor_is_not_quadratic() -> None:
    """1,024 shards of a weight wider than tall: DCP compares every pair (half a million box
    checks); ours each shard with its neighbours. Same answer, a fraction of the time."""
    global_plan, metadata = _metadata_of(_fsdp(1024, shape=(1024, 4096)))
    t0 = time.process_time()
    theirs = default_planner._validate_global_plan(global_plan, metadata)
    dcp_s = time.process_time() - t0
    t0 = time.process_time()
    ours = validate_global_plan(global_plan, metadata)
    ours_s = time.process_time() - t0
    assert ours == theirs == []
    assert ours_s * 10 < dcp_s, (ours_s, dcp_s)


def test_plan_globally_makes_dcps_plan_and_metadata() -> None:
    plans = _fsdp(4) + [SavePlan([WriteItem(index=MetadataIndex("step"), type=Kind.BYTE_IO)])]
    planner = default_planner.DefaultSavePlanner()
    planner.set_up_planner({})
    plans[-1] = SavePlan(plans[-1].items, planner_data={"step": ("step",)})
    expected_plans, expected = planner.create_global_plan(plans)
    got_plans, got = plan_globally(plans)
    assert got.state_dict_metadata == expected.state_dict_metadata
    assert got.planner_data == expected.planner_data
    assert [p.items for p in got_plans] == [p.items for p in expected_plans]


class _Ranks:
    """Each rank's memo (rank 0's also the coordinator's), and one save's round of DCP's
    planning calls: local plans, the global plan, the final plans."""

    def __init__(self, world: int) -> None:
        self.memos = [GlobalPlanMemo() for _ in range(world)]

    def save(self, plans: list[SavePlan]) -> tuple[list[SavePlan], list[SavePlan], object]:
        sent = [m.local(p) for m, p in zip(self.memos, plans, strict=True)]
        central, metadata = self.memos[0].plan(sent)
        final = [m.finish(c, p) for m, c, p in zip(self.memos, central, plans, strict=True)]
        return sent, final, metadata


def test_a_repeat_save_is_served_from_the_cache_and_a_changed_rank_plans_again() -> None:
    ranks = _Ranks(3)
    plans = _fsdp(3, shape=(48, 256))
    _, first, metadata = ranks.save(plans)
    sent, again, metadata2 = ranks.save(plans)  # every rank replays: the same plan objects
    assert all(not p.usable and not p.items for p in sent), "unchanged ranks sent their plans"
    assert all(isinstance(p.planner_data, PlanToken) for p in sent)
    assert (ranks.memos[0].made, ranks.memos[0].served) == (1, 1)
    assert all(a is b for a, b in zip(again, first, strict=True))
    assert metadata2.state_dict_metadata == metadata.state_dict_metadata
    assert (
        metadata2 is not metadata
        and metadata2.state_dict_metadata is not metadata.state_dict_metadata
    )

    changed = list(plans)
    changed[1] = SavePlan(list(plans[1].items), planner_data=plans[1].planner_data)  # a new plan
    local = [m.local(p) for m, p in zip(ranks.memos, changed, strict=True)]
    # what the writer's prepare_local_plan adds: this save's checkpoint, on every rank's plan
    sent = [dataclasses.replace(p, storage_data=f"save-3:{i}") for i, p in enumerate(local)]
    central, _ = ranks.memos[0].plan(sent)
    assert [p.storage_data for p in central] == [f"save-3:{i}" for i in range(3)]
    final = [m.finish(c, p) for m, c, p in zip(ranks.memos, central, changed, strict=True)]
    assert [p.usable for p in sent] == [False, True, False]
    assert ranks.memos[0].made == 2, "a changed rank's plan was not planned again"
    assert all(p.usable and p.items for p in final)
    assert [p.items for p in final] == [p.items for p in first]


def test_a_cached_plan_the_coordinator_does_not_hold_is_refused_and_the_next_save_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ranks = _Ranks(2)
    plans = _fsdp(2)
    ranks.save(plans)
    ranks.memos[0].forget()  # the coordinator lost its cache (its rank's part too) ...
    monkeypatch.setattr(global_plan, "_last_made", None)  # ... and its process's (a restart)
    with pytest.raises(WriterUsageError, match="does not hold"):
        ranks.save(plans)
    # The failed save never reached finish_plan: every rank sends its whole plan again.
    sent, final, _ = ranks.save(plans)
    assert all(p.usable for p in sent), "a rank sent a cached plan after a failed save"
    assert all(p.items for p in final)


def test_saves_of_one_writer_to_two_directories_that_plan_at_once_each_get_their_own_plan() -> None:
    # Saves to different directories (TieredCheckpointer's step_N) do not take turns
    # (path_turns): save B plans while save A, answered from the cache, has not finished.
    memo = GlobalPlanMemo()
    (plan,) = _fsdp(1)
    first = memo.finish(memo.plan([memo.local(plan)])[0][0], plan)
    sent_a = memo.local(plan)  # A offers the cached plan
    sent_b = memo.local(plan)  # B overlaps A: its whole plan
    assert not sent_a.usable and sent_b.usable
    central_b = memo.plan([sent_b])[0][0]  # B plans anew first ...
    central_a = memo.plan([sent_a])[0][0]  # ... and A is still served its own
    assert memo.finish(central_b, plan).items == first.items
    assert memo.finish(central_a, plan) is first
    assert (memo.made, memo.served) == (2, 1)
    # After an overlap the next save sends its whole plan; the one after is served again.
    assert memo.local(plan).usable
    memo.finish(memo.plan([plan])[0][0], plan)
    again = memo.local(plan)
    assert not again.usable
    assert memo.finish(memo.plan([again])[0][0], plan).items == first.items


def test_a_writer_made_anew_on_the_coordinator_only_serves_the_other_ranks_cached_plans() -> None:
    """A user closes and remakes the writer on rank 0 only (after an error there): the other
    ranks' writers still send the token of the last global plan, which rank 0's process made.
    Refused, that save failed on every rank (a user sweep); served, it plans as before."""
    ranks = _Ranks(3)
    plans = _fsdp(3, shape=(48, 256))
    _, first, metadata = ranks.save(plans)
    ranks.memos[0].forget()  # writer.close()
    ranks.memos[0] = GlobalPlanMemo()  # and a new writer, on rank 0 only
    sent, final, metadata2 = ranks.save(plans)
    assert [p.usable for p in sent] == [True, False, False]
    assert [p.items for p in final] == [p.items for p in first]
    assert metadata2.state_dict_metadata == metadata.state_dict_metadata
    sent, final, _ = ranks.save(plans)  # and then from the new writer's own cache
    assert not any(p.usable for p in sent) and ranks.memos[0].served == 1
    assert [p.items for p in final] == [p.items for p in first]


def test_the_manifest_grows_linearly_with_the_items() -> None:
    def size(n: int) -> int:
        entries = {
            f"model.layers.{i}.w@{i * 7},0": RecordInfo(
                f"__{i % 97}_0.distcp", i, 9, i + 1, 8, i, "tensor"
            )
            for i in range(n)
        }
        return len(encode_manifest(entries, world_size=n, torch_version="2.13"))

    small, large = size(2000), size(8000)
    assert 3.9 < large / small < 4.2, (small, large)
