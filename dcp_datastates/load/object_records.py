"""Object items without ``torch.load``: the pickle of a ``torch.save`` record, unpickled safely.

An object item (DCP ``BYTE_IO``) is a ``torch.save`` zip record whose first entry,
``<archive>/data.pkl``, is a plain pickle when the object holds no tensor. ``torch.load`` costs
150-250 us per record (zip reader, a class defined per call, the pure-Python weights-only
unpickler); a checkpoint of thousands of small objects (dataloader state, metrics, config) spends
most of its load there. :func:`fast_load` reads that entry in place and unpickles it with the C
unpickler, resolving only globals that ``torch.load(weights_only=True)`` also allows by default
and that build plain data (sets, ordered dicts, bytes, complex numbers, dtypes, devices, sizes,
and ``io.BytesIO``, which the reader's safe load allows too). It checks the entry's zip CRC-32,
as ``torch.load`` does.

Anything else -- a tensor inside the object (persistent ids), another global, an unexpected zip
layout, a CRC that does not match -- returns :data:`MISS`, and the caller loads the record with
``torch.load`` as before, so a record loads to the same value, or is refused the same way, on
either path.
"""

from __future__ import annotations

import codecs
import collections
import io
import pickle
import struct
import zlib
from typing import Any

import torch

#: Returned by :func:`fast_load` when the record needs ``torch.load``.
MISS: Any = object()

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, before its name
_LOCAL_SIG = 0x04034B50
_DESCRIPTOR = struct.Struct("<IIII")  # signature, crc32, compressed and uncompressed size
_DESCRIPTOR_SIG = 0x08074B50
_HAS_DESCRIPTOR = 0x08  # general purpose flag bit 3: sizes and CRC follow the data

_PLAIN: dict[tuple[str, str], Any] = {}
for _module in ("builtins", "__builtin__"):  # protocol 2 names builtins "__builtin__"
    _PLAIN.update(
        {(_module, "set"): set, (_module, "bytearray"): bytearray, (_module, "complex"): complex}
    )
_PLAIN.update(
    {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("collections", "Counter"): collections.Counter,
        ("_codecs", "encode"): codecs.encode,  # how protocol 2 pickles bytes
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("_io", "BytesIO"): io.BytesIO,
        ("io", "BytesIO"): io.BytesIO,
    }
)


class _Refused(Exception):
    """A global outside the plain set: the record goes to ``torch.load``."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _PLAIN.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a tensor storage")  # torch.load rebuilds those


def pickle_span(blob: bytes) -> tuple[int, int] | None:
    """``(start, flags)`` of the first zip entry's data when it is a stored ``data.pkl``."""
    if len(blob) < _LOCAL.size:
        return None
    sig, _, flags, method, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack_from(blob, 0)
    name_end = _LOCAL.size + name_len
    if sig != _LOCAL_SIG or method != 0 or not blob[_LOCAL.size : name_end].endswith(b"/data.pkl"):
        return None
    return name_end + extra_len, flags


def fast_load(blob: bytes) -> Any:
    """The object in the ``torch.save`` record ``blob``, or :data:`MISS` when it needs
    ``torch.load`` (see the module's docstring)."""
    span = pickle_span(blob)
    if span is None:
        return MISS
    start, flags = span
    stream = io.BytesIO(blob)
    stream.seek(start)
    try:
        value = _PlainUnpickler(stream).load()
    except Exception:  # _Refused, or a damaged pickle: torch.load decides and explains
        return MISS
    end = stream.tell()
    if not _crc_matches(blob, start, end, flags):
        return MISS
    return value


def _crc_matches(blob: bytes, start: int, end: int, flags: int) -> bool:
    """The entry's zip CRC-32 (in the data descriptor after it, as torch.save writes it, or in
    the local header) is that of the pickle's bytes, and its size is theirs."""
    if flags & _HAS_DESCRIPTOR:
        if end + _DESCRIPTOR.size > len(blob):
            return False
        sig, crc, _, size = _DESCRIPTOR.unpack_from(blob, end)
        if sig != _DESCRIPTOR_SIG:
            return False
    else:
        fields = _LOCAL.unpack_from(blob, 0)
        crc, size = fields[6], fields[8]
    return size == end - start and crc == zlib.crc32(memoryview(blob)[start:end])


__all__ = ["MISS", "fast_load"]
