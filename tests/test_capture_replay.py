"""A writer's later saves replay the previous save's layout (``snapshot/replay.py``) and still
commit the state at the call; every change to the layout between saves falls back to the walk.

Each test saves the same state several times with one writer, changing it between saves (or
right after a call), and loads every checkpoint back against a copy taken at the call.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import EVENT_TIMEOUT_S, assert_same_state
from torch import nn

from dcp_datastates import DataStatesWriter
from dcp_datastates.snapshot import replay


def make_state() -> dict[str, Any]:
    """Big tensors (version-checked), small ones (copied eagerly, two shapes and a 0-dim
    counter), an int-keyed optimizer state, a list and scalars."""
    torch.manual_seed(0)
    return {
        "model": {
            "w1": torch.randn(64, 64),
            "w2": torch.randn(64, 64),
            "b1": torch.randn(8),
            "b2": torch.randn(8),
            "norm": torch.randn(4, 4),
            "count": torch.tensor(0),
        },
        "optim": {
            "state": {
                0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(64, 64)},
                1: {"step": torch.tensor(1.0), "exp_avg": torch.randn(8)},
            },
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}],
        },
        "step": 0,
    }


def at_call(state: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(state)


def blank(state: Any) -> Any:
    """A load target: zeroed tensors, and a marker in place of every object (so a loaded
    scalar is one the checkpoint holds)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {key: blank(value) for key, value in state.items()}
    if isinstance(state, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in state):
        return [blank(value) for value in state]
    return "not loaded"


def load(path: Path, expected: dict[str, Any]) -> dict[str, Any]:
    target = blank(expected)
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    return target


class Saver:
    """One writer; ``save(state)`` checks the checkpoint against the state at the call."""

    def __init__(self, root: Path, make_writer: Callable[..., DataStatesWriter]) -> None:
        self.root = root
        self.writer = make_writer(root / "writer", eager_copy_bytes=4096)
        self.count = 0

    def save(
        self, state: dict[str, Any], after_call: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        expected = at_call(state)
        path = self.root / f"c{self.count}"
        self.count += 1
        future = dcp.async_save(
            state, storage_writer=self.writer, checkpoint_id=str(path), no_dist=True
        )
        if after_call is not None:
            after_call()
        future.result(timeout=EVENT_TIMEOUT_S)
        loaded = load(path, expected)
        assert_same_state(expected, loaded)
        return loaded

    @property
    def counts(self) -> tuple[int, int]:
        cache = self.writer._staging.captures
        return cache.replays, cache.walks


@pytest.fixture
def saver(tmp_path: Path, make_writer: Callable[..., DataStatesWriter]) -> Saver:
    return Saver(tmp_path, make_writer)


def test_later_saves_replay_and_commit_in_place_updates_and_new_scalars(saver: Saver) -> None:
    state = make_state()
    for i in range(4):
        with torch.no_grad():
            state["model"]["w1"].add_(1)
            state["model"]["b1"].mul_(2)
            state["optim"]["state"][0]["exp_avg"].sub_(0.5)
        state["step"] = 1000 + i  # a new int object each save
        state["optim"]["param_groups"][0]["lr"] = 0.1 / (i + 1)
        saver.save(state)
    assert saver.counts == (3, 1)


def test_small_tensors_changed_right_after_the_call_keep_their_value_at_the_call(
    saver: Saver,
) -> None:
    state = make_state()

    def bump() -> None:  # the eager copies of stage() hold the values at the call
        state["model"]["count"].add_(1)
        state["model"]["b2"].add_(1)
        for entry in state["optim"]["state"].values():
            entry["step"].add_(1)

    for _ in range(3):
        saver.save(state, after_call=bump)
    assert saver.counts == (2, 1)
    assert int(state["model"]["count"]) == 3


def test_new_containers_holding_the_same_tensors_replay(saver: Saver) -> None:
    """``model.state_dict(keep_vars=True)`` builds new dicts of the same tensors each call."""
    state = make_state()
    saver.save(state)
    for _ in range(2):
        fresh = {key: copy.copy(value) for key, value in state.items()}
        fresh["model"] = dict(state["model"])
        saver.save(fresh)
    assert saver.counts == (2, 1)


@pytest.mark.parametrize(
    "change",
    [
        "add_key",
        "remove_key",
        "rename_key",
        "resize_small",
        "retype_small",
        "retype_small_uncastable",
        "grow_small_data",
        "scalar_to_tensor",
        "parameter_to_tensor",
        "big_to_dict",
        "tuple_with_tensor",
        "list_longer",
    ],
)
def test_a_changed_layout_is_walked_again_and_committed(saver: Saver, change: str) -> None:
    state = make_state()
    saver.save(state)
    model = state["model"]
    if change == "add_key":
        model["extra"] = torch.ones(3)
    elif change == "remove_key":
        del model["w2"]
    elif change == "rename_key":
        model["w3"] = model.pop("w2")
    elif change == "resize_small":
        model["b1"].resize_(4)  # in place: same object, new shape
        model["b2"].resize_(4)  # the whole group: torch.stack would not notice by itself
    elif change == "retype_small":
        model["b1"].data = torch.ones(8, dtype=torch.float64)  # no version bump
    elif change == "retype_small_uncastable":  # torch.stack into the int64 buffer: TypeError
        model["count"] = torch.tensor(0.5)
    elif change == "grow_small_data":
        model["b1"].data = torch.ones(64, 64)
    elif change == "parameter_to_tensor":
        model["w2"] = nn.Parameter(model["w2"].clone())
    elif change == "big_to_dict":
        model["w2"] = {"inner": torch.ones(2)}
    elif change == "scalar_to_tensor":
        state["step"] = torch.tensor(5)
    elif change == "tuple_with_tensor":
        state["optim"]["param_groups"][0]["betas"] = (0.9, torch.tensor(0.95))
    elif change == "list_longer":
        state["optim"]["param_groups"][0]["params"].append(2)
    if change == "tuple_with_tensor":  # an object the walk declines: the caller's path
        path = saver.root / "declined"
        dcp.async_save(
            state, storage_writer=saver.writer, checkpoint_id=str(path), no_dist=True
        ).result(timeout=EVENT_TIMEOUT_S)
        assert saver.counts == (0, 1)
        return
    saver.save(state)
    assert saver.counts == (0, 2)
    saver.save(state)  # the new layout replays
    assert saver.counts == (1, 2)


def test_a_big_tensor_resized_between_saves_replays_and_its_size_is_learnt_for_the_next(
    saver: Saver,
) -> None:
    """The size of a big tensor is not checked on the caller: one resized since the last save
    is saved as a big one (read live, version-checked); the planning thread learns the layout
    again, so the next save copies the now small tensor eagerly, as the walk would."""
    state = make_state()
    saver.save(state)
    model = state["model"]
    model["w1"].data = torch.ones(4)  # no version bump; now small
    saver.save(state)
    assert saver.counts == (1, 1)
    # Copied eagerly now: an in-place change right after the call leaves the checkpoint alone
    # (a big tensor changed there fails the save with SnapshotMutationError).
    loaded = saver.save(state, after_call=lambda: model["w1"].add_(1))
    assert saver.counts == (2, 1)
    assert torch.equal(loaded["model"]["w1"], torch.ones(4))


@pytest.mark.parametrize("accelerator", [False, True])
def test_a_tensor_replaced_by_a_meta_tensor_fails_that_save_and_the_next_commits(
    saver: Saver, monkeypatch: pytest.MonkeyPatch, accelerator: bool
) -> None:
    """Without an accelerator the replay does not check devices (no tensor can be on one): a
    ``meta`` tensor, which has no bytes, fails the save in its copy, as it does on the caller's
    path. With one, the replay sees the tensor is not on the CPU and does not replay. Either way
    the writer saves again."""
    monkeypatch.setattr(replay, "_accelerator", accelerator)
    state = make_state()
    saver.save(state)
    real = state["model"]["w1"]
    state["model"]["w1"] = torch.empty(64, 64, device="meta")
    future = dcp.async_save(
        state, storage_writer=saver.writer, checkpoint_id=str(saver.root / "meta"), no_dist=True
    )
    with pytest.raises(BaseException, match="meta tensor"):
        future.result(timeout=EVENT_TIMEOUT_S)
    assert saver.counts[0] == (0 if accelerator else 1)
    state["model"]["w1"] = real
    saver.save(state)


@pytest.mark.parametrize("grad", [True, False])
def test_a_replayed_save_leaves_the_callers_grad_mode_as_it_found_it(
    saver: Saver, grad: bool
) -> None:
    """The eager copies are taken with autograd off (parameters among them); the caller's
    grad mode is its own again on return, on or off."""
    state = make_state()
    state["model"]["p"] = nn.Parameter(torch.randn(8))  # small, requires grad: copied eagerly
    saver.save(state)
    with torch.set_grad_enabled(grad):
        saver.save(state)
        assert torch.is_grad_enabled() is grad
    assert saver.counts == (1, 1)


def test_eager_copies_keep_the_tensors_python_attributes() -> None:
    """DCP plans from some attributes of a plain tensor (torch 2.14's CheckpointableTensor
    fields make SHARD items of it): the eager copy of a small tensor keeps them, walked and
    replayed."""
    cache = replay.CaptureCache(eager_bytes=4096)
    shard = torch.arange(20.0).reshape(5, 4)
    shard.global_shape = (8, 4)  # type: ignore[attr-defined]
    state = {"t": shard, "w": torch.randn(64, 64)}
    for expect_replay in (False, True):
        captured = cache.capture(state)
        assert captured is not None and captured.replayed is expect_replay
        captured.resolve()
        copy = captured.state["t"]
        assert copy is not shard and copy.global_shape == (8, 4)
        cache.learn(captured)


def test_a_replayed_save_holds_no_reference_to_the_saved_tensors(saver: Saver) -> None:
    state = make_state()
    for _ in range(3):
        saver.save(state)
    assert saver.counts == (2, 1)
    refs = [weakref.ref(state["model"]["w1"]), weakref.ref(state["model"]["count"])]
    del state
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_new_tensor_objects_of_the_same_kind_replay_and_commit_their_values(
    saver: Saver,
) -> None:
    """``model.state_dict()`` detaches: new tensor objects each call. The replay records the
    objects found now (versions read, small ones copied), as the walk would."""
    state = make_state()
    saver.save(state)
    for i in range(2):
        state["model"] = {k: torch.full_like(v, float(i + 2)) for k, v in state["model"].items()}
        saver.save(state)
    assert saver.counts == (2, 1)


def test_replay_builds_the_structure_the_walk_builds() -> None:
    cache = replay.CaptureCache(64)
    state = make_state()
    walked = cache.capture(state)
    assert walked is not None
    walked.resolve()
    cache.learn(walked)
    replayed = cache.capture(state)
    assert replayed is not None and replayed.replayed
    replayed.resolve()
    assert_same_state(walked.state, replayed.state)
    big, alias = state["model"]["w1"], replayed.state["model"]["w1"]
    assert alias is not big and alias.data_ptr() == big.data_ptr()  # big: an alias of it
    assert replayed.state["model"]["b1"] is not state["model"]["b1"]  # small: a copy
    assert replayed.state["optim"] is not state["optim"]  # the structure: a copy
    assert replayed.eager_bytes == walked.eager_bytes
    assert replayed.tensors == walked.tensors
    assert replayed.versions[id(alias)] == big._version
    assert len(replayed.versions) == len(walked.versions)


def test_a_batchnorm_loop_saved_with_keep_vars_replays_and_commits_the_call_state(
    saver: Saver,
) -> None:
    """Forward right after the call updates running statistics in place (copied eagerly or by
    the forward gate); the optimizer step waits for the snapshot."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 2048), nn.BatchNorm1d(2048), nn.Linear(2048, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()

    step()
    for _ in range(3):
        state = {"model": model.state_dict(keep_vars=True)}
        saver.save(state, after_call=step)
    replays, walks = saver.counts
    assert (replays, walks) == (2, 1)
