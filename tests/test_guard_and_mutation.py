"""The optimizer-step guard keeps checkpoints consistent; without it, a torn snapshot is refused.

The races are made deterministic with a real tensor provider whose copy waits on an event
(``GatedTensorProvider``), registered for ``nn.Parameter`` so only the parameter is gated.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import wait as real_wait
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _signal_util import signal_from_a_thread_once_main_sleeps
from conftest import (
    EVENT_TIMEOUT_S,
    GatedTensorProvider,
    MiB,
    assert_same_state,
    failure_of,
    load_like,
    pool_drains,
)

from dcp_datastates import CheckpointSaveError, SnapshotMutationError, async_save
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.snapshot import guard

SMALL_POOL = {"host_pool_bytes": MiB, "chunk_bytes": 64 * 1024, "coalesce_bytes": 16 * 1024}


@pytest.fixture
def gated_parameters(registered_providers):
    """Snapshots of every ``nn.Parameter`` wait on the returned gate; the providers are listed."""
    gate = threading.Event()
    made: list[GatedTensorProvider] = []

    def factory(fqn: str, value: torch.Tensor) -> GatedTensorProvider:
        made.append(GatedTensorProvider(fqn, value, gate))
        return made[-1]

    registered_providers(torch.nn.Parameter, factory)
    yield gate, made
    gate.set()  # never leave a copy thread parked


def training_state() -> tuple[torch.nn.Parameter, torch.optim.Optimizer, dict]:
    weight = torch.nn.Parameter(torch.randn(128, 128))
    weight.grad = torch.ones_like(weight)
    optimizer = torch.optim.SGD([weight], lr=0.5)
    # Several pool-fuls of other state, so the snapshot has to stream through the small pool.
    state = {"model": {"weight": weight}, "buffers": [torch.randn(MiB // 2) for _ in range(4)]}
    return weight, optimizer, state


def test_optimizer_step_waits_for_the_snapshot_so_the_checkpoint_holds_pre_step_values(
    tmp_path: Path, make_writer, gated_parameters, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, providers = gated_parameters

    # Open the gate only once optimizer.step() is parked in the guard: the step provably ran
    # while the parameter's copy was still pending.
    def waiting_in_guard(*args, **kwargs):
        gate.set()
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(guard, "wait", waiting_in_guard)
    weight, optimizer, state = training_state()
    before = weight.detach().clone()
    waits_before = guard.waits

    response = async_save(state, make_writer(tmp_path, **SMALL_POOL), no_dist=True)
    assert not response.staging_completion.done()
    optimizer.step()

    assert guard.waits == waits_before + 1
    assert response.staging_completion.done()
    assert [p.fqn for p in providers] == ["model.weight"]
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    assert torch.equal(weight.detach(), before - 0.5)
    loaded = load_like(tmp_path, state, "datastates")
    assert torch.equal(loaded["model"]["weight"], before)
    assert_same_state(state["buffers"], loaded["buffers"])


def test_a_signal_taken_by_another_thread_is_handled_while_the_step_waits_for_the_snapshot(
    tmp_path: Path, make_writer, gated_parameters
) -> None:
    # The parameter's copy is held back until the handler has run (or 10 s have passed): a
    # step parked without a timeout would let the handler run only once the snapshot is done,
    # and a snapshot in front of a hung flush is never done (a SIGTERM then saves nothing).
    gate, _ = gated_parameters
    weight, optimizer, state = training_state()
    handled, in_time = threading.Event(), []

    def then() -> None:
        in_time.append(handled.wait(10))
        gate.set()

    previous = signal.signal(signal.SIGUSR1, lambda *_: handled.set())
    try:
        response = async_save(state, make_writer(tmp_path, **SMALL_POOL), no_dist=True)
        signaller = signal_from_a_thread_once_main_sleeps(signal.SIGUSR1, then)
        optimizer.step()
        signaller.join(EVENT_TIMEOUT_S)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert in_time == [True]
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)


def test_optimizer_step_does_not_wait_once_the_snapshot_is_done(
    tmp_path: Path, make_writer
) -> None:
    weight, optimizer, state = training_state()
    waits_before = guard.waits

    response = async_save(state, make_writer(tmp_path), no_dist=True)
    response.staging_completion.result(timeout=EVENT_TIMEOUT_S)
    optimizer.step()

    assert guard.waits == waits_before
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)


def test_without_the_guard_an_in_flight_mutation_fails_the_save_naming_the_tensor(
    tmp_path: Path, make_writer, gated_parameters
) -> None:
    gate, providers = gated_parameters
    weight, optimizer, state = training_state()
    writer = make_writer(tmp_path, guard_optimizer_step=False, copy_on_write=False, **SMALL_POOL)

    response = async_save(state, writer, no_dist=True)
    optimizer.step()  # not held back: the parameter's copy has not run yet
    gate.set()

    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = raised.value.failures[0]
    assert isinstance(mutation, SnapshotMutationError)
    assert mutation.fqn == "model.weight"
    assert "rank 0: SnapshotMutationError: rank 0: tensor 'model.weight'" in str(raised.value)
    assert not (tmp_path / METADATA_NAME).exists()
    assert pool_drains(writer)


def test_without_the_guard_dcp_async_save_reports_the_mutation_through_its_future(
    tmp_path: Path, make_writer, gated_parameters
) -> None:
    gate, _ = gated_parameters
    weight, _, state = training_state()
    writer = make_writer(tmp_path, guard_optimizer_step=False, copy_on_write=False)

    future = dcp.async_save(state, storage_writer=writer, no_dist=True)
    with torch.no_grad():
        weight.mul_(2.0)
    gate.set()

    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is a BaseException
        future.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None, raised.value
    assert mutation.fqn == "model.weight"
    assert not (tmp_path / METADATA_NAME).exists()


def test_a_writer_recovers_after_a_failed_save(
    tmp_path: Path, make_writer, gated_parameters
) -> None:
    gate, _ = gated_parameters
    weight, optimizer, state = training_state()
    writer = make_writer(
        tmp_path / "first", guard_optimizer_step=False, copy_on_write=False, **SMALL_POOL
    )
    failed = async_save(state, writer, no_dist=True)
    optimizer.step()
    gate.set()
    with pytest.raises(CheckpointSaveError):
        failed.upload_completion.result(timeout=EVENT_TIMEOUT_S)

    retried = async_save(state, writer, checkpoint_id=str(tmp_path / "second"), no_dist=True)
    retried.upload_completion.result(timeout=EVENT_TIMEOUT_S)

    loaded = load_like(tmp_path / "second", state, "datastates")
    assert torch.equal(loaded["model"]["weight"], weight.detach())
