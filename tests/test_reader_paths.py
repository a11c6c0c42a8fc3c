"""The reader's I/O paths: coalesced small records, big records split into parallel regions,
stock records located without torch.load, bounce buffers, and damage found on each path.

Every load here is checked against what stock ``FileSystemReader`` loads into the same targets.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import MiB, assert_same_state, blank_like, data_files, failure_of

from dcp_datastates import ChecksumMismatchError, DataStatesReader, UnsafeCheckpointError
from dcp_datastates.load import fetch as fetch_module
from dcp_datastates.load.fetch import FetchOptions
from dcp_datastates.load.locate import NotLocatable

#: Small reads everywhere: nothing is coalesced and every big record is split into many regions.
TINY_READS = FetchOptions(io_workers=3, coalesce_bytes=0, span_bytes=0, split_bytes=4096)
READ_SHAPES = {"default": FetchOptions(), "tiny_reads": TINY_READS}


def mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    big = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "big": big(512, 1024),  # 2 MiB: a record of its own, split into regions
        "big_t": big(600, 700).t(),  # non-contiguous: stock keeps its strides in the record
        "big_bf16": big(1 << 20).bfloat16(),
        "small": [big(3, 4), torch.arange(10, dtype=torch.int16), torch.tensor(1.5)],
        "empty": torch.empty(0, 4),
        "mask": torch.rand(1000, generator=g) > 0.5,
        "step": 12,
        "note": {"text": "hello", "lrs": [0.1, 0.01]},
    }


def save(state: dict[str, Any], path: Path, writer: str) -> None:
    if writer == "stock":
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    else:
        from dcp_datastates import DataStatesWriter

        w = DataStatesWriter(path)
        try:
            dcp.save(state, storage_writer=w, no_dist=True)
        finally:
            w.close()


def read(path: Path | str, target: dict[str, Any], options: FetchOptions, **kw: Any) -> None:
    reader = DataStatesReader(path, **kw)
    reader.fetch_options = options
    dcp.load(target, storage_reader=reader, no_dist=True)


@pytest.fixture
def no_whole_record_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any record is loaded with torch.load instead of read in place."""

    def refuse(self: Any, record: Any, mv: Any) -> None:
        raise AssertionError(f"{record.fqn} was loaded whole with torch.load")

    monkeypatch.setattr(fetch_module.Fetch, "_load_whole", refuse)


@pytest.mark.parametrize("shape", READ_SHAPES)
@pytest.mark.parametrize("writer", ("stock", "datastates"))
def test_both_writers_load_bit_exact_on_every_read_path(
    tmp_path: Path, writer: str, shape: str, no_whole_record_loads: None
) -> None:
    state = mixed_state()
    save(state, tmp_path, writer)
    target = blank_like(state)
    read(tmp_path, target, READ_SHAPES[shape])
    assert_same_state(state, target)


@pytest.mark.parametrize("shape", READ_SHAPES)
@pytest.mark.parametrize("writer", ("stock", "datastates"))
def test_every_target_written_has_its_version_bumped_as_stock_loads_do(
    tmp_path: Path, writer: str, shape: str
) -> None:
    """Records read straight into their targets are written behind torch's back; stock's
    ``copy_`` bumps each target's version counter, and autograd and our own snapshots rely on
    it (a user sweep: a backward after such a load ran silently on the new values)."""
    state = mixed_state()
    save(state, tmp_path, writer)
    target = blank_like(state)
    tensors = {k: v for k, v in target.items() if isinstance(v, torch.Tensor) and v.numel()}
    tensors.update({f"small.{i}": v for i, v in enumerate(target["small"])})  # (no bytes, no write)
    before = {k: v._version for k, v in tensors.items()}
    read(tmp_path, target, READ_SHAPES[shape])
    assert [k for k, v in tensors.items() if v._version == before[k]] == []

    weight = torch.zeros(512, 1024, requires_grad=True)
    loss = (weight * weight).sum()  # saves weight for its backward
    with torch.no_grad():
        read(tmp_path, {"big": weight}, READ_SHAPES[shape])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("writer", ("stock", "datastates"))
def test_targets_unlike_the_saved_chunk_load_as_stock_loads_them(
    tmp_path: Path, writer: str
) -> None:
    """Another dtype, a non-contiguous target, a strided view: the bounce-buffer path."""
    state = mixed_state()
    save(state, tmp_path, writer)

    def targets() -> dict[str, Any]:
        return {
            "big": torch.zeros(1024, 512).t(),  # non-contiguous
            "big_t": torch.zeros(700, 600, dtype=torch.float64),  # another dtype, contiguous
            "big_bf16": torch.zeros(1 << 20, dtype=torch.float32),
            "mask": torch.zeros(2000, dtype=torch.bool)[::2],  # a strided view
        }

    ours, stock = targets(), targets()
    read(tmp_path, ours, TINY_READS)
    dcp.load(stock, checkpoint_id=str(tmp_path), no_dist=True)
    assert_same_state(stock, ours)
    torch.testing.assert_close(ours["big_t"], state["big_t"].double())


def test_a_stock_record_whose_data_cannot_be_located_falls_back_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = mixed_state()
    save(state, tmp_path, "stock")

    def cannot(*args: Any) -> None:
        raise NotLocatable("this torch does not report data offsets")

    monkeypatch.setattr(fetch_module, "locate_stock_tensor", cannot)
    target = blank_like(state)
    with caplog.at_level(logging.INFO, logger="dcp_datastates.load.fetch"):
        read(tmp_path, target, FetchOptions())
    assert_same_state(state, target)
    lines = [r.getMessage() for r in caplog.records if "loaded whole" in r.getMessage()]
    # One log line for the whole load, counting every tensor record read (DCP plans no read for
    # a tensor without elements).
    tensors = [v for v in [*state.values(), *state["small"]] if isinstance(v, torch.Tensor)]
    read_records = sum(1 for t in tensors if t.numel())
    assert len(lines) == 1 and lines[0].startswith(f"{read_records} stock record(s)"), lines


@pytest.mark.parametrize("shape", READ_SHAPES)
def test_a_flipped_byte_inside_a_split_record_is_found(tmp_path: Path, shape: str) -> None:
    state = {"big": torch.randn(512, 1024), "small": torch.randn(8)}
    save(state, tmp_path, "datastates")
    path, data_offset = _where_big_is(tmp_path)
    data = bytearray(path.read_bytes())
    where = data_offset + MiB  # the middle of the 2 MiB record: not its head, not its first region
    data[where] ^= 0x01
    path.write_bytes(bytes(data))
    assert_damage_found(
        lambda: read(tmp_path, blank_like(state), READ_SHAPES[shape]),
        r"item 'big' has crc32c 0x[0-9a-f]{8}, expected 0x[0-9a-f]{8}",
    )


@pytest.mark.parametrize("writer", ("stock", "datastates"))
def test_a_truncated_file_is_found_by_the_reads_themselves(tmp_path: Path, writer: str) -> None:
    """Trusted mode skips the up-front extent check: the short read itself must be caught."""
    state = {"big": torch.randn(512, 1024)}
    save(state, tmp_path, writer)
    (path,) = [p for p in data_files(tmp_path) if p.stat().st_size > MiB]
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 100_000)
    assert_damage_found(
        lambda: read(tmp_path, blank_like(state), TINY_READS, trusted=True),
        r"__0_0\.distcp: item 'big' is truncated",
    )


def test_an_fsspec_checkpoint_loads_through_ranged_reads(memory_url: str) -> None:
    state = mixed_state()
    save(state, memory_url, "datastates")  # type: ignore[arg-type]
    for options in READ_SHAPES.values():
        target = blank_like(state)
        read(memory_url, target, options)
        assert_same_state(state, target)


def test_read_options_are_the_readers(tmp_path: Path) -> None:
    reader = DataStatesReader(tmp_path, verify=False, io_workers=7)
    assert reader.fetch_options == dataclasses.replace(FetchOptions(), verify=False, io_workers=7)


def assert_damage_found(load: Any, pattern: str) -> None:
    """``load`` fails (through DCP's wrapper) with our checksum error matching ``pattern``."""
    with pytest.raises(BaseException) as caught:  # DCP's CheckpointException is a BaseException
        load()
    error = failure_of(caught.value, ChecksumMismatchError)
    assert error is not None, f"not a checksum error: {caught.value!r}"
    assert re.search(pattern, str(error)), str(error)


def _where_big_is(path: Path) -> tuple[Path, int]:
    """The data file holding item ``big`` and the offset of its raw bytes, from the manifest."""
    from dcp_datastates.format import MANIFEST_NAME, decode_manifest

    info = decode_manifest((path / MANIFEST_NAME).read_bytes())["big@0,0"]
    return path / info.relative_path, info.data_offset


def test_stock_records_from_another_torch_are_parsed_not_trusted_by_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_whole_record_loads: None
) -> None:
    """Records whose head differs from this torch's frame (another torch wrote them) take the
    zip-and-pickle parse instead of the frame shortcut, and still read in place."""
    from dcp_datastates.format import RecordFrame
    from dcp_datastates.load import locate

    state = mixed_state()
    save(state, tmp_path, "stock")
    parsed: list[int] = []
    real_parse, real_frame = locate.locate_tensor, locate.record_frame

    def foreign_frame(dtype: torch.dtype, size: tuple[int, ...]) -> RecordFrame:
        frame = real_frame(dtype, size)
        return RecordFrame(b"\0" + frame.head[1:], frame.tail, frame.data_length)

    def counting_parse(*args: Any) -> Any:
        parsed.append(1)
        return real_parse(*args)

    monkeypatch.setattr(locate, "record_frame", foreign_frame)
    monkeypatch.setattr(locate, "locate_tensor", counting_parse)
    for options in READ_SHAPES.values():
        target = blank_like(state)
        read(tmp_path, target, options)
        assert_same_state(state, target)
    assert len(parsed) == 2 * 7  # every tensor record with elements, in both read shapes


class _Evil:
    """Unpickling this runs ``marker.touch()``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_tensor_record_whose_pickle_runs_code_is_refused_in_safe_mode(tmp_path: Path) -> None:
    """Stock records are parsed with torch.load: only with weights_only, so a record's pickle
    cannot run code even where a tensor is expected."""
    import pickle

    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    save({"t": torch.randn(4)}, ckpt, "stock")
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    (ckpt / "evil.distcp").write_bytes(buf.getvalue())
    metadata_path = ckpt / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())
    (index,) = [i for i in metadata.storage_data if i.fqn == "t"]
    info = metadata.storage_data[index]
    metadata.storage_data[index] = dataclasses.replace(
        info, relative_path="evil.distcp", offset=0, length=len(buf.getvalue())
    )
    metadata_path.write_bytes(pickle.dumps(metadata))

    with pytest.raises(BaseException) as caught:
        read(ckpt, {"t": torch.zeros(4)}, FetchOptions())
    error = failure_of(caught.value, UnsafeCheckpointError)
    assert error is not None, repr(caught.value)
    assert "evil.distcp: item 't'" in str(error) and "weights_only" in str(error)
    assert not marker.exists()


def test_verify_false_reads_past_a_damaged_manifest_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dcp_datastates.format import MANIFEST_NAME

    state = mixed_state()
    save(state, tmp_path, "datastates")
    (tmp_path / MANIFEST_NAME).write_bytes(b"{not json")
    with pytest.raises(ChecksumMismatchError, match=r"\.datastates\.json is damaged"):
        DataStatesReader(tmp_path).read_metadata()
    target = blank_like(state)
    with caplog.at_level(logging.WARNING, logger="dcp_datastates.load.reader"):
        read(tmp_path, target, FetchOptions(verify=False), verify=False)
    assert_same_state(state, target)
    assert any("reading without the manifest" in r.getMessage() for r in caplog.records)


def test_objects_load_through_the_default_planner_and_a_custom_one(tmp_path: Path) -> None:
    """Safe mode loads each object once (weights-only) and hands it to DefaultLoadPlanner; any
    other planner gets the bytes through its own load_bytes, as DCP's contract says."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    seen: list[str] = []

    class CountingPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            seen.append(read_item.dest_index.fqn)
            super().load_bytes(read_item, value)

    state = mixed_state()
    save(state, tmp_path, "datastates")
    for planner in (DefaultLoadPlanner(), CountingPlanner()):
        target = blank_like(state)
        dcp.load(target, storage_reader=DataStatesReader(tmp_path), planner=planner, no_dist=True)
        assert_same_state(state, target)
    assert sorted(seen) == ["note.lrs", "note.text", "step"]


@pytest.mark.parametrize("shape", READ_SHAPES)
def test_stock_records_of_conjugate_and_negative_views_load_with_their_sign(
    tmp_path: Path, shape: str
) -> None:
    """Stock ``FileSystemWriter`` saves ``z.conj()`` as a lazy conjugate view, whose bytes are
    the unconjugated values: read in place, they loaded with the sign lost (a user sweep)."""
    z = torch.randn(300, 700, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    state = {
        "conj": z.conj(),  # 1.6 MiB: split into regions with tiny reads
        "small_conj": z[:2, :3].conj(),
        "neg": torch._neg_view(torch.arange(1.0, 9.0)),
    }
    save(state, tmp_path, "stock")
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    read(tmp_path, target, READ_SHAPES[shape])
    for k, v in state.items():
        assert torch.equal(target[k], v.resolve_conj().resolve_neg()), k


@pytest.mark.parametrize("shape", READ_SHAPES)
def test_stock_records_of_quantized_tensors_load(tmp_path: Path, shape: str) -> None:
    """Stock ``FileSystemWriter`` saves quantized tensors (our writer refuses them); our reader
    failed on them, naming no item, when building the plain record's head to compare, which
    ``torch.save`` cannot write for a quantized dtype (a user sweep)."""
    g = torch.Generator().manual_seed(2)
    per_tensor = torch.quantize_per_tensor(torch.randn(600, 700, generator=g), 0.1, 3, torch.quint8)
    scales, points = torch.rand(4, generator=g) + 0.05, torch.arange(4)
    per_channel = torch.quantize_per_channel(
        torch.randn(4, 9, generator=g), scales, points, 0, torch.qint8
    )
    state = {"q": per_tensor, "qc": per_channel, "w": torch.arange(5.0)}
    save(state, tmp_path, "stock")
    target = {
        "q": torch.quantize_per_tensor(torch.zeros(600, 700), 0.1, 3, torch.quint8),
        "qc": torch.quantize_per_channel(torch.zeros(4, 9), scales, points, 0, torch.qint8),
        "w": torch.zeros(5),
    }
    read(tmp_path, target, READ_SHAPES[shape])
    for k in ("q", "qc"):
        assert torch.equal(target[k].int_repr(), state[k].int_repr()), k
    assert torch.equal(target["w"], state["w"])


@pytest.mark.parametrize("writer", ["ours", "stock"])
@pytest.mark.parametrize("shape", READ_SHAPES)
def test_conjugate_and_negative_view_targets_receive_the_saved_values(
    tmp_path: Path, shape: str, writer: str
) -> None:
    """A target that is a conjugate or negative view of a big record was read into as its
    base's bytes (``view`` refused it, naming no item; a user sweep); stock's reader copies
    into the view, which stores the values so that the view reads them back."""
    g = torch.Generator().manual_seed(4)
    z = torch.randn(300, 700, dtype=torch.complex64, generator=g)  # 1.6 MiB
    x = torch.randn(300, 1400, generator=g)
    save({"z": z, "x": x}, tmp_path, writer)
    target = {"z": torch.zeros_like(z).conj(), "x": torch._neg_view(torch.zeros_like(x))}
    read(tmp_path, target, READ_SHAPES[shape])
    assert target["z"].is_conj() and target["x"].is_neg()
    assert torch.equal(target["z"].resolve_conj(), z)
    assert torch.equal(target["x"].resolve_neg(), x)
