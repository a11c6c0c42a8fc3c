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

from dcp_datastates import DataStatesReader
from dcp_datastates.errors import ChecksumMismatchError, UnsafeCheckpointError
from dcp_datastates.format import MANIFEST_NAME, METADATA_NAME


@pytest.fixture
def ckpt(tmp_path: Path, make_writer: Any) -> Path:
    path = tmp_path / "ckpt"
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 7}
    dcp.save(state, storage_writer=make_writer(path), no_dist=True)
    return path


def _edit_manifest(path: Path, field: str, value: Any) -> str:
    body = json.loads((path / MANIFEST_NAME).read_bytes())
    key = "w@0,0"
    body["items"][key][field] = value
    (path / MANIFEST_NAME).write_text(json.dumps(body))
    return key


def _edit_metadata(path: Path, **changes: Any) -> str:
    metadata = pickle.loads((path / METADATA_NAME).read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **changes)
    (path / METADATA_NAME).write_bytes(pickle.dumps(metadata))
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
    (ckpt.parent / "outside.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes())
    with pytest.raises(UnsafeCheckpointError):
        DataStatesReader(ckpt).read_metadata()
    DataStatesReader(ckpt, trusted=True).read_metadata()  # the caller vouched for it
