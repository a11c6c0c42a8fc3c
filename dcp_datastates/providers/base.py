"""The state-provider protocol: one object per DCP ``WriteItem`` that knows how its kind is saved.

Two shapes of provider exist:

* *raw* providers (``nbytes > 0``) own a tensor-like source. The snapshot stage asks them to copy
  byte ranges of their data into host-pool blocks; the flush stage writes ``frame.head``, those
  bytes, then ``frame.tail``. The data is never pickled.
* *eager* providers (``nbytes == 0``) serialized their value when they were created (at stage
  time: Python objects are mutable and cheap) and hand the bytes to the flush stage as ``payload``.

A provider declares its byte cost (``nbytes``) before any work is admitted, so the snapshot stage
can plan pool usage and chunking up front.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..format import RecordFrame


@runtime_checkable
class StateProvider(Protocol):
    """What the snapshot and flush stages need from one write item."""

    #: Short name of the provider kind, recorded in the manifest ("tensor", "shard", "object", ...).
    kind: str
    #: Fully qualified name of the item, for error messages.
    fqn: str

    @property
    def nbytes(self) -> int:
        """Bytes that must be snapshotted into the host pool (0 for eager providers)."""
        ...

    @property
    def frame(self) -> RecordFrame | None:
        """Record framing around the raw bytes; ``None`` for eager providers."""
        ...

    @property
    def payload(self) -> bytes | None:
        """Serialized bytes of an eager provider; ``None`` for raw providers."""
        ...

    def split(self, max_bytes: int) -> list[tuple[int, int]]:
        """Byte ranges ``[start, stop)`` the data may be copied in, each at most ``max_bytes``
        where the layout allows it (a non-contiguous source splits on rows)."""
        ...

    def copy_into(self, dst: torch.Tensor, start: int, stop: int) -> None:
        """Copy data bytes ``[start, stop)`` into ``dst``, a uint8 tensor of ``stop - start``."""
        ...

    def check_unchanged(self, rank: int) -> None:
        """Raise :class:`~dcp_datastates.errors.SnapshotMutationError` if the source changed since
        the provider was created."""
        ...
