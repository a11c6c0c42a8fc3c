"""Corruption: one flipped byte or a truncation anywhere in a data file, or in the manifest, is
detected by ``DataStatesReader`` and named (the item, the file), never loaded.

Data files: every record of every file gets flipped bytes in its frame head, its data (first,
middle and last byte) and its frame tail, and every file is truncated inside every record. The
manifest: every byte is flipped (lowest bit, which keeps the JSON mostly well-formed and so is
the hardest case), some bytes get their high bit set, and it is truncated at seeded lengths; each
outcome is classified by what the flip changed in the parsed JSON.
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_same_state, blank_like, failure_of

from dcp_datastates import ChecksumMismatchError, DataStatesReader
from dcp_datastates.errors import DataStatesError
from dcp_datastates.format import MANIFEST_NAME

SEED = 11


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(SEED)
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "ids": torch.randint(0, 1000, (100,), generator=g),
            "scale": torch.tensor(0.5, dtype=torch.float64),
        },
        "big": torch.randn(200_000, generator=g),  # several chunks, its own file
        "step": 42,
        "meta": {"tag": "run-7", "lrs": [0.1, 0.01]},
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dcp_datastates import DataStatesWriter

    path = tmp_path_factory.mktemp("corruption") / "pristine"
    writer = DataStatesWriter(
        path, flush_workers=2, chunk_bytes=64 * 1024, coalesce_bytes=16 * 1024
    )
    try:
        dcp.save(_state(), storage_writer=writer, no_dist=True)
    finally:
        writer.close()
    return path


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(pristine, path)
    return path


def _records(path: Path) -> dict[str, dict[str, Any]]:
    return json.loads((path / MANIFEST_NAME).read_bytes())["items"]


@contextlib.contextmanager
def _patched(file: Path, blob: bytes) -> Iterator[None]:
    """``file`` holds ``blob`` inside the block; its original bytes afterwards."""
    original = file.read_bytes()
    file.write_bytes(blob)
    try:
        yield
    finally:
        file.write_bytes(original)


def _load(path: Path) -> tuple[dict[str, Any] | None, BaseException | None]:
    target = blank_like(_state())
    try:
        dcp.load(target, storage_reader=DataStatesReader(path), no_dist=True)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        return None, exc
    return target, None


def _refusal(exc: BaseException) -> BaseException:
    """The error a user would read: the rank's own error inside DCP's CheckpointException."""
    for kind in (DataStatesError, Exception):
        found = failure_of(exc, kind)
        if found is not None:
            return found
    return exc


def _data_flips(path: Path, rng: random.Random) -> list[tuple[str, str, int]]:
    """(item key, file, byte offset) to flip: head, data first/middle/last, tail of each record."""
    flips = []
    for key, rec in _records(path).items():
        start, end = rec["offset"], rec["offset"] + rec["length"]
        d0, d1 = rec["data_offset"], rec["data_offset"] + rec["data_length"]
        spots = {d0, (d0 + d1) // 2, d1 - 1} if d1 > d0 else {rng.randrange(start, end)}
        if d0 > start:
            spots.add(rng.randrange(start, d0))
        if end > d1:
            spots.add(rng.randrange(d1, end))
        flips += [(key, rec["relative_path"], at) for at in sorted(spots)]
    return flips


def test_every_flipped_byte_in_every_data_file_is_detected_and_named(ckpt: Path) -> None:
    rng = random.Random(SEED)
    flips = _data_flips(ckpt, rng)
    files = {f for _, f, _ in flips}
    assert len(files) >= 2 and len(flips) >= 30
    missed = []
    for key, name, at in flips:
        blob = bytearray((ckpt / name).read_bytes())
        blob[at] ^= rng.randrange(1, 256)
        with _patched(ckpt / name, bytes(blob)):
            loaded, exc = _load(ckpt)
        fqn = key.split("@")[0]
        err = _refusal(exc) if exc is not None else None
        if not (
            isinstance(err, ChecksumMismatchError) and repr(fqn) in str(err) and name in str(err)
        ):
            missed.append((key, name, at, repr(err)[:200]))
    assert missed == [], f"{len(missed)} of {len(flips)} flips not detected and named: {missed}"
    print(f"\ndata-file flips: {len(flips)} trials in {len(files)} files, all detected")


def test_every_truncated_data_file_is_detected_and_names_a_damaged_item(ckpt: Path) -> None:
    records = _records(ckpt)
    by_file: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for key, rec in records.items():
        by_file[rec["relative_path"]].append({"key": key, **rec})
    trials = 0
    for name, recs in by_file.items():
        blob = (ckpt / name).read_bytes()
        cuts = {len(blob) - 1}
        for rec in recs:
            cuts |= {rec["offset"] + 1, rec["offset"] + rec["length"] // 2}
        for cut in sorted(cuts):
            with _patched(ckpt / name, blob[:cut]):
                loaded, exc = _load(ckpt)
            trials += 1
            assert loaded is None, f"{name} cut at {cut} of {len(blob)} bytes loaded"
            # Found while reading .metadata, so DCP re-raises it as its own AssertionError with
            # our ChecksumMismatchError's message in it.
            text = str(_refusal(exc))
            damaged = {r["key"].split("@")[0] for r in recs if r["offset"] + r["length"] > cut}
            assert any(repr(fqn) in text or repr(f"{fqn}@") in text for fqn in damaged), text
            assert name in text and "truncated" in text and "damaged" in text
    print(f"\ndata-file truncations: {trials} trials, all detected")


# -- the manifest --------------------------------------------------------------------------------
def _category(original: dict[str, Any], blob: bytes) -> str:
    """What a damaged manifest ``blob`` changed, compared with the parsed ``original``."""
    try:
        body = json.loads(blob)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return "unparsable"
    if not isinstance(body, dict):
        return "unparsable"
    if body.keys() != original.keys():
        return "field name"
    for top in ("format", "version"):
        if body[top] != original[top]:
            return "format or version"
    items, was = body["items"], original["items"]
    if not isinstance(items, dict):
        return "field name"
    if items.keys() != was.keys():
        return "item key"
    for key, rec in items.items():
        if not isinstance(rec, dict) or rec.keys() != was[key].keys():
            return "field name"
        changed = {f for f in rec if rec[f] != was[key][f]}
        if changed:
            (field,) = changed  # one flipped byte changes one value
            return f"record {field}"
    return "descriptive (torch, checksum, world_size)"


def _clear(err: BaseException) -> bool:
    """A refusal a user can act on: our error type, or one that names the manifest."""
    return isinstance(err, DataStatesError) or "manifest" in str(err)


@pytest.fixture(scope="module")
def manifest_trials(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    """{category: [(what was done, outcome, detail)]} for every manifest damage trial."""
    path = tmp_path_factory.mktemp("manifest") / "ckpt"
    shutil.copytree(pristine, path)
    manifest = path / MANIFEST_NAME
    blob = manifest.read_bytes()
    original = json.loads(blob)
    expected = _state()
    rng = random.Random(SEED)
    # A seeded third of the bytes (a load costs ~15 ms; every byte would take ~25 s).
    damaged = [
        (f"flip 0x01 at {i}", blob[:i] + bytes([blob[i] ^ 0x01]) + blob[i + 1 :])
        for i in sorted(rng.sample(range(len(blob)), len(blob) // 3))
    ]
    for i in sorted(rng.sample(range(len(blob)), 24)):
        damaged.append((f"flip 0x80 at {i}", blob[:i] + bytes([blob[i] ^ 0x80]) + blob[i + 1 :]))
    for cut in sorted(rng.sample(range(len(blob)), 12)):
        damaged.append((f"truncate to {cut}", blob[:cut]))
    out: dict[str, list] = collections.defaultdict(list)
    for what, bad in damaged:
        with _patched(manifest, bad):
            loaded, exc = _load(path)
        if exc is not None:
            err = _refusal(exc)
            outcome = "refused clearly" if _clear(err) else "refused unclearly"
            detail = f"{type(err).__name__}: {str(err)[:120]}"
        else:
            try:
                assert_same_state(expected, loaded)
                outcome, detail = "loaded exactly", ""
            except AssertionError as wrong:
                outcome, detail = "LOADED WRONG VALUES", str(wrong)[:120]
        out[_category(original, bad)].append((what, outcome, detail))
    return out


MANIFEST_CATEGORIES = (
    "unparsable",
    "format or version",
    "record crc32c",
    "record offset",
    "record length",
    "record data_length",
    "record data_offset",
    "record relative_path",
    "record kind",
    "item key",
    "field name",
    "descriptive (torch, checksum, world_size)",
)


@pytest.mark.parametrize(
    "category",
    MANIFEST_CATEGORIES,
)
def test_damaged_manifest_is_refused_with_a_clear_error(
    manifest_trials: dict[str, list], category: str
) -> None:
    assert set(manifest_trials) <= set(MANIFEST_CATEGORIES), set(manifest_trials)
    trials = manifest_trials[category]
    assert trials, f"no trial fell into {category!r}"
    outcomes = collections.Counter(outcome for _, outcome, _ in trials)
    print(f"\nmanifest, {category}: {len(trials)} trials: {dict(outcomes)}")
    bad = [t for t in trials if t[1] != "refused clearly"]
    assert bad == [], f"{len(bad)} of {len(trials)} not refused clearly, e.g. {bad[:3]}"


def test_damaged_manifest_never_loads_wrong_values(manifest_trials: dict[str, list]) -> None:
    """The safety property behind the table: no damaged manifest loads wrong values."""
    wrong = [
        (category, what)
        for category, trials in manifest_trials.items()
        for what, outcome, _ in trials
        if outcome == "LOADED WRONG VALUES"
    ]
    assert wrong == []
