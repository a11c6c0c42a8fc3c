"""Disk full: saves into a real 32 MiB tmpfs fail through the upload future with an error that
names ENOSPC and the file, commit nothing, give the space and the host pool back, and the
training loop runs on throughout; the same writer then saves elsewhere at once."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _faults_util import BOUNDED_S, MiB, mounted_tmpfs
from conftest import assert_same_state, data_files, load_like, pool_drains
from torch.distributed.checkpoint.state_dict import get_state_dict

from dcp_datastates import CheckpointSaveError, StorageWriteError, async_save
from dcp_datastates.format import MANIFEST_NAME, METADATA_NAME

pytestmark = pytest.mark.timeout(180)

PAGE = 4096


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs: smaller than the ~48 MiB model state saved into it."""
    with mounted_tmpfs(tmp_path, "32m") as mnt:
        yield mnt


def _model_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A real model and optimizer, about 48 MiB of state in all (more than the tmpfs holds)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, optimizer)  # AdamW's moments exist from here on
    # FQN-keyed, as DCP wants (a raw optimizer.state_dict() has int keys, refused at stage()).
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return model, optimizer, {"model": model_sd, "optim": optim_sd}


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 1024)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _the_storage_error(exc: CheckpointSaveError) -> StorageWriteError:
    assert list(exc.failures) == [0], exc
    err = exc.failures[0]
    assert isinstance(err, StorageWriteError), repr(err)
    return err


def test_a_full_device_fails_the_save_through_its_future_and_training_goes_on(
    small_tmpfs: Path, tmp_path: Path, make_writer
) -> None:
    free_before = _free_bytes(small_tmpfs)
    model, optimizer, state = _model_state()
    writer = make_writer(tmp_path / "unused", host_pool_bytes=8 * MiB, chunk_bytes=MiB)
    target = small_tmpfs / "ckpt"

    response = async_save(state, writer, checkpoint_id=str(target), no_dist=True)
    steps_while_failing = 0
    deadline = time.monotonic() + BOUNDED_S
    while not response.upload_completion.done():  # the loop does not wait for the save
        assert time.monotonic() < deadline, "the failing save never reported"
        _train_step(model, optimizer)  # the guard holds this step only until the snapshot ends
        steps_while_failing += 1

    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result()
    err = _the_storage_error(raised.value)
    assert err.errno == errno.ENOSPC
    assert "ENOSPC" in str(raised.value) and str(target) in str(raised.value)
    assert err.filename is not None and err.filename.startswith(str(target))
    assert steps_while_failing >= 1
    assert not (target / METADATA_NAME).exists()
    assert not (target / MANIFEST_NAME).exists()
    assert data_files(target) == []  # partial files are removed: the space comes back
    assert _free_bytes(small_tmpfs) == free_before
    assert pool_drains(writer)

    for _ in range(3):  # and the loop keeps going after the failure
        _train_step(model, optimizer)
    healthy = tmp_path / "healthy"
    start = time.monotonic()
    retry = async_save(state, writer, checkpoint_id=str(healthy), no_dist=True)
    retry.upload_completion.result(timeout=BOUNDED_S)
    assert time.monotonic() - start < BOUNDED_S
    assert writer.last_stats is not None and writer.last_stats.optimizer_wait_s >= 0
    tensors = {"model": state["model"], "optim": {"state": state["optim"]["state"]}}
    assert_same_state(tensors, load_like(healthy, tensors, "datastates"))


def test_a_device_that_fills_up_at_commit_time_names_the_manifest_and_commits_nothing(
    small_tmpfs: Path, tmp_path: Path, make_writer
) -> None:
    state = {"w": torch.randn(1 << 20), "step": 3}
    writer = make_writer(tmp_path / "unused", flush_workers=1)
    probe = tmp_path / "probe"
    async_save(state, writer, checkpoint_id=str(probe), no_dist=True).upload_completion.result(
        timeout=BOUNDED_S
    )
    data_pages = sum(-(-f.stat().st_size // PAGE) for f in data_files(probe))
    # Leave room for the data files and not one page more: the manifest is what does not fit.
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (_free_bytes(small_tmpfs) - data_pages * PAGE))
    target = small_tmpfs / "ckpt"

    response = async_save(state, writer, checkpoint_id=str(target), no_dist=True)
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=BOUNDED_S)
    err = _the_storage_error(raised.value)
    assert err.errno == errno.ENOSPC
    assert "ENOSPC" in str(raised.value)
    assert err.filename == str(target / f"{MANIFEST_NAME}.tmp") or MANIFEST_NAME in str(err)
    assert not (target / METADATA_NAME).exists()
    assert not (target / f"{MANIFEST_NAME}.tmp").exists()
    assert pool_drains(writer)

    filler.unlink()  # space again: the same writer commits into the same directory
    async_save(state, writer, checkpoint_id=str(target), no_dist=True).upload_completion.result(
        timeout=BOUNDED_S
    )
    assert_same_state(state, load_like(target, state, "stock"))
