"""Values out of records: stock stream transforms (compression) decoded with a bound, and
object items set into the planner's state once loaded safely (not deserialized twice)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from .._dcp_private import StreamTransformExtension, set_element
from ..errors import ChecksumMismatchError

#: Bytes a decoded tensor record may hold beyond its data (torch.save's zip entries and pickle).
FRAME_SLACK = 1 << 20


def transform_from(
    extensions: Sequence[Any], raw: memoryview, where: str, limit: int | None
) -> bytes:
    """``raw`` through the extensions' ``transform_from``; at most ``limit`` bytes come out (a
    record that decompresses to more is refused before it fills memory)."""
    stream: Any = io.BytesIO(raw)
    try:
        for ex in extensions:
            if isinstance(ex, StreamTransformExtension):
                stream = ex.transform_from(stream)
        if limit is None:
            return stream.read(-1)
        out = bytearray()
        while len(out) <= limit:
            block = stream.read(min(FRAME_SLACK, limit + 1 - len(out)))
            if not block:
                return bytes(out)
            out += block
    except Exception as exc:
        raise ChecksumMismatchError(
            f"{where}: its record does not decode through {[type(e).__name__ for e in extensions]}"
            f" ({type(exc).__name__}: {exc}); the checkpoint is damaged"
        ) from exc
    raise ChecksumMismatchError(
        f"{where}: its record decodes to more than {limit} bytes, more than the tensor it holds "
        "needs; refusing to decode it further (the checkpoint is damaged or hostile)"
    )


def set_loaded_object(planner: LoadPlanner, req: ReadItem, value: Any) -> bool:
    """Do what ``DefaultLoadPlanner.load_bytes`` does with an object already loaded (safely),
    instead of deserializing it a second time; only for exactly that planner."""
    if type(planner) is not DefaultLoadPlanner:
        return False
    fqn = req.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value
    return True


__all__ = ["FRAME_SLACK", "set_loaded_object", "transform_from"]
