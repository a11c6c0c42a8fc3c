"""Bad input: each is refused on the caller's thread, by the call itself, with an error that
names the culprit, and leaves nothing behind (no directory, no data file, no held snapshot).

Covered for our ``async_save`` (given a path, or a reused writer) and for ``dcp.async_save``
with our writer. A plain ``dcp.save`` has no ``stage()``: there the writer sees the state only in
``write_data`` and DCP raises its ``CheckpointException`` from the call (see the last test).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _faults_util import BOUNDED_S, wait_until
from conftest import assert_same_state, data_files, failure_of, load_like

from dcp_datastates import DataStatesWriter, InvalidStateDictError, async_save
from dcp_datastates.format import METADATA_NAME


class ScaledTensor(torch.Tensor):
    """A tensor subclass the writer cannot copy raw."""


def _cases() -> dict[str, tuple[dict[str, Any], type[BaseException], str]]:
    good = torch.ones(4)
    return {
        "unpicklable object": (
            {"w": good, "lock": threading.Lock()},
            InvalidStateDictError,
            "'lock'",
        ),
        "mixed top-level keys": (
            {1: good, "w": good},
            InvalidStateDictError,
            "mix ints (1)",
        ),
        "tensor subclass": (
            {"w": good.as_subclass(ScaledTensor)},
            InvalidStateDictError,
            "ScaledTensor",
        ),
        # Int keys are fine (optimizer.state_dict() has them, DCP loads them back); a float
        # or None key is not: DCP names it by str() and does not load it back as itself.
        "non-string key": ({"w": good, 3.5: good}, InvalidStateDictError, "key 3.5"),
        "nested non-string key": (
            {"model": {"w": good, None: {"exp_avg": good}}},
            InvalidStateDictError,
            "key None under 'model.'",
        ),
        "keys naming one item": (
            {"model": {1: good, "1": good}},
            InvalidStateDictError,
            "keys 1 and '1' under 'model.' both name the item model.1",
        ),
        "empty state dict": ({}, InvalidStateDictError, "empty"),
        # Tensors whose bytes are not their elements (a user sweep: raw torch errors naming no
        # item, or, for a nested tensor, "Internal error ... Please file an issue").
        "sparse COO tensor": (
            {"w": good, "adj": torch.eye(3).to_sparse()},
            InvalidStateDictError,
            "item 'adj' is a sparse_coo layout tensor",
        ),
        "sparse CSR tensor": (
            {"w": good, "adj": torch.eye(3).to_sparse_csr()},
            InvalidStateDictError,
            "item 'adj' is a sparse_csr layout tensor",
        ),
        "quantized tensor": (
            {"w": good, "q": torch.quantize_per_tensor(good, 0.1, 0, torch.qint8)},
            InvalidStateDictError,
            "item 'q' is a quantized",
        ),
        "nested tensor": (
            {"model": {"ragged": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}},
            InvalidStateDictError,
            "item 'model.ragged' is a nested tensor",
        ),
    }


CASES = _cases()
ENTRY_POINTS = ["async_save(path)", "async_save(writer)", "dcp.async_save"]


def _call(entry: str, state: dict, path: Path, writer: DataStatesWriter) -> Any:
    if entry == "async_save(path)":
        return async_save(state, path, no_dist=True)
    if entry == "async_save(writer)":
        return async_save(state, writer, checkpoint_id=str(path), no_dist=True)
    return dcp.async_save(state, storage_writer=writer, checkpoint_id=str(path), no_dist=True)


def _the_writer_still_saves(writer: DataStatesWriter, tmp_path: Path) -> None:
    good = {"w": torch.arange(6.0), "step": 1}
    path = tmp_path / "after"
    async_save(good, writer, checkpoint_id=str(path), no_dist=True).upload_completion.result(
        timeout=BOUNDED_S
    )
    assert_same_state(good, load_like(path, good, "datastates"))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_state_dict_is_refused_at_the_call_site_and_leaves_nothing(
    tmp_path: Path, make_writer, case: str, entry: str
) -> None:
    state, error, names = CASES[case]
    writer = make_writer(tmp_path / "unused")
    path = tmp_path / "ckpt"
    threads = threading.active_count()

    with pytest.raises(error, match=None) as raised:  # raised by the call, on this thread
        _call(entry, state, path, writer)
    assert names in str(raised.value)
    assert not path.exists()
    # Nothing was queued: no save thread was started, and the writer saves the next state.
    wait_until(lambda: threading.active_count() <= threads, BOUNDED_S, "stray threads to end")
    _the_writer_still_saves(writer, tmp_path)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_checkpoint_path_that_is_a_file_is_refused_at_the_call_site(
    tmp_path: Path, make_writer, entry: str
) -> None:
    path = tmp_path / "not-a-dir"
    path.write_bytes(b"precious")
    writer = make_writer(tmp_path / "unused")

    with pytest.raises(NotADirectoryError) as raised:
        _call(entry, {"w": torch.ones(3)}, path, writer)
    assert str(path) in str(raised.value) and "not a directory" in str(raised.value)
    assert path.read_bytes() == b"precious"
    _the_writer_still_saves(writer, tmp_path)


# A nested tensor fails inside DCP's own planning there, before the writer sees the state.
@pytest.mark.parametrize(
    "case", ["unpicklable object", "tensor subclass", "sparse COO tensor", "quantized tensor"]
)
def test_plain_dcp_save_refuses_it_from_the_call_and_writes_no_file(
    tmp_path: Path, make_writer, case: str
) -> None:
    state, error, names = CASES[case]
    path = tmp_path / "ckpt"
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException
        dcp.save(state, storage_writer=make_writer(path), no_dist=True)
    assert names in str(raised.value) and error.__name__ in str(raised.value)
    assert data_files(path) == [] and not (path / METADATA_NAME).exists()


class _PlanDroppingPlanner(dcp.DefaultSavePlanner):
    """A planner whose final plan loses an item the global metadata lists: what DCP's plan
    cache (``enable_plan_caching``) handed a save after one that failed while planning."""

    def finish_plan(self, new_plan: Any) -> Any:
        plan = super().finish_plan(new_plan)
        return type(plan)(
            [i for i in plan.items if i.index.fqn != "b"], plan.storage_data, plan.planner_data
        )


def test_metadata_naming_an_item_no_rank_wrote_is_not_committed(
    tmp_path: Path, make_writer
) -> None:
    """Stock ``FileSystemWriter`` commits such a checkpoint, and every load of it fails with a
    ``KeyError``; ours refuses the commit, naming the item."""
    path = tmp_path / "ckpt"
    state = {"a": torch.ones(3), "b": torch.full((2, 2), 2.0), "obj": {"k": 1}}
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException
        dcp.save(state, storage_writer=make_writer(path), planner=_PlanDroppingPlanner())
    assert "WriterUsageError" in str(raised.value) and "(b@0,0)" in str(raised.value)
    assert not (path / METADATA_NAME).exists()
    # The same planner with the stock writer commits a checkpoint that cannot be loaded.
    stock = tmp_path / "stock"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(stock), planner=_PlanDroppingPlanner())
    with pytest.raises(BaseException, match="KeyError"):
        dcp.load({k: v for k, v in state.items() if k != "obj"}, checkpoint_id=stock)


@pytest.mark.parametrize("entry", ["async_save(writer)", "dcp.async_save"])
def test_a_nested_key_and_a_dotted_key_naming_one_item_fail_the_save_naming_it(
    tmp_path: Path, make_writer, entry: str
) -> None:
    """``{"a": {"b": ...}, "a.b": ...}``: both flatten to the item ``a.b``. Found when the save
    plans (on the planning thread: joining every key on the caller costs it a string a key), it
    failed as DCP's bare ``ValueError`` (a user sweep); now an ``InvalidStateDictError`` that
    names the item and what to do, and nothing is committed. (A writer made for one save, from
    a path, saves through DCP's own planner on DCP's save thread, which still raises its
    ``ValueError`` first, as stock does.)"""
    state = {"a": {"b": torch.ones(2)}, "a.b": torch.zeros(2)}
    writer = make_writer(tmp_path / "unused")
    path = tmp_path / "ckpt"
    response = _call(entry, state, path, writer)
    upload = getattr(response, "upload_completion", response)
    with pytest.raises(BaseException) as raised:  # noqa: PT011 - DCP's or ours; cause below
        upload.result(timeout=BOUNDED_S)
    cause = failure_of(raised.value, InvalidStateDictError)
    assert cause is not None and "'a.b'" in str(cause) and "rename one" in str(cause), raised
    assert not (path / METADATA_NAME).exists()
    _the_writer_still_saves(writer, tmp_path)
