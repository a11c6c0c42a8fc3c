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
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.serialization import skip_data

FORMAT_NAME = "dcp_datastates"
FORMAT_VERSION = 1
METADATA_NAME = ".metadata"
MANIFEST_NAME = ".datastates.json"
DATA_SUFFIX = ".distcp"


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
    # An empty tensor has no hole: the whole record is its head.
    blob = bytearray(sink.pos)
    for pos, part in sink.parts:
        blob[pos : pos + len(part)] = part
    return RecordFrame(
        head=bytes(blob[:hole_start]), tail=bytes(blob[hole_start + nbytes :]), data_length=nbytes
    )


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
    return f"{fqn}@{','.join(str(int(o)) for o in offset)}"


def encode_manifest(
    entries: dict[str, RecordInfo], *, world_size: int, torch_version: str
) -> bytes:
    body = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "torch": torch_version,
        "world_size": world_size,
        "checksum": "crc32c",
        "items": {key: asdict(info) for key, info in sorted(entries.items())},
    }
    return json.dumps(body, indent=1, sort_keys=True).encode()


def decode_manifest(blob: bytes) -> dict[str, RecordInfo]:
    body = json.loads(blob)
    if body.get("format") != FORMAT_NAME:
        raise ValueError(f"not a {FORMAT_NAME} manifest (format={body.get('format')!r})")
    if body.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"manifest format version {body.get('version')!r} is not supported by this "
            f"dcp_datastates (reads version {FORMAT_VERSION}); upgrade the package"
        )
    return {key: RecordInfo(**value) for key, value in body["items"].items()}
