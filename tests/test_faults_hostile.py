"""Hostile checkpoints, beyond ``test_safety_and_cli.py`` (which covers a ``.metadata`` pickle
that runs code, ``..`` / absolute / symlinked paths in ``.metadata`` and a truncated file): the
same attacks carried by the manifest, and records in ``.metadata`` or the manifest that point past
the end of their file or before its start. A safe ``DataStatesReader`` refuses each before
reading a byte of data, with an error that says why.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import write_commit_record
from crc32c import crc32c

from dcp_datastates import DataStatesReader
from dcp_datastates.errors import ChecksumMismatchError, UnsafeCheckpointError
from dcp_datastates.format import MANIFEST_CRC_FIELD, MANIFEST_NAME, METADATA_NAME


@pytest.fixture
def ckpt(tmp_path: Path, make_writer: Any) -> Path:
    path = tmp_path / "ckpt"
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}
    dcp.save(state, storage_writer=make_writer(path), no_dist=True)
    return path


def _edit_manifest(path: Path, field: str, value: Any, key: str = "w@0,0") -> str:
    """Change one record field (``value=None``: drop the item) and re-sign the manifest, as
    someone crafting it would: its own checksum proves it undamaged, not trustworthy."""
    body = json.loads((path / MANIFEST_NAME).read_bytes())
    body.pop(MANIFEST_CRC_FIELD)
    if value is None:
        del body["items"][key]
    else:
        body["items"][key][field] = value
    body[MANIFEST_CRC_FIELD] = crc32c(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    )
    (path / MANIFEST_NAME).write_text(json.dumps(body))
    return key


def _edit_metadata(path: Path, **changes: Any) -> str:
    metadata = pickle.loads((path / METADATA_NAME).read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **changes)
    write_commit_record(path, pickle.dumps(metadata))
    return index.fqn


@pytest.mark.parametrize("relative_path", ["../outside.distcp", "/etc/passwd"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(
    ckpt: Path, relative_path: str
) -> None:
    (ckpt.parent / "outside.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes())
    _edit_manifest(ckpt, "relative_path", relative_path)
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        DataStatesReader(ckpt).read_metadata()


@pytest.mark.parametrize("where", ["manifest", "metadata"])
def test_a_record_pointing_past_the_end_of_its_file_is_refused(ckpt: Path, where: str) -> None:
    size = (ckpt / "__0_0.distcp").stat().st_size
    if where == "manifest":
        item = _edit_manifest(ckpt, "length", size * 4)
    else:
        item = _edit_metadata(ckpt, length=size * 4)
    with pytest.raises(ChecksumMismatchError) as raised:
        DataStatesReader(ckpt).read_metadata()
    assert repr(item) in str(raised.value) and "truncated" in str(raised.value)


@pytest.mark.parametrize("where", ["manifest", "metadata"])
def test_a_record_with_a_negative_offset_is_refused(ckpt: Path, where: str) -> None:
    if where == "manifest":
        _edit_manifest(ckpt, "offset", -64)
    else:
        _edit_metadata(ckpt, offset=-64)
    with pytest.raises(UnsafeCheckpointError, match="offset -64"):
        DataStatesReader(ckpt).read_metadata()


def test_trusted_mode_is_the_only_way_past_the_checks(ckpt: Path) -> None:
    _edit_metadata(ckpt, relative_path="../outside.distcp")
    _edit_manifest(ckpt, "relative_path", "../outside.distcp")  # consistent, as if crafted
    (ckpt.parent / "outside.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes())
    with pytest.raises(UnsafeCheckpointError):
        DataStatesReader(ckpt).read_metadata()
    DataStatesReader(ckpt, trusted=True).read_metadata()  # the caller vouched for it


def _load_w(path: Path) -> BaseException:
    target = {"w": torch.zeros(3, 4), "step": 0}
    with pytest.raises(BaseException) as caught:  # DCP's CheckpointException is a BaseException
        dcp.load(target, storage_reader=DataStatesReader(path), no_dist=True)
    return caught.value


@pytest.mark.parametrize("shift", [-64, -4, 4, 64])
def test_a_resigned_manifest_moving_data_offset_does_not_load_shifted_bytes(
    ckpt: Path, shift: int
) -> None:
    """The record checksum covers head + data + tail whatever the split; the data must start
    right after the record's zip entry header, so a moved data_offset is refused."""
    info = json.loads((ckpt / MANIFEST_NAME).read_bytes())["items"]["w@0,0"]
    _edit_manifest(ckpt, "data_offset", info["data_offset"] + shift)
    error = _load_w(ckpt)
    assert "item 'w': its data does not start at data_offset" in str(error), error


def test_a_resigned_manifest_that_drops_an_item_is_refused_not_read_unverified(
    ckpt: Path,
) -> None:
    _edit_manifest(ckpt, "", None)
    with pytest.raises(ChecksumMismatchError, match=r"no entry for item 'w@0,0'"):
        DataStatesReader(ckpt).read_metadata()


def test_a_resigned_manifest_giving_an_object_a_data_range_is_refused(ckpt: Path) -> None:
    info = json.loads((ckpt / MANIFEST_NAME).read_bytes())["items"]["step"]
    _edit_manifest(ckpt, "data_length", info["data_length"] - 1, key="step")
    with pytest.raises(ChecksumMismatchError, match=r"object item 'step' has data_offset"):
        DataStatesReader(ckpt).read_metadata()
