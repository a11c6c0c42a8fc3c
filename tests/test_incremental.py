"""Incremental saves (``incremental=True``): unchanged host tensors are linked, not copied or
written; every checkpoint loads alone with stock ``dcp.load``, and any change to a frozen
tensor, whatever path it takes, is written again."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _incremental_workers
import _s3_server
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_workers import check_all_ok, launch
from _s3_server import S3Env
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from dcp_datastates import Checkpointer, DataStatesReader, DataStatesWriter
from dcp_datastates.checkpointers.tiers import Tier, TieredCheckpointer
from dcp_datastates.cli import main as cli_main
from dcp_datastates.format import LINKED_DATA
from dcp_datastates.storage.s3 import S3Storage

moto_server, s3 = _s3_server.moto_server, _s3_server.s3

BASE = 4 * 64 * 256 * 4  # bytes of the frozen model's weights


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.ModuleList(nn.Linear(256, 64, bias=False) for _ in range(4))
        self.adapter = nn.Linear(8, 8)
        self.base.requires_grad_(False)


def _state(model: nn.Module) -> dict[str, Any]:
    return {"model": model.state_dict(), "step": 0}


def _save(writer: DataStatesWriter, state: dict[str, Any], path: Path, mode: str) -> None:
    if mode == "async":
        dcp.async_save(state, storage_writer=writer, checkpoint_id=path).result()
    else:
        dcp.save(state, storage_writer=writer, checkpoint_id=path)


def _stock_load(path: Path, like: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load({"model": out}, storage_reader=FileSystemReader(path))
    return out


def _linked(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if LINKED_DATA.match(n))


def _train(model: _Model) -> None:
    with torch.no_grad():
        model.adapter.weight.add_(1.0)


@pytest.mark.parametrize("mode", ["save", "async"])
def test_unchanged_tensors_are_linked_and_each_checkpoint_loads_alone(
    tmp_path: Path, mode: str
) -> None:
    torch.manual_seed(0)
    model = _Model()
    writer = DataStatesWriter(tmp_path, incremental=True, flush_workers=2)
    expected = []
    for step in range(3):
        _train(model)
        _save(writer, _state(model), tmp_path / f"s{step}", mode)
        expected.append({k: v.clone() for k, v in model.state_dict().items()})
        assert writer.last_stats is not None
        if step == 0:
            assert writer.last_stats.bytes_written > BASE and not _linked(tmp_path / "s0")
        else:  # only the adapter's records (and framing) are written
            assert writer.last_stats.bytes_written < 16 << 10
            assert writer.last_stats.linked_bytes > BASE
            assert _linked(tmp_path / f"s{step}")
    writer.close()
    assert cli_main(["verify", str(tmp_path / "s2")]) == 0
    for step in (0, 1):  # retention's way, or rm -r
        shutil.rmtree(tmp_path / f"s{step}")
    loaded = _stock_load(tmp_path / "s2", expected[2])
    assert all(torch.equal(loaded[k], v) for k, v in expected[2].items())
    assert cli_main(["verify", str(tmp_path / "s2")]) == 0


def _data_assignment(model: _Model, state: dict[str, Any]) -> None:
    model.base[0].weight.data = torch.randn(64, 256)


def _numpy_view(model: _Model, state: dict[str, Any]) -> None:
    model.base[0].weight.detach().numpy()[3, 7] = 123.0  # no version counter moves


def _load_state_dict(model: _Model, state: dict[str, Any]) -> None:
    model.load_state_dict({**model.state_dict(), "base.0.weight": torch.full((64, 256), 2.0)})


def _new_tensor_same_key(model: _Model, state: dict[str, Any]) -> None:
    state["model"]["base.0.weight"] = torch.randn(64, 256)


def _no_grad_inplace(model: _Model, state: dict[str, Any]) -> None:
    with torch.no_grad():
        model.base[0].weight.mul_(2.0)


def _another_view(model: _Model, state: dict[str, Any]) -> None:
    model.base[0].weight.detach().view(-1)[99] = 5.0


def _alias_of_the_storage(model: _Model, state: dict[str, Any]) -> None:
    w = model.base[0].weight
    alias = torch.empty(0).set_(w.untyped_storage(), 0, (w.numel(),))  # its own counter
    alias[42] = -7.0


MUTATIONS: dict[str, Callable[[_Model, dict[str, Any]], None]] = {
    f.__name__.lstrip("_"): f
    for f in (
        _data_assignment,
        _numpy_view,
        _load_state_dict,
        _new_tensor_same_key,
        _no_grad_inplace,
        _another_view,
        _alias_of_the_storage,
    )
}


@pytest.mark.parametrize("mode", ["save", "async"])
@pytest.mark.parametrize("how", sorted(MUTATIONS))
def test_a_frozen_tensor_changed_by_any_path_is_written_again(
    tmp_path: Path, how: str, mode: str
) -> None:
    torch.manual_seed(1)
    model = _Model()
    writer = DataStatesWriter(tmp_path, incremental=True, flush_workers=1)
    state = _state(model)
    _save(writer, state, tmp_path / "a", mode)
    state = _state(model)
    _save(writer, state, tmp_path / "b", mode)
    assert _linked(tmp_path / "b")  # nothing changed: linked
    before = {k: v.clone() for k, v in state["model"].items()}
    state = _state(model)  # as a loop holds it between saves
    MUTATIONS[how](model, state)
    if how != "new_tensor_same_key":
        state = _state(model)  # and as it takes it again at the next save
    now = {k: v.clone() for k, v in state["model"].items()}
    assert not torch.equal(now["base.0.weight"], before["base.0.weight"])
    _save(writer, state, tmp_path / "c", mode)
    writer.close()
    shutil.rmtree(tmp_path / "a")
    loaded = _stock_load(tmp_path / "c", now)
    assert all(torch.equal(loaded[k], v) for k, v in now.items()), how
    older = _stock_load(tmp_path / "b", before)  # the older checkpoint is untouched
    assert all(torch.equal(older[k], v) for k, v in before.items()), how
    assert cli_main(["verify", str(tmp_path / "c")]) == 0


def test_a_linked_record_damaged_on_disk_fails_verify_of_the_newer_checkpoint(
    tmp_path: Path,
) -> None:
    model = _Model()
    writer = DataStatesWriter(tmp_path, incremental=True, flush_workers=1)
    for name in ("a", "b"):
        _save(writer, _state(model), tmp_path / name, "save")
    writer.close()
    shared = tmp_path / "b" / _linked(tmp_path / "b")[0]
    assert os.stat(shared).st_nlink == 2
    with open(shared, "r+b") as f:
        f.seek(os.path.getsize(shared) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cli_main(["verify", str(tmp_path / "b")]) == 1


def test_a_save_over_a_checkpoint_never_changes_one_that_shares_its_files(
    tmp_path: Path,
) -> None:
    model = _Model()
    writer = DataStatesWriter(tmp_path, incremental=True, flush_workers=1)
    _save(writer, _state(model), tmp_path / "a", "save")
    _save(writer, _state(model), tmp_path / "b", "save")  # links a's file
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.base[1].weight.fill_(3.0)
    # A new writer, with no memory of b: overwrites a's files in place of linking.
    other = DataStatesWriter(tmp_path, incremental=True, flush_workers=1)
    _save(other, _state(model), tmp_path / "a", "save")
    other.close()
    writer.close()
    loaded = _stock_load(tmp_path / "b", kept)
    assert all(torch.equal(loaded[k], v) for k, v in kept.items())


def test_a_new_writer_writes_its_first_save_whole(tmp_path: Path) -> None:
    model = _Model()
    for name in ("a", "b"):  # as a restarted process would
        writer = DataStatesWriter(tmp_path, incremental=True)
        _save(writer, _state(model), tmp_path / name, "save")
        assert writer.last_stats is not None and writer.last_stats.bytes_written > BASE
        writer.close()
    assert not _linked(tmp_path / "b")


def test_retention_keeps_the_newest_incremental_checkpoint_whole(tmp_path: Path) -> None:
    model = _Model()
    ckpt = Checkpointer(tmp_path, every_steps=1, keep_latest_k=1, incremental=True)
    for step in range(1, 4):
        _train(model)
        assert ckpt.save(step, _state(model))
    ckpt.close()
    steps = [n for n in os.listdir(tmp_path) if n.startswith("step")]
    assert len(steps) == 1
    newest = tmp_path / steps[0]
    assert _linked(newest)
    expected = model.state_dict()
    loaded = _stock_load(newest, expected)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    assert cli_main(["verify", str(newest)]) == 0


def test_tiered_upload_of_an_incremental_step_copies_linked_files_server_side(
    tmp_path: Path, s3: S3Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies: list[str] = []
    real = S3Storage.copy_within

    def counted(self: S3Storage, name: str, source_key: str, size: int) -> None:
        real(self, name, source_key, size)
        copies.append(source_key)

    monkeypatch.setattr(S3Storage, "copy_within", counted)
    model = _Model()
    tiers = TieredCheckpointer(
        Tier(url=str(tmp_path / "local"), keep=1),
        Tier(url=s3.url("run"), keep=1, storage_options=s3.options()),
        incremental=True,
        flush_workers=1,
    )
    try:
        for step in (1, 2, 3):
            _train(model)
            tiers.save(_state(model), step).remote.result(30)
            tiers.wait()
            # Each upload after the first copies the linked file from the step before, which
            # the remote retention (keep=1) deletes once this one is committed.
            assert len(copies) == step - 1
            assert (
                copies
                == [f"run/step-{s}/__0_{'0' if s == 1 else 'k0'}.distcp" for s in (1, 2)][
                    : step - 1
                ]
            )
        assert tiers.committed_steps(tiers.remote) == [3]
        expected = model.state_dict()
        out = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": 0}
        shutil.rmtree(tmp_path / "local")  # the remote copy alone
        dcp.load(
            out,
            storage_reader=DataStatesReader(s3.url("run", "step-3"), storage_options=s3.options()),
        )
        assert all(torch.equal(out["model"][k], v) for k, v in expected.items())
    finally:
        tiers.close()


def test_each_rank_links_its_own_files(tmp_path: Path) -> None:
    results = launch("ranks", tmp_path, script=_incremental_workers.__file__)
    check_all_ok(results)
    for r in results:
        linked = r.report["linked"]
        assert linked[0] == [] and linked[1] and linked[2], (r.rank, linked)
        assert all(n.startswith(f"__{r.rank}_k") for n in linked[1] + linked[2])
        assert r.report["written"][2] < 4096  # the adapter's record alone
        assert r.report["loaded_ok"]


@pytest.mark.parametrize("then", ["removed", "replaced"])
def test_a_proven_file_removed_or_replaced_before_the_flush_is_copied_from_the_open_file(
    tmp_path: Path, then: str
) -> None:
    from dcp_datastates.save.incremental import _link, _Source

    older = tmp_path / "older.distcp"
    older.write_bytes(b"proven records")
    source = _Source(str(older))
    older.unlink()  # retention deleted the older checkpoint meanwhile
    if then == "replaced":  # or a save over it wrote a new file there
        older.write_bytes(b"other bytes!!!")
    _link(source, str(tmp_path / "new.distcp"), sync=True)
    source.close()
    assert (tmp_path / "new.distcp").read_bytes() == b"proven records"


def test_a_restarted_checkpointer_reuses_what_its_bytes_prove_unchanged(tmp_path: Path) -> None:
    model = _Model()
    first = Checkpointer(tmp_path, every_steps=1, incremental=True, flush_workers=1)
    first.save(1, _state(model))
    first.close()
    model.base[2].weight.detach().numpy()[0, 0] = 42.0  # while no process watched it
    _train(model)
    again = Checkpointer(tmp_path, every_steps=1, incremental=True, flush_workers=2)
    again.save(2, _state(model))
    again.wait()
    stats = again.writer.last_stats
    again.close()
    newest = next(p for p in tmp_path.iterdir() if p.name.startswith("step") and "2" in p.name)
    linked = _linked(newest)
    assert linked and stats is not None
    assert 64 * 256 * 4 < stats.bytes_written < BASE  # the changed tensor, not the others
    shutil.rmtree(next(p for p in tmp_path.iterdir() if p.is_dir() and p != newest))
    expected = model.state_dict()
    loaded = _stock_load(newest, expected)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


@pytest.mark.parametrize("way", ["copy_object", "upload_part_copy"])
def test_a_server_side_copy_holds_the_source_bytes(
    s3: S3Env, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    from dcp_datastates.storage import s3 as s3_module

    if way == "upload_part_copy":  # as for an object past CopyObject's 5 GB
        monkeypatch.setattr(s3_module, "_COPY_OBJECT_MAX", 0)
    blob = os.urandom(6 << 20)
    s3.client().put_object(Bucket=s3.bucket, Key="a/__0_0.distcp", Body=blob)
    target = S3Storage(s3.url("b"), s3.options())
    target.copy_within("__0_k0.distcp", "a/__0_0.distcp", len(blob))
    body = s3.client().get_object(Bucket=s3.bucket, Key="b/__0_k0.distcp")["Body"].read()
    assert body == blob
    with pytest.raises(OSError):  # a source retention deleted: the caller uploads instead
        target.copy_within("__0_k1.distcp", "a/gone.distcp", len(blob))


def test_an_incremental_writer_saving_straight_to_s3_writes_each_save_whole(s3: S3Env) -> None:
    """No link exists there (tiered uploads copy server-side instead): written, as without it."""
    model = _Model()
    writer = DataStatesWriter(s3.url("direct"), incremental=True, storage_options=s3.options())
    for name in ("a", "b"):
        _save(writer, _state(model), s3.url("direct", name), "save")  # type: ignore[arg-type]
        assert writer.last_stats is not None and writer.last_stats.bytes_written > BASE
        assert writer.last_stats.linked_bytes == 0
    writer.close()
    expected = model.state_dict()
    out = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "step": 0}
    reader = DataStatesReader(s3.url("direct", "b"), storage_options=s3.options())
    dcp.load(out, storage_reader=reader)
    assert all(torch.equal(out["model"][k], v) for k, v in expected.items())


def test_a_compressed_incremental_writer_writes_what_it_cannot_prove(tmp_path: Path) -> None:
    """Records through a stream transform carry the transformed bytes' CRC-32C, which no raw
    tensor gives: nothing is linked, every save is written and loads alone."""
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    model = _Model()
    writer = DataStatesWriter(tmp_path, incremental=True, _extensions=[ZStandard()])
    for name in ("a", "b"):
        _save(writer, _state(model), tmp_path / name, "save")
    writer.close()
    assert not _linked(tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    expected = model.state_dict()
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load({"model": out}, checkpoint_id=tmp_path / "b")
    assert all(torch.equal(out[k], v) for k, v in expected.items())
