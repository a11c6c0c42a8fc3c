"""Unmodified training loops whose forward updates state in place still commit the state at the
call: BatchNorm statistics, an EMA buffer kept by a forward hook, a counter.

``async_save`` is followed at once by the next forward, backward and ``optimizer.step()``; every
checkpoint must load back equal to a copy of the state taken at the call. The deterministic tests
hold every snapshot copy behind a gate until forward and backward have run, so forward provably
ran while the snapshot was pending.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    EVENT_TIMEOUT_S,
    GatedTensorProvider,
    MiB,
    assert_same_state,
    failure_of,
    load_like,
)
from torch import nn

from dcp_datastates import (
    CheckpointSaveError,
    DataStatesWriter,
    SnapshotMutationError,
    async_save,
)
from dcp_datastates.snapshot import forward_gate

SMALL_POOL = {"host_pool_bytes": MiB, "chunk_bytes": 64 * 1024, "coalesce_bytes": 16 * 1024}


class Net(nn.Module):
    """BatchNorm between linears, an EMA of the first weight and a call counter, both buffers
    updated by a forward hook (as EMA/teacher code and step counters do)."""

    def __init__(self, width: int = 64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(
            nn.Linear(32, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 8)
        )
        self.register_buffer("ema_weight", self.body[0].weight.detach().clone())
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_forward_hook(Net._update_ema)

    @staticmethod
    def _update_ema(module: Net, args: object, output: torch.Tensor) -> None:
        with torch.no_grad():
            module.ema_weight.lerp_(module.body[0].weight, 0.25)
            module.calls.add_(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def training(width: int = 64) -> tuple[Net, torch.optim.Optimizer]:
    model = Net(width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


def forward_backward(model: Net, batch: int = 16) -> None:
    x = torch.randn(batch, 32)
    model(x).square().mean().backward()


def train_step(model: Net, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    forward_backward(model)
    optimizer.step()


def state_of(model: Net, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def frozen_copy(state: dict) -> dict:
    """The tensors of the state at the call, as independent copies (the load target's shape)."""
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].items()},
        "optim": {"state": copy.deepcopy(state["optim"]["state"])},
    }


@pytest.fixture
def gated_tensors(registered_providers):
    """Every tensor's snapshot copy waits for the returned gate."""
    gate = threading.Event()

    def factory(fqn: str, value: torch.Tensor) -> GatedTensorProvider:
        return GatedTensorProvider(fqn, value, gate)

    registered_providers(torch.Tensor, factory)
    yield gate
    gate.set()


@pytest.mark.parametrize("eager_copy_bytes", [0, 4096], ids=["gate-only", "eager-small"])
def test_forward_that_updates_buffers_while_the_snapshot_is_pending_commits_the_call_state(
    tmp_path: Path, make_writer, gated_tensors, eager_copy_bytes: int
) -> None:
    model, optimizer = training()
    train_step(model, optimizer)  # optimizer state exists, BatchNorm has statistics
    state = state_of(model, optimizer)
    expected = frozen_copy(state)
    writer = make_writer(tmp_path, eager_copy_bytes=eager_copy_bytes, **SMALL_POOL)

    response = async_save(state, writer, no_dist=True)
    optimizer.zero_grad()
    forward_backward(model)  # updates running stats, num_batches_tracked, ema_weight, calls
    assert not response.staging_completion.done(), "the snapshot ran before forward"
    gated_tensors.set()
    optimizer.step()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)

    bn = model.body[1]
    assert int(bn.num_batches_tracked) == int(expected["model"]["body.1.num_batches_tracked"]) + 1
    assert not torch.equal(model.ema_weight, expected["model"]["ema_weight"])
    assert_same_state(expected, load_like(tmp_path, expected, "stock"))
    stats = writer.last_stats
    assert stats.forward_frozen_bytes + stats.eager_bytes > 0
    assert stats.blocked_s < 0.5, stats.summary()


def test_without_the_forward_gate_the_same_loop_fails_instead_of_committing_a_torn_state(
    tmp_path: Path, make_writer, gated_tensors
) -> None:
    model, optimizer = training()
    train_step(model, optimizer)
    state = state_of(model, optimizer)
    writer = make_writer(
        tmp_path, guard_forward=False, copy_on_write=False, eager_copy_bytes=0, **SMALL_POOL
    )

    response = async_save(state, writer, no_dist=True)
    forward_backward(model)
    gated_tensors.set()
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None and mutation.fqn.startswith("model."), raised.value


def test_without_the_forward_gate_a_batchnorm_update_fails_the_save_naming_the_gate(
    tmp_path: Path, make_writer, gated_tensors
) -> None:
    """BatchNorm's forward updates its running statistics without a version bump: the save
    fails on them, and the error names that cause and the option (a user sweep: it named only
    writes through .data or numpy views)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64))
    model(torch.randn(16, 32))
    writer = make_writer(
        tmp_path, guard_forward=False, copy_on_write=False, eager_copy_bytes=0, **SMALL_POOL
    )
    response = async_save({"model": model.state_dict()}, writer, no_dist=True)
    model(torch.randn(16, 32))
    gated_tensors.set()
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None, raised.value
    assert mutation.fqn.startswith("model.1.running_"), mutation
    assert "a module's forward updating a buffer with guard_forward off" in str(mutation)


@pytest.mark.parametrize("entry", ["ours", "dcp", "dcp, a writer per save"])
def test_an_unmodified_batchnorm_loop_commits_every_save_with_the_state_at_the_call(
    tmp_path: Path, make_writer, entry: str
) -> None:
    """Also the README's call with a writer made for each save and dropped: each first save of
    a writer walks the state, and DCP saves the placeholder stage() returns."""
    model, optimizer = training(width=512)  # a few MiB through a 1 MiB pool: copies overlap
    train_step(model, optimizer)
    writer = make_writer(tmp_path / "unused", **SMALL_POOL)
    saves = []
    for n in range(5):
        state = state_of(model, optimizer)
        expected = frozen_copy(state)
        path = tmp_path / f"step{n}"
        start = time.perf_counter()
        if entry == "ours":
            done = async_save(state, writer, checkpoint_id=str(path), no_dist=True)
            future = done.upload_completion
        elif entry == "dcp, a writer per save":
            future = dcp.async_save(
                state, storage_writer=DataStatesWriter(path, **SMALL_POOL), no_dist=True
            )
        else:
            future = dcp.async_save(
                state, storage_writer=writer, checkpoint_id=str(path), no_dist=True
            )
        blocked = time.perf_counter() - start
        train_step(model, optimizer)  # next forward, backward and step, right away
        train_step(model, optimizer)
        future.result(timeout=EVENT_TIMEOUT_S)
        saves.append((path, expected, blocked))
    for path, expected, blocked in saves:
        assert_same_state(expected, load_like(path, expected, "datastates"))
        assert blocked < 0.5, f"async_save blocked {blocked:.3f}s"


def test_the_forward_hook_is_installed_only_while_a_snapshot_is_in_flight(
    tmp_path: Path, make_writer, gated_tensors
) -> None:
    model, optimizer = training()
    train_step(model, optimizer)
    writer = make_writer(tmp_path, **SMALL_POOL)
    response = async_save(state_of(model, optimizer), writer, no_dist=True)
    assert forward_gate.installed()
    gated_tensors.set()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    forward_backward(model)  # the first forward after the snapshot removes the hook
    assert not forward_gate.installed()


def test_a_counter_changed_right_after_the_call_keeps_its_value_at_the_call(
    tmp_path: Path, make_writer, gated_tensors
) -> None:
    """A small tensor outside any module (a step counter) is copied during stage()."""
    step = torch.tensor(41)
    state = {"step": step, "w": torch.randn(64, 64)}
    writer = make_writer(tmp_path, **SMALL_POOL)
    response = async_save(state, writer, no_dist=True)
    step.add_(1)
    gated_tensors.set()
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    loaded = load_like(tmp_path, {"step": torch.tensor(0), "w": state["w"]}, "stock")
    assert int(loaded["step"]) == 41
    assert writer.last_stats.eager_bytes >= step.element_size()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_process_executor_commits_the_call_state_of_a_batchnorm_loop(tmp_path: Path) -> None:
    """PROCESS executor: staging copies into shared memory in the background; the same forward
    gate and eager copies protect it (one gloo rank; DCP's daemon does the writing)."""
    from _dist_workers import check_all_ok, launch

    worker = str(Path(__file__).resolve().parent / "_loop_workers.py")
    results = launch("process-bn", tmp_path, world_size=1, timeout=90, script=worker)
    check_all_ok(results)
    assert results[0].report["modes"] == ["dcp_async", "ours"]
    for mode in ("dcp_async", "ours"):
        expected = torch.load(tmp_path / f"{mode}.expected.pt", weights_only=True)
        assert_same_state(expected, load_like(tmp_path / mode, expected, "stock"))
