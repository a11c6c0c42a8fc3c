"""Eager object provider: serializes a Python object at stage time (objects are mutable)."""

from __future__ import annotations

import io
from typing import Any

import torch

from ..errors import InvalidStateDictError


class ObjectProvider:
    """A non-tensor value, saved as DCP ``BYTE_IO`` with ``torch.save`` so stock DCP loads it."""

    kind = "object"
    nbytes = 0
    frame = None

    def __init__(self, fqn: str, payload: bytes) -> None:
        self.fqn = fqn
        self._payload = payload

    @classmethod
    def serialize(cls, fqn: str, value: Any) -> ObjectProvider:
        """Serialize ``value`` now, with ``torch.save`` (what stock DCP does for BYTE_IO items)."""
        buf = io.BytesIO()
        try:
            torch.save(value, buf)
        except Exception as exc:  # pickling errors come in many types
            raise InvalidStateDictError(
                f"item {fqn!r} ({type(value).__name__}) cannot be serialized: {exc}. Make it "
                "picklable, drop it from the state dict, or register a provider for its type"
            ) from exc
        return cls(fqn, buf.getvalue())

    @property
    def payload(self) -> bytes:
        return self._payload

    def split(self, max_bytes: int) -> list[tuple[int, int]]:
        return []

    def copy_into(self, dst: torch.Tensor, start: int, stop: int) -> None:
        raise TypeError("eager providers have no raw data to copy")

    def check_unchanged(self, rank: int) -> None:
        # The value was serialized when the provider was made; later changes cannot reach it.
        return None
