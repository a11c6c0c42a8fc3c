"""Raw tensor provider: copies a tensor's own bytes (never its base storage), never pickles."""

from __future__ import annotations

import torch

from ..errors import InvalidStateDictError, SnapshotMutationError
from ..format import RecordFrame, record_frame


class TensorProvider:
    """Provider for a plain tensor (or one local chunk of a distributed tensor).

    The saved record describes the tensor with its own shape as a contiguous tensor, so a view
    saves only the elements it shows, not the storage it shares with others.
    """

    kind = "tensor"

    def __init__(self, fqn: str, tensor: torch.Tensor) -> None:
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            raise InvalidStateDictError(
                f"item {fqn!r} is a {type(tensor).__name__}, a tensor subclass this writer cannot "
                "copy raw; convert it to a plain tensor (or a DTensor) before saving, or register "
                "a provider for it with dcp_datastates.register_provider"
            )
        if tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg()
        self.fqn = fqn
        self.source = tensor.detach()  # shares the version counter with the live tensor
        self._version = self.source._version
        self._nbytes = self.source.numel() * self.source.element_size()
        self._rows = self.source.shape[0] if self.source.dim() > 0 else 1
        self._row_bytes = (self._nbytes // self._rows) if self._rows else 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def frame(self) -> RecordFrame:
        # Built (and cached per dtype/shape) by the flush thread, never on the training thread.
        return record_frame(self.source.dtype, tuple(self.source.shape))

    @property
    def payload(self) -> None:
        return None

    def split(self, max_bytes: int) -> list[tuple[int, int]]:
        total = self.nbytes
        if total == 0:
            return []
        if self.source.is_contiguous():
            step = max_bytes
        else:
            # Non-contiguous sources are copied a block of whole rows at a time.
            step = max(1, max_bytes // max(self._row_bytes, 1)) * self._row_bytes
        return [(start, min(start + step, total)) for start in range(0, total, step)]

    def copy_into(self, dst: torch.Tensor, start: int, stop: int) -> None:
        src = self.source
        if src.is_contiguous():
            flat = src.reshape(-1) if src.dim() != 1 else src
            dst.copy_(flat.view(torch.uint8)[start:stop])
            return
        r0, r1 = start // self._row_bytes, stop // self._row_bytes
        rows = src[r0:r1]
        dst.view(src.dtype).view(rows.shape).copy_(rows)

    def check_unchanged(self, rank: int) -> None:
        now = self.source._version
        if now != self._version:
            raise SnapshotMutationError(fqn=self.fqn, rank=rank, before=self._version, after=now)


class ShardProvider(TensorProvider):
    """The local chunk of a DTensor or ShardedTensor; its global offsets ride on the WriteItem."""

    kind = "shard"
