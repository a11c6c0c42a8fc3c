"""Stream transforms: DCP's ``_extensions`` (``ZStandard`` compression, any
``StreamTransformExtension``), applied to each record as the flush writes it.

A record's bytes (a tensor's ``torch.save`` frame head, its data piece by piece as the pieces
land in the pool, the frame's tail; an object's payload) go through the extension chain that
stock ``FileSystemWriter`` builds: the first extension's ``transform_to`` wraps the file, each
next one wraps the one before, and the descriptors go to ``.metadata`` in reverse order, in the
item's ``_StorageInfo.transform_descriptors``, as stock writes them. Stock ``FileSystemReader``
decodes such records through its extension registry, and so does ``DataStatesReader``.

Each piece goes back to the pool as soon as the chain has taken it, so the state is never held
twice; each file of a rank is written (and so transformed) by a thread of its own, in parallel
(``zstandard`` compresses without the GIL).

The record's ``RecordInfo`` describes the *stored* bytes: ``offset``, ``length`` and ``crc32c``
are those of what lies in the file (``verify`` checks them without decoding), and
``data_offset``, ``data_length`` are the record's own (its raw data has no place in the file:
readers decode the record whole). See ``docs/format.md``.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from ..format import RecordInfo


def stream_transforms(extensions: Sequence[Any] | None) -> tuple[Any, ...]:
    """``_extensions`` as given to ``FileSystemWriter``, checked: ``None`` or empty for none,
    else stream transforms (objects with ``transform_to`` and ``get_descriptor``)."""
    if extensions is None:
        return ()
    if isinstance(extensions, (str, bytes)) or not isinstance(extensions, Sequence):
        raise ValueError(
            f"DataStatesWriter(_extensions={extensions!r}): expected a list of stream "
            "transforms, such as [ZStandard()] (torch.distributed.checkpoint._extension)"
        )
    for ex in extensions:
        if not (
            callable(getattr(ex, "transform_to", None))
            and callable(getattr(ex, "get_descriptor", None))
        ):
            raise ValueError(
                f"DataStatesWriter(_extensions=[..., {ex!r}, ...]): {type(ex).__name__} is not a "
                "stream transform (a StreamTransformExtension, with transform_to and "
                "get_descriptor), such as ZStandard()"
            )
    return tuple(extensions)


@dataclass(frozen=True)
class TransformedRecord:
    """``WriteResult.storage_data`` of a record written through stream transforms: its manifest
    entry, and the descriptors ``.metadata`` records for it (``commit.py`` splits them)."""

    info: RecordInfo
    descriptors: tuple[str, ...]


class _Sink(io.RawIOBase):
    """The end of the chain: writes the transformed bytes to the file, counting and checking
    them. Closing it leaves the file open (the file's other records follow)."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self.f = f
        self.length = 0
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        if mv.nbytes:
            self.f.write(mv)
            self.crc = crc32c(mv, value=self.crc)
            self.length += mv.nbytes
        return mv.nbytes


def write_record(
    f: Any,
    transforms: Sequence[Any],
    parts: Iterable[Any],
    *,
    name: str,
    offset: int,
    index: MetadataIndex,
    kind: str,
) -> WriteResult:
    """Write one record, whose bytes are ``parts`` in order, at ``offset`` of file ``name``
    (open as ``f``) through ``transforms``. ``parts`` may release each part once the next one
    is asked for: the chain has taken it by then."""
    sink = _Sink(f)
    stream: Any = sink
    for ex in transforms:
        stream = ex.transform_to(stream)
    for part in parts:
        stream.write(part)
    stream.close()  # ends the transforms' output (a zstd frame); the sink leaves f open
    info = RecordInfo(
        relative_path=name,
        offset=offset,
        length=sink.length,
        data_offset=offset,
        data_length=sink.length,
        crc32c=sink.crc,
        kind=kind,
    )
    descriptors = tuple(ex.get_descriptor() for ex in reversed(transforms))
    return WriteResult(
        index=index, size_in_bytes=sink.length, storage_data=TransformedRecord(info, descriptors)
    )


__all__ = ["TransformedRecord", "stream_transforms", "write_record"]
