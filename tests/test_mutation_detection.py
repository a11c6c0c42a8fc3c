"""What the mutation check sees: writes that bypass the version counter.

``tensor.data``, ``tensor.numpy()`` and ``torch.from_numpy`` views share a tensor's memory but
not its version counter, so the version check alone let such a save commit a torn checkpoint.
Each raw provider also samples 32 bytes at the head, middle and tail of a contiguous CPU tensor
(and at the start of each range an elementwise op writes in parallel) at stage time and
compares them with its copy and, after the copy, with the live tensor: a write that changes a
sampled byte before the copy ends fails the save, as does an in-place op still running then.
The rest (a write that misses every sampled byte, a non-contiguous or GPU
tensor) is the documented limitation, pinned here so that a change in it is noticed.

Each race is deterministic: the parameter's copy waits on a gate that the test opens after
writing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import EVENT_TIMEOUT_S, GatedTensorProvider, failure_of, load_like

from dcp_datastates import (
    CheckpointSaveError,
    DataStatesReader,
    DataStatesWriter,
    SnapshotMutationError,
    async_save,
)
from dcp_datastates.format import METADATA_NAME
from dcp_datastates.providers import TensorProvider

N = 4096  # float32 elements: 16 KiB, probes at bytes [0, 32), [8192, 8224), [16352, 16384)


@pytest.fixture
def gate(registered_providers: Any) -> Iterator[threading.Event]:
    """Copies of every ``nn.Parameter`` wait until the returned event is set."""
    event = threading.Event()
    registered_providers(torch.nn.Parameter, lambda fqn, v: GatedTensorProvider(fqn, v, event))
    yield event
    event.set()


def _save_while(tmp_path: Path, make_writer: Any, gate: threading.Event, weight: Any, write: Any):
    """Stage ``{"w": weight}``, run ``write()`` before the copy, then let the copy run."""
    state = {"w": weight}
    response = async_save(
        state, make_writer(tmp_path, guard_optimizer_step=False, copy_on_write=False), no_dist=True
    )
    write()
    gate.set()
    return state, response


def _fails_unversioned(response: Any, tmp_path: Path) -> None:
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None, raised.value
    assert mutation.fqn == "w" and mutation.unversioned
    assert ".data" in str(mutation) and "without a version bump" in str(mutation)
    assert not (tmp_path / METADATA_NAME).exists()


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda w: w.data.add_(1.0), id="data-add"),
        pytest.param(lambda w: w.data.copy_(torch.zeros(N)), id="data-copy"),
        pytest.param(lambda w: w.data.mul_(0.5).add_(0.25), id="data-ema-like"),
        pytest.param(lambda w: w.detach().numpy().__setitem__(slice(None), 7.0), id="numpy-all"),
        pytest.param(lambda w: w.detach().numpy().__setitem__(0, 7.0), id="numpy-first"),
        pytest.param(lambda w: w.data.__setitem__(N - 1, 7.0), id="data-last"),
        pytest.param(lambda w: w.data.__setitem__(N // 2, 7.0), id="data-middle"),
    ],
)
def test_a_write_that_bypasses_the_version_counter_fails_the_save(
    tmp_path: Path, make_writer: Any, gate: threading.Event, write: Any
) -> None:
    weight = torch.nn.Parameter(torch.randn(N), requires_grad=False)
    version = weight._version
    _, response = _save_while(tmp_path, make_writer, gate, weight, lambda: write(weight))
    assert weight._version == version, "the write was meant to bypass the version counter"
    _fails_unversioned(response, tmp_path)


def test_a_write_through_the_numpy_array_behind_a_from_numpy_tensor_fails_the_save(
    tmp_path: Path, make_writer: Any, gate: threading.Event
) -> None:
    array = np.random.default_rng(0).standard_normal(N).astype(np.float32)
    weight = torch.nn.Parameter(torch.from_numpy(array), requires_grad=False)

    def write() -> None:
        np.multiply(array, 2.0, out=array)

    _, response = _save_while(tmp_path, make_writer, gate, weight, write)
    _fails_unversioned(response, tmp_path)


def test_an_ordinary_in_place_write_is_still_caught_by_its_version(
    tmp_path: Path, make_writer: Any, gate: threading.Event
) -> None:
    weight = torch.nn.Parameter(torch.randn(N), requires_grad=False)
    _, response = _save_while(tmp_path, make_writer, gate, weight, lambda: weight.add_(1.0))
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None and not mutation.unversioned


def test_a_load_through_our_reader_into_a_tensor_in_flight_fails_the_save(
    tmp_path: Path, make_writer: Any, gate: threading.Event
) -> None:
    """``DataStatesReader`` reads a big record straight into its target, behind torch's back.
    It bumps the target's version counter as stock's ``copy_`` does: a user sweep restored a
    checkpoint into live tensors while their save was in flight, and without the bump the save
    committed the loaded values (they differed only away from the sampled bytes)."""
    big = 1 << 19  # float32 elements: 2 MiB, a record the reader reads in place
    weight = torch.nn.Parameter(torch.zeros(big), requires_grad=False)
    other = torch.zeros(big)
    other[1000:2000] = 5.0  # away from every sampled byte
    dcp.save({"w": other}, storage_writer=DataStatesWriter(tmp_path / "other"), no_dist=True)

    def restore() -> None:
        version = weight._version
        dcp.load({"w": weight}, storage_reader=DataStatesReader(tmp_path / "other"), no_dist=True)
        assert torch.equal(weight.detach(), other) and weight._version > version

    _, response = _save_while(tmp_path / "ckpt", make_writer, gate, weight, restore)
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None and mutation.fqn == "w" and not mutation.unversioned
    assert not (tmp_path / "ckpt" / METADATA_NAME).exists()


# -- the documented limitation -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "index"),
    [
        pytest.param((N,), (100,), id="contiguous-unsampled-byte"),
        pytest.param((64, 128), (0, 0), id="non-contiguous"),  # a transposed view: not sampled
    ],
)
def test_limitation_a_write_missing_every_sampled_byte_commits_a_torn_checkpoint(
    tmp_path: Path, make_writer: Any, gate: threading.Event, shape: tuple, index: tuple
) -> None:
    base = torch.randn(shape)
    weight = torch.nn.Parameter(base if len(shape) == 1 else base.t(), requires_grad=False)
    before = weight.detach().clone()

    def write() -> None:
        weight.data[index] = 7.0

    state, response = _save_while(tmp_path, make_writer, gate, weight, write)
    response.upload_completion.result(timeout=EVENT_TIMEOUT_S)  # not detected: it commits
    loaded = load_like(tmp_path, state, "datastates")["w"]
    assert loaded[index] == 7.0 and before[index] != 7.0, "the save caught it: update the docs"


# -- a write right after the copy ------------------------------------------------------------------
class _WrittenRightAfterItsCopy(TensorProvider):
    """A real provider whose live tensor is written in place the moment its copy returns: what a
    forward does to a buffer whose snapshot was complete when the forward gate looked (the gate
    then leaves it alone). The copy thread's check came after that moment and failed the save."""

    def copy_into(self, dst: torch.Tensor, start: int, stop: int) -> None:
        super().copy_into(dst, start, stop)
        assert self.source is not None
        self.source.add_(1.0)


def test_a_write_after_the_last_part_was_copied_does_not_fail_the_snapshot(
    tmp_path: Path, make_writer: Any, registered_providers: Any
) -> None:
    registered_providers(torch.nn.Parameter, _WrittenRightAfterItsCopy)
    weight = torch.nn.Parameter(torch.randn(N), requires_grad=False)
    at_call = weight.detach().clone()
    writer = make_writer(
        tmp_path, guard_optimizer_step=False, copy_on_write=False, eager_copy_bytes=0
    )
    async_save({"w": weight}, writer, no_dist=True).upload_completion.result(EVENT_TIMEOUT_S)
    assert not torch.equal(weight.detach(), at_call)  # written after the copy
    loaded = load_like(tmp_path, {"w": torch.zeros(N)}, "stock")
    assert torch.equal(loaded["w"], at_call)


# -- an in-place op still running when the copy ends ---------------------------------------------
BIG = 1 << 21  # float32 elements: 8 MiB, sampled in stage() (PROBE_AT_CALL_BYTES)


@pytest.mark.parametrize("saves", [1, 3], ids=["walked", "replayed"])
def test_an_in_place_op_still_running_when_planning_starts_fails_the_save(
    tmp_path: Path, make_writer: Any, saves: int
) -> None:
    """``add_`` right after the call: its version counter moves only when it returns, so a copy
    that overlapped it passed the version check, and the planning thread's samples, read after
    the op had begun, matched the torn copy: 2-7 of 20 saves committed half-updated tensors (a
    user sweep). The op is frozen here mid-way, as the planning thread starts: every element of
    each range it writes in parallel (``probe_offsets``) from the first on is new, the version
    counter not moved yet. The samples ``stage()`` read find it."""
    weight = torch.randn(BIG)
    writer = make_writer(tmp_path / "unused", guard_optimizer_step=False, copy_on_write=False)
    for i in range(saves - 1):  # earlier saves teach the writer the layout it then replays
        async_save({"w": weight}, writer, checkpoint_id=tmp_path / f"s{i}", no_dist=True)
        writer.staging_future.result(EVENT_TIMEOUT_S)
    version, returning = weight._version, writer._returning_from_async_save

    def op_half_done() -> None:  # each parallel range's first half written, no version bump
        chunk = -(-BIG // torch.get_num_threads()) if BIG > 32768 else BIG
        for start in range(0, BIG, chunk):
            weight.data[start : start + chunk // 2] += 1.0
        returning()

    writer._returning_from_async_save = op_half_done
    path = tmp_path / "torn"
    response = async_save({"w": weight}, writer, checkpoint_id=path, no_dist=True)
    assert weight._version == version
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None and "still running" in str(mutation), raised.value
    assert not (path / METADATA_NAME).exists()


class _OpStartsDuringItsCopy(TensorProvider):
    """A real provider whose copy is overlapped by an in-place op that starts after the copy
    read the sampled bytes: the copy holds them unchanged but later bytes new (a torn copy), and
    the op's version bump is still to come."""

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, start: int, stop: int) -> None:
        super()._copy(src, dst, start, stop)
        if src is self.source:
            src.data += 1.0  # the op, from the start of each range on; no version bump yet
            dst.view(torch.float32)[100] += 1.0  # read after the op began; not a sampled byte


def test_an_in_place_op_overlapping_the_copy_is_found_by_reading_the_live_samples_again(
    tmp_path: Path, make_writer: Any, registered_providers: Any
) -> None:
    registered_providers(torch.nn.Parameter, _OpStartsDuringItsCopy)
    weight = torch.nn.Parameter(torch.randn(BIG), requires_grad=False)
    writer = make_writer(tmp_path, guard_optimizer_step=False, copy_on_write=False)
    response = async_save({"w": weight}, writer, no_dist=True)
    with pytest.raises(CheckpointSaveError) as raised:
        response.upload_completion.result(timeout=EVENT_TIMEOUT_S)
    mutation = failure_of(raised.value, SnapshotMutationError)
    assert mutation is not None and mutation.unversioned, raised.value
    assert not (tmp_path / METADATA_NAME).exists()


@pytest.mark.parametrize("api", ["dcp.async_save", "dcp_datastates.async_save"])
def test_large_conjugate_and_negative_views_save_unchanged_through_both_async_apis(
    tmp_path: Path, api: str
) -> None:
    """Conjugate and negative views are copied resolved; sampling their raw bytes in
    ``stage()`` (4 MiB and more) made every async save of one fail as changed (a user sweep).
    Two saves per writer: the walk, then the replay of its layout."""
    z = torch.randn(600, 1000, dtype=torch.complex64)  # 4.8 MB
    x = torch.randn(1100, 1000)  # 4.4 MB
    state = {"z": z.conj(), "x": torch._neg_view(x), "step": 3}
    writer = DataStatesWriter(tmp_path / "unused")
    for i in range(2):
        path = tmp_path / f"c{i}"
        if api == "dcp.async_save":
            dcp.async_save(state, storage_writer=writer, checkpoint_id=path).result()
        else:
            async_save(state, writer, checkpoint_id=path).upload_completion.result()
        loaded = {"z": torch.zeros_like(z), "x": torch.zeros_like(x), "step": 0}
        dcp.load(loaded, checkpoint_id=path)
        assert torch.equal(loaded["z"], z.conj().resolve_conj()), f"save {i}"
        assert torch.equal(loaded["x"], -x), f"save {i}"
    assert writer._staging.captures.replays == 1
    writer.close()
