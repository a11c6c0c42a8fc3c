"""Safe loads refuse hostile checkpoints; the command line inspects and verifies checkpoints."""

from __future__ import annotations

import dataclasses
import fcntl
import io
import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_same_state, blank_like, failure_of, write_commit_record
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_datastates import DataStatesReader
from dcp_datastates.errors import ChecksumMismatchError, UnsafeCheckpointError
from dcp_datastates.format import MANIFEST_NAME, METADATA_NAME


@dataclasses.dataclass
class RunInfo:
    name: str


class Pwn:
    """Unpickling this runs a shell command: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"echo pwned > {self.marker}",))


def _state() -> dict[str, Any]:
    return {
        "w": torch.arange(12.0).reshape(3, 4),
        "half": torch.ones(5, dtype=torch.bfloat16),
        "nested": {"ids": torch.arange(4), "step": 7},
    }


@pytest.fixture
def ckpt(tmp_path: Path, make_writer: Any) -> Path:
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=make_writer(path), no_dist=True)
    return path


def _rewrite_metadata(path: Path, edit: Any) -> None:
    metadata = pickle.loads((path / METADATA_NAME).read_bytes())
    edit(metadata)
    write_commit_record(path, pickle.dumps(metadata))


def _move_first_record(path: Path, relative_path: str) -> None:
    def edit(metadata: Any) -> None:
        index = next(iter(metadata.storage_data))
        info = metadata.storage_data[index]
        metadata.storage_data[index] = dataclasses.replace(info, relative_path=relative_path)

    _rewrite_metadata(path, edit)


def _load(path: Path, **reader_options: Any) -> dict[str, Any]:
    target = blank_like(_state())
    dcp.load(target, storage_reader=DataStatesReader(path, **reader_options), no_dist=True)
    return target


def test_hostile_metadata_is_refused_without_running_it(ckpt: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    write_commit_record(ckpt, pickle.dumps(Pwn(marker)))
    with pytest.raises(UnsafeCheckpointError) as raised:
        DataStatesReader(ckpt).read_metadata()
    assert "system" in str(raised.value) and "trusted=True" in str(raised.value)
    assert not marker.exists()


def test_hostile_object_record_is_refused_without_running_it(
    tmp_path: Path, make_writer: Any
) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "ckpt"
    dcp.save({"hook": Pwn(marker)}, storage_writer=make_writer(path), no_dist=True)
    assert not marker.exists()
    with pytest.raises(BaseException) as raised:
        dcp.load({"hook": None}, storage_reader=DataStatesReader(path), no_dist=True)
    refused = failure_of(raised.value, UnsafeCheckpointError)
    assert refused is not None and "'hook'" in str(refused)
    assert not marker.exists()


@pytest.mark.parametrize("relative_path", ["../elsewhere/__0_0.distcp", "/etc/passwd"])
def test_file_outside_the_checkpoint_is_refused(ckpt: Path, relative_path: str) -> None:
    _move_first_record(ckpt, relative_path)
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        DataStatesReader(ckpt).read_metadata()


def test_symlink_out_of_the_checkpoint_is_refused(ckpt: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((ckpt / "__0_0.distcp").read_bytes())
    (ckpt / "link.distcp").symlink_to(outside)
    _move_first_record(ckpt, "link.distcp")
    with pytest.raises(UnsafeCheckpointError, match="resolves to"):
        DataStatesReader(ckpt).read_metadata()


def test_record_past_the_end_of_its_file_is_refused(ckpt: Path) -> None:
    data = ckpt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(ChecksumMismatchError, match="truncated"):
        DataStatesReader(ckpt).read_metadata()


def test_a_damaged_metadata_file_fails_naming_it_whatever_the_damage(
    ckpt: Path, tmp_path: Path
) -> None:
    """One flipped byte anywhere in ``.metadata``: refused by its checksum in the manifest
    before it is unpickled (a damaged pickle raised UnicodeDecodeError, UnpicklingError,
    AttributeError naming nothing, and a flip that made a memo index of ~10^9 allocated
    gigabytes for a minute). A stock checkpoint's (no manifest) fails with our error too."""
    original = (ckpt / METADATA_NAME).read_bytes()
    for at in range(len(original)):
        damaged = bytearray(original)
        damaged[at] ^= 0x5A
        (ckpt / METADATA_NAME).write_bytes(bytes(damaged))
        with pytest.raises(ChecksumMismatchError, match=r"\.metadata has crc32c"):
            DataStatesReader(ckpt).read_metadata()
    (ckpt / METADATA_NAME).write_bytes(original)
    assert DataStatesReader(ckpt).read_metadata().storage_data

    stock = tmp_path / "stock"
    dcp.save(_state(), storage_writer=FileSystemWriter(stock), no_dist=True)
    whole = (stock / METADATA_NAME).read_bytes()
    (stock / METADATA_NAME).write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ChecksumMismatchError, match=r"\.metadata cannot be read"):
        DataStatesReader(stock).read_metadata()


def test_safe_load_reads_our_checkpoints_and_stock_ones(ckpt: Path, tmp_path: Path) -> None:
    assert_same_state(_state(), _load(ckpt))
    stock = tmp_path / "stock"
    dcp.save(_state(), checkpoint_id=str(stock), no_dist=True)
    assert_same_state(_state(), _load(stock))


def test_trusted_loads_what_safe_mode_refuses(tmp_path: Path, make_writer: Any) -> None:
    path = tmp_path / "ckpt"
    state = {**_state(), "run": RunInfo("run-7")}
    dcp.save(state, storage_writer=make_writer(path), no_dist=True)
    with pytest.raises(BaseException) as raised:
        dcp.load(blank_like(state), storage_reader=DataStatesReader(path), no_dist=True)
    refused = failure_of(raised.value, UnsafeCheckpointError)
    assert refused is not None and "RunInfo" in str(refused)
    target = blank_like(state)
    dcp.load(target, storage_reader=DataStatesReader(path, trusted=True), no_dist=True)
    assert_same_state(state, target)


class _Allocates:
    """Unpickles as ``bytes(10**6)``: a call of ``bytes`` with an argument."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (bytes, (10**6,))


def test_a_safe_load_reads_empty_bytes_and_refuses_bytes_called_with_a_size(
    tmp_path: Path, make_writer: Any
) -> None:
    """An empty ``BytesIO`` or ``b""`` pickles as a call of ``bytes()``, which the safe load
    refused (stock loads it; a user sweep); ``bytes`` called with a size stays refused."""
    path = tmp_path / "ckpt"
    state = {"w": torch.arange(4.0), "empty": io.BytesIO(b""), "tok": b"", "toks": [b"", b"a"]}
    dcp.save(state, storage_writer=make_writer(path), no_dist=True)
    target: dict[str, Any] = {"w": torch.zeros(4), "empty": io.BytesIO(), "tok": None}
    target["toks"] = [None, None]
    dcp.load(target, storage_reader=DataStatesReader(path), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and target["empty"].getvalue() == b""
    assert (target["tok"], target["toks"]) == (b"", [b"", b"a"])

    evil = tmp_path / "evil"
    dcp.save({"x": _Allocates()}, storage_writer=make_writer(evil), no_dist=True)
    with pytest.raises(BaseException) as raised:
        dcp.load({"x": None}, storage_reader=DataStatesReader(evil), no_dist=True)
    refused = failure_of(raised.value, UnsafeCheckpointError)
    assert refused is not None and "only bytes() is allowed" in str(refused)


def _cli(*commands: tuple[Any, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Run ``python -m dcp_datastates`` once per command, all at once (each start imports
    torch, which takes longer than the command)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dcp_datastates", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_cli_inspect_lists_items_files_and_version(ckpt: Path) -> None:
    text, as_json = _cli(("inspect", ckpt), ("inspect", ckpt, "--json"))
    assert text.returncode == 0, text.stderr
    assert "committed" in text.stdout and "bfloat16[5]" in text.stdout
    assert "rank 0: __0_0.distcp" in text.stdout

    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["committed"] is True and report["format_version"] == 1
    items = {item["fqn"]: item for item in report["items"]}
    assert items["w"]["dtype"] == "float32" and items["w"]["shape"] == [3, 4]
    assert items["nested.step"]["kind"] == "object"
    assert set(report["files"]["0"]) == {item["file"] for item in report["items"]}


def _into_closed_pipes(*runs: tuple[tuple[Any, ...], int]) -> list[tuple[int, str, bytes]]:
    """Run ``python -m dcp_datastates ARGS`` with stdout into a pipe whose reader reads ``n``
    bytes and goes away (``| head -c n``; 0: ``| true``), all at once. The pipe is shrunk to
    its smallest, so that a listing longer than it plus ``n`` must meet the closed end; no
    timing decides it. Returns (exit code, stderr, bytes read) per run."""
    started = []
    for args, n in runs:
        read_end, write_end = os.pipe()
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
        if not n:  # gone before the first write
            os.close(read_end)
        proc = subprocess.Popen(
            [sys.executable, "-m", "dcp_datastates", *map(str, args)],
            stdout=write_end,
            stderr=subprocess.PIPE,
        )
        os.close(write_end)
        started.append((proc, read_end, n))
    done = []
    for proc, read_end, n in started:
        head = b""
        if n:
            head = os.read(read_end, n)
            os.close(read_end)
        _, err = proc.communicate(timeout=60)
        done.append((proc.returncode, err.decode(), head))
    return done


def test_cli_stops_quietly_when_its_reader_goes_away(ckpt: Path, make_writer: Any) -> None:
    """``inspect CKPT | head`` said "cannot read CKPT: [Errno 32] Broken pipe; nothing was
    checked", exit 4 (a user sweep): a closed pipe is not an unreadable checkpoint. Every
    command stops quietly with 141 (128 + SIGPIPE, as ``cat`` or ``git log`` cut short)."""
    probe_r, probe_w = os.pipe()
    capacity = fcntl.fcntl(probe_w, fcntl.F_SETPIPE_SZ, 4096)  # what the runs' pipes get
    os.close(probe_r), os.close(probe_w)
    many = ckpt.parent / "many"
    # Each item's line is over 40 bytes: the listing is twice what the pipe holds.
    state = {f"layer_{i:05d}.weight": torch.ones(1) for i in range(capacity // 20)}
    dcp.save(state, storage_writer=make_writer(many), no_dist=True)
    runs = _into_closed_pipes(
        (("inspect", many), 64),
        (("inspect", ckpt), 0),
        (("inspect", ckpt, "--json"), 0),
        (("verify", ckpt, "--quiet"), 0),
        (("--help",), 0),
    )
    names = ("| head", "inspect", "--json", "verify", "--help")
    for (code, err, _), what in zip(runs, names, strict=True):
        assert code == 141 and err == "", f"{what}: exit {code}, stderr {err!r}"
    head = runs[0][2]  # the listing's start, as head shows it
    assert head and head == f"{many}: committed".encode()[: len(head)], head


def test_cli_verify_exit_codes_say_ok_damaged_or_not_committed(
    tmp_path: Path, make_writer: Any
) -> None:
    paths = {}
    for case in ("good", "flipped", "truncated", "uncommitted"):
        paths[case] = tmp_path / case
        dcp.save(_state(), storage_writer=make_writer(paths[case]), no_dist=True)
    record = json.loads((paths["flipped"] / MANIFEST_NAME).read_bytes())["items"]["w@0,0"]
    data = paths["flipped"] / record["relative_path"]
    blob = bytearray(data.read_bytes())
    blob[record["data_offset"] + 3] ^= 0x01
    data.write_bytes(bytes(blob))
    data = paths["truncated"] / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    (paths["uncommitted"] / METADATA_NAME).unlink()

    good, flipped, truncated, uncommitted, inspect_uncommitted, quiet = _cli(
        *(("verify", path) for path in paths.values()),
        ("inspect", paths["uncommitted"]),
        ("verify", paths["good"], "--quiet"),
    )
    assert good.returncode == 0, good.stdout + good.stderr
    assert "OK" in good.stdout
    # The progress bar goes to stderr and ends full; --quiet drops it, not the verdict.
    assert "verify: 100%" in good.stderr
    assert quiet.returncode == 0 and "OK" in quiet.stdout and "verify:" not in quiet.stderr
    assert flipped.returncode == 1
    assert "w@0,0" in flipped.stdout and "crc32c expected" in flipped.stdout
    assert record["relative_path"] in flipped.stdout
    assert truncated.returncode == 1 and "truncated" in truncated.stdout
    assert uncommitted.returncode == 2 and "NOT COMMITTED" in uncommitted.stdout
    assert inspect_uncommitted.returncode == 2


def test_cli_names_an_item_alike_in_inspect_and_verify(ckpt: Path) -> None:
    """``inspect`` printed ``w@[0, 0]`` where ``verify`` printed ``w@0,0``: both print the
    manifest's key, the name load errors use too, so one grep finds the item everywhere."""
    record = json.loads((ckpt / MANIFEST_NAME).read_bytes())["items"]["w@0,0"]
    data = ckpt / record["relative_path"]
    blob = bytearray(data.read_bytes())
    blob[record["data_offset"]] ^= 0x01
    data.write_bytes(bytes(blob))
    inspect, verify = _cli(("inspect", ckpt), ("verify", ckpt, "--quiet"))
    listed = {line.split()[0] for line in inspect.stdout.splitlines() if "tensor" in line}
    assert listed == {"w@0,0", "half@0", "nested.ids@0"}, inspect.stdout
    (failed,) = (line for line in verify.stdout.splitlines() if "crc32c expected" in line)
    assert failed.split()[1] == "w@0,0", verify.stdout


def test_cli_verify_checks_the_commit_record_against_the_manifest(ckpt: Path) -> None:
    blob = bytearray((ckpt / METADATA_NAME).read_bytes())
    blob[len(blob) // 2] ^= 0x01
    (ckpt / METADATA_NAME).write_bytes(bytes(blob))
    (verify,) = _cli(("verify", ckpt))
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "DAMAGED" in verify.stdout and METADATA_NAME in verify.stdout


def test_a_lost_manifest_is_refused_not_read_as_a_stock_checkpoint(
    ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy that took ``.metadata`` and the data files but not the manifest (a user sweep:
    the reader took it for stock DCP's and loaded it unverified, silently). Our ``.metadata``
    says a manifest was committed with it; a stock checkpoint's does not."""
    (ckpt / MANIFEST_NAME).unlink()
    with pytest.raises(ChecksumMismatchError, match=r"\.datastates\.json is missing") as raised:
        DataStatesReader(ckpt).read_metadata()
    assert "verify=False" in str(raised.value)
    with pytest.raises(BaseException) as raised:  # DCP's error quotes what read_metadata raised
        _load(ckpt)
    assert ".datastates.json is missing" in str(raised.value)
    with caplog.at_level(logging.WARNING, logger="dcp_datastates.load.reader"):
        assert_same_state(_state(), _load(ckpt, verify=False))
    assert any("checksums are lost" in r.getMessage() for r in caplog.records)
    stock_target = blank_like(_state())  # stock DCP still reads it (the mark is a save_id)
    dcp.load(stock_target, storage_reader=FileSystemReader(ckpt), no_dist=True)
    assert_same_state(_state(), stock_target)

    stock = tmp_path / "stock"
    dcp.save(_state(), storage_writer=FileSystemWriter(stock), no_dist=True)
    assert_same_state(_state(), _load(stock))  # no manifest was ever committed: no error
    lost, of_stock = _cli(("verify", ckpt), ("verify", stock))
    assert lost.returncode == 1 and "DAMAGED" in lost.stdout and MANIFEST_NAME in lost.stdout
    assert of_stock.returncode == 3 and "no checksums to verify" in of_stock.stdout


def test_stock_saved_over_ours_says_which_manifest_to_remove(ckpt: Path) -> None:
    """Stock ``FileSystemWriter`` saving over a checkpoint of ours leaves our manifest, which no
    longer matches the commit record: the refusal says that this may be why, and what to do."""
    newer = {**_state(), "w": torch.full((3, 4), -2.0)}
    dcp.save(newer, storage_writer=FileSystemWriter(ckpt, overwrite=True), no_dist=True)
    with pytest.raises(ChecksumMismatchError) as raised:
        DataStatesReader(ckpt).read_metadata()
    assert "stock FileSystemWriter" in str(raised.value)
    assert f"remove {ckpt / MANIFEST_NAME}" in str(raised.value)
    (verify,) = _cli(("verify", ckpt))
    assert verify.returncode == 1 and f"remove {MANIFEST_NAME}" in verify.stdout
    (ckpt / MANIFEST_NAME).unlink()  # as the message says: stock's checkpoint then loads
    assert_same_state(newer, _load(ckpt))


def test_cli_says_when_there_is_no_checkpoint_at_all(tmp_path: Path) -> None:
    """A path that does not exist, or a file, is not an unfinished save."""
    (tmp_path / "a_file").write_text("not a checkpoint")
    missing, a_file, inspect_missing = _cli(
        ("verify", tmp_path / "nope"),
        ("verify", tmp_path / "a_file"),
        ("inspect", tmp_path / "nope"),
    )
    assert missing.returncode == 2 and "NO CHECKPOINT" in missing.stdout
    assert "NOT COMMITTED" not in missing.stdout
    assert a_file.returncode == 2 and "is a file" in a_file.stderr
    assert "Traceback" not in a_file.stderr
    assert inspect_missing.returncode == 2 and "NO CHECKPOINT" in inspect_missing.stdout


def test_cli_on_a_checkpointer_root_names_the_step_to_run_it_on(tmp_path: Path) -> None:
    """A Checkpointer's root holds step directories and ``latest``: ``verify`` on it said the
    save that wrote it did not finish (a user sweep)."""
    from dcp_datastates.checkpointers.checkpointer import Checkpointer, step_dir_name

    with Checkpointer(tmp_path, every_steps=1, preemption_signals=()) as ck:
        for step in (1, 2):
            ck.maybe_save(step, {"w": torch.full((4,), float(step))})
    verify, inspect = _cli(("verify", tmp_path), ("inspect", tmp_path))
    for run in (verify, inspect):
        assert run.returncode == 2 and "NO CHECKPOINT here" in run.stdout, run.stdout
        assert f"latest names step 2: run this on {tmp_path / step_dir_name(2)}" in run.stdout
        assert "did not finish" not in run.stdout


def test_cli_rank_of_a_checkpoint_saved_with_collectives_says_to_drop_it(ckpt: Path) -> None:
    """``--rank R`` picks ``__R.metadata``; on a checkpoint with a global ``.metadata`` the
    answer "not committed, the save did not finish" sent a user sweep looking for a crash."""
    (verify,) = _cli(("verify", ckpt, "--rank", 1))
    assert verify.returncode == 2 and "NOT COMMITTED (no __1.metadata" in verify.stdout
    assert "drop --rank" in verify.stdout and "did not finish" not in verify.stdout


def test_cli_inspect_keeps_each_key_on_its_line(
    tmp_path: Path, make_writer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keys holding a newline, a tab or NUL were printed as they are, so one key split the
    listing's line (a user sweep); they are escaped as Python writes them."""
    from dcp_datastates.cli import main

    state = {"line\nbreak": torch.ones(2), "tab\tkey": torch.ones(2), "nul\x00": torch.ones(2)}
    dcp.save(state, storage_writer=make_writer(tmp_path / "c"), no_dist=True)
    assert main(["inspect", str(tmp_path / "c")]) == 0
    lines = capsys.readouterr().out.splitlines()
    items = lines[lines.index(next(x for x in lines if x.startswith("  items"))) + 1 :]
    assert len(items) == 3 and all("float32[2]" in line for line in items), items
    shown = {line.split()[0].split("@")[0] for line in items}
    assert shown == {"line\\nbreak", "tab\\tkey", "nul\\x00"}, shown
