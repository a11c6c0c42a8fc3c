"""Conformance: the same DCP scenarios with the stock classes and with ours, the same results.

Every test is parametrized by ``impl``: ``stock`` runs it with ``FileSystemWriter`` /
``FileSystemReader``, ``ours`` with ``DataStatesWriter`` / ``DataStatesReader`` built from the
very same arguments (a drop-in is a class-name change). Checkpoints are loaded with both readers
and compared with what was saved: sync and async saves, objects and ``io.BytesIO`` values,
overwrite, compression and user stream transforms, incremental saves, storage ids, custom
planners, plan caching, legacy metadata types, and (on two gloo ranks,
``_conformance_workers.py``) sharded and replicated DTensors, resharding, compressed checkpoints,
repeated cached-plan async saves and ``use_collectives=False``.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _conformance_workers import reader_for, writer_for
from _dist_workers import check_all_ok, launch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcp_datastates import DataStatesReader, DataStatesWriter

IMPLS = ["stock", "ours"]
READERS = ["stock", "ours"]


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    return request.param


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 8, generator=g)
    return {
        "f32": torch.randn(64, 33, generator=g),
        "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-5, 5, (4, 4), generator=g),
        "flags": torch.rand(9, generator=g) > 0.5,
        "scalar": torch.tensor(3.5 + seed),
        "empty": torch.empty(0, 3),
        "column": base[:, 2],  # a non-contiguous view: only its own elements are saved
        "big": torch.randn(1 << 18, generator=g),  # 1 MiB: read in regions
        "obj": {"step": 10 + seed, "name": f"run-{seed}", "lrs": [0.1, 0.01]},
        "losses": io.BytesIO(f"losses {seed}".encode()),
    }


def _blank() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in _state().items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value, memory_format=torch.contiguous_format)
        elif isinstance(value, io.BytesIO):
            out[key] = io.BytesIO()
        else:
            out[key] = {"step": 0, "name": "", "lrs": []}
    return out


def _differs(loaded: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    out = []
    for key, want in expected.items():
        got = loaded[key]
        if isinstance(want, torch.Tensor):
            same = got.dtype == want.dtype and torch.equal(got, want)
        elif isinstance(want, io.BytesIO):
            same = isinstance(got, io.BytesIO) and got.getvalue() == want.getvalue()
        else:
            same = got == want
        if not same:
            out.append(key)
    return out


def _load(reader: str, path: Path) -> dict[str, Any]:
    target = _blank()
    dcp.load(target, storage_reader=reader_for(reader, path))
    return target


def _check_loads(path: Path, expected: dict[str, Any]) -> None:
    for reader in READERS:
        assert _differs(_load(reader, path), expected) == [], f"read by the {reader} reader"


# -- the constructor surface -----------------------------------------------------------------------
def test_writer_takes_every_stock_argument_in_place() -> None:
    stock = list(inspect.signature(dcp.FileSystemWriter).parameters)
    ours = list(inspect.signature(DataStatesWriter).parameters)
    assert ours[: len(stock)] == stock
    for name in ours[len(stock) :]:
        kind = inspect.signature(DataStatesWriter).parameters[name].kind
        assert kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD), name


def test_writer_has_the_stock_writers_attributes_and_refuses_bad_values_by_their_name(
    tmp_path: Path,
) -> None:
    """Code reading ``writer.overwrite`` or ``writer.thread_count`` broke on ours, and
    ``thread_count=0`` was refused as ``flush_workers=0``, a name the user never wrote (a user
    sweep)."""
    args = (tmp_path, False, False, 3, 1 << 20, True, False)
    stock, ours = dcp.FileSystemWriter(*args), DataStatesWriter(*args)
    try:
        for name in (
            "single_file_per_rank",
            "sync_files",
            "thread_count",
            "per_thread_copy_ahead",
            "cache_staged_state_dict",
            "overwrite",
        ):
            assert getattr(ours, name) == getattr(stock, name), name
    finally:
        ours.close()
    with pytest.raises(ValueError, match=r"thread_count=0"):
        DataStatesWriter(tmp_path, thread_count=0)
    with pytest.raises(ValueError, match=r"per_thread_copy_ahead=True"):
        DataStatesWriter(tmp_path, per_thread_copy_ahead=True)
    with pytest.raises(TypeError, match=r"live_flsh \(did you mean live_flush\?\)"):
        DataStatesWriter(tmp_path, live_flsh=True)


def test_reader_refuses_option_values_that_are_not_what_they_mean(tmp_path: Path) -> None:
    for bad in ({"verify": "yes"}, {"trusted": 1}, {"io_workers": 0}, {"io_workers": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DataStatesReader(tmp_path, **bad)


def test_reader_takes_every_stock_argument_in_place() -> None:
    stock = list(inspect.signature(dcp.FileSystemReader).parameters)
    ours = list(inspect.signature(DataStatesReader).parameters)
    assert ours[: len(stock)] == stock
    # Ours are keyword-only; the last catches the rest, for a did-you-mean instead of a bare
    # TypeError.
    *own, rest = ours[len(stock) :]
    for name in own:
        kind = inspect.signature(DataStatesReader).parameters[name].kind
        assert kind is inspect.Parameter.KEYWORD_ONLY, name
    assert (
        inspect.signature(DataStatesReader).parameters[rest].kind is inspect.Parameter.VAR_KEYWORD
    )


def test_reader_answers_a_misspelt_option_with_the_name_it_missed(tmp_path: Path) -> None:
    """The writer's typos got a did-you-mean, the reader's a bare ``TypeError`` (a user sweep)."""
    with pytest.raises(TypeError, match=r"verfy \(did you mean verify\?\)") as raised:
        DataStatesReader(tmp_path, verfy=False)
    assert "DataStatesReader" in str(raised.value) and "io_workers" in str(raised.value)
    with pytest.raises(TypeError, match=r"io_worker \(did you mean io_workers\?\), zzz;"):
        DataStatesReader(tmp_path, zzz=1, io_worker=2)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_roundtrip_with_stock_arguments(impl: str, mode: str, tmp_path: Path) -> None:
    """Every stock writer argument, by position; objects, BytesIO, odd tensors; both readers."""
    path = tmp_path / "ckpt"
    # path, single_file_per_rank, sync_files, thread_count, per_thread_copy_ahead,
    # cache_staged_state_dict, overwrite
    writer_class = dcp.FileSystemWriter if impl == "stock" else DataStatesWriter
    writer = writer_class(path, True, True, 2, 1 << 20, False, True)
    state = _state(1)
    if mode == "sync":
        dcp.save(state, storage_writer=writer)
    else:
        dcp.async_save(state, storage_writer=writer).result(timeout=30)
    _check_loads(path, _state(1))
    if impl == "ours":
        assert writer.options.flush_workers == 2  # thread_count
        writer.close()


def test_overwrite(impl: str, tmp_path: Path) -> None:
    """PyTorch's own ``test_overwrite`` (test_fsspec.py, test_e2e_save_and_load.py), on CPU:
    a refused save raises what stock raises, with stock's words (code matches on them)."""
    from torch.distributed.checkpoint.api import CheckpointException

    path = tmp_path / "ckpt"
    dcp.save(_state(1), storage_writer=writer_for(impl, path, overwrite=False))
    dcp.save(_state(2), storage_writer=writer_for(impl, path, overwrite=True))
    _check_loads(path, _state(2))
    with pytest.raises(CheckpointException, match=".*Checkpoint already exists.*") as info:
        dcp.save(_state(3), storage_writer=writer_for(impl, path, overwrite=False))
    ((error, _),) = info.value.failures.values()  # (exception, traceback) per rank
    assert type(error) is RuntimeError
    assert "Checkpoint already exists and self.overwrite=False." in str(error)
    if impl == "ours":  # and ours says where, and what to do
        assert f"{path / '.metadata'} exists" in str(error) and "overwrite=True" in str(error)
    _check_loads(path, _state(2))


def test_a_save_without_checkpoint_id_goes_to_the_writers_path(tmp_path: Path) -> None:
    """The one documented difference (docs/compat.md): stock's ``reset()`` keeps the last
    checkpoint_id, so a stock writer saves over it again; ours saves where it was made to."""
    writer = writer_for("ours", tmp_path / "home")
    dcp.save(_state(1), storage_writer=writer, checkpoint_id=tmp_path / "a")
    dcp.save(_state(2), storage_writer=writer)
    writer.close()
    _check_loads(tmp_path / "a", _state(1))
    _check_loads(tmp_path / "home", _state(2))
    stock = writer_for("stock", tmp_path / "home_stock")
    dcp.save(_state(1), storage_writer=stock, checkpoint_id=tmp_path / "b")
    dcp.save(_state(2), storage_writer=stock)
    _check_loads(tmp_path / "b", _state(2))  # stock: saved over b
    assert not (tmp_path / "home_stock").exists()


def test_storage_meta_and_ids(impl: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    writer = writer_for(impl, path)
    dcp.save(_state(), storage_writer=writer)
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f).storage_meta
    assert meta is not None and isinstance(meta.save_id, str) and meta.save_id
    assert Path(meta.checkpoint_id) == path
    assert writer.save_id == meta.save_id
    reader = reader_for(impl, path)
    first = reader.load_id
    assert reader.read_metadata().storage_meta.load_id == first
    reader.reset(path)
    assert reader.load_id != first


# -- compression -----------------------------------------------------------------------------------
def test_compressed_stock_checkpoint_loads(impl: str, tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    path = tmp_path / "ckpt"
    dcp.save(_state(4), storage_writer=dcp.FileSystemWriter(path, _extensions=[ZStandard()]))
    with open(path / ".metadata", "rb") as f:
        infos = list(pickle.load(f).storage_data.values())
    assert all(i.transform_descriptors == ["stream.zstd/1"] for i in infos)
    assert _differs(_load(impl, path), _state(4)) == []


def _descriptors(path: Path) -> set[tuple[str, ...] | None]:
    with open(path / ".metadata", "rb") as f:
        infos = pickle.load(f).storage_data.values()
    return {
        None if i.transform_descriptors is None else tuple(i.transform_descriptors) for i in infos
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_compressed_writer(impl: str, mode: str, tmp_path: Path) -> None:
    """``_extensions=[ZStandard()]``: every record compressed, its descriptor in ``.metadata``
    as stock writes it, and the checkpoint read by both readers (stock's with its registry)."""
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    path = tmp_path / "ckpt"
    writer = writer_for(impl, path, _extensions=[ZStandard()])
    if mode == "sync":
        dcp.save(_state(5), storage_writer=writer)
    else:
        dcp.async_save(_state(5), storage_writer=writer).result(timeout=30)
    assert _descriptors(path) == {("stream.zstd/1",)}
    _check_loads(path, _state(5))
    if impl == "ours":
        writer.close()
        data = sum(f.stat().st_size for f in path.glob("*.distcp"))
        assert data < 0.95 * sum(_raw_bytes(_state(5))), data  # the zeros and ints shrink
        assert writer.last_stats.bytes_written <= data


def test_writer_refuses_what_is_not_a_stream_transform_by_its_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="_extensions=.*dict is not a stream transform"):
        DataStatesWriter(tmp_path, _extensions=[{"level": 3}])
    with pytest.raises(ValueError, match="expected a list of stream transforms"):
        DataStatesWriter(tmp_path, _extensions="zstd")


def _raw_bytes(state: dict[str, Any]) -> list[int]:
    return [v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)]


def test_user_stream_transform_round_trips(impl: str, tmp_path: Path) -> None:
    """A user's ``StreamTransformExtension`` (PyTorch's test Rot13, two chained): what stock's
    reader decodes with the user's registry, and ours too."""
    from torch.testing._internal.distributed.checkpoint_utils import (
        Rot13Example,
        get_test_extension_registry,
    )

    path = tmp_path / "ckpt"
    state = {k: v for k, v in _state(7).items() if k != "big"}  # rot13 is a Python loop
    writer = writer_for(impl, path, _extensions=[Rot13Example(), Rot13Example()])
    dcp.save(state, storage_writer=writer)
    assert _descriptors(path) == {("stream.rot13/1", "stream.rot13/1")}
    for reader in (dcp.FileSystemReader, DataStatesReader):
        target = {k: v for k, v in _blank().items() if k != "big"}
        dcp.load(
            target, storage_reader=reader(path, _extension_registry=get_test_extension_registry())
        )
        assert _differs(target, state) == [], reader
    if impl == "ours":
        writer.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_compressed_save_streams_through_a_pool_smaller_than_one_tensor(
    mode: str, tmp_path: Path
) -> None:
    """Each pool piece goes back once the transforms took it: a 16 MiB tensor is compressed
    through a 2 MiB pool (were a record's pieces held to its end, the snapshot would wait for
    space forever), and read back by both readers."""
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(4 << 20, generator=g), "step": 7}
    path = tmp_path / "ckpt"
    pool = {"host_pool_bytes": 2 << 20, "chunk_bytes": 256 << 10, "coalesce_bytes": 64 << 10}
    writer = DataStatesWriter(path, _extensions=[ZStandard()], **pool)
    try:
        if mode == "sync":
            dcp.save(state, storage_writer=writer)
        else:
            dcp.async_save(state, storage_writer=writer).result(timeout=60)
        assert writer.last_stats.pool_peak_bytes <= 2 << 20
    finally:
        writer.close()
    for reader in READERS:
        target = {"w": torch.zeros(4 << 20), "step": 0}
        dcp.load(target, storage_reader=reader_for(reader, path))
        assert torch.equal(target["w"], state["w"]) and target["step"] == 7, reader


def test_a_damaged_compressed_record_is_caught(tmp_path: Path) -> None:
    """The crc32c of a compressed record covers its stored bytes: a flipped byte is caught by our
    reader and by ``verify`` before anything is decoded."""
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    from dcp_datastates.cli import EXIT_OK, main

    path = tmp_path / "ckpt"
    writer = DataStatesWriter(path, _extensions=[ZStandard()])
    dcp.save(_state(8), storage_writer=writer)
    writer.close()
    assert main(["verify", "--quiet", str(path)]) == EXIT_OK
    with open(path / ".metadata", "rb") as f:
        info = next(i for idx, i in pickle.load(f).storage_data.items() if idx.fqn == "big")
    with open(path / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, io.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    assert main(["verify", "--quiet", str(path)]) != EXIT_OK
    with pytest.raises(BaseException, match="'big' has crc32c .* the checkpoint is damaged"):
        dcp.load(_blank(), storage_reader=DataStatesReader(path))


# -- incremental saves ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_incremental_checkpoint_loads_alone(mode: str, tmp_path: Path) -> None:
    """Ours with ``incremental=True``: a save after an unchanged one links that checkpoint's data
    file; with the older checkpoint removed, both readers load the newer alone."""
    import shutil

    from dcp_datastates.format import LINKED_DATA

    writer = DataStatesWriter(tmp_path, incremental=True, flush_workers=1)
    first = _state(7)
    second = {**first, "scalar": torch.tensor(9.0), "obj": {"step": 8, "name": "b", "lrs": []}}
    for state, name in ((first, "a"), (second, "b")):
        if mode == "sync":
            dcp.save(state, storage_writer=writer, checkpoint_id=tmp_path / name)
        else:
            dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / name).result()
    writer.close()
    assert [n for n in (tmp_path / "b").iterdir() if LINKED_DATA.match(n.name)]
    shutil.rmtree(tmp_path / "a")
    _check_loads(tmp_path / "b", second)


def test_serialization_format(impl: str, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    path = tmp_path / "ckpt"
    writer = writer_for(impl, path, serialization_format=SerializationFormat.TORCH_SAVE)
    dcp.save(_state(6), storage_writer=writer)
    _check_loads(path, _state(6))
    if impl == "ours":
        with pytest.raises(ValueError, match="SAFETENSORS"):
            DataStatesWriter(path, serialization_format=SerializationFormat.SAFETENSORS)


# -- planners --------------------------------------------------------------------------------------
class _DoublingPlanner(DefaultSavePlanner):
    """A user planner that changes what is saved: tensors doubled, objects tagged."""

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if write_item.type == WriteItemType.BYTE_IO:
            return data
        return data * 2


def _doubled(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (v * 2 if isinstance(v, torch.Tensor) and v.dtype != torch.bool else v)
        for k, v in state.items()
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_custom_planner_resolve_data(impl: str, mode: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    state = {k: v for k, v in _state(7).items() if k != "flags"}  # bool * 2 is an int
    writer = writer_for(impl, path)
    if mode == "sync":
        dcp.save(state, storage_writer=writer, planner=_DoublingPlanner())
    else:
        fut = dcp.async_save(state, storage_writer=writer, planner=_DoublingPlanner())
        fut.result(timeout=30)
    expected = _doubled({k: v for k, v in _state(7).items() if k != "flags"})
    for reader in READERS:
        target = {k: v for k, v in _blank().items() if k != "flags"}
        dcp.load(target, storage_reader=reader_for(reader, path))
        assert _differs(target, expected) == [], reader


def test_plan_caching_repeated_async_saves(impl: str, tmp_path: Path) -> None:
    writer = writer_for(impl, tmp_path / "c0")
    for i in range(3):
        planner = DefaultSavePlanner(enable_plan_caching=True)
        dcp.async_save(
            _state(20 + i), checkpoint_id=tmp_path / f"c{i}", storage_writer=writer, planner=planner
        ).result(timeout=30)
    for i in range(3):
        _check_loads(tmp_path / f"c{i}", _state(20 + i))


# -- old checkpoints -------------------------------------------------------------------------------
def test_legacy_shard_tensor_properties(impl: str, tmp_path: Path) -> None:
    """Checkpoints of older torch hold ``torch.distributed._shard``'s ``TensorProperties``."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as Legacy

    path = tmp_path / "ckpt"
    dcp.save({"t": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(path))
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    md = metadata.state_dict_metadata["t"]
    legacy = Legacy(dtype=md.properties.dtype, layout=md.properties.layout)
    metadata.state_dict_metadata["t"] = dataclasses.replace(md, properties=legacy)
    blob = pickle.dumps(metadata)
    assert b"torch.distributed._shard.sharded_tensor.metadata" in blob
    (path / ".metadata").write_bytes(blob)
    target = {"t": torch.zeros(6)}
    dcp.load(target, storage_reader=reader_for(impl, path))
    assert torch.equal(target["t"], torch.arange(6.0))


# -- two gloo ranks --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_rank_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = {}
    for name in IMPLS:
        workdir = tmp_path_factory.mktemp(f"conformance-{name}")
        results = launch(
            name, workdir, timeout=90, script=str(Path(__file__).parent / "_conformance_workers.py")
        )
        check_all_ok(results)
        out[name] = ([r.report for r in results], workdir)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_two_ranks(two_rank_reports: dict[str, Any], impl: str) -> None:
    reports, workdir = two_rank_reports[impl]
    for rank, report in enumerate(reports):
        for scenario, by_reader in report.items():
            if scenario in ("ok", "nocoll_files"):
                continue
            assert by_reader == {"stock": [], "ours": []}, f"rank {rank} {scenario}"
    names = reports[0]["nocoll_files"]
    assert "__0.metadata" in names and "__1.metadata" in names and ".metadata" not in names
    data = [n for n in names if n.endswith(".distcp")]
    assert {n.split("_")[2] for n in data} == {"0", "1"}, data  # per-rank file prefixes
    # Saved on two ranks, loaded here on one: resharded into whole tensors by both readers.
    from _dist_workers import full_values

    values = full_values(1)
    for reader in READERS:
        target = {k: torch.zeros_like(values[k]) for k in ("sharded", "replicated_dt", "plain")}
        dcp.load(target, storage_reader=reader_for(reader, workdir / "sync"))
        for k, v in target.items():
            assert torch.equal(v, values[k]), (reader, k)
    # Both implementations leave the same items in the same checkpoints.
    with open(workdir / "sync" / ".metadata", "rb") as f:
        ours_items = set(pickle.load(f).state_dict_metadata)
    stock_dir = two_rank_reports["stock"][1]
    with open(stock_dir / "sync" / ".metadata", "rb") as f:
        assert set(pickle.load(f).state_dict_metadata) == ours_items


@pytest.mark.multiprocess
def test_cli_checks_every_rank_commit_record(
    two_rank_reports: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """``use_collectives=False`` leaves ``__{rank}.metadata`` only: the CLI checks each."""
    import json

    from dcp_datastates.cli import EXIT_OK, main

    path = str(two_rank_reports["ours"][1] / "nocoll")
    assert main(["verify", "--quiet", path]) == EXIT_OK
    out = capsys.readouterr().out
    assert "(__0.metadata): OK" in out and "(__1.metadata): OK" in out
    assert main(["inspect", "--json", "--rank", "1", path]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["commit_record"] == "__1.metadata"
    assert {item["fqn"] for item in report["items"]} == {"w", "step", "note.rank", "buf"}
    # Every rank's record: still one JSON document (a user sweep got one object per rank,
    # which json.loads refuses), and in text each block names its record.
    assert main(["inspect", "--json", path]) == EXIT_OK
    both = json.loads(capsys.readouterr().out)
    assert [r["commit_record"] for r in both["commit_records"]] == ["__0.metadata", "__1.metadata"]
    assert main(["inspect", path]) == EXIT_OK
    text = capsys.readouterr().out
    assert "commit record: __0.metadata" in text and "commit record: __1.metadata" in text
    assert "world size" not in text


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpointable_tensor_shards(impl: str, mode: str, tmp_path: Path) -> None:
    """torch 2.14's ``CheckpointableTensor``: a plain tensor holding shards (with padding) of a
    bigger global tensor makes SHARD items; our planner must slice them, not take the buffer."""
    pytest.importorskip("torch.distributed.checkpoint.protocol")
    if impl == "stock" and mode == "async":
        pytest.skip("stock staging (torch 2.14.1) copies the tensor without the protocol fields")

    def shards(buffer: torch.Tensor) -> torch.Tensor:
        buffer.global_shape = (8, 4)  # type: ignore[attr-defined]
        buffer.global_offsets = ((0, 0), (6, 0))  # type: ignore[attr-defined]
        buffer.local_offsets = ((0, 0), (3, 0))  # type: ignore[attr-defined]  # row 2: padding
        buffer.local_sizes = ((2, 4), (2, 4))  # type: ignore[attr-defined]
        return buffer

    saved = shards(torch.arange(20.0).reshape(5, 4))
    path = tmp_path / "ckpt"
    writer = writer_for(impl, path)
    if mode == "sync":
        dcp.save({"t": saved}, storage_writer=writer)
    else:
        dcp.async_save({"t": saved}, storage_writer=writer).result(timeout=30)
    for reader in READERS:
        target = shards(torch.zeros(5, 4))
        dcp.load({"t": target}, storage_reader=reader_for(reader, path))
        assert torch.equal(target[0:2], saved[0:2]) and torch.equal(target[3:5], saved[3:5])


def test_staged_and_planned_dtype_must_match(tmp_path: Path) -> None:
    """A tensor replaced by one of another dtype (same shape) between ``stage()`` and planning
    is refused, naming both dtypes, instead of writing staged bytes under the planned dtype."""
    import threading

    writer = DataStatesWriter(tmp_path / "ckpt")
    try:
        writer.stage({"w": torch.ones(4, 4)})
        errors: list[BaseException] = []

        def save() -> None:  # DCP's save thread: it claims the snapshot staged above
            try:
                dcp.save({"w": torch.ones(4, 4, dtype=torch.float64)}, storage_writer=writer)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=save)
        thread.start()
        thread.join(timeout=30)
        assert len(errors) == 1
        message = str(errors[0])
        assert "torch.float32" in message and "torch.float64" in message and "'w'" in message
        assert not (tmp_path / "ckpt" / ".metadata").exists()
    finally:
        writer.close()


def test_compressed_record_that_decodes_too_big_is_refused(tmp_path: Path) -> None:
    """A zstd record that expands far beyond the tensor it claims (a decompression bomb) is
    refused once it passes the tensor's size, before it fills memory."""
    zstandard = pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    path = tmp_path / "ckpt"
    dcp.save(
        {"t": torch.ones(16)}, storage_writer=dcp.FileSystemWriter(path, _extensions=[ZStandard()])
    )
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    (index, info) = next(iter(metadata.storage_data.items()))
    bomb = zstandard.ZstdCompressor().compress(bytes(16 << 20))
    with open(path / info.relative_path, "ab") as f:
        offset = f.seek(0, io.SEEK_END)
        f.write(bomb)
    info.offset, info.length = offset, len(bomb)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(BaseException, match="decodes to more than") as caught:
        dcp.load({"t": torch.zeros(16)}, storage_reader=DataStatesReader(path))
    assert f"item {index.fqn!r}" in str(caught.value)
