"""The device layer: how the snapshot engine moves a piece's bytes into the host pool.

The engine talks to a small interface so that its gating logic is the same on every device and can
be tested without a GPU (``device_fake.py``)::

    gate(providers)          training thread, in stage(): mark "the state is produced" on every
                             producing stream (an event per stream); returns the gate
    after_freeze(tensors)    training thread, right after ``freeze()`` queued private copies
                             (clones) of live tensors: mark "these copies are made"
    copy(parts, dst, gate)   copy worker: enqueue the piece's copies after the gate (and after
                             the clones they read); returns a Completion, or None when the
                             bytes are already in ``dst``
    Completion.wait()        completion thread: block until that piece's copies are done
    Completion.fence()       optimizer-step guard: make the caller's current stream wait for the
                             copies instead of blocking the host (False: the host must wait)

:class:`CpuDevice` is the direct synchronous copy the engine always did (no events, no threads).
:class:`CudaDevice` records events on the producing streams, copies on one side stream per device
with ``non_blocking=True`` into the pinned pool, coalesces a piece's small tensors into one
device-to-host copy, and keeps sources safe from the caching allocator (``record_stream``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._platform.cuda import TORCH_CUDA, Runtime
from ..providers import StateProvider

#: (provider, source byte start, source byte stop, offset inside the piece)
Part = tuple[StateProvider, int, int, int]

_local = threading.local()


@contextlib.contextmanager
def producing_streams(*streams: Any) -> Iterator[None]:
    """Also gate snapshots staged in this block on ``streams`` (besides each device's current one).

    Use it when the state is produced on side streams::

        with producing_streams(side_stream):
            dcp_datastates.async_save(state, writer)
    """
    before = getattr(_local, "streams", ())
    _local.streams = tuple(before) + tuple(streams)
    try:
        yield
    finally:
        _local.streams = before


def extra_producing_streams() -> tuple[Any, ...]:
    return tuple(getattr(_local, "streams", ()))


@contextlib.contextmanager
def use_device(device: CopyDevice) -> Iterator[None]:
    """Snapshots created on this thread inside the block copy through ``device`` (the seam the
    fake-device tests use; also for a device layer of your own)."""
    before = getattr(_local, "device", None)
    _local.device = device
    try:
        yield
    finally:
        _local.device = before


class Completion(Protocol):
    def query(self) -> bool:
        """True when the piece's bytes are in the pool."""
        ...

    def wait(self) -> None:
        """Block until the piece's bytes are in the pool; raise the copy's error if it failed."""
        ...

    def fence(self) -> bool:
        """Order the calling thread's current device work after the copies, without blocking
        (again: a no-op for a stream fenced already); False when only a host wait can do
        it."""
        ...


class CopyDevice(Protocol):
    #: copies are finished when :meth:`copy` returns (no completion tracking needed)
    synchronous: bool

    def gate(self, providers: Sequence[StateProvider]) -> Any:
        """On the training thread, in stage(): mark "the state is produced" on every stream that
        produces the providers' sources."""
        ...

    def after_freeze(self, tensors: Sequence[torch.Tensor]) -> None:
        """On the thread that just queued ``tensors`` (private copies ``freeze()`` made): copies
        that read them must wait for them to be made."""
        ...

    def copy(self, parts: Sequence[Part], dst: torch.Tensor, gate: Any) -> Completion | None: ...


def source_of(provider: StateProvider) -> torch.Tensor | None:
    """The tensor a provider copies from, when it exposes one (custom providers may not): its
    private copy once ``freeze()`` took one (TensorProvider), else the live tensor."""
    source = getattr(provider, "_frozen", None)
    if source is None:
        source = getattr(provider, "source", None)
    return source if isinstance(source, torch.Tensor) else None


class CpuDevice:
    """The direct copy: the provider copies its bytes on the calling (copy worker) thread."""

    synchronous = True

    def gate(self, providers: Sequence[StateProvider]) -> None:
        return None

    def after_freeze(self, tensors: Sequence[torch.Tensor]) -> None:
        return None  # a host clone is made when freeze() returns

    def copy(self, parts: Sequence[Part], dst: torch.Tensor, gate: Any) -> None:
        for provider, start, stop, at in parts:
            provider.copy_into(dst[at : at + stop - start], start, stop)
        return None


CPU = CpuDevice()


def source_bytes(
    provider: StateProvider, source: torch.Tensor, start: int, stop: int
) -> torch.Tensor:
    """Bytes ``[start, stop)`` of ``source`` as a flat uint8 tensor on its device, split the way
    :meth:`TensorProvider.split` splits (whole rows when the source is not contiguous)."""
    if source.is_contiguous():
        flat = source.reshape(-1) if source.dim() != 1 else source
        return flat.view(torch.uint8)[start:stop]
    rows = source.shape[0] if source.dim() > 0 else 1
    row_bytes = provider.nbytes // max(rows, 1)
    block = source[start // row_bytes : stop // row_bytes].contiguous()
    return block.reshape(-1).view(torch.uint8)


class _CudaCompletion:
    def __init__(self, runtime: Runtime, events: list[tuple[int, Any]]) -> None:
        self.runtime = runtime
        self.events = events
        self._fenced: set[Any] = set()  # streams that wait on these events already
        self._lock = threading.Lock()

    def query(self) -> bool:
        return all(event.query() for _, event in self.events)

    def wait(self) -> None:
        for _, event in self.events:
            event.synchronize()

    def fence(self) -> bool:
        for index, event in self.events:
            stream = self.runtime.current_stream(index)
            with self._lock:
                new = stream not in self._fenced
                self._fenced.add(stream)
            if new:  # a stream waits once: the steps it queues later are behind the copy
                stream.wait_event(event)
        return True


@dataclass(frozen=True)
class Gate:
    """What ``stage()`` recorded: an event on each producing stream, by device, and the streams
    themselves (a copy of a clone no event was recorded for waits on them as they are then)."""

    events: dict[int, list[Any]] = field(default_factory=dict)
    streams: dict[int, list[Any]] = field(default_factory=dict)


class CudaDevice:
    """Side-stream copies gated on the producing streams' events.

    A part whose provider took a private copy (``freeze()``: small tensors in ``stage()``,
    buffers at the forward gate, copy-on-write) reads that clone, which the training thread
    queued on its stream *after* the gate: the copy stream also waits on the event
    :meth:`after_freeze` recorded behind the clone, or, where no one recorded one, on an event
    recorded on the producing streams when the copy is enqueued (the clone was queued there
    before the copy worker could see it).

    ``coalesce`` merges the consecutive small CUDA parts of one piece into one ``torch.cat`` on the
    copy stream (padding included, so the result has the piece's layout) and one device-to-host
    copy, instead of one launch per tensor. Every CUDA call goes through ``runtime``
    (``_platform.cuda.Runtime``): torch's by default, a simulated GPU in tests
    (``device_fake.FakeCuda``).
    """

    synchronous = False

    def __init__(self, *, coalesce: bool = True, runtime: Runtime | None = None) -> None:
        self.coalesce = coalesce
        self.runtime: Runtime = runtime if runtime is not None else TORCH_CUDA
        self._streams: dict[int, Any] = {}
        self._pads: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        #: clone -> the event recorded right after it was queued (``after_freeze``)
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _stream(self, index: int) -> Any:
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = self.runtime.new_stream(index)
                # No kernel: gap bytes are never read, so the pad needs no ordering.
                self._pads[index] = self.runtime.empty(64, index)
            return stream

    def gate(self, providers: Sequence[StateProvider]) -> Gate:
        """Record an event on the current stream of each device the providers' sources are on,
        and on the extra producing streams."""
        rt = self.runtime
        gate = Gate()
        devices = {rt.device_of(s) for p in providers if (s := source_of(p)) is not None}
        streams = [rt.current_stream(d) for d in sorted(d for d in devices if d is not None)]
        streams += [s for s in extra_producing_streams() if rt.is_stream(s)]
        for stream in streams:
            event = rt.new_event()
            event.record(stream)
            gate.events.setdefault(stream.device_index, []).append(event)
            gate.streams.setdefault(stream.device_index, []).append(stream)
        return gate

    def after_freeze(self, tensors: Sequence[torch.Tensor]) -> None:
        """One event per device, on the calling thread's current stream, behind the clones."""
        rt = self.runtime
        events: dict[int, Any] = {}
        for tensor in tensors:
            index = rt.device_of(tensor)
            if index is None:
                continue
            event = events.get(index)
            if event is None:
                event = events[index] = rt.new_event()
                event.record(rt.current_stream(index))
            with self._lock:
                self._made[tensor] = event

    def copy(self, parts: Sequence[Part], dst: torch.Tensor, gate: Gate) -> _CudaCompletion | None:
        groups: dict[int, list[tuple[int, torch.Tensor]]] = {}
        host: list[Part] = []
        for i, part in enumerate(parts):
            source = source_of(part[0])
            index = self.runtime.device_of(source) if source is not None else None
            if source is not None and index is not None:
                groups.setdefault(index, []).append((i, source))
            else:
                host.append(part)
        events = [self._enqueue(index, group, parts, dst, gate) for index, group in groups.items()]
        CPU.copy(host, dst, None)  # host parts never overlap the device parts' bytes
        return _CudaCompletion(self.runtime, events) if events else None

    def _enqueue(
        self,
        index: int,
        group: list[tuple[int, torch.Tensor]],
        parts: Sequence[Part],
        dst: torch.Tensor,
        gate: Gate,
    ) -> tuple[int, Any]:
        rt = self.runtime
        stream = self._stream(index)
        waits = list(gate.events.get(index, ())) + self._clones_made(index, group, parts, gate)
        with rt.on(index, stream):
            try:
                for event in waits:
                    stream.wait_event(event)
                if self.coalesce and len(group) > 1 and _adjacent(group, parts):
                    self._copy_coalesced(index, group, parts, dst)
                else:
                    for i, source in group:  # the tensors the waits above were chosen for
                        provider, start, stop, at = parts[i]
                        src = source_bytes(provider, source, start, stop)
                        dst[at : at + stop - start].copy_(src, non_blocking=True)
                for _, source in group:
                    rt.keep(source, stream)  # not reused by the allocator before the copy
                done = rt.new_event(blocking=True)  # the waiting thread sleeps, not spins
                done.record(stream)
            except BaseException:
                stream.synchronize()  # nothing may still write into the pool block
                raise
        return index, done

    def _clones_made(
        self, index: int, group: list[tuple[int, torch.Tensor]], parts: Sequence[Part], gate: Gate
    ) -> list[Any]:
        """The events the copy of ``group`` waits on besides the gate: one behind each clone it
        reads (``after_freeze``); for a clone without one, one recorded now on the producing
        streams, where the clone was queued before its provider handed it out."""
        events: list[Any] = []
        unmarked = False
        with self._lock:
            for i, source in group:
                if getattr(parts[i][0], "_frozen", None) is not source:
                    continue  # the live tensor: the gate orders it
                event = self._made.get(source)
                if event is None:
                    unmarked = True
                elif all(event is not e for e in events):
                    events.append(event)
        if unmarked:
            for stream in gate.streams.get(index, ()):
                event = self.runtime.new_event()
                event.record(stream)
                events.append(event)
        return events

    def _copy_coalesced(
        self,
        index: int,
        group: list[tuple[int, torch.Tensor]],
        parts: Sequence[Part],
        dst: torch.Tensor,
    ) -> None:
        first, stop, pieces = coalesced_sources(group, parts, self._pads[index])
        staged = torch.cat(pieces)  # allocated on the copy stream: reused only after this copy
        dst[first:stop].copy_(staged, non_blocking=True)


def _adjacent(group: list[tuple[int, torch.Tensor]], parts: Sequence[Part]) -> bool:
    """Whether the parts of ``group`` follow each other in the piece with only alignment padding
    between them (a re-copy of some of a piece's parts may skip others: never pad over those)."""
    for (i, _), (j, _) in zip(group, group[1:], strict=False):
        _, start, stop, at = parts[i]
        if not 0 <= parts[j][3] - (at + stop - start) < 64:
            return False
    return True


def coalesced_sources(
    group: list[tuple[int, torch.Tensor]], parts: Sequence[Part], pad: torch.Tensor
) -> tuple[int, int, list[torch.Tensor]]:
    """The byte tensors whose concatenation is the piece's bytes ``[first, stop)`` for the
    consecutive parts in ``group``, alignment gaps filled from ``pad`` (its content is never
    read back: no slice covers a gap)."""
    first = parts[group[0][0]][3]
    cursor, pieces = first, []
    for i, source in group:
        provider, start, stop, at = parts[i]
        if at > cursor:
            pieces.append(pad[: at - cursor])
        pieces.append(source_bytes(provider, source, start, stop))
        cursor = at + stop - start
    return first, cursor, pieces


_cuda_device: CudaDevice | None = None
_cuda_lock = threading.Lock()


def chosen() -> CopyDevice | None:
    """The device :func:`use_device` set for this thread, if any."""
    return getattr(_local, "device", None)


def for_providers(providers: Sequence[StateProvider]) -> CopyDevice:
    """The device layer for a snapshot of ``providers``: CUDA when any source is on a GPU."""
    global _cuda_device
    chosen = getattr(_local, "device", None)
    if chosen is not None:
        return chosen
    # Without CUDA no source can be on a GPU: the CPU path scans nothing. With it, one cheap
    # attribute per provider (is_cuda, not .device, which builds an object).
    if not torch.cuda.is_available() or not any(
        getattr(getattr(p, "source", None), "is_cuda", False) for p in providers
    ):
        return CPU
    with _cuda_lock:
        if _cuda_device is None:
            _cuda_device = CudaDevice()
        return _cuda_device


__all__ = [
    "CPU",
    "Gate",
    "Completion",
    "CopyDevice",
    "CpuDevice",
    "CudaDevice",
    "for_providers",
    "producing_streams",
    "use_device",
]
