"""On-disk format: torch.save records with raw data, and the sidecar manifest.

Every tensor item is stored as a complete ``torch.save`` zip record, so stock DCP's
``FileSystemReader`` (``torch.load(weights_only=True)``) reads it. The record is produced without
serializing the data: ``torch.save`` under ``skip_data()`` into a sink that records everything
except the data region gives a *frame* (head + tail) that depends only on dtype and shape. A record
is ``head + raw bytes + tail``. See ``docs/format.md``.
"""

from __future__ import annotations

import functools
import json
import re
import struct
import uuid
from dataclasses import dataclass, fields
from json.encoder import encode_basestring_ascii
from typing import Any

import torch
from crc32c import crc32c
from torch.serialization import skip_data

from .errors import ChecksumMismatchError

FORMAT_NAME = "dcp_datastates"
FORMAT_VERSION = 1
METADATA_NAME = ".metadata"
MANIFEST_NAME = ".datastates.json"
#: In a ``Checkpointer`` root: the newest committed step, as text (the CLI and reader read it).
LATEST_NAME = "latest"
DATA_SUFFIX = ".distcp"
#: ``__{rank}_k{n}.distcp``: a data file an incremental save linked from an older checkpoint
#: (``save/incremental.py``); it may hold records no item of this checkpoint names.
LINKED_DATA = re.compile(r"^__\d+_k\d+" + re.escape(DATA_SUFFIX) + "$")


@dataclass(frozen=True)
class RecordFrame:
    """The bytes around a tensor's raw data in its ``torch.save`` record."""

    head: bytes
    tail: bytes
    data_length: int

    @property
    def length(self) -> int:
        return len(self.head) + self.data_length + len(self.tail)


class _FrameSink:
    """A seekable sink for ``torch.save``: keeps every write, remembers the skipped data hole."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, bytes]] = []
        self.pos = 0
        self.hole: tuple[int, int] | None = None

    def write(self, data: Any) -> int:
        blob = bytes(data)
        self.parts.append((self.pos, blob))
        self.pos += len(blob)
        return len(blob)

    def seek(self, offset: int, whence: int = 0) -> int:
        target = offset if whence == 0 else self.pos + offset
        if whence not in (0, 1):
            raise OSError("record frames are written forward only")
        if target > self.pos:
            if self.hole is not None:
                raise AssertionError("torch.save skipped two data regions for one tensor")
            self.hole = (self.pos, target - self.pos)
        self.pos = target
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


@functools.lru_cache(maxsize=4096)
def record_frame(dtype: torch.dtype, shape: tuple[int, ...]) -> RecordFrame:
    """Head and tail of the ``torch.save`` record of a contiguous tensor of ``dtype``/``shape``.

    Cached: frames depend only on dtype and shape (and the torch version writing them).
    """
    template = torch.empty(shape, dtype=dtype)  # never touched: only its metadata is saved
    sink = _FrameSink()
    with skip_data():
        torch.save(template, sink)
    nbytes = template.numel() * template.element_size()
    hole_start, hole_len = sink.hole if sink.hole is not None else (sink.pos, 0)
    if hole_len != nbytes:
        raise AssertionError(f"unexpected torch.save layout for {dtype} {tuple(shape)}")
    # An empty tensor has no hole: the whole record is its head. Head and tail are assembled
    # apart: a buffer of the whole record (zeroed, as big as the tensor) cost a memset and a
    # fault per page of every new shape's size on the flush thread, 0.3-0.5 s of a first
    # save's 4 GB state.
    hole_end = hole_start + nbytes
    head, tail = bytearray(hole_start), bytearray(sink.pos - hole_end)
    for pos, part in sink.parts:
        end = pos + len(part)
        if end <= hole_start:
            head[pos:end] = part
        elif pos >= hole_end:
            tail[pos - hole_end : end - hole_end] = part
        elif part:
            raise AssertionError(f"torch.save wrote into the data of {dtype} {tuple(shape)}")
    return RecordFrame(head=bytes(head), tail=bytes(tail), data_length=nbytes)


@dataclass(frozen=True)
class RecordInfo:
    """Where one item's record sits and how to check it; carried in ``WriteResult.storage_data``.

    ``finish`` splits it into the stock ``_StorageInfo`` (for ``.metadata``) and a manifest entry.
    """

    relative_path: str
    offset: int
    length: int
    data_offset: int  # absolute offset of the raw bytes in the file
    data_length: int
    crc32c: int  # over the whole record: [offset, offset + length)
    kind: str  # provider kind: "tensor", "shard", "object", or a user kind


def manifest_key(fqn: str, offset: Any) -> str:
    """Stable text key of a ``MetadataIndex``: the fqn, plus the chunk offsets for tensors."""
    if offset is None:
        return fqn
    return f"{fqn}@{_offsets_text(tuple(offset))}"


@functools.lru_cache(maxsize=4096)
def _offsets_text(offset: tuple[Any, ...]) -> str:
    # Cached: most items share a few offsets (all zeros), and a generator per item was 9% of
    # the save thread's CPU at 20,000 items.
    return ",".join(str(int(o)) for o in offset)


#: The manifest's own checksum: CRC-32C of the compact sorted JSON of every other field.
MANIFEST_CRC_FIELD = "manifest_crc32c"
#: CRC-32C of the commit record (``.metadata``) the manifest was written with: a reader checks
#: the bytes before it unpickles them. Optional (manifests before it have none).
METADATA_CRC_FIELD = "metadata_crc32c"

#: How our writer's ``StorageMeta.save_id`` starts (an opaque string to stock DCP, which makes a
#: bare UUID): a ``.metadata`` that carries it was committed after its manifest, so a reader
#: that finds no manifest beside it knows the manifest was lost, not that stock DCP wrote it.
SAVE_ID_PREFIX = f"{FORMAT_NAME}:"


def new_save_id() -> str:
    """A save's ``StorageMeta.save_id``: unique, and saying that a manifest was committed."""
    return f"{SAVE_ID_PREFIX}{uuid.uuid4()}"


def committed_with_manifest(metadata: Any) -> bool:
    """Whether ``metadata`` (DCP's ``Metadata``) was committed by our writer, with a manifest."""
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    return isinstance(save_id, str) and save_id.startswith(SAVE_ID_PREFIX)


def _canonical(body: dict[str, Any]) -> bytes:
    """The bytes ``manifest_crc32c`` covers: compact, sorted JSON (json's fast C encoder)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_manifest(
    entries: dict[str, RecordInfo],
    *,
    world_size: int,
    torch_version: str,
    metadata_crc32c: int | None = None,
) -> bytes:
    """The manifest file: its checksum field first, then the canonical bytes it covers.

    One pass of json's C encoder: 0.75 ms for 350 items, 72 ms for 20,000, on the save thread.
    The indented file this replaced took 6.1 ms and 0.38 s (an ``indent`` makes json fall back
    to its Python encoder, and ``asdict`` deep-copies every entry). Readers parse the file as
    JSON and check the field against the canonical bytes of the rest, so its place is free."""
    canonical = _canonical_manifest(
        entries, world_size=world_size, torch_version=torch_version, metadata_crc32c=metadata_crc32c
    )
    return b'{"%s":%d,' % (MANIFEST_CRC_FIELD.encode(), crc32c(canonical)) + canonical[1:]


def _manifest_body(
    entries: dict[str, RecordInfo],
    *,
    world_size: int,
    torch_version: str,
    metadata_crc32c: int | None = None,
) -> dict[str, Any]:
    body = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "torch": torch_version,
        "world_size": world_size,
        "checksum": "crc32c",
        "items": {key: vars(info) for key, info in sorted(entries.items())},
    }
    if metadata_crc32c is not None:
        body[METADATA_CRC_FIELD] = metadata_crc32c
    return body


#: One manifest entry, as ``_canonical`` writes it: ``RecordInfo``'s fields in sorted order
#: (checked below, so that a field added to ``RecordInfo`` cannot be left out of the text).
_ENTRY = (
    '{"crc32c":%d,"data_length":%d,"data_offset":%d,"kind":%s,"length":%d,"offset":%d,'
    '"relative_path":%s}'
)
if re.findall(r'"(\w+)":', _ENTRY) != sorted(f.name for f in fields(RecordInfo)):
    raise AssertionError("format._ENTRY does not write RecordInfo's fields")


def _canonical_manifest(
    entries: dict[str, RecordInfo],
    *,
    world_size: int,
    torch_version: str,
    metadata_crc32c: int | None = None,
) -> bytes:
    """``_canonical`` of the manifest's body, byte for byte, written as text directly.

    ``json.dumps`` turns each entry's dict into a list of (key, value) tuples to encode it:
    140,000 objects the cyclic GC tracks at 20,000 entries, whose young collections made the
    encoding 45-270 ms on the save thread. Here each entry is one string (which the GC does not
    track), strings escaped by json's own C function. An entry whose fields are not exactly
    ints and strings (none that this package writes) sends the whole manifest down json's path:
    ``%d`` would write a float or a bool otherwise than json does."""
    text = _json_text
    parts = []
    for key in sorted(entries):
        info = entries[key]
        if not (
            type(info) is RecordInfo
            and type(info.crc32c) is int
            and type(info.data_length) is int
            and type(info.data_offset) is int
            and type(info.length) is int
            and type(info.offset) is int
            and type(info.kind) is str
            and type(info.relative_path) is str
        ):
            return _canonical(
                _manifest_body(
                    entries,
                    world_size=world_size,
                    torch_version=torch_version,
                    metadata_crc32c=metadata_crc32c,
                )
            )
        entry = _ENTRY % (
            info.crc32c,
            info.data_length,
            info.data_offset,
            text(info.kind),
            info.length,
            info.offset,
            text(info.relative_path),
        )
        parts.append(f"{encode_basestring_ascii(key)}:{entry}")
    head = f'{{"checksum":"crc32c","format":{encode_basestring_ascii(FORMAT_NAME)},"items":{{'
    crc = "" if metadata_crc32c is None else f',"{METADATA_CRC_FIELD}":{metadata_crc32c:d}'
    tail = (
        f'}}{crc},"torch":{encode_basestring_ascii(torch_version)},"version":{FORMAT_VERSION:d},'
        f'"world_size":{world_size:d}}}'
    )
    return (head + ",".join(parts) + tail).encode()


@functools.lru_cache(maxsize=1024)
def _json_text(value: str) -> str:
    return encode_basestring_ascii(value)  # a few file names and kinds, again and again


def decode_manifest(blob: bytes, where: str = "the manifest") -> dict[str, RecordInfo]:
    """Parse and check a manifest: its entries (:func:`decode_manifest_full`)."""
    return decode_manifest_full(blob, where)[0]


def decode_manifest_full(
    blob: bytes, where: str = "the manifest"
) -> tuple[dict[str, RecordInfo], int | None]:
    """Parse and check a manifest: its entries and the commit record's CRC-32C (None in a
    manifest written before it was recorded); ``where`` names it in errors.

    Raises :class:`~dcp_datastates.ChecksumMismatchError` when it is damaged (not JSON, its own
    checksum does not match, a field is missing) and ``ValueError`` for a version this package
    does not read.
    """

    def damaged(why: str) -> ChecksumMismatchError:
        return ChecksumMismatchError(
            f"{where} is damaged ({why}), so no record of the checkpoint can be verified. Load "
            "an earlier checkpoint; stock dcp.load(..., checkpoint_id=path) still reads this one, "
            "without checksums"
        )

    try:
        body = json.loads(blob)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise damaged(f"not UTF-8 JSON: {exc}") from None
    if not isinstance(body, dict):
        raise damaged(f"a JSON {type(body).__name__}, not an object")
    if body.get("format") != FORMAT_NAME:
        raise damaged(f"format is {body.get('format')!r}, not {FORMAT_NAME!r}")
    if body.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{where} has format version {body.get('version')!r}, which this dcp_datastates "
            f"does not read (it reads version {FORMAT_VERSION}); upgrade the package"
        )
    expected = body.pop(MANIFEST_CRC_FIELD, None)
    if not isinstance(expected, int):
        raise damaged(f"no {MANIFEST_CRC_FIELD}")
    actual = crc32c(_canonical(body))
    if actual != expected:
        raise damaged(f"its crc32c is {actual:#010x}, expected {expected:#010x}")
    metadata_crc = body.get(METADATA_CRC_FIELD)
    if metadata_crc is not None and type(metadata_crc) is not int:
        raise damaged(f"{METADATA_CRC_FIELD} is {metadata_crc!r}, not an integer")
    try:
        return {key: RecordInfo(**value) for key, value in body["items"].items()}, metadata_crc
    except (KeyError, TypeError, AttributeError) as exc:
        raise damaged(f"{type(exc).__name__}: {exc}") from None


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, before its name
_DATA_ENTRY = re.compile(rb"/data/\d+$")


def data_start(head: bytes) -> int | None:
    """Where the data of the zip entry that ``head`` ends with starts (the end of the last local
    file header), when that entry is a stored ``torch.save`` storage; None otherwise.

    Our records are ``head + data + tail``; a reader checks the manifest's ``data_offset`` with
    it, since the record checksum covers the bytes but not where data begins among them.
    """
    at = head.rfind(b"PK\x03\x04")
    if at < 0 or at + _LOCAL_HEADER.size > len(head):
        return None
    fields = _LOCAL_HEADER.unpack_from(head, at)
    method, name_len, extra_len = fields[3], fields[9], fields[10]
    name = head[at + _LOCAL_HEADER.size : at + _LOCAL_HEADER.size + name_len]
    if method != 0 or not _DATA_ENTRY.search(name):
        return None
    return at + _LOCAL_HEADER.size + name_len + extra_len


#: ``__{rank}.metadata``: a rank's own commit record (group 1: the rank).
RANK_METADATA = re.compile(r"^__(\d+)" + re.escape(METADATA_NAME) + "$")


def metadata_name(rank: int | None = None) -> str:
    """``.metadata``, or ``__{rank}.metadata`` for a save with ``use_collectives=False`` (each
    rank commits its own, as stock ``FileSystemWriter`` does)."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def manifest_name(rank: int | None = None) -> str:
    """The manifest that goes with :func:`metadata_name` of the same ``rank``."""
    return MANIFEST_NAME if rank is None else f"__{rank}{MANIFEST_NAME}"
