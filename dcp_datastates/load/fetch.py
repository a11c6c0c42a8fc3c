"""The load's I/O stage: records read straight into their targets, in parallel, verified.

Per data file, records are taken in file order:

- a run of small neighbouring records (each at most ``coalesce_bytes``) is one read into one
  buffer, then split into its records;
- a big record is read in regions of at most ``split_bytes`` straight into its target tensor (or
  into a bounce buffer when the target is not a plain tensor of the saved chunk: resharding,
  another dtype), and the regions are read in parallel;
- a big record whose target is a CUDA tensor of the saved chunk goes through two pinned bounce
  buffers of ``split_bytes``, its reads overlapping its host-to-device copies (``bounce.py``).

Region reads run before new records start (a priority queue), so the memory in flight stays near
``io_workers`` records however large the checkpoint. Each region's reader checks the CRC-32C of
its bytes piece by piece as they land, while they are in cache (``checksum.py``; a remote file
reads each region in one request and checks it after); the record's checksum is the regions'
CRCs combined in file order, compared when its last region lands.

Records of stock ``FileSystemWriter`` checkpoints carry no manifest entry: their data is found
with :func:`~dcp_datastates.load.locate.locate_tensor`, and read the same way, without a checksum.
A record written through stream transforms (compression), by stock's writer or ours, is read
whole, checked against its manifest entry (if any: the checksum covers the stored bytes),
decoded by the reader's ``decode`` and then handled as a stock record held in memory.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from crc32c import crc32c
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import ChecksumMismatchError
from ..format import RecordInfo, data_start
from ..snapshot import cow as _cow
from ..storage.base import RangedFile
from .bounce import BounceBuffers
from .checksum import CHECK_PIECE, crc32c_combine, read_checked
from .locate import NotLocatable, StockLayout, locate_stock_tensor
from .read_pool import Runner

logger = logging.getLogger(__name__)


@dataclass
class Record:
    """One record of a data file and the read items it serves."""

    name: str  # data file
    fqn: str
    offset: int
    length: int
    info: RecordInfo | None  # manifest entry; None for a stock record
    reqs: list[ReadItem] = field(default_factory=list)
    saved: tuple[torch.dtype, torch.Size] | None = None  # None for an object item
    transforms: tuple[str, ...] = ()  # stock stream-transform descriptors (compression)

    @property
    def is_bytes(self) -> bool:
        return self.saved is None


@dataclass(frozen=True)
class FetchOptions:
    verify: bool = True
    io_workers: int = 4
    coalesce_bytes: int = 1 << 20  # records up to this size share reads with their neighbours
    span_bytes: int = 16 << 20  # at most this much per coalesced read
    gap_bytes: int = 64 << 10  # neighbours at most this far apart share a read
    split_bytes: int = 32 << 20  # big records are read in regions of this size, in parallel
    # A region is read and checksummed this much at a time; None: in one read (remote files).
    check_bytes: int | None = CHECK_PIECE


class Fetch:
    """Reads ``records`` of ``storage`` into ``targets``; object items land in ``blobs``."""

    def __init__(
        self,
        storage: Any,
        records: list[Record],
        targets: dict[ReadItem, torch.Tensor],
        options: FetchOptions,
        decode: Callable[[Record, memoryview], bytes] | None = None,
    ) -> None:
        self.storage = storage
        self.decode = decode
        self.records = records
        self.targets = targets
        self.options = options
        self.blobs: dict[ReadItem, bytes] = {}
        self.fallbacks: list[str] = []  # stock records loaded whole with torch.load
        self._lock = threading.Lock()
        self._files: dict[str, RangedFile] = {}
        cuda = sorted({t.device.index for t in targets.values() if t.is_cuda})
        self._pin = torch.cuda.is_available() and bool(cuda)
        self._devices = cuda  # every device the load touches
        self._device = cuda[0] if cuda else None  # pinned memory in this rank's context
        self._bounces = BounceBuffers(options.split_bytes, pin=self._pin)

    # -- driving ------------------------------------------------------------------------------
    def run(self) -> None:
        by_file: dict[str, list[Record]] = {}
        for record in self.records:
            by_file.setdefault(record.name, []).append(record)
        runner = Runner(max(1, self.options.io_workers))
        if self._pin:
            # On the caller's thread: the copies come after the targets' work on its streams.
            self._bounces.begin(self._devices)
        try:
            for name, records in by_file.items():
                self._files[name] = self.storage.open_ranged(name)
                for job in self._jobs(sorted(records, key=lambda r: r.offset), runner):
                    runner.submit(job, urgent=False)
        finally:
            try:
                runner.join()
            finally:
                for f in self._files.values():
                    f.close()
                if self._pin:
                    # Every device's copies, on the caller's streams and for the host: the
                    # targets hold the checkpoint once the load returns.
                    self._bounces.end()
        if self.fallbacks:
            logger.info(
                "%d stock record(s) loaded whole with torch.load (their data offset could not "
                "be found), e.g. %s",
                len(self.fallbacks),
                self.fallbacks[0],
            )

    def _jobs(self, records: list[Record], runner: Runner) -> list[Callable[[], None]]:
        opts = self.options
        jobs: list[Callable[[], None]] = []
        span: list[Record] = []

        def close_span() -> None:
            if span:
                jobs.append(_bind(self._read_span, list(span)))
                span.clear()

        for record in records:
            if record.length > opts.coalesce_bytes:
                close_span()
                jobs.append(_bind(self._start_record, record, runner))
                continue
            if span and (
                record.offset - (span[-1].offset + span[-1].length) > opts.gap_bytes
                or record.offset + record.length - span[0].offset > opts.span_bytes
                or record.offset < span[-1].offset + span[-1].length
            ):
                close_span()
            span.append(record)
        close_span()
        return jobs

    # -- small records: one read for a run of neighbours --------------------------------------
    def _read_span(self, records: list[Record]) -> None:
        first = records[0].offset
        buf = bytearray(max(r.offset + r.length for r in records) - first)
        view = memoryview(buf)
        got = self._files[records[0].name].read_into(first, [view])
        for record in records:
            start = record.offset - first
            self._from_memory(record, view[start : start + max(0, min(record.length, got - start))])

    def _from_memory(self, record: Record, mv: memoryview) -> None:
        """Check and deliver a record held whole in memory."""
        if record.info is not None:
            self._check(record, crc32c(mv) if self.options.verify else 0, mv.nbytes)
        elif mv.nbytes != record.length:
            raise self._truncated(record)
        if record.transforms:
            if self.decode is None:
                raise ValueError(f"{self._item(record)} is transformed and no decoder was given")
            mv = memoryview(bytearray(self.decode(record, mv)))  # writable: torch.frombuffer
        if record.is_bytes:
            blob = bytes(mv)
            for req in record.reqs:
                self.blobs[req] = blob
            return
        if record.info is not None and not record.transforms:  # decoded: located as stock's
            start = record.info.data_offset - record.offset
            self._check_data_offset(record, mv[:start])
            data = _as_uint8(mv[start : start + record.info.data_length])
            self._deliver(record, self._saved_view(record, data))
            return
        try:
            layout = self._locate(record, _memory_reader(mv), mv.nbytes)
        except NotLocatable:
            self._deliver(record, self._load_whole(record, mv))
            return
        storage = mv[layout.data_offset : layout.data_offset + layout.storage_nbytes]
        self._deliver(record, layout.tensor(_as_uint8(storage)))

    # -- big records: regions read in parallel, straight into the target ----------------------
    def _start_record(self, record: Record, runner: Runner) -> None:
        if record.is_bytes or record.transforms:
            self._read_span([record])
            return
        layout: StockLayout | None = None
        if record.info is None:
            try:
                layout = self._locate(record, self._file_reader(record), record.length)
            except NotLocatable:
                self._read_span([record])  # _from_memory falls back to torch.load
                return
            data_at, nbytes = record.offset + layout.data_offset, layout.storage_nbytes
            head, tail = b"", b""
        else:
            info = record.info
            self._check_extent(record)
            data_at, nbytes = info.data_offset, info.data_length
            head = bytearray(info.data_offset - info.offset)
            tail = bytearray(info.offset + info.length - info.data_offset - info.data_length)
        device_target = self._direct_target(record, layout, device="cuda")
        if device_target is not None:
            _cow.before_write([device_target], "a load")  # a save of it in flight copies it first
            runner.submit(
                _bind(self._fill_device, record, device_target, data_at, head, tail), urgent=True
            )
            return
        target = self._direct_target(record, layout)
        if target is not None:
            # The reads below write its bytes behind torch's back: bump its version counter, as
            # the copy_ of stock's reader does, before they start. Otherwise autograd would use
            # the new values silently, and an async save of this tensor in flight would not see
            # the write (its snapshot checks the version counter). A save in flight that has
            # not copied it yet copies it now (copy-on-write), as it would for stock's copy_.
            _cow.before_write([target], "a load")
            increment_version(target)
        data = target if target is not None else self._bounce(nbytes)
        data_bytes = memoryview(_bytes_of(data).numpy()) if nbytes else memoryview(b"")

        regions: list[tuple[int, list[memoryview]]] = []
        step = self.options.split_bytes
        for start in range(0, max(nbytes, 1), step):
            bufs = [data_bytes[start : start + step]]
            if start == 0 and head:
                bufs.insert(0, memoryview(head))
            if start + step >= nbytes and tail:
                bufs.append(memoryview(tail))
            at = data_at + start - (len(head) if start == 0 else 0)
            regions.append((at, bufs))
        left = [len(regions)]
        verify = self.options.verify and record.info is not None
        crcs: list[tuple[int, int]] = [(0, 0)] * len(regions)  # (crc32c, bytes) per region

        def finish() -> None:
            if record.info is not None:
                self._check_data_offset(record, head)
                crc = crcs[0][0]
                for part, nbytes in crcs[1:]:
                    crc = crc32c_combine(crc, part, nbytes)
                self._check(record, crc, record.info.length)
            if target is None:
                saved = (
                    layout.tensor(data) if layout is not None else self._saved_view(record, data)
                )
                self._deliver(record, saved)

        def read_region(i: int, at: int, bufs: list[memoryview]) -> None:
            # Each piece is checked right after it lands, while it is in cache.
            want = sum(b.nbytes for b in bufs)
            got, crc = read_checked(
                self._files[record.name].read_into,
                at,
                bufs,
                verify=verify,
                piece=self.options.check_bytes,
            )
            if got != want:
                raise self._truncated(record)
            crcs[i] = (crc, got)
            with self._lock:
                left[0] -= 1
                last = not left[0]
            if last:
                finish()

        for i, (at, bufs) in enumerate(regions):
            runner.submit(_bind(read_region, i, at, bufs), urgent=True)

    def _fill_device(
        self, record: Record, target: torch.Tensor, data_at: int, head: Any, tail: Any
    ) -> None:
        crc, got = self._bounces.fill(
            target,
            self._files[record.name].read_into,
            data_at=data_at,
            head=head,
            tail=tail,
            checksum=self.options.verify and record.info is not None,
        )
        if record.info is None:
            if got != target.numel() * target.element_size():
                raise self._truncated(record)
            return
        self._check_data_offset(record, head)
        self._check(record, crc, got)

    def _locate(
        self, record: Record, read_at: Callable[[int, int], bytes], length: int
    ) -> StockLayout:
        assert record.saved is not None
        dtype, sizes = record.saved
        return locate_stock_tensor(read_at, length, dtype, tuple(sizes), self._item(record))

    def _direct_target(
        self, record: Record, layout: StockLayout | None, device: str = "cpu"
    ) -> torch.Tensor | None:
        """The target itself when the record's data is exactly its bytes and it lives on
        ``device``; else None."""
        if len(record.reqs) != 1 or record.saved is None:
            return None
        req = record.reqs[0]
        dtype, sizes = record.saved
        target = self.targets[req]
        whole = tuple(req.storage_offsets) == (0,) * len(sizes) and tuple(req.lengths) == tuple(
            sizes
        )
        fits = (
            whole
            and target.device.type == device
            and target.is_contiguous()
            and not (target.is_conj() or target.is_neg())  # bytes of the view's base
            and target.dtype == dtype
            and tuple(target.shape) == tuple(sizes)
        )
        if layout is not None:
            fits = fits and layout.plain and layout.dtype == dtype and layout.size == tuple(sizes)
        return target if fits else None

    def _bounce(self, nbytes: int) -> torch.Tensor:
        if self._pin:
            torch.cuda.set_device(self._device)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    # -- shared ---------------------------------------------------------------------------------
    def _saved_view(self, record: Record, data: torch.Tensor) -> torch.Tensor:
        """The saved chunk over ``data`` (uint8, as written by our writer)."""
        assert record.saved is not None
        dtype, sizes = record.saved
        want = torch.Size(sizes).numel() * torch.empty((), dtype=dtype).element_size()
        if data.numel() != want:
            raise ChecksumMismatchError(
                f"{self._where(record)}: the manifest gives {data.numel()} data bytes for item "
                f"{record.fqn!r}, but a {dtype} chunk of shape {tuple(sizes)} has {want}; the "
                "checkpoint is damaged"
            )
        if not want:
            return torch.empty(sizes, dtype=dtype)
        return data.view(dtype).view(sizes)

    def _deliver(self, record: Record, saved: torch.Tensor) -> None:
        for req in record.reqs:
            target = self.targets[req]
            source = _narrow(saved, req)
            if source.data_ptr() == target.data_ptr() and source.shape == target.shape:
                continue  # read in place
            if target.is_cuda:
                self._bounces.deliver(target, source)  # on its device's side stream
            else:
                target.copy_(source)

    def _load_whole(self, record: Record, mv: memoryview) -> torch.Tensor:
        with self._lock:
            self.fallbacks.append(f"{record.fqn!r} in {self._where(record)}")
        tensor = torch.load(io.BytesIO(mv), map_location="cpu", weights_only=True)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{self._where(record)}: item {record.fqn!r} is not a tensor")
        return tensor

    def _file_reader(self, record: Record) -> Callable[[int, int], bytes]:
        ranged = self._files[record.name]

        def read_at(offset: int, n: int) -> bytes:
            buf = bytearray(max(0, min(n, record.length - offset)))
            got = ranged.read_into(record.offset + offset, [memoryview(buf)])
            return bytes(buf[:got])

        return read_at

    def _check_extent(self, record: Record) -> None:
        info = record.info
        assert info is not None
        if not (
            info.offset <= info.data_offset
            and info.data_length >= 0
            and info.data_offset + info.data_length <= info.offset + info.length
        ):
            raise ChecksumMismatchError(
                f"{self._where(record)}: the manifest places item {record.fqn!r}'s data outside "
                "its record; the checkpoint is damaged"
            )

    def _check_data_offset(self, record: Record, head: Any) -> None:
        """The record's data starts where the manifest says: its checksum covers the bytes, not
        where the data begins among them."""
        info = record.info
        assert info is not None
        if info.data_length and data_start(bytes(head)) != len(head):
            raise ChecksumMismatchError(
                f"{self._where(record)}: item {record.fqn!r}: its data does not start at "
                f"data_offset {info.data_offset}, as the manifest says; the checkpoint is damaged"
            )

    def _check(self, record: Record, crc: int, got: int) -> None:
        info = record.info
        assert info is not None
        if got != info.length:
            raise self._truncated(record)
        if self.options.verify and crc != info.crc32c:
            raise ChecksumMismatchError(
                f"{self._where(record)}: item {record.fqn!r} has crc32c {crc:#010x}, expected "
                f"{info.crc32c:#010x}; the checkpoint is damaged"
            )

    def _truncated(self, record: Record) -> ChecksumMismatchError:
        return ChecksumMismatchError(
            f"{self._where(record)}: item {record.fqn!r} is truncated (the file ends inside its "
            f"{record.length}-byte record); the checkpoint is damaged"
        )

    def _where(self, record: Record) -> str:
        return self.storage.describe(record.name)

    def _item(self, record: Record) -> str:
        return f"{self.storage.describe(record.name)}: item {record.fqn!r}"


def _bind(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
    return lambda: fn(*args)


def _memory_reader(mv: memoryview) -> Callable[[int, int], bytes]:
    return lambda offset, n: bytes(mv[offset : offset + n])


def _as_uint8(mv: memoryview) -> torch.Tensor:
    if not mv.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mv, dtype=torch.uint8)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _narrow(tensor: torch.Tensor, req: ReadItem) -> torch.Tensor:
    """The part of a saved chunk that ``req`` asks for (resharding)."""
    for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


__all__ = ["Fetch", "FetchOptions", "Record"]
