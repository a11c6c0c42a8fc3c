"""Where a tensor's bytes sit inside a stock ``torch.save`` record, found without reading them.

Stock DCP's ``FileSystemWriter`` writes each tensor as a ``torch.save`` zip record and keeps no
index of the data inside it. ``torch.load(map_location="meta", weights_only=True)`` reads only
the record's zip directory and its small pickle, never the data, and leaves the data's offset in
the record on the (meta) storage as ``_checkpoint_offset``. With that offset and the tensor's
size, stride and storage offset, the reader reads the data straight into its target.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ChecksumMismatchError, UnsafeCheckpointError
from ..format import record_frame

#: Bytes fetched per read while ``torch.load`` walks a record's zip directory and pickle.
_BLOCK = 64 << 10


class NotLocatable(Exception):
    """The record's data offset could not be found; the caller loads the whole record instead."""


@dataclass(frozen=True)
class StockLayout:
    """A tensor in a ``torch.save`` record: its storage bytes, and how the tensor views them."""

    data_offset: int  # where the storage's bytes start, relative to the record
    storage_nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements

    @property
    def plain(self) -> bool:
        """The storage holds exactly this tensor, contiguous: its bytes are the tensor's bytes."""
        probe = torch.empty(self.size, dtype=self.dtype, device="meta")
        return (
            self.storage_offset == 0
            and self.stride == probe.stride()
            and self.storage_nbytes == probe.numel() * probe.element_size()
        )

    def tensor(self, storage_bytes: torch.Tensor) -> torch.Tensor:
        """The tensor over ``storage_bytes`` (a uint8 tensor holding the storage)."""
        typed = torch.empty(0, dtype=self.dtype)
        typed.set_(storage_bytes.untyped_storage(), self.storage_offset, self.size, self.stride)
        return typed


class _RecordWindow(io.RawIOBase):
    """A seekable read-only view of ``length`` bytes, fetched in blocks through ``read_at``."""

    def __init__(self, read_at: Callable[[int, int], bytes], length: int) -> None:
        super().__init__()
        self._read_at = read_at
        self._length = length
        self._pos = 0
        self._blocks: dict[int, bytes] = {}
        self.short = False  # the source ended before the record did

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        n = max(0, min(out.nbytes, self._length - self._pos))
        done = 0
        while done < n:
            index, within = divmod(self._pos + done, _BLOCK)
            block = self._blocks.get(index)
            if block is None:
                start = index * _BLOCK
                want = min(_BLOCK, self._length - start)
                block = self._read_at(start, want)
                self.short = self.short or len(block) < want
                if not block:
                    break
                self._blocks[index] = block
            take = min(n - done, len(block) - within)
            if take <= 0:
                break
            out[done : done + take] = block[within : within + take]
            done += take
        self._pos += done
        return done


def locate_stock_tensor(
    read_at: Callable[[int, int], bytes],
    length: int,
    dtype: torch.dtype,
    size: tuple[int, ...],
    where: str,
) -> StockLayout:
    """Like :func:`locate_tensor`, for a record expected to hold a ``dtype`` tensor of ``size``.

    ``torch.save`` of a plain contiguous tensor writes, before the data, bytes that depend only
    on dtype and shape (the same head our writer uses, see :func:`record_frame`): when the record
    starts with exactly that head, the data follows it, and one small read replaces the parse.
    """
    try:
        frame = record_frame(dtype, size)
    except RuntimeError as exc:  # a quantized dtype: torch.save cannot write its head alone
        raise NotLocatable(f"no plain record of {dtype}: loaded through torch.load") from exc
    if length == frame.length and read_at(0, len(frame.head)) == frame.head:
        probe = torch.empty(size, dtype=dtype, device="meta")
        return StockLayout(
            data_offset=len(frame.head),
            storage_nbytes=frame.data_length,
            dtype=dtype,
            size=size,
            stride=tuple(probe.stride()),
            storage_offset=0,
        )
    return locate_tensor(read_at, length, where)


def locate_tensor(read_at: Callable[[int, int], bytes], length: int, where: str) -> StockLayout:
    """Parse the ``torch.save`` record of ``length`` bytes that ``read_at(offset, n)`` reads.

    ``where`` names the file and item for messages. Raises :class:`NotLocatable` when this torch
    cannot report the data offset, :class:`ChecksumMismatchError` when the record is damaged or
    holds no tensor, and :class:`UnsafeCheckpointError` when weights-only loading refuses it.
    """
    window = _RecordWindow(read_at, length)
    try:
        meta = torch.load(window, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as exc:  # what weights_only refuses
        raise UnsafeCheckpointError(
            f"{where}: the record does not load with torch.load(weights_only=True) "
            f"({str(exc).splitlines()[0]}); a safe load refuses it"
        ) from exc
    except Exception as exc:
        if window.short:
            raise ChecksumMismatchError(
                f"{where} is truncated (the file ends inside its {length}-byte record); the "
                "checkpoint is damaged"
            ) from exc
        raise ChecksumMismatchError(
            f"{where}: the record is not a readable torch.save record ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); the checkpoint is damaged"
        ) from exc
    if not isinstance(meta, torch.Tensor):
        raise ChecksumMismatchError(
            f"{where}: the record holds a {type(meta).__name__} where a tensor was saved; the "
            "checkpoint is damaged"
        )
    if meta.is_conj() or meta.is_neg():
        # A lazy conjugate or negative view (stock FileSystemWriter saves z.conj() as one):
        # its bytes are the unconjugated values; torch.load applies the bit (a user sweep:
        # the raw bytes loaded with the sign lost).
        raise NotLocatable("a conjugate or negative view: loaded through torch.load")
    storage = meta.untyped_storage()
    data_offset = getattr(storage, "_checkpoint_offset", None)
    if not isinstance(data_offset, int):
        raise NotLocatable(f"torch {torch.__version__} does not report data offsets of records")
    layout = StockLayout(
        data_offset=data_offset,
        storage_nbytes=storage.nbytes(),
        dtype=meta.dtype,
        size=tuple(meta.shape),
        stride=tuple(meta.stride()),
        storage_offset=meta.storage_offset(),
    )
    elements = meta.numel()
    needed = 0
    if elements:
        reach = sum((n - 1) * st for n, st in zip(layout.size, layout.stride, strict=True))
        last = layout.storage_offset + reach
        needed = (last + 1) * meta.element_size()
    if min(layout.stride, default=0) < 0 or layout.storage_offset < 0 or needed > storage.nbytes():
        raise ChecksumMismatchError(
            f"{where}: the record's tensor view (size {layout.size}, stride {layout.stride}, "
            f"offset {layout.storage_offset}) does not fit its {storage.nbytes()}-byte storage; "
            "the checkpoint is damaged"
        )
    if layout.storage_nbytes and data_offset + layout.storage_nbytes > length:
        raise ChecksumMismatchError(
            f"{where}: the record's data ends at byte {data_offset + layout.storage_nbytes} of "
            f"a {length}-byte record; the checkpoint is damaged"
        )
    return layout
