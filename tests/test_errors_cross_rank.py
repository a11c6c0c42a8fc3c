"""Errors that cross ranks: DCP gathers each rank's failure on the coordinator by pickling it.

An error type that cannot be unpickled there (``SnapshotMutationError`` had a keyword-only
``__init__``) turned the real cause into a ``TypeError`` on the coordinator and left the other
rank waiting in a collective until the process-group timeout.
"""

from __future__ import annotations

import inspect
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cross_rank_workers import CAUSE, UserProviderError, injected_errors
from _dist_workers import check_all_ok, empty_like_values, full_values, launch
from _faults_util import BOUNDED_S

from dcp_datastates import errors

WORKERS = str(Path(__file__).with_name("_cross_rank_workers.py"))


#: Two gloo ranks, through ``dcp_datastates.async_save`` ("ours") and ``dcp.async_save``.
def two_ranks_both_apis(test: Callable[..., None]) -> Callable[..., None]:
    test = pytest.mark.parametrize(
        "mode", ["ours", "dcp"], ids=["dcp_datastates.async_save", "dcp.async_save"]
    )(test)
    return pytest.mark.multiprocess(pytest.mark.timeout(150)(test))


def _public_error_types() -> set[str]:
    return {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, errors.DataStatesError)
    }


def test_every_public_error_type_survives_pickling_with_its_attributes() -> None:
    samples = {k: v for k, v in injected_errors().items() if k != "UserProviderError"}
    assert set(samples) == _public_error_types(), "add a sample of the new error type"
    for name, err in samples.items():
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err), name
        assert str(back) == str(err) and back.args == err.args, name
        assert set(vars(back)) == set(vars(err)), name
        for attr, value in vars(err).items():
            if attr == "failures":  # exceptions compare by identity: compare what they say
                assert {r: str(e) for r, e in back.failures.items()} == {
                    r: str(e) for r, e in value.items()
                }
            else:
                assert getattr(back, attr) == value, f"{name}.{attr}"
        if isinstance(err, OSError):
            assert (back.errno, back.filename) == (err.errno, err.filename), name
    mutation = pickle.loads(pickle.dumps(samples["SnapshotMutationError"]))
    assert (mutation.rank, mutation.before, mutation.after) == (1, 3, 4)


def test_the_error_types_outside_errors_py_survive_pickling_with_their_attributes() -> None:
    """``ObjectStoreError`` (an ``OSError`` with a keyword-only ``__init__``) reached the
    coordinator as a plain ``DataStatesError`` without bucket, key or code (a user sweep)."""
    import errno

    from dcp_datastates.checkpointers.tiers import MirrorError
    from dcp_datastates.storage._s3_client import ObjectStoreError

    store = ObjectStoreError(
        errno.EIO,
        f"rank 1: upload_part failed: {CAUSE}",
        bucket="bkt",
        key="run/__1_0.distcp",
        operation="upload_part",
        code="SlowDown",
    )
    store.transient = True
    for err in (store, MirrorError(f"rank 1: {CAUSE}")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.args == err.args
        assert vars(back) == vars(err)
    back = pickle.loads(pickle.dumps(store))
    assert (back.errno, back.filename, back.bucket, back.code, back.transient) == (
        errno.EIO,
        "s3://bkt/run/__1_0.distcp",
        "bkt",
        "SlowDown",
        True,
    )
    assert errors.portable(store) is store


def test_an_error_that_cannot_be_unpickled_is_made_portable_keeping_its_cause() -> None:
    err = UserProviderError(item="w")
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(err))
    portable = errors.portable(err)
    back = pickle.loads(pickle.dumps(portable))
    assert isinstance(back, errors.DataStatesError)
    assert "UserProviderError" in str(back) and CAUSE in str(back)
    assert portable.__cause__ is err
    ours = errors.InvalidStateDictError("x")
    assert errors.portable(ours) is ours


@two_ranks_both_apis
def test_each_error_kind_on_one_rank_fails_every_rank_naming_that_rank_and_the_cause(
    tmp_path: Path, mode: str
) -> None:
    results = launch(f"errors-{mode}", tmp_path, timeout=140, script=WORKERS)
    check_all_ok(results)
    for r in results:
        for kind in injected_errors():
            seen = r.report[kind]
            where = f"rank {r.rank}, {kind}"
            assert seen["failed"], f"{where}: the save succeeded"
            assert seen["type"] == (
                "CheckpointSaveError" if mode == "ours" else "CheckpointException"
            )
            assert seen["failed_ranks"] == [1], where
            cause = "DataStatesError" if kind == "UserProviderError" else kind
            assert seen["cause_types"] == {"1": cause}, where
            assert CAUSE in seen["cause_messages"]["1"] and CAUSE in seen["message"], where
            assert "rank 1" in seen["message"].lower(), where
            assert seen["seconds"] < BOUNDED_S, f"{where}: took {seen['seconds']:.1f}s"


@two_ranks_both_apis
def test_a_state_one_rank_cannot_stage_fails_the_save_on_every_rank(
    tmp_path: Path, mode: str
) -> None:
    """Rank 1's state holds a value that cannot be pickled. Raised by ``stage()`` on rank 1
    alone, the error left rank 0's save waiting in DCP's collective for good (as stock does);
    it now fails rank 1's save, which DCP reports to every rank, and the next save works."""
    _rank_1_failed_every_save_then_all_saved(f"call-error-{mode}", tmp_path, "pickled")


def _rank_1_failed_every_save_then_all_saved(
    scenario: str, tmp_path: Path, says: str, error_type: str | None = None
) -> None:
    """No call raised; every rank's bad save failed at once naming rank 1 and the cause (with
    ``says`` in its message; as ``error_type`` if given), and every rank's next save
    committed."""
    results = launch(scenario, tmp_path, timeout=140, script=WORKERS)
    check_all_ok(results)
    for r in results:
        bad, good = r.report["bad"], r.report.get("good")
        where = f"rank {r.rank}"
        assert bad["raised_at_call"] is None, f"{where}: {bad['raised_at_call']}"
        assert bad["failed"] and bad["type"] != "TimeoutError", f"{where}: {bad}"
        assert error_type in (None, bad["type"]), f"{where}: {bad}"
        assert CAUSE in bad["message"] and says in bad["message"], f"{where}: {bad}"
        assert bad["failed_ranks"] == [1], f"{where}: {bad}"
        assert bad["seconds"] < BOUNDED_S, f"{where}: {bad['seconds']:.1f}s"
        assert good is not None and not good["failed"], f"{where}: {good}"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "mode", ["ours", "path", "process"], ids=["a writer", "a path", "the PROCESS executor"]
)
def test_a_stateful_raising_on_one_rank_fails_the_save_on_every_rank(
    tmp_path: Path, mode: str
) -> None:
    """Rank 1's ``Stateful.state_dict()`` raises in ``dcp_datastates.async_save``. Raised at
    the call there, it left rank 0's save waiting until the process group's timeout, failing
    then on a closed connection that named nobody (a user sweep; stock ``dcp.async_save``
    behaves the same). It now fails rank 1's save, which every rank's future reports; with the
    PROCESS executor it travels to rank 1's daemon in place of the state."""
    _rank_1_failed_every_save_then_all_saved(
        f"call-error-{mode}-stateful", tmp_path, "state_dict() failed", "CheckpointSaveError"
    )


@two_ranks_both_apis
def test_a_save_whose_process_group_is_destroyed_before_it_runs_commits_nothing(
    tmp_path: Path, mode: str
) -> None:
    """``async_save`` then ``dist.destroy_process_group()`` at once: DCP's save thread found no
    group and saved each rank as rank 0 of one, into the same files; a checkpoint holding one
    rank's state verified OK (a user sweep). Now every rank's save fails, nothing is committed,
    and our own save threads say why."""
    results = launch(f"lost-group-{mode}", tmp_path, timeout=140, script=WORKERS)
    check_all_ok(results)
    for r in results:
        seen, where = r.report, f"rank {r.rank}"
        assert seen["failed"], f"{where}: {seen}"
        assert ".metadata" not in seen["files"], f"{where}: {seen}"
        if mode == "ours":
            assert seen["type"] == "CheckpointSaveError", f"{where}: {seen}"
            assert seen["failure_types"] == ["WriterUsageError"], f"{where}: {seen}"
            assert "was destroyed before its save ran" in seen["message"], f"{where}: {seen}"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["ours", "dcp", "sync"])
def test_ranks_naming_different_checkpoints_are_refused_before_anything_is_written(
    tmp_path: Path, mode: str
) -> None:
    """Each rank passes its own ``checkpoint_id`` (a path built from the clock on each rank):
    every rank wrote its data files into its own directory and the coordinator's commit then
    failed naming rank 1's missing file (a user sweep; stock commits a ``.metadata`` naming
    files that are not beside it). The global plan now refuses the save on every rank, naming
    each rank's path, before any file is written; the next save to one path commits."""
    results = launch(f"split-path-{mode}", tmp_path, timeout=140, script=WORKERS)
    check_all_ok(results)
    for r in results:
        split, same, where = r.report["split"], r.report["same"], f"rank {r.rank}"
        assert split["failed"], f"{where}: {split}"
        assert split["failure_types"] == ["WriterUsageError"], f"{where}: {split}"
        for rank in (0, 1):
            assert f"rank {rank}: {tmp_path / f'rank{rank}'}" in split["message"], where
        assert not same["failed"], f"{where}: {same}"
        files = r.report["files"]
        assert files["rank0"] == [] and files.get("rank1", []) == [], f"{where}: {files}"
        assert ".metadata" in files["same"], f"{where}: {files}"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_node_local_ranks_save_into_their_own_directories_and_the_coordinator_commits_in_its(
    tmp_path: Path,
) -> None:
    """``node_local=True`` (one directory per node, as the memory tier saves): each rank's files
    land in its own directory, the commit in the coordinator's; brought together they load back
    whole. Ranks that disagree on the option are refused, as ranks naming different
    directories without it are (the test above)."""
    results = launch("node-local", tmp_path, timeout=140, script=WORKERS)
    check_all_ok(results)
    for r in results:
        assert not r.report["split"]["failed"], r.report
        mixed = r.report["mixed"]
        assert mixed["failed"] and mixed["types"] == ["WriterUsageError"], r.report
        assert "disagree on node_local" in mixed["message"], mixed
    own = {rank: sorted(os.listdir(tmp_path / f"split{rank}")) for rank in (0, 1)}
    assert {".metadata", ".datastates.json"} <= set(own[0]), own
    assert all(n.startswith("__0_") for n in own[0] if n.startswith("__")), own
    assert own[1] and all(n.startswith("__1_") for n in own[1]), own
    assert not any(os.listdir(tmp_path / f"mixed{rank}") for rank in (0, 1))
    for name in own[1]:
        shutil.copy(tmp_path / "split1" / name, tmp_path / "split0" / name)
    values = full_values()
    back = empty_like_values(values)
    dcp.load(back, checkpoint_id=str(tmp_path / "split0"), no_dist=True)
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back[key], value), key
        else:
            assert back[key] == value, key


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_plan_caching_survives_a_refused_save_and_saves_to_new_paths(tmp_path: Path) -> None:
    """With DCP's plan caching the coordinator plans from other ranks' cached local plans,
    which name the checkpoint of the save they were made for: each save to a new path must
    still commit and load back. A save refused for ``overwrite=False`` was refused in the global
    plan, which left DCP's cache half updated: the next save committed a checkpoint that every
    load failed on (``KeyError: big0``)."""
    results = launch("cached-plans", tmp_path, timeout=140, script=WORKERS)
    check_all_ok(results)
    for r in results:
        refused = r.report["step1"]
        assert refused["failed"] and "overwrite=False" in refused["message"], refused
        for step in (0, 2, 3):
            seen = r.report[f"step{step}"]
            assert not seen["failed"] and seen["wrong"] == [], f"rank {r.rank}, {step}: {seen}"


@two_ranks_both_apis
def test_an_in_place_op_through_a_dtensor_after_the_call_is_copied_first_and_commits(
    tmp_path: Path, mode: str
) -> None:
    """Copy-on-write on two ranks: ``dt[3].fill_`` right after the call (a DTensor op, whose
    local writes the mode sees through the DTensor) copies the shard first."""
    results = launch(f"dtensor-cow-{mode}", tmp_path, timeout=140, script=WORKERS)
    check_all_ok(results)
    for r in results:
        seen, where = r.report, f"rank {r.rank}"
        assert not seen["failed"] and seen["committed"], f"{where}: {seen}"
        assert seen["holds_the_call_state"], f"{where}: {seen}"


@two_ranks_both_apis
def test_an_in_place_op_through_a_dtensor_after_the_call_fails_the_save(
    tmp_path: Path, mode: str
) -> None:
    """``dt[3].fill_(7.0)`` on a DTensor moves the DTensor's own version counter and leaves its
    local tensor's alone, which was the one checked: the save committed the later value in 7-9
    of 10 saves (a user sweep). Both counters are checked now."""
    results = launch(f"dtensor-inplace-{mode}", tmp_path, timeout=140, script=WORKERS)
    check_all_ok(results)
    for r in results:
        seen, where = r.report, f"rank {r.rank}"
        assert seen["failed"] and not seen["committed"], f"{where}: {seen}"
        assert "SnapshotMutationError" in seen["failure_types"], f"{where}: {seen}"
        assert "version" in seen["message"], f"{where}: {seen}"


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_an_in_place_op_through_a_dtensor_fails_a_process_executor_save(tmp_path: Path) -> None:
    """The PROCESS executor's staging thread checked the local tensor's counter only, so a
    DTensor's in-place op before its copy was committed; it watches the DTensor's counter too.
    Here rank 1 alone changes its shard: its staging failure travels to its daemon, which raises
    it in the local planning step, so both ranks' saves fail naming rank 1 and the change.
    Raised in rank 1's process alone, rank 0's daemon waited in DCP's collectives for rank 1's
    and failed naming no cause once rank 1's process ended (or at the process group's
    timeout, in a job whose rank 1 went on training)."""
    results = launch("dtensor-inplace-process", tmp_path, timeout=140, script=WORKERS)
    check_all_ok(results)
    for r in results:
        seen, where = r.report, f"rank {r.rank}"
        assert seen["failed"] and not seen["committed"], f"{where}: {seen}"
        assert seen["failure_types"] == ["SnapshotMutationError"], f"{where}: {seen}"
        assert "rank 1: tensor 'dt'" in seen["message"], f"{where}: {seen}"
