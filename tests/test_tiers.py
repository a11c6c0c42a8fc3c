"""Tiered checkpoints: a local directory at local speed, mirrored to S3 (moto on loopback)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import _s3_server
import _tiers_workers
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_workers import check_all_ok, launch
from _s3_server import Fault, S3Env

from dcp_datastates import CheckpointLoadError, DataStatesReader
from dcp_datastates.checkpointers.tiers import MirrorError, Tier, TieredCheckpointer
from dcp_datastates.format import METADATA_NAME

moto_server, s3, s3_proxy = _s3_server.moto_server, _s3_server.s3, _s3_server.s3_proxy

TIMEOUT = 30.0
MiB = 1 << 20


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((256, 1024), float(step)), "step": torch.tensor(step)}


def _tiers(tmp_path: Path, env: S3Env, **kw: Any) -> TieredCheckpointer:
    return TieredCheckpointer(
        Tier(url=str(tmp_path / "local"), keep=kw.pop("keep_local", 2)),
        Tier(url=env.url("run"), keep=kw.pop("keep_remote", None), storage_options=env.options()),
        host_pool_bytes=4 * MiB,
        **kw,
    )


def _local_steps(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "local").iterdir())


def test_each_step_commits_locally_then_remotely_and_loads_from_either(
    tmp_path: Path, s3: S3Env
) -> None:
    tiers = _tiers(tmp_path, s3, keep_local=2)
    try:
        for step in (1, 2, 3):
            handle = tiers.save(_state(step), step)
            handle.local.result(TIMEOUT)
            assert handle.remote.result(TIMEOUT) == s3.url("run", f"step-{step}")
            assert handle.local_s is not None and handle.remote_s is not None
            assert handle.local_s <= handle.remote_s
        tiers.wait()
        assert tiers.committed_steps(tiers.remote) == [1, 2, 3]
        assert _local_steps(tmp_path) == ["step-2", "step-3"]  # keep=2 locally
        assert s3.open_uploads() == []
        out = _state(0)
        assert tiers.load(out, step=1) == 1  # only the remote holds it
        assert torch.equal(out["w"], _state(1)["w"])
    finally:
        tiers.close()


def test_upload_holds_neither_the_training_thread_nor_the_pool(
    tmp_path: Path, s3_proxy: S3Env
) -> None:
    """The first upload is held at the server; two more saves still commit locally meanwhile."""
    release = threading.Event()
    s3_proxy.proxy.faults.append(
        Fault("PUT", r"run/step-1/", action=lambda: release.wait(TIMEOUT), times=1)
    )
    tiers = _tiers(tmp_path, s3_proxy, keep_local=3)
    try:
        first = tiers.save(_state(1), 1)
        first.local.result(TIMEOUT)
        later = [tiers.save(_state(s), s) for s in (2, 3)]
        for handle in later:
            handle.local.result(TIMEOUT)  # local commits while step 1 is still uploading
        assert not first.remote.done()
        release.set()
        assert [h.remote.result(TIMEOUT) for h in [first, *later]] == [
            s3_proxy.url("run", f"step-{s}") for s in (1, 2, 3)
        ]
    finally:
        release.set()
        tiers.close()


def test_failed_upload_is_retried_reported_and_its_local_copy_kept(
    tmp_path: Path, s3_proxy: S3Env
) -> None:
    denied = Fault("PUT", r"run/step-1/\.metadata", status=403, code="AccessDenied", times=None)
    s3_proxy.proxy.faults.append(denied)
    tiers = _tiers(tmp_path, s3_proxy, keep_local=1, upload_attempts=2)
    try:
        handle = tiers.save(_state(1), 1)
        with pytest.raises(MirrorError, match="step 1.*failed 2 times") as info:
            handle.remote.result(TIMEOUT)
        assert "AccessDenied" in str(info.value) and denied.hits == 2
        assert isinstance(tiers.failed_uploads[1], MirrorError)
        second = tiers.save(_state(2), 2)
        second.remote.result(TIMEOUT)
        tiers.wait()
        # keep=1 locally, but step 1 exists nowhere else: it stays until it is uploaded.
        assert _local_steps(tmp_path) == ["step-1", "step-2"]
        s3_proxy.proxy.faults.clear()
        assert tiers.mirror(1) == s3_proxy.url("run", "step-1")
        assert tiers.failed_uploads == {}
        assert tiers.retain(tiers.local) == [1]
        assert _local_steps(tmp_path) == ["step-2"]
    finally:
        tiers.close()


def test_retention_spares_the_newest_and_checkpoints_being_read(tmp_path: Path, s3: S3Env) -> None:
    tiers = _tiers(tmp_path, s3, keep_local=1, keep_remote=1)
    try:
        tiers.save(_state(1), 1).remote.result(TIMEOUT)
        tiers.wait()
        with tiers.reading(tiers.remote, 1):
            tiers.save(_state(2), 2).remote.result(TIMEOUT)
            tiers.wait()
            assert tiers.committed_steps(tiers.remote) == [1, 2]  # step 1 is being read
        assert tiers.retain(tiers.remote) == [1]
        assert tiers.retain(tiers.remote) == []  # the newest is never deleted
        assert tiers.committed_steps(tiers.remote) == [2]
        assert not any(k.startswith("run/step-1/") for k in s3.list_keys())
    finally:
        tiers.close()


def test_restart_loads_the_newest_step_from_the_fastest_tier_holding_it(
    tmp_path: Path, s3: S3Env
) -> None:
    tiers = _tiers(tmp_path, s3, keep_local=5)
    try:
        for step in (1, 2, 3):
            tiers.save(_state(step), step).remote.result(TIMEOUT)
    finally:
        tiers.close()
    # A step that committed locally only (its upload never ran) is still the newest.
    shutil.copytree(tmp_path / "local" / "step-3", tmp_path / "local" / "step-4")
    (tmp_path / "local" / "step-4" / METADATA_NAME).unlink()  # ...but it is not committed
    restarted = _tiers(tmp_path, s3, keep_local=5)
    try:
        step, tier = restarted.latest()
        assert (step, tier) == (3, restarted.local)
        shutil.rmtree(tmp_path / "local" / "step-3")  # lost locally: the remote still has it
        step, tier = restarted.latest()
        assert (step, tier) == (3, restarted.remote)
        out = _state(0)
        assert restarted.load(out) == 3
        assert torch.equal(out["w"], _state(3)["w"]) and int(out["step"]) == 3
    finally:
        restarted.close()


def test_a_damaged_step_fails_the_load_with_an_exception_naming_the_step_and_tier(
    tmp_path: Path, s3: S3Env
) -> None:
    """DCP reports a failed load as ``CheckpointException``, a ``BaseException`` that
    ``except Exception`` misses: the tiered load raises ``CheckpointLoadError`` instead."""
    tiers = _tiers(tmp_path, s3, keep_local=5)
    try:
        tiers.save(_state(1), 1).remote.result(TIMEOUT)
        data = next((tmp_path / "local" / "step-1").glob("*.distcp"))
        raw = bytearray(data.read_bytes())
        raw[-64] ^= 0xFF  # inside the last record's bytes: its checksum no longer holds
        data.write_bytes(bytes(raw))
        with pytest.raises(CheckpointLoadError) as raised:
            tiers.load(_state(0), step=1)
        assert "step 1" in str(raised.value) and "step-1" in str(raised.value)
        assert isinstance(raised.value.__cause__, dcp.CheckpointException)
    finally:
        tiers.close()


def test_tier_refuses_a_bad_keep() -> None:
    with pytest.raises(ValueError, match="keep=0"):
        Tier(url="/tmp/x", keep=0)


def test_close_right_after_save_still_uploads_and_resolves_remote(
    tmp_path: Path, s3: S3Env
) -> None:
    tiers = _tiers(tmp_path, s3)
    handle = tiers.save(_state(1), 1)
    tiers.close()  # waits for the local commit, then for the upload it queued
    assert handle.remote.done() and handle.remote.result() == s3.url("run", "step-1")


def test_retention_after_a_restart_deletes_local_steps_an_earlier_process_uploaded(
    tmp_path: Path, s3: S3Env
) -> None:
    """The record of what was uploaded lived in the process: after a restart no local step
    was ever deleted again (a user sweep: keep_local=2 held step-4, step-5, step-7, step-8).
    A step whose upload failed before the restart stays, and ``local_only`` names it."""
    first = _tiers(tmp_path, s3, keep_local=2)
    try:
        for step in (1, 2, 3):
            first.save(_state(step), step).remote.result(TIMEOUT)
        first.wait()
    finally:
        first.close()
    shutil.copytree(tmp_path / "local" / "step-3", tmp_path / "local" / "step-0")  # never uploaded
    restarted = _tiers(tmp_path, s3, keep_local=2)
    try:
        assert restarted.local_only() == [0]
        for step in (4, 5):
            restarted.save(_state(step), step).remote.result(TIMEOUT)
        restarted.wait()
        assert _local_steps(tmp_path) == ["step-0", "step-4", "step-5"]
    finally:
        restarted.close()


def test_a_step_saved_again_whose_upload_fails_keeps_its_local_copy(
    tmp_path: Path, s3_proxy: S3Env
) -> None:
    """A rollback saves step 2 again; that save's upload fails. Retention deleted its local
    copy, the only copy of that save, because step 2's first upload had counted it as uploaded
    (a user sweep: ``load(step=2)`` then found it in no tier)."""
    tiers = _tiers(tmp_path, s3_proxy, keep_local=2, upload_attempts=1)
    try:
        for step in (1, 2, 3):
            tiers.save(_state(step), step).remote.result(TIMEOUT)
        denied = Fault("PUT", r"run/step-2/", status=403, code="AccessDenied", times=None)
        s3_proxy.proxy.faults.append(denied)
        again = {"w": torch.full((256, 1024), 22.0), "step": torch.tensor(2)}
        with pytest.raises(MirrorError, match="step 2"):
            tiers.save(again, 2).remote.result(TIMEOUT)
        tiers.save(_state(4), 4).remote.result(TIMEOUT)
        tiers.wait()
        assert _local_steps(tmp_path) == ["step-2", "step-3", "step-4"]
        assert tiers.local_only() == [2] and list(tiers.failed_uploads) == [2]
        out = _state(0)
        assert tiers.load(out, step=2) == 2
        assert torch.equal(out["w"], again["w"])
        s3_proxy.proxy.faults.clear()
        assert tiers.mirror(2) == s3_proxy.url("run", "step-2")
        assert tiers.local_only() == [] and tiers.retain(tiers.local) == [2]
        out = _state(0)
        assert tiers.load(out, step=2) == 2  # from the remote now: the rolled-back save
        assert torch.equal(out["w"], again["w"])
    finally:
        tiers.close()


def test_saving_a_step_again_while_it_uploads_never_commits_a_mix_of_both(
    tmp_path: Path, s3_proxy: S3Env
) -> None:
    """The upload read the local files while the second save of the step overwrote them: the
    remote committed a mix of both saves, and ``remote`` reported success (a user sweep). The
    first upload now finds the local checkpoint replaced and leaves the remote uncommitted;
    the second save's upload commits it."""
    uploading, release = threading.Event(), threading.Event()

    def hold() -> None:  # the upload has started reading the local files
        uploading.set()
        release.wait(TIMEOUT)

    s3_proxy.proxy.faults.append(Fault("PUT", r"run/step-5/__0_0\.distcp", action=hold, times=1))
    tiers = _tiers(tmp_path, s3_proxy, keep_local=3)
    try:
        first = tiers.save(_state(5), 5)
        first.local.result(TIMEOUT)
        assert uploading.wait(TIMEOUT)
        second = tiers.save({"w": torch.full((256, 1024), 55.0), "step": torch.tensor(5)}, 5)
        second.local.result(TIMEOUT)
        release.set()
        with pytest.raises(MirrorError, match="saved again"):
            first.remote.result(TIMEOUT)
        second.remote.result(TIMEOUT)
        out = _state(0)
        with tiers.reading(tiers.remote, 5) as path:
            reader = DataStatesReader(path, storage_options=s3_proxy.options())
            dcp.load(out, storage_reader=reader)
        assert torch.equal(out["w"], torch.full((256, 1024), 55.0))
    finally:
        release.set()
        tiers.close()


def test_a_restart_with_the_remote_unreachable_loads_the_newest_local_step(
    tmp_path: Path, s3_proxy: S3Env
) -> None:
    """Listing the remote failed, and with it ``latest()`` and ``load()``, though the local
    tier held the newest committed step (a user sweep)."""
    tiers = _tiers(tmp_path, s3_proxy, keep_local=3)
    try:
        for step in (1, 2):
            tiers.save(_state(step), step).remote.result(TIMEOUT)
    finally:
        tiers.close()
    s3_proxy.proxy.faults.append(
        Fault("GET", r"list-type=2", status=403, code="AccessDenied", times=None)
    )
    restarted = _tiers(tmp_path, s3_proxy, keep_local=3)
    try:
        assert restarted.latest() == (2, restarted.local)
        out = _state(0)
        assert restarted.load(out) == 2 and torch.equal(out["w"], _state(2)["w"])
        shutil.rmtree(tmp_path / "local")
        with pytest.raises(Exception, match="AccessDenied"):  # no tier can be listed
            restarted.latest()
    finally:
        restarted.close()


def test_two_ranks_with_a_collective_each_step_save_and_only_rank_0_uploads(
    tmp_path: Path, s3: S3Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks all-reducing each step and saving each step: they hung at the second save
    (the save thread's collectives on the training's group), and every rank uploaded and ran
    retention, rank 0 deleting local files rank 1 was uploading (a user sweep)."""
    monkeypatch.setenv("TIERS_ENDPOINT", s3.endpoint)
    monkeypatch.setenv("TIERS_REMOTE", s3.url("run"))
    results = launch("train", tmp_path, world_size=2, timeout=120, script=_tiers_workers.__file__)
    check_all_ok(results)
    steps = list(range(1, _tiers_workers.STEPS + 1))
    assert results[0].report["remote"] == [s3.url("run", f"step-{s}") for s in steps]
    assert results[1].report["remote"] == [None] * len(steps)  # rank 0 uploads for both
    assert results[0].report["held"] == {str(tmp_path / "local"): steps[-2:], s3.url("run"): steps}
    assert "rank 0 of the process group" in results[1].report["held"]["retain"]
    assert results[0].report["missing"] == "step 99 is committed in no tier"
    assert results[1].report["missing"].startswith("rank 0 found nothing to load: step 99")
    for r in results:
        assert "failed" not in r.output and "Traceback" not in r.output, r.output[-3000:]
    assert s3.open_uploads() == []
    out = {"rank0": torch.zeros(64, 256), "rank1": torch.zeros(64, 256), "step": 0}
    reader = DataStatesReader(s3.url("run", "step-6"), storage_options=s3.options())
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert out["step"] == 6
    for rank in (0, 1):
        assert torch.equal(out[f"rank{rank}"], _tiers_workers.rank_values(rank, 6))
