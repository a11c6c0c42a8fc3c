"""``stage()`` records the state on the caller's thread and plans on the planning thread.

The snapshot must still be the state as ``stage()`` saw it: a version bump between ``stage()``
and planning fails the save, a dict entry replaced after ``stage()`` is not what gets saved, the
optimizer-step guard waits for planning too, and a planning failure reaches the save's future.
Each race is made deterministic by a writer whose planning waits on a gate (fault injection by
subclassing the real staging).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import EVENT_TIMEOUT_S, failure_of, load_like

from dcp_datastates import (
    CheckpointSaveError,
    DataStatesWriter,
    SnapshotMutationError,
    async_save,
)
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.save.staging import ThreadStaging
from dcp_datastates.snapshot.capture import capture


class GatedPlanning(ThreadStaging):
    """Planning (on the planning thread) starts only once ``gate`` is set; may then fail."""

    def __init__(self, *args: Any, fail: BaseException | None) -> None:
        super().__init__(*args)
        self.gate = threading.Event()
        self.planned_on: list[str] = []
        self.fail = fail

    def plan_captured(self, captured: Any, call: Any, path: str) -> Any:
        self.planned_on.append(threading.current_thread().name)
        assert self.gate.wait(EVENT_TIMEOUT_S)
        if self.fail is not None:
            raise self.fail
        return super().plan_captured(captured, call, path)


class GatedPlanningWriter(DataStatesWriter):
    """A writer whose staging is :class:`GatedPlanning`."""

    def __init__(self, path: Any, *, fail: BaseException | None = None, **options: Any) -> None:
        super().__init__(path, **options)
        self._staging = GatedPlanning(self._runtime, self.options, fail=fail)
        self.gate, self.planned_on = self._staging.gate, self._staging.planned_on


@pytest.fixture
def gated(tmp_path: Path) -> Any:
    writers: list[GatedPlanningWriter] = []

    def make(**options: Any) -> GatedPlanningWriter:
        writer = GatedPlanningWriter(tmp_path / "ckpt", **options)
        writers.append(writer)
        return writer

    yield make
    for writer in writers:
        writer.gate.set()
        writer.close()


def test_planning_runs_off_the_callers_thread(tmp_path: Path, gated: Any) -> None:
    writer = gated()
    state = {"w": torch.arange(8.0), "step": 3}
    response = async_save(state, writer, no_dist=True)  # returns with planning still gated
    assert not writer.staging_future.done()
    writer.gate.set()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert writer.planned_on and writer.planned_on[0].startswith("datastates-plan")
    assert torch.equal(load_like(tmp_path / "ckpt", state, "datastates")["w"], state["w"])


def test_a_write_between_stage_and_planning_waits_for_planning_and_commits_the_call_state(
    tmp_path: Path, gated: Any
) -> None:
    writer = gated(guard_optimizer_step=False)
    weight = torch.ones(4096)  # above eager_copy_bytes: not copied by stage()
    response = async_save({"w": weight}, writer, no_dist=True)
    # Copy-on-write cannot know yet whether the planning thread will enter `w`: the write
    # waits for planning (released here from another thread), then copies `w` first.
    caller = threading.get_ident()

    def release_once_the_write_waits() -> None:
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while time.monotonic() < deadline and not _waits_in(caller, "wait_planned"):
            threading.Event().wait(0.001)
        writer.gate.set()

    threading.Thread(target=release_once_the_write_waits, daemon=True).start()
    weight.add_(1.0)
    assert writer.gate.is_set()

    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert torch.equal(load_like(tmp_path / "ckpt", {"w": weight}, "stock")["w"], torch.ones(4096))
    assert writer.last_stats.cow_bytes == weight.nbytes


def _waits_in(thread_id: int, function: str) -> bool:
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def test_without_copy_on_write_a_write_between_stage_and_planning_fails_the_save(
    tmp_path: Path, gated: Any
) -> None:
    writer = gated(guard_optimizer_step=False, copy_on_write=False)
    weight = torch.ones(4096)  # above eager_copy_bytes: not copied by stage()
    response = async_save({"w": weight}, writer, no_dist=True)
    weight.add_(1.0)  # before planning: only the version recorded by stage() can tell
    writer.gate.set()

    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None and mutation.fqn == "w", raised.value
    assert not (tmp_path / "ckpt" / METADATA_NAME).exists()


def test_an_entry_replaced_after_stage_is_not_what_gets_saved(tmp_path: Path, gated: Any) -> None:
    writer = gated()
    staged = torch.full((4096,), 1.0)
    state = {"w": staged, "meta": {"epoch": 1}}
    response = async_save(state, writer, no_dist=True)
    state["w"] = torch.full((4096,), 2.0)  # same shape: DCP's plan still matches
    writer.gate.set()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)

    loaded = load_like(tmp_path / "ckpt", {"w": torch.zeros(4096)}, "stock")
    assert torch.equal(loaded["w"], staged)


def test_the_optimizer_step_waits_for_planning_and_copy(tmp_path: Path, gated: Any) -> None:
    writer = gated()
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(2, 8)).sum().backward()
    before = model.weight.detach().clone()
    response = async_save({"model": model.state_dict()}, writer, no_dist=True)

    stepped = threading.Event()
    stepper = threading.Thread(target=lambda: (optimizer.step(), stepped.set()))
    stepper.start()
    assert not stepped.wait(0.2)  # held back: the snapshot is not even planned yet
    writer.gate.set()
    stepper.join(EVENT_TIMEOUT_S)
    assert stepped.is_set()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)

    target = {"model": {"weight": torch.zeros(4, 8), "bias": torch.zeros(4)}}
    loaded = load_like(tmp_path / "ckpt", target, "datastates")
    assert torch.equal(loaded["model"]["weight"], before)
    assert not torch.equal(model.weight.detach(), before)


def test_a_planning_failure_reaches_the_save_once_and_frees_the_state(
    tmp_path: Path, gated: Any
) -> None:
    writer = gated(fail=RuntimeError("planning broke"))
    response = async_save({"w": torch.ones(4)}, writer, no_dist=True)
    writer.gate.set()
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert failure_of(raised.value, RuntimeError) is not None
    assert "planning broke" in str(raised.value)
    assert writer.staging_future.result(timeout=EVENT_TIMEOUT_S) is None  # state free to change
    assert not (tmp_path / "ckpt" / METADATA_NAME).exists()


def test_capture_records_versions_and_copies_the_structure() -> None:
    w = torch.ones(3)
    w.add_(1.0)
    state = {"model": {"w": w}, "optim": {"state": {0: {"m": w}}, "groups": [{"betas": (0.9,)}]}}
    captured = capture(state)
    assert captured is not None
    alias, again = captured.state["model"]["w"], captured.state["optim"]["state"][0]["m"]
    assert captured.versions == {id(alias): w._version, id(again): w._version}
    assert captured.state["optim"]["groups"] == state["optim"]["groups"]
    assert captured.state["model"] is not state["model"]
    assert alias is not w and alias.data_ptr() == w.data_ptr()  # an alias made at the call
    w.data = torch.zeros(3)  # another storage for w: the capture keeps the one of the call
    assert torch.equal(alias, torch.full((3,), 2.0))


@pytest.mark.parametrize(
    "state",
    [
        pytest.param({"obj": object()}, id="object-serialized-on-the-caller"),
        pytest.param({"w": torch.ones(2), "lst": [{1, 2}]}, id="mutable-set"),
        pytest.param({"d": {1: torch.ones(1), "1": torch.ones(1)}}, id="colliding-keys"),
        pytest.param({}, id="empty"),
    ],
)
def test_capture_declines_what_the_callers_path_must_handle(state: dict[str, Any]) -> None:
    assert capture(state) is None


def test_capture_declines_when_a_provider_is_registered(registered_providers: Any) -> None:
    registered_providers(frozenset, lambda fqn, v: None)
    assert capture({"w": torch.ones(2)}) is None


def test_capture_copies_small_tensors_eagerly_when_asked() -> None:
    small, big = torch.ones(4), torch.ones(4096)
    captured = capture({"s": small, "b": big}, eager_bytes=64)
    assert captured is not None and captured.eager_bytes == 16
    assert captured.state["b"].data_ptr() == big.data_ptr() and captured.state["s"] is not small
    small.add_(1.0)
    assert torch.equal(captured.state["s"], torch.ones(4))


def test_a_forward_waits_for_planning_so_its_buffers_are_frozen(tmp_path: Path, gated: Any) -> None:
    """BatchNorm's running statistics (8 KiB each here: above eager_copy_bytes) change in
    forward, before any optimizer step: the forward gate must cover them even though the
    session is planned after stage() returned."""
    writer = gated()
    model = torch.nn.BatchNorm1d(2048).train()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    response = async_save({"model": model.state_dict()}, writer, no_dist=True)

    done = threading.Event()
    forward = threading.Thread(target=lambda: (model(torch.randn(4, 2048)), done.set()))
    forward.start()
    assert not done.wait(0.2)  # held until the planning thread has protected the buffers
    writer.gate.set()
    forward.join(EVENT_TIMEOUT_S)
    assert done.is_set()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)

    assert not torch.equal(model.running_mean, before["running_mean"])  # forward did update
    target = {"model": {k: torch.zeros_like(v) for k, v in before.items()}}
    loaded = load_like(tmp_path / "ckpt", target, "datastates")
    for key, value in before.items():
        assert torch.equal(loaded["model"][key], value), key


@pytest.fixture
def local_planning(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that run DCP's local planning, in order."""
    from torch.distributed.checkpoint import default_planner

    threads: list[str] = []
    real = default_planner.create_default_local_save_plan

    def recording(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        if plan.items:  # DCP's planning of the writer's placeholder plans nothing
            threads.append(threading.current_thread().name)
        return plan

    monkeypatch.setattr(default_planner, "create_default_local_save_plan", recording)
    return threads


def _metadata(path: Path) -> Any:
    import pickle

    return pickle.loads((path / METADATA_NAME).read_bytes())


def test_warm_up_learns_the_layout_so_the_first_save_replays_it_and_plans_nothing(
    tmp_path: Path, local_planning: list[str]
) -> None:
    """``warm_up`` plans the state once, on the caller, as a first save would: the first save
    then replays that layout and keeps the plan's items (DCP's local planning does not run
    again), and the checkpoint is the one a walk would have written."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    state = {"model": model.state_dict(), "extra": {"step": 4, "lr": [0.1, 0.2]}}
    writer = DataStatesWriter(tmp_path / "ours")
    try:
        writer.warm_up(state, wait=True)
        assert local_planning == ["MainThread"]  # the warm-up's, on the calling thread
        assert (writer._staging.captures.walks, writer._staging.captures.replays) == (1, 0)
        local_planning.clear()
        with torch.no_grad():
            model[0].weight.add_(1.0)  # values change after warm_up; the layout does not
        state["model"] = model.state_dict()
        async_save(state, writer, no_dist=True).upload_completion.result(EVENT_TIMEOUT_S)
        assert local_planning == []
        assert (writer._staging.captures.walks, writer._staging.captures.replays) == (1, 1)
        writer.warm_up(state)  # after a save: the layout is the save's, not learnt again
        assert (writer._staging.captures.walks, writer._staging.captures.replays) == (1, 1)
    finally:
        writer.close()

    save(state, storage_writer=FileSystemWriter(tmp_path / "stock"), no_dist=True)
    ours, stock = _metadata(tmp_path / "ours"), _metadata(tmp_path / "stock")
    assert ours.state_dict_metadata == stock.state_dict_metadata
    loaded = load_like(tmp_path / "ours", state, "stock")
    assert torch.equal(loaded["model"]["0.weight"], state["model"]["0.weight"])
    assert loaded["extra"] == state["extra"]


def test_a_state_whose_layout_changed_after_warm_up_is_walked_and_saved_whole(
    tmp_path: Path,
) -> None:
    state: dict[str, Any] = {"a": torch.randn(4, 4), "step": 1}
    writer = DataStatesWriter(tmp_path / "ours")
    try:
        writer.warm_up(state)
        state["b"] = torch.randn(3)  # a new entry: the recorded layout no longer holds
        async_save(state, writer, no_dist=True).upload_completion.result(EVENT_TIMEOUT_S)
        assert (writer._staging.captures.walks, writer._staging.captures.replays) == (2, 0)
    finally:
        writer.close()
    loaded = load_like(tmp_path / "ours", state, "datastates")
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    assert loaded["step"] == 1


@pytest.mark.parametrize("call", ["dcp_datastates.async_save", "dcp.async_save"])
def test_the_save_thread_reuses_the_plan_of_the_snapshot(
    tmp_path: Path, local_planning: list[str], call: str
) -> None:
    """DCP's local planning of the state runs at most once per save, on the planning thread:
    under dcp_datastates.async_save the save thread's planner reuses it; under a plain
    dcp.async_save (DCP's own DefaultSavePlanner) the save thread plans the placeholder
    ``stage()`` returned, and the writer's plan takes its place. A save that replays the layout
    of the one before keeps its items and plans nothing. The metadata is stock's either way."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    state = {"model": model.state_dict(), "extra": {"step": 4, "lr": [0.1, 0.2]}}
    writer = DataStatesWriter(tmp_path / "ours")
    try:
        for i in range(2):  # the walk, then the replay of its layout
            local_planning.clear()
            if call == "dcp.async_save":
                path = tmp_path / "ours" if i else tmp_path / "first"
                dcp.async_save(
                    state, storage_writer=writer, checkpoint_id=str(path), no_dist=True
                ).result(EVENT_TIMEOUT_S)
            else:
                async_save(state, writer, no_dist=True).upload_completion.result(EVENT_TIMEOUT_S)
            if i == 0:
                assert len(local_planning) == 1
                assert local_planning[0].startswith("datastates-plan")
            else:
                assert local_planning == []  # the walk's items still hold
        assert writer._staging.captures.replays == 1
    finally:
        writer.close()

    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "stock"), no_dist=True)
    ours, stock = _metadata(tmp_path / "ours"), _metadata(tmp_path / "stock")
    assert ours.state_dict_metadata == stock.state_dict_metadata
    assert ours.planner_data == stock.planner_data
    loaded = load_like(tmp_path / "ours", state, "stock")
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    assert loaded["extra"] == state["extra"]


def test_the_placeholder_saved_without_its_snapshot_is_refused(tmp_path: Path) -> None:
    """The placeholder stage() hands a plain dcp.async_save means nothing without the snapshot
    it stands for: saved on its own it is refused, naming it, and nothing is committed."""
    import torch.distributed.checkpoint as dcp

    from dcp_datastates.save.planner import PLANNED_KEY, planned_elsewhere

    writer = DataStatesWriter(tmp_path / "ckpt")
    try:
        with pytest.raises(BaseException, match=PLANNED_KEY):
            dcp.save(planned_elsewhere(), storage_writer=writer, no_dist=True)
    finally:
        writer.close()
    assert not (tmp_path / "ckpt" / METADATA_NAME).exists()


def test_a_key_added_after_stage_is_not_saved(tmp_path: Path, gated: Any) -> None:
    # The snapshot is the state at the call, whatever the dict holds by the time DCP plans.
    writer = gated()
    state: dict[str, Any] = {"w": torch.arange(4096.0)}
    response = async_save(state, writer, no_dist=True)
    state["late"] = torch.zeros(3)
    writer.gate.set()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert set(_metadata(tmp_path / "ckpt").state_dict_metadata) == {"w"}


def test_a_planner_given_to_async_save_plans_on_the_save_thread(
    tmp_path: Path, local_planning: list[str]
) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = {"w": torch.arange(4096.0), "step": 2}
    writer = DataStatesWriter(tmp_path / "ckpt")
    try:
        response = async_save(state, writer, no_dist=True, planner=DefaultSavePlanner())
        response.upload_completion.result(EVENT_TIMEOUT_S)
    finally:
        writer.close()
    assert any(name.startswith("datastates-save") for name in local_planning), local_planning
    assert torch.equal(load_like(tmp_path / "ckpt", state, "stock")["w"], state["w"])


def test_a_reused_plan_still_resolves_items_through_the_planner() -> None:
    # Nothing in the writer resolves items through StagedSavePlanner, but DCP's API allows it:
    # the state dict is flattened then, and the item found as DefaultSavePlanner finds it.
    from dcp_datastates.save.planner import StagedSavePlanner, plan_providers

    state = {"model": {"w": torch.arange(6.0)}, "step": 3}
    local_plan = plan_providers(state).local_plan
    planner = StagedSavePlanner(lambda: local_plan)
    planner.set_up_planner(state, None, True)
    assert planner.create_local_plan() is local_plan
    w = next(i for i in local_plan.items if i.index.fqn == "model.w")
    assert torch.equal(planner.resolve_data(w), state["model"]["w"])


def _changed_same_bytes(w: torch.Tensor, change: str) -> torch.Tensor:
    if change == "shape":
        return w.view(32, 128)
    if change == "dtype":
        return w.view(torch.int32)
    if change == "requires_grad":
        return w.detach().requires_grad_()
    assert change == "nothing"
    return w


@pytest.mark.parametrize("change", ["nothing", "shape", "dtype", "requires_grad"])
def test_a_replay_keeps_the_items_of_the_save_before_only_where_they_still_hold(
    tmp_path: Path, local_planning: list[str], change: str
) -> None:
    """The replay checks a big tensor's size in bytes only; a tensor of the same bytes but
    another shape, dtype or ``requires_grad`` must be planned again, or the metadata would
    describe the tensor of the save before (a checkpoint that looks fine and is not)."""
    import torch.distributed.checkpoint as dcp

    w = torch.randn(64, 64)  # 16 KiB: above eager_copy_bytes, so its size is not re-checked
    state: dict[str, Any] = {"w": w, "b": torch.ones(4), "step": 1}
    writer = DataStatesWriter(tmp_path / "w")
    try:
        async_save(
            state, writer, checkpoint_id=tmp_path / "first", no_dist=True
        ).upload_completion.result(EVENT_TIMEOUT_S)
        first_plan = writer._staging.captures._record.local_plan
        assert first_plan is not None
        state = {**state, "w": _changed_same_bytes(w, change), "step": 2}
        local_planning.clear()
        async_save(
            state, writer, checkpoint_id=tmp_path / "second", no_dist=True
        ).upload_completion.result(EVENT_TIMEOUT_S)
        assert writer._staging.captures.replays == 1
        reused = writer._staging.captures._record.local_plan is first_plan
        assert reused == (change == "nothing")
        assert len(local_planning) == (0 if change == "nothing" else 1)
    finally:
        writer.close()
    meta = _metadata(tmp_path / "second").state_dict_metadata["w"]
    assert tuple(meta.size) == tuple(state["w"].shape)
    assert meta.properties.dtype == state["w"].dtype
    assert meta.properties.requires_grad == state["w"].requires_grad
    target = {"w": torch.zeros_like(state["w"]), "b": torch.zeros(4), "step": 0}
    dcp.load(target, checkpoint_id=tmp_path / "second", no_dist=True)
    assert torch.equal(target["w"], state["w"].detach())
    assert target["step"] == 2


@pytest.fixture
def global_planning(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The item count of each global plan DCP makes, in order."""
    from torch.distributed.checkpoint import default_planner

    made: list[int] = []
    real = default_planner.create_default_global_save_plan

    def recording(all_plans: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(sum(len(p.items) for p in all_plans))
        return real(all_plans, *args, **kwargs)

    monkeypatch.setattr(default_planner, "create_default_global_save_plan", recording)
    return made


def test_a_replayed_save_takes_the_global_plan_of_the_save_before_and_its_own_metadata(
    tmp_path: Path, global_planning: list[int]
) -> None:
    """A save that keeps the local plan of the one before (a replay) keeps its global plan and
    metadata too (``planner.GlobalPlanMemo``), as DCP would make them again. Each save's
    metadata is its own: the commit sets its storage data, and the first save's must not
    change under the next ones. A layout that changes is planned again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    state: dict[str, Any] = {"model": model.state_dict(), "step": 0}
    writer = DataStatesWriter(tmp_path / "w")
    results = []
    try:
        for i in range(3):
            state["step"] = i
            response = async_save(state, writer, checkpoint_id=tmp_path / f"c{i}", no_dist=True)
            results.append(response.upload_completion.result(EVENT_TIMEOUT_S))
        first_storage = dict(results[0].storage_data)
        assert writer._staging.captures.replays == 2
        assert len(global_planning) == 1, "a replayed save planned its global plan again"
        assert len({id(r) for r in results}) == 3
        assert all(r.storage_data is not results[0].storage_data for r in results[1:])
        # A weight of the same bytes and another shape: local and global plans made again.
        weight = model[0].weight
        state = {"model": {**state["model"], "0.weight": weight.detach().view(32, 128)}, "step": 3}
        async_save(
            state, writer, checkpoint_id=tmp_path / "c3", no_dist=True
        ).upload_completion.result(EVENT_TIMEOUT_S)
        assert len(global_planning) == 2
    finally:
        writer.close()
    assert dict(results[0].storage_data) == first_storage
    for i in range(3):
        state_i = {"model": model.state_dict(), "step": i}
        stock_path = tmp_path / "stock" / str(i)
        dcp.save(state_i, storage_writer=FileSystemWriter(stock_path), no_dist=True)
        ours, stock = _metadata(tmp_path / f"c{i}"), _metadata(stock_path)
        assert ours.state_dict_metadata == stock.state_dict_metadata
        assert ours.planner_data == stock.planner_data
        loaded = load_like(tmp_path / f"c{i}", state_i, "stock")
        assert loaded["step"] == i
        assert all(torch.equal(loaded["model"][k], v) for k, v in state_i["model"].items())
    reshaped = _metadata(tmp_path / "c3").state_dict_metadata["model.0.weight"]
    assert tuple(reshaped.size) == (32, 128)


def _planner_of(state: dict[str, Any]) -> Any:
    from dcp_datastates.save.planner import DataStatesSavePlanner

    planner = DataStatesSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=False)
    return planner


def test_replans_to_holds_only_for_what_dcp_would_plan_alike() -> None:
    from dcp_datastates.save.planner import replans_to

    def state() -> dict[str, Any]:
        return {"a": {"b": torch.zeros(8, 8)}, "n": 3, "t": (1, 2)}

    plan = _planner_of(state()).create_local_plan()
    assert replans_to(plan, _planner_of(state()))  # new tensors of the same kind

    tagged = state()
    tagged["a"]["b"].global_offsets = (0, 0)  # attributes DCP may plan from
    object_now_tensor = {**state(), "n": torch.zeros(1)}
    reordered = {"n": 3, "a": {"b": torch.zeros(8, 8)}, "t": (1, 2)}
    same_fqn_other_path = {"a.b": torch.zeros(8, 8), "n": 3, "t": (1, 2)}
    other_dtype = {**state(), "a": {"b": torch.zeros(8, 8, dtype=torch.float64)}}
    for other in (tagged, object_now_tensor, reordered, same_fqn_other_path, other_dtype):
        assert not replans_to(plan, _planner_of(other)), other


def test_eager_copies_are_private_to_the_snapshot_and_only_live_tensors_are_probed(
    tmp_path: Path,
) -> None:
    """An eager copy (``eager_copy_bytes``) is held by nothing but the snapshot: its provider
    reads no probe bytes and stays out of the forward gate, walked or replayed. A live tensor
    keeps both: they are what catches a write its version counter does not see."""
    from concurrent.futures import Future

    from dcp_datastates.save.planner import plan_providers
    from dcp_datastates.snapshot import forward_gate

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    state = {"model": model.state_dict(), "step": 1}
    writer = DataStatesWriter(tmp_path / "w")
    try:
        kinds = []
        for _ in range(2):  # the walk, then the replay of its layout
            captured = writer._staging.captures.capture(state)
            assert captured is not None
            kinds.append(captured.replayed)
            captured.resolve()
            items = plan_providers(
                captured.state, versions=captured.versions, private=captured.private
            )
            providers = [p for _, p in items if hasattr(p, "private")]
            for provider in providers:
                small = provider.nbytes <= writer.options.eager_copy_bytes
                assert provider.private == small, provider.fqn
                assert (provider._probes == []) == small, provider.fqn
            assert {p.fqn for p in providers if not p.private} == {"model.0.weight"}

            class Session:
                def __init__(self, providers: list[Any]) -> None:
                    self.staged: Future[None] = Future()
                    self._providers = providers

                def raw_providers(self) -> list[Any]:
                    return self._providers

            session = Session(providers)
            forward_gate.protect(session)
            try:
                assert len(forward_gate._keys[session]) == 1  # the live weight alone
            finally:
                forward_gate._forget(session)
            async_save(state, writer, no_dist=True).upload_completion.result(EVENT_TIMEOUT_S)
        assert kinds == [False, True]
    finally:
        writer.close()
    loaded = load_like(tmp_path / "w", state, "stock")
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
