"""The storage helper (open for write, fsync, remove on failure) on every kind of location, and
a reader that refuses uncommitted or damaged checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_same_state, failure_of, load_like

from dcp_datastates import (
    CheckpointNotCommittedError,
    ChecksumMismatchError,
    DataStatesReader,
)
from dcp_datastates.format import MANIFEST_NAME, METADATA_NAME
from dcp_datastates.storage.base import FsspecStorage, LocalStorage, storage_for

LOCATIONS = ("local path", "file://", "memory://")


@pytest.fixture(params=LOCATIONS)
def location(request: pytest.FixtureRequest, tmp_path: Path, memory_url: str) -> str:
    return {
        "local path": str(tmp_path / "ckpt"),
        "file://": f"file://{tmp_path / 'ckpt'}",
        "memory://": memory_url,
    }[request.param]


def read_back(location: str, name: str) -> bytes | None:
    """``name``'s bytes as an independent fsspec client sees them; ``None`` if it is absent."""
    fs, root = fsspec.core.url_to_fs(location)
    path = f"{root.rstrip('/')}/{name}"
    return fs.cat_file(path) if fs.exists(path) else None


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """File descriptors passed to ``os.fsync`` during the test (the real fsync still runs)."""
    calls: list[int] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return calls


def test_local_paths_and_file_urls_take_the_local_fast_path(
    tmp_path: Path, memory_url: str
) -> None:
    assert isinstance(storage_for(tmp_path), LocalStorage)
    assert storage_for(f"file://{tmp_path}").root == str(tmp_path)
    assert isinstance(storage_for(memory_url), FsspecStorage)


def test_open_write_keeps_the_file_when_the_block_succeeds(location: str) -> None:
    storage = storage_for(location)
    storage.makedirs()
    with storage.open_write("data.bin", sync=True) as f:
        f.write(b"hello ")
        f.write(b"world")

    assert read_back(location, "data.bin") == b"hello world"
    assert storage.exists("data.bin")


def test_open_write_removes_the_file_when_the_block_fails(location: str) -> None:
    storage = storage_for(location)
    storage.makedirs()
    with (
        pytest.raises(RuntimeError, match="disk on fire"),
        storage.open_write("data.bin", sync=True) as f,
    ):
        f.write(b"half a record")
        raise RuntimeError("disk on fire")

    assert read_back(location, "data.bin") is None
    assert not storage.exists("data.bin")


@pytest.mark.parametrize("sync", [True, False])
def test_open_write_fsyncs_a_local_file_once_only_when_asked(
    tmp_path: Path, fsyncs: list[int], sync: bool
) -> None:
    storage = storage_for(tmp_path)
    with storage.open_write("data.bin", sync=sync) as f:
        for _ in range(3):
            f.write(b"x" * 1000)

    assert len(fsyncs) == (1 if sync else 0)
    assert (tmp_path / "data.bin").stat().st_size == 3000


def test_put_atomic_replaces_the_whole_file_and_leaves_no_temporary(location: str) -> None:
    storage = storage_for(location)
    storage.makedirs()
    storage.put_atomic("record", b"old", sync=True)
    storage.put_atomic("record", b"new contents", sync=True)

    assert read_back(location, "record") == b"new contents"
    assert read_back(location, "record.tmp") is None


@pytest.mark.parametrize("buffers", [[5000], [1200, 0, 2300, 1500]], ids=["one", "several"])
@pytest.mark.parametrize("cap", [None, 700], ids=["whole", "short reads"])
def test_a_local_ranged_read_fills_its_buffers_whatever_each_call_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffers: list[int], cap: int | None
) -> None:
    """``read_into`` fills every buffer from the offset, returning fewer bytes only at the end of
    the file, also where the kernel returns less than asked (a signal, a network file system):
    ``cap`` bytes at most per ``preadv``."""
    data = os.urandom(9000)
    (tmp_path / "f").write_bytes(data)
    if cap is not None:
        real_preadv = os.preadv

        def short_preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
            first = memoryview(bufs[0]).cast("B")
            return real_preadv(fd, [first[:cap]], offset)

        monkeypatch.setattr(os, "preadv", short_preadv)
    ranged = LocalStorage(str(tmp_path)).open_ranged("f")
    try:
        views = [memoryview(bytearray(n)) for n in buffers]
        assert ranged.read_into(1000, views) == sum(buffers)
        assert b"".join(bytes(v) for v in views) == data[1000 : 1000 + sum(buffers)]
        tail = [memoryview(bytearray(n)) for n in buffers]
        want = len(data) - 6000
        assert ranged.read_into(6000, tail) == want  # past the end: what the file holds
        assert b"".join(bytes(v) for v in tail)[:want] == data[6000:]
    finally:
        ranged.close()


def test_a_checkpoint_round_trips_through_every_location(location: str, make_writer) -> None:
    state = {"w": torch.randn(32, 8), "nested": {"b": torch.arange(5)}, "step": 9}
    writer = make_writer(location)
    dcp.save(state, storage_writer=writer, no_dist=True)

    assert read_back(location, METADATA_NAME) is not None
    assert writer.last_stats.bytes_written > 32 * 8 * 4
    target = load_like(location, state, "datastates")
    assert_same_state(state, target)


def test_a_checkpoint_without_metadata_is_refused_as_not_committed(
    tmp_path: Path, make_writer
) -> None:
    state = {"w": torch.randn(16)}
    dcp.save(state, storage_writer=make_writer(tmp_path), no_dist=True)
    (tmp_path / METADATA_NAME).unlink()  # as if the save died before its commit

    with pytest.raises(CheckpointNotCommittedError, match="not a committed checkpoint"):
        DataStatesReader(tmp_path).read_metadata()
    # dcp.load catches reader errors and re-raises its own, but our message survives in it.
    with pytest.raises(BaseException, match="not a committed checkpoint"):
        load_like(tmp_path, state, "datastates")


def test_a_path_with_no_checkpoint_is_named_as_such_not_as_an_unfinished_save(
    tmp_path: Path,
) -> None:
    """A typo in the path is not a save that died (a user sweep: it said "did not finish")."""
    for path in (tmp_path / "no such dir", tmp_path):
        with pytest.raises(CheckpointNotCommittedError, match="no checkpoint at") as raised:
            DataStatesReader(path).read_metadata()
        assert "check the path" in str(raised.value)
        assert "did not finish" not in str(raised.value)
        with pytest.raises(BaseException, match="no checkpoint at") as raised:
            load_like(path, {"w": torch.zeros(2)}, "datastates")
        assert "did not finish" not in str(raised.value)


def test_the_reader_on_a_checkpointer_root_names_the_step_to_load(tmp_path: Path) -> None:
    """A Checkpointer's root has no ``.metadata`` of its own: the reader said the save that
    wrote it did not finish, where the CLI named the step (a user sweep); both name it now."""
    from dcp_datastates import Checkpointer
    from dcp_datastates.checkpointers.checkpointer import step_dir_name

    with Checkpointer(tmp_path, every_steps=1, preemption_signals=()) as ck:
        for step in (1, 2):
            ck.maybe_save(step, {"w": torch.full((4,), float(step))})
    step_2 = tmp_path / step_dir_name(2)
    expected = f"latest names step 2: load {step_2}"
    with pytest.raises(CheckpointNotCommittedError, match="holds checkpoint directories") as raised:
        DataStatesReader(tmp_path).read_metadata()
    assert expected in str(raised.value) and "did not finish" not in str(raised.value)
    with pytest.raises(BaseException) as raised:  # dcp.load asks for __0.metadata too
        load_like(tmp_path, {"w": torch.zeros(4)}, "datastates")
    assert expected in str(raised.value) and "did not finish" not in str(raised.value)
    # Without latest (a tier's layout, or latest lost), the newest committed step is named.
    (tmp_path / "latest").unlink()
    (tmp_path / step_dir_name(3)).mkdir()  # a save in flight: not committed, not named
    with pytest.raises(CheckpointNotCommittedError) as raised:
        DataStatesReader(tmp_path).read_metadata()
    assert f"3 step directories, the newest committed {step_2}: load that" in str(raised.value)


def test_dcp_load_of_a_damaged_metadata_says_why_and_not_that_the_save_did_not_finish(
    tmp_path: Path, make_writer
) -> None:
    """``dcp.load`` falls back to ``__{rank}.metadata`` when reading ``.metadata`` failed, and
    reports both errors: the second one must not blame an unfinished save (a user sweep)."""
    state = {"w": torch.randn(16)}
    dcp.save(state, storage_writer=make_writer(tmp_path), no_dist=True)
    blob = bytearray((tmp_path / METADATA_NAME).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (tmp_path / METADATA_NAME).write_bytes(bytes(blob))
    with pytest.raises(BaseException) as raised:
        load_like(tmp_path, state, "datastates")
    message = str(raised.value)
    assert "crc32c" in message and "the checkpoint is damaged" in message, message
    assert "committed with collectives" in message, message
    assert "did not finish" not in message, message


def test_a_flipped_data_byte_fails_the_load_naming_the_item(tmp_path: Path, make_writer) -> None:
    state = {"intact": torch.randn(64), "damaged": torch.randn(64)}
    dcp.save(state, storage_writer=make_writer(tmp_path), no_dist=True)
    record = json.loads((tmp_path / MANIFEST_NAME).read_text())["items"]["damaged@0"]
    data_file = tmp_path / record["relative_path"]
    blob = bytearray(data_file.read_bytes())
    blob[record["data_offset"] + 5] ^= 0x40
    data_file.write_bytes(bytes(blob))

    with pytest.raises(BaseException) as raised:
        load_like(tmp_path, state, "datastates")

    mismatch = failure_of(raised.value, ChecksumMismatchError)
    assert mismatch is not None, raised.value
    assert "'damaged'" in str(mismatch)
    assert record["relative_path"] in str(mismatch)


def test_a_flipped_byte_loads_silently_when_verification_is_off(
    tmp_path: Path, make_writer
) -> None:
    state = {"w": torch.zeros(8, dtype=torch.uint8)}
    dcp.save(state, storage_writer=make_writer(tmp_path), no_dist=True)
    record = json.loads((tmp_path / MANIFEST_NAME).read_text())["items"]["w@0"]
    data_file = tmp_path / record["relative_path"]
    blob = bytearray(data_file.read_bytes())
    blob[record["data_offset"] + 2] = 7
    data_file.write_bytes(bytes(blob))

    target = {"w": torch.zeros(8, dtype=torch.uint8)}
    dcp.load(target, storage_reader=DataStatesReader(tmp_path, verify=False), no_dist=True)

    assert target["w"].tolist() == [0, 0, 7, 0, 0, 0, 0, 0]


def test_removing_a_file_that_is_a_directory_names_it(tmp_path: Path) -> None:
    """A ``.metadata`` directory in the checkpoint made a save fail with a bare
    "[Errno 21] Is a directory" (a user sweep)."""
    from dcp_datastates.storage.base import LocalStorage

    (tmp_path / ".metadata").mkdir()
    with pytest.raises(IsADirectoryError, match=r"\.metadata is a directory where a checkpoint"):
        LocalStorage(str(tmp_path)).remove(".metadata")
