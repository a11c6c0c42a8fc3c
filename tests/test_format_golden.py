"""The on-disk format, pinned: a tiny fixed state must produce the committed golden bytes.

Regenerate the golden files only for a deliberate format change (and bump FORMAT_VERSION)::

    python tests/test_format_golden.py

That writes ``tests/golden/manifest.json`` and ``tests/golden/__0_0.distcp``; see
``tests/golden/README.md``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from crc32c import crc32c

from dcp_datastates import DataStatesWriter
from dcp_datastates.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_CRC_FIELD,
    MANIFEST_NAME,
    METADATA_CRC_FIELD,
    METADATA_NAME,
    decode_manifest,
)

GOLDEN = Path(__file__).parent / "golden"
DATA_FILE = "__0_0.distcp"
#: The torch release whose ``torch.save`` framing the golden bytes were made with.
GOLDEN_TORCH = "2.13."
#: Manifest fields that legitimately differ between machines or torch builds (the manifest's own
#: checksum covers the torch version string).
VOLATILE = ("torch", MANIFEST_CRC_FIELD, METADATA_CRC_FIELD)


def golden_state() -> dict[str, Any]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": 3}


def write_checkpoint(path: Path) -> None:
    writer = DataStatesWriter(path, flush_workers=1)
    try:
        dcp.save(golden_state(), storage_writer=writer, no_dist=True)
    finally:
        writer.close()


def stable_manifest(path: Path) -> dict[str, Any]:
    body = json.loads((path / MANIFEST_NAME).read_text())
    for key in VOLATILE:
        body.pop(key, None)
    return body


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("golden")
    write_checkpoint(path)
    return path


def test_the_checkpoint_holds_one_data_file_a_manifest_and_metadata(saved: Path) -> None:
    assert sorted(p.name for p in saved.iterdir()) == sorted(
        [DATA_FILE, MANIFEST_NAME, METADATA_NAME]
    )


def test_the_manifest_describes_each_record(saved: Path) -> None:
    body = stable_manifest(saved)
    assert body["format"] == FORMAT_NAME
    assert body["version"] == FORMAT_VERSION
    assert body["checksum"] == "crc32c"
    assert body["world_size"] == 1
    items = body["items"]
    assert sorted(items) == ["step", "w@0,0"]
    assert items["w@0,0"]["kind"] == "tensor"
    assert items["w@0,0"]["data_length"] == 6 * 4
    assert items["step"]["kind"] == "object"
    assert {item["relative_path"] for item in items.values()} == {DATA_FILE}


def test_the_manifest_carries_its_own_checksum(saved: Path) -> None:
    blob = (saved / MANIFEST_NAME).read_bytes()
    body = json.loads(blob)
    crc = body.pop(MANIFEST_CRC_FIELD)
    assert crc == crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    assert decode_manifest(blob)  # and the reader accepts it


def test_the_manifest_holds_the_checksum_of_the_commit_record(saved: Path) -> None:
    """``.metadata`` carries paths and a save id, so its bytes differ per save: not golden, but
    the manifest must hold their CRC-32C (a reader checks it before unpickling)."""
    body = json.loads((saved / MANIFEST_NAME).read_bytes())
    assert body[METADATA_CRC_FIELD] == crc32c((saved / METADATA_NAME).read_bytes())


def test_an_indented_manifest_of_earlier_versions_reads_the_same(saved: Path) -> None:
    # Earlier versions wrote json.dumps(..., indent=1, sort_keys=True); the checksum covers the
    # canonical bytes, not the layout, so both files must decode to the same entries.
    blob = (saved / MANIFEST_NAME).read_bytes()
    indented = json.dumps(json.loads(blob), indent=1, sort_keys=True).encode()
    assert indented != blob
    assert decode_manifest(indented) == decode_manifest(blob)


def test_a_tensor_record_holds_the_raw_little_endian_values(saved: Path) -> None:
    record = stable_manifest(saved)["items"]["w@0,0"]
    blob = (saved / DATA_FILE).read_bytes()

    raw = blob[record["data_offset"] : record["data_offset"] + record["data_length"]]
    assert raw == golden_state()["w"].numpy().astype("<f4").tobytes()
    assert record["offset"] <= record["data_offset"]
    assert record["data_offset"] + record["data_length"] <= record["offset"] + record["length"]


@pytest.mark.skipif(
    not torch.__version__.startswith(GOLDEN_TORCH),
    reason=f"golden bytes were made with torch {GOLDEN_TORCH}x; torch.save framing (record "
    f"headers, offsets, checksums) may differ in torch {torch.__version__}",
)
def test_the_manifest_and_data_file_match_the_golden_bytes(saved: Path) -> None:
    expected_manifest = json.loads((GOLDEN / "manifest.json").read_text())
    assert stable_manifest(saved) == expected_manifest
    assert (saved / DATA_FILE).read_bytes() == (GOLDEN / DATA_FILE).read_bytes()


def regenerate() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        write_checkpoint(path)
        GOLDEN.mkdir(exist_ok=True)
        manifest = json.dumps(stable_manifest(path), indent=1, sort_keys=True) + "\n"
        (GOLDEN / "manifest.json").write_text(manifest)
        shutil.copyfile(path / DATA_FILE, GOLDEN / DATA_FILE)
    print(f"wrote {GOLDEN} with torch {torch.__version__}", file=sys.stderr)


if __name__ == "__main__":
    regenerate()


def test_the_manifest_text_is_json_canonical_bytes_for_any_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The manifest is written as text directly (``format._canonical_manifest``), not through
    ``json.dumps``; readers check its checksum against json's canonical bytes of what they
    parse, so the two must agree byte for byte, whatever the keys, file names and kinds hold."""
    from dcp_datastates.format import (
        RecordInfo,
        _canonical,
        _canonical_manifest,
        _manifest_body,
        decode_manifest_full,
        encode_manifest,
        manifest_key,
    )

    names = ["w", 'q"uote', "back\\slash", "tab\there", "ünïcödé.λ", "emoji 🚀", "ctl\x01", ""]
    entries = {
        manifest_key(name, (i, 0) if i % 2 else None): RecordInfo(
            f"__0_{i % 3}.distcp" if i % 4 else f"dir/{name}.distcp",
            offset=4096 * i,
            length=100 + i,
            data_offset=4096 * i + 64,
            data_length=36 + i,
            crc32c=(2**32 - 1) - i,
            kind=name if i == 5 else "tensor",
        )
        for i, name in enumerate(names)
    }
    from dcp_datastates import format as format_module

    for world_size, torch_version, meta_crc in (
        (1, "2.13.0+cpu", None),
        (16, 'v"1\u00e9', 2**32 - 1),
    ):
        kw = {"world_size": world_size, "torch_version": torch_version, "metadata_crc32c": meta_crc}
        expected = _canonical(_manifest_body(entries, **kw))
        with monkeypatch.context() as m:  # the direct text, not json's path
            m.setattr(format_module, "_canonical", None)
            ours = _canonical_manifest(entries, **kw)
        assert ours == expected
        blob = encode_manifest(entries, **kw)
        assert decode_manifest_full(blob) == (entries, meta_crc)
    assert _canonical_manifest({}, world_size=1, torch_version="x") == _canonical(
        _manifest_body({}, world_size=1, torch_version="x")
    )


def test_a_record_frame_takes_no_memory_the_size_of_its_tensor() -> None:
    """A frame is built once per dtype and shape, on the flush thread: a buffer as big as the
    record cost a memset of the tensor's size (0.3-0.5 s of a 4 GB state's first save, beside
    the snapshot's copies)."""
    import tracemalloc

    from dcp_datastates import format as format_mod

    shape = (1 << 14, 1 << 14)  # 1 GiB of float32, never allocated for real (torch.empty)
    format_mod.record_frame.cache_clear()
    tracemalloc.start()
    try:
        frame = format_mod.record_frame(torch.float32, shape)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert frame.data_length == 1 << 30
    assert peak < 1 << 20
