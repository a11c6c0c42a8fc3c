"""Loads (issue 11): object items without ``torch.load``, checksums computed while reading.

- ``object_records.fast_load`` gives what ``torch.load(weights_only=True)`` gives for plain data,
  and declines (so ``torch.load`` decides, as before) for anything else: tensors inside objects,
  other globals, hostile pickles (never run), damaged records.
- Object-heavy checkpoints of both writers load equal, safe and trusted, with no ``torch.load``.
- ``crc32c_combine`` and ``read_checked``: a record read in many regions and pieces has the CRC of
  its bytes; a flipped byte in an object record or in any region of a tensor record is named.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import io
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_same_state, blank_like, failure_of
from crc32c import crc32c

from dcp_datastates import ChecksumMismatchError, DataStatesReader
from dcp_datastates.format import MANIFEST_NAME
from dcp_datastates.load.checksum import crc32c_combine, read_checked
from dcp_datastates.load.fetch import FetchOptions
from dcp_datastates.load.object_records import MISS, fast_load

#: Many regions per big record, many checked pieces per region, sizes that do not divide.
SMALL_PIECES = FetchOptions(
    io_workers=3, coalesce_bytes=0, span_bytes=0, split_bytes=40_000, check_bytes=3_001
)


@dataclasses.dataclass
class RunInfo:
    name: str


class Pwn:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"echo pwned > {self.marker}",))


def _record(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _weights_only(blob: bytes) -> Any:
    with torch.serialization.safe_globals([io.BytesIO]):
        return torch.load(io.BytesIO(blob), weights_only=True)


PLAIN = {
    "dict": {"loss": 0.25, "step": 7, "tag": "run-7", "ok": True, "none": None},
    "list": [1, 2.5, "x", None, [3, (4, 5)]],
    "tuple": (3, (1, 2, 3), None),
    "str": "ünïcode ✓" * 40,
    "bytes": b"\x00\xffraw bytes",
    "big int": 2**100 + 7,
    "float": -0.0,
    "set": {1, 2, 3},
    "ordered": collections.OrderedDict(b=1, a=2),
    "counter": collections.Counter("abracadabra"),
    "complex": 3 + 4j,
    "bytearray": bytearray(b"abc"),
    "size": torch.Size([2, 3]),
    "dtype": torch.bfloat16,
    "device": torch.device("cpu"),
    "nested": {"rng": (3, tuple(range(20)), None), "cfg": {"lr": 3e-4, "betas": [0.9, 0.95]}},
}


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_plain_data_loads_as_weights_only_torch_load_does(name: str) -> None:
    blob = _record(PLAIN[name])
    fast = fast_load(blob)
    assert fast is not MISS
    slow = _weights_only(blob)
    assert type(fast) is type(slow) and fast == slow == PLAIN[name]


def test_bytesio_loads_with_its_bytes_and_position() -> None:
    value = io.BytesIO(b"payload")
    value.seek(3)
    fast = fast_load(_record(value))
    assert isinstance(fast, io.BytesIO)
    assert fast.getvalue() == b"payload" and fast.tell() == 3


@pytest.mark.parametrize(
    "value",
    [{"t": torch.arange(3)}, RunInfo("x"), frozenset({1}), [RunInfo("y")]],
    ids=["tensor inside", "dataclass", "frozenset", "dataclass in a list"],
)
def test_anything_else_is_left_to_torch_load(value: Any) -> None:
    assert fast_load(_record(value)) is MISS


def test_a_hostile_pickle_is_declined_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    assert fast_load(_record(Pwn(marker))) is MISS
    assert not marker.exists()


def test_a_damaged_or_foreign_record_is_declined() -> None:
    blob = bytearray(_record({"key": "a value long enough to flip"}))
    at = blob.index(b"a value")
    blob[at] ^= 0x01  # the pickle still parses: only the zip CRC-32 tells
    assert fast_load(bytes(blob)) is MISS
    assert fast_load(b"") is MISS
    assert fast_load(b"not a zip record at all, just bytes") is MISS
    import pickle

    assert fast_load(pickle.dumps({"a": 1})) is MISS  # a bare pickle, not torch.save's zip


def _object_state() -> dict[str, Any]:
    return {
        "metrics": {f"step_{i}": {"loss": 1 / (i + 1), "step": i} for i in range(40)},
        "loader": {f"worker_{i}": [i, 7 * i, "shard"] for i in range(60)},
        "rng": (3, tuple(range(30)), None),
        "blob": b"\x00" * 100,
        "w": torch.arange(4000.0),
    }


@pytest.mark.parametrize("writer", ["ours", "stock"])
@pytest.mark.parametrize("trusted", [False, True])
def test_object_heavy_checkpoints_load_without_torch_load(
    tmp_path: Path, make_writer: Any, monkeypatch: pytest.MonkeyPatch, writer: str, trusted: bool
) -> None:
    state = _object_state()
    path = tmp_path / "ckpt"
    if writer == "ours":
        dcp.save(state, storage_writer=make_writer(path), no_dist=True)
    else:
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(1) or real_load(*a, **k))
    target = blank_like(state)
    dcp.load(target, storage_reader=DataStatesReader(path, trusted=trusted), no_dist=True)
    assert_same_state(state, target)
    assert calls == []


def test_an_object_outside_the_plain_set_loads_when_trusted(
    tmp_path: Path, make_writer: Any
) -> None:
    state = {"opaque": RunInfo("run-9"), "plain": {"k": "v"}}
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=make_writer(path), no_dist=True)
    target = {"opaque": None, "plain": {"k": None}}
    dcp.load(target, storage_reader=DataStatesReader(path, trusted=True), no_dist=True)
    assert target == state


def test_the_reader_leaves_the_cyclic_gc_as_it_found_it(tmp_path: Path, make_writer: Any) -> None:
    state = _object_state()
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=make_writer(path), no_dist=True)
    assert gc.isenabled()
    dcp.load(blank_like(state), storage_reader=DataStatesReader(path), no_dist=True)
    assert gc.isenabled()
    gc.disable()
    try:
        dcp.load(blank_like(state), storage_reader=DataStatesReader(path), no_dist=True)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_crc32c_combine_is_the_crc_of_the_concatenation() -> None:
    rng = random.Random(5)
    for _ in range(200):
        a, b = rng.randbytes(rng.randrange(0, 5000)), rng.randbytes(rng.randrange(0, 5000))
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    a, b = rng.randbytes(10), bytes(3 << 20)
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


@pytest.mark.parametrize("piece", [1, 7, 1000, 1 << 20])
def test_read_checked_reads_and_checks_every_piece(tmp_path: Path, piece: int) -> None:
    data = random.Random(piece).randbytes(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:

        def read_into(at: int, bufs: list[memoryview]) -> int:
            return os.preadv(fd, bufs, at)

        bufs = [memoryview(bytearray(n)) for n in (13, 5000, 0, 987)]
        got, crc = read_checked(read_into, 100, bufs, verify=True, piece=piece)
        assert got == 6000 and crc == crc32c(data[100:6100])
        assert b"".join(bytes(b) for b in bufs) == data[100:6100]
        short = [memoryview(bytearray(3000))]  # past the end of the file
        got, crc = read_checked(read_into, 8000, short, verify=True, piece=piece)
        assert got == 2000 and crc == crc32c(data[8000:])
    finally:
        os.close(fd)


def _mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {
        "big": torch.randn(100_000, generator=g),  # 400 kB: 10 regions of 40,000 bytes
        "odd": torch.randn(33, 77, generator=g).to(torch.bfloat16),
        "config": {"name": "a run name of some length", "seed": 11},
        "metrics": [0.5, 0.25, 0.125],
    }


def _read(path: Path, target: dict[str, Any]) -> None:
    reader = DataStatesReader(path)
    reader.fetch_options = SMALL_PIECES
    dcp.load(target, storage_reader=reader, no_dist=True)


def test_records_read_in_many_regions_and_pieces_load_exactly(
    tmp_path: Path, make_writer: Any
) -> None:
    state = _mixed_state()
    dcp.save(state, storage_writer=make_writer(tmp_path), no_dist=True)
    target = blank_like(state)
    _read(tmp_path, target)
    assert_same_state(state, target)


@pytest.mark.parametrize(
    ("item", "where"),
    [
        ("big", 0.0),  # first region
        ("big", 0.55),  # a middle region, inside a piece
        ("big", 1.0),  # the last byte of the data (last region)
        ("odd", 0.5),
        ("config.name", 0.5),  # inside an object record's pickle
        ("metrics", 0.5),
    ],
)
def test_a_flipped_byte_in_an_object_or_tensor_record_is_named(
    tmp_path: Path, make_writer: Any, item: str, where: float
) -> None:
    state = _mixed_state()
    dcp.save(state, storage_writer=make_writer(tmp_path), no_dist=True)
    items = json.loads((tmp_path / MANIFEST_NAME).read_bytes())["items"]
    key = next(k for k in items if k.split("@")[0] == item)
    rec = items[key]
    at = rec["data_offset"] + min(rec["data_length"] - 1, int(where * rec["data_length"]))
    data = tmp_path / rec["relative_path"]
    blob = bytearray(data.read_bytes())
    blob[at] ^= 0x10
    data.write_bytes(bytes(blob))
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is a BaseException
        _read(tmp_path, blank_like(state))
    err = failure_of(raised.value, ChecksumMismatchError)
    assert err is not None, repr(raised.value)
    assert repr(item) in str(err) and rec["relative_path"] in str(err) and "crc32c" in str(err)


def _count_reads(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[int]:
    """Count ``cls.read_into`` calls (the real method still runs)."""
    calls: list[int] = []
    real = cls.read_into

    def counted(self: Any, offset: int, buffers: list[memoryview]) -> int:
        calls.append(offset)
        return real(self, offset, buffers)

    monkeypatch.setattr(cls, "read_into", counted)
    return calls


def test_local_regions_are_read_in_pieces_remote_regions_in_one_request(
    tmp_path: Path, memory_url: str, make_writer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_datastates.storage import base as storage

    state = {"big": torch.arange(100_000.0)}  # 400 kB: 10 regions of 40,000 bytes
    options = dataclasses.replace(SMALL_PIECES, check_bytes=8_000)
    counts = {}
    for where, cls in ((str(tmp_path), storage._LocalRangedFile), (memory_url, None)):
        dcp.save(state, storage_writer=make_writer(where), no_dist=True)
        reader = DataStatesReader(where)
        cls = cls or type(reader.storage.open_ranged(reader.storage.list_names()[0]))
        calls = _count_reads(monkeypatch, cls)
        reader.fetch_options = dataclasses.replace(
            options, check_bytes=reader.fetch_options.check_bytes and options.check_bytes
        )
        target = blank_like(state)
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert_same_state(state, target)
        counts[where] = len(calls)
        monkeypatch.undo()
    assert counts[memory_url] == 10  # one request per region, head and tail included
    assert counts[str(tmp_path)] >= 50  # 40,000-byte regions in 8,000-byte pieces, + head/tail
