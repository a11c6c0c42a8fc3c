"""Mutation race with real timing (no gated provider): a long snapshot (64 MiB streamed through
a 2 MiB pool, the parameters last) is racing a training loop.

Guard off: an optimizer step during the snapshot fails the save with ``SnapshotMutationError``.
Guard on: ``optimizer.step()`` waits, and the checkpoint holds the pre-step parameters and
optimizer state. The deterministic, gated versions of these races are in
``test_guard_and_mutation.py``; these show the same outcome without any test seam.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _faults_util import BOUNDED_S, MiB
from conftest import assert_same_state, load_like, pool_drains
from torch.distributed.checkpoint.state_dict import get_state_dict

from dcp_datastates import CheckpointSaveError, SnapshotMutationError, async_save
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.snapshot import guard

pytestmark = pytest.mark.timeout(120)

LONG_SNAPSHOT = {"host_pool_bytes": 2 * MiB, "chunk_bytes": 512 * 1024, "coalesce_bytes": 64 * 1024}


def _training() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # 64 MiB of other state first: the snapshot reaches the parameters only after streaming it.
    g = torch.Generator().manual_seed(2)
    state = {
        "activations": {f"a{i}": torch.randn(4 * MiB, generator=g) for i in range(4)},
        "model": model_sd,
        "optim": {"state": optim_sd["state"]},
    }
    return model, optimizer, state


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 256)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_guard_off_a_step_during_a_long_snapshot_fails_the_save(tmp_path: Path, make_writer):
    model, optimizer, state = _training()
    writer = make_writer(
        tmp_path / "unused", guard_optimizer_step=False, copy_on_write=False, **LONG_SNAPSHOT
    )

    response = async_save(state, writer, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert not response.staging_completion.done(), "the snapshot was not long enough to race"
    _step(model, optimizer)  # not held back

    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=BOUNDED_S)
    err = raised.value.failures[0]
    assert isinstance(err, SnapshotMutationError), repr(err)
    assert err.fqn.startswith(("model.", "optim.")), err.fqn
    assert "modified in place" in str(raised.value)
    assert not (tmp_path / "ckpt" / METADATA_NAME).exists()
    assert pool_drains(writer)


def test_guard_on_steps_wait_and_the_checkpoint_holds_the_pre_step_state(
    tmp_path: Path, make_writer
) -> None:
    model, optimizer, state = _training()
    before = {
        "model": {k: v.detach().clone() for k, v in state["model"].items()},
        "optim": {
            "state": {
                p: {k: v.clone() for k, v in s.items()} for p, s in state["optim"]["state"].items()
            }
        },
    }
    writer = make_writer(tmp_path / "unused", **LONG_SNAPSHOT)
    waits = guard.waits

    response = async_save(state, writer, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert not response.staging_completion.done(), "the snapshot was not long enough to race"
    for _ in range(3):
        _step(model, optimizer)  # the first one waits for the snapshot
    response.upload_completion.result(timeout=BOUNDED_S)

    assert guard.waits == waits + 1
    assert writer.last_stats is not None and writer.last_stats.optimizer_wait_s > 0
    live = state["model"]["0.weight"]
    assert not torch.equal(live, before["model"]["0.weight"]), "the steps did not run"
    loaded = load_like(
        tmp_path / "ckpt", {"model": before["model"], "optim": before["optim"]}, "stock"
    )
    assert_same_state(before, loaded)


def test_without_copy_on_write_an_in_place_change_outside_the_optimizer_fails_the_save(
    tmp_path: Path, make_writer
) -> None:
    _, _, state = _training()
    # Small tensors are copied during stage() (eager_copy_bytes): turn that off so the bias is
    # still waiting for its copy when it changes.
    writer = make_writer(
        tmp_path / "unused", eager_copy_bytes=0, copy_on_write=False, **LONG_SNAPSHOT
    )

    response = async_save(state, writer, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert not response.staging_completion.done(), "the snapshot was not long enough to race"
    with torch.no_grad():
        state["model"]["1.bias"].mul_(2.0)  # the guard only holds optimizer steps

    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=BOUNDED_S)
    err = raised.value.failures[0]
    assert isinstance(err, SnapshotMutationError) and err.fqn == "model.1.bias", repr(err)
    assert not (tmp_path / "ckpt" / METADATA_NAME).exists()
    assert pool_drains(writer)
