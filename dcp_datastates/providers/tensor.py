"""Raw tensor provider: copies a tensor's own bytes (never its base storage), never pickles."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from ..errors import InvalidStateDictError, SnapshotMutationError
from ..format import RecordFrame, record_frame

#: Alignment of a direct write (``localfile.ALIGN``): a part that may be written from the live
#: tensor lies in the pool at its source address modulo this (``live_skew``).
_ALIGN = 4096

#: Tensors smaller than this are never written from the live tensor (``begin_live``): below
#: it a direct write gains nothing (``localfile.EXTERNAL_MIN``), and their freezes (thousands
#: of small tensors in ``stage()``) skip the lock below.
LIVE_MIN_BYTES = 1 << 20

#: Guards live writes against freezes (``begin_live``, ``freeze``): one for all providers,
#: held for a few instructions at a time.
_live_lock = threading.Condition(threading.Lock())


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements are its storage's bytes at its strides: not sparse, not
    quantized (scales and zero points beside the bytes), not nested, not MKL-DNN."""
    return tensor.layout is torch.strided and not (tensor.is_quantized or tensor.is_nested)


def not_dense_error(fqn: str, tensor: torch.Tensor) -> InvalidStateDictError:
    return InvalidStateDictError(
        f"item {fqn!r} is a {_layout_of(tensor)} tensor, whose bytes this writer cannot copy "
        f"raw; save {_dense_hint(tensor)} instead, or register a provider for it with "
        "dcp_datastates.register_provider"
    )


def _layout_of(tensor: torch.Tensor) -> str:
    if tensor.is_quantized:
        return f"quantized ({tensor.qscheme()})"
    if tensor.is_nested:
        return "nested"
    return f"{tensor.layout} layout".removeprefix("torch.")


def _dense_hint(tensor: torch.Tensor) -> str:
    if tensor.is_quantized:
        return "tensor.dequantize(), or its int_repr() with its scales and zero points"
    if tensor.is_nested:
        return "its components (tensor.unbind()) or tensor.to_padded_tensor(0.0)"
    if tensor.layout in (torch.sparse_coo, torch._mkldnn):  # type: ignore[attr-defined]
        return "tensor.to_dense()" + (
            ", or its indices() and values()" if tensor.layout is torch.sparse_coo else ""
        )
    return "tensor.to_dense(), or its compressed indices and values"


class TensorProvider:
    """Provider for a plain tensor (or one local chunk of a distributed tensor).

    The saved record describes the tensor with its own shape as a contiguous tensor, so a view
    saves only the elements it shows, not the storage it shares with others.
    """

    kind = "tensor"

    def __init__(self, fqn: str, tensor: torch.Tensor, *, private: bool = False) -> None:
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            raise InvalidStateDictError(
                f"item {fqn!r} is a {type(tensor).__name__}, a tensor subclass this writer cannot "
                "copy raw; convert it to a plain tensor (or a DTensor) before saving, or register "
                "a provider for it with dcp_datastates.register_provider"
            )
        if not is_dense(tensor):
            raise not_dense_error(fqn, tensor)
        if tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg()
        self.fqn = fqn
        self.source: torch.Tensor | None = tensor.detach()  # shares the live version counter
        self._version = self.source._version
        self._owner: torch.Tensor | None = None  # a DTensor whose counter is watched too
        self.dtype = self.source.dtype
        self.shape = tuple(self.source.shape)
        self._nbytes = self.source.numel() * self.source.element_size()
        self._contiguous = self.source.is_contiguous()
        self._rows = self.shape[0] if self.shape else 1
        self._row_bytes = (self._nbytes // self._rows) if self._rows else 0
        #: A copy that nothing but the snapshot holds (an eager copy ``stage()`` made): no
        #: write can reach it, so it is not probed (3 reads of its bytes, a sixth of the
        #: planning thread's CPU at 20,000 tensors) nor entered in the forward gate.
        self.private = private
        self._probes = [] if private else probe(self.source, self._nbytes)
        #: A private copy taken by :meth:`freeze`; copies read it instead of the live tensor.
        self._frozen: torch.Tensor | None = None
        self._torn: int | None = None  # live version seen by a freeze that came too late
        self.parts = 0  # copy parts the snapshot planned for this provider
        self._parts_done = 0  # an undercount under concurrent copies, never an overcount
        #: Host parts whose bytes were checked unchanged right after their copy, before they
        #: counted as done: once all are, a later write cannot have reached the snapshot.
        self._parts_verified = 0
        #: Live writes in flight (``begin_live``): a freeze waits for them.
        self._live_busy = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def storage_key(self) -> int:
        """Identifies the live tensor's storage (its base address): how a module buffer is
        matched to the provider that snapshots it. 0 for an empty or released tensor."""
        src = self.source
        if src is None or self._nbytes == 0:
            return 0
        return storage_key(src)

    @property
    def frame(self) -> RecordFrame:
        # Built (and cached per dtype/shape) by the flush thread, never on the training thread.
        return record_frame(self.dtype, self.shape)

    @property
    def payload(self) -> None:
        return None

    def split(self, max_bytes: int) -> list[tuple[int, int]]:
        total = self.nbytes
        if total == 0:
            return []
        if self._contiguous:
            step = max_bytes
        else:
            # Non-contiguous sources are copied a block of whole rows at a time.
            step = max(1, max_bytes // max(self._row_bytes, 1)) * self._row_bytes
        return [(start, min(start + step, total)) for start in range(0, total, step)]

    def note_part(self) -> None:
        """The snapshot planned one more copy part of this provider."""
        self.parts += 1

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, start: int, stop: int) -> None:
        if self._contiguous:
            if src.is_cpu and dst.is_cpu and _holds(src, stop):  # dst: a pool view of the part
                host_copy(dst.data_ptr(), src.data_ptr() + start, stop - start)
                return
            # A device copy, or a storage resized since stage() (FSDP frees storages by
            # resizing them to 0): torch checks the bounds and raises.
            flat = src.reshape(-1) if src.dim() != 1 else src
            dst.copy_(flat.view(torch.uint8)[start:stop])
            return
        r0, r1 = start // self._row_bytes, stop // self._row_bytes
        rows = src[r0:r1]
        out = dst.view(src.dtype).view(rows.shape)
        if not (rows.is_cpu and out.is_cpu and strided_host_copy(out, rows)):
            out.copy_(rows)

    def watch_owner(self, owner: torch.Tensor) -> None:
        """Also watch ``owner``'s version counter: a DTensor's in-place ops (``dt.add_``,
        ``dt[i].fill_``) move the DTensor's own counter, not its local tensor's, which moves
        only for writes through the local tensor (``to_local()``). A user sweep: such a change
        after the call was committed, in 7-9 of 10 saves."""
        self._owner = owner
        self._version += owner._version

    def _now(self, live: torch.Tensor) -> int:
        """The live version: the source's counter, plus its owner's (:meth:`watch_owner`).
        Both only grow, so the sum moves when either does."""
        owner = self._owner
        return live._version if owner is None else live._version + owner._version

    def staged_version(self, version: int, live: torch.Tensor) -> None:
        """``live`` (the caller's tensor) had ``version`` at ``stage()``, recorded there when
        this provider is built later, on the planning thread: a write in between fails the
        snapshot, now or after its copy."""
        if live.is_conj() or live.is_neg():
            # The source is a copy resolved just now: faithful only if nothing wrote since.
            if self._now(live) != version:
                raise SnapshotMutationError(
                    fqn=self.fqn, rank=_rank(), before=version, after=self._now(live)
                )
            return
        self._version = version

    def staged_probes(self, probes: list[tuple[int, bytes]]) -> None:
        """``probes`` were read from the live tensor in ``stage()``, before the caller could
        write it: they replace the planning thread's, which an in-place op started right
        after the call may already have reached."""
        self._probes = probes

    def _live_changed(self, live: torch.Tensor) -> bool:
        """Whether the live tensor's sampled bytes changed: an in-place op that is still
        running (its version counter moves only when it returns) has written the start of one
        of its ranges (:func:`probe_offsets`), so a copy that overlapped it is found."""
        return bool(self._probes) and probes_differ(self._probes, live.data_ptr(), 0, self._nbytes)

    def _changed_error(self, live: torch.Tensor) -> SnapshotMutationError:
        return SnapshotMutationError(
            fqn=self.fqn,
            rank=_rank(),
            before=self._version,
            after=self._now(live),
            unversioned=self._now(live) == self._version,
        )

    def copy_into(self, dst: torch.Tensor, start: int, stop: int) -> None:
        frozen = self._frozen
        live = self.source
        if frozen is None and live is None:
            raise RuntimeError(f"tensor {self.fqn!r} was released before its snapshot was copied")
        src = frozen if frozen is not None else live
        assert src is not None
        self._copy(src, dst, start, stop)
        verified = src is live and src.is_cpu and dst.is_cpu  # a host copy is done on return
        # The live tensor read again after the copy: its version counter, and for a host copy
        # its sampled bytes, which an in-place op still running has changed.
        changed = verified and self._contiguous and self._live_changed(live)
        if src is live and self._frozen is not None:
            # A freeze ran while we copied: a write may be under way now (copy-on-write lets it
            # go once the freeze returns, before its version counter moves), and the frozen
            # copy holds the staged bytes.
            self._copy(self._frozen, dst, start, stop)
            changed = False
        if self._contiguous:
            self._check_probes(dst.data_ptr(), start, stop)
        if changed:
            raise self._changed_error(live)
        # Checked before the part counts as done: from then on freeze() leaves the live tensor
        # to the caller's forward, and a write right after it must not fail a snapshot whose
        # bytes were whole (the check after the copy used to see it). The rank is looked up
        # only where the check may raise.
        if verified and (
            self._frozen is not None or self._torn is not None or self._now(live) != self._version
        ):
            self.check_unchanged(_rank())
        self._parts_done += 1
        if verified:
            self._parts_verified += 1

    def _check_probes(self, addr: int, start: int, stop: int) -> None:
        """Compare the bytes ``[start, stop)`` copied (or written) from ``addr`` with those
        sampled at stage time, where this chunk has any: catches writes that do not bump the
        version counter (``.data``, ``.numpy()``, a ``torch.from_numpy`` view) when they touch a
        sampled byte."""
        if probes_differ(self._probes, addr, start, stop):
            live = self.source
            now = self._now(live) if live is not None else self._version
            raise SnapshotMutationError(
                fqn=self.fqn,
                rank=_rank(),
                before=self._version,
                after=now,
                unversioned=now == self._version,
            )

    def live_skew(self, start: int) -> int | None:
        """Where byte ``start`` lies modulo the direct-write alignment, for a part the flush may
        write straight from the live tensor (a contiguous host tensor of the caller's); None for
        any other part (a private copy, a device or strided tensor)."""
        src = self.source
        if (
            self.private
            or not self._contiguous
            or self._nbytes < LIVE_MIN_BYTES
            or src is None
            or not src.is_cpu
        ):
            return None
        return (src.data_ptr() + start) % _ALIGN

    def begin_live(self, start: int, stop: int) -> memoryview | None:
        """The live bytes ``[start, stop)`` for the flush to write in place of a copy, or None
        where they cannot be (frozen, changed, released, or the storage resized since
        ``stage()``). Until :meth:`end_live`, a freeze waits: the forward gate then copies the
        buffer only once this write has read it."""
        with _live_lock:
            live = self.source
            if (
                live is None
                or self._frozen is not None
                or self._torn is not None
                or self.live_skew(start) is None
                or not _holds(live, stop)
                or self._now(live) != self._version
            ):
                return None
            self._live_busy += 1
        flat = live.reshape(-1) if live.dim() != 1 else live
        # numpy's view keeps the tensor (and so its memory) alive as long as the memoryview.
        return memoryview(flat.view(torch.uint8)[start:stop].numpy())

    def cancel_live(self) -> None:
        """A view from :meth:`begin_live` that will not be written (the copy came first)."""
        with _live_lock:
            self._live_busy -= 1
            _live_lock.notify_all()

    def end_live(self, view: memoryview, start: int, stop: int) -> None:
        """The live bytes ``[start, stop)`` from :meth:`begin_live` were written: check that
        nothing changed them (version counter, and the bytes sampled at ``stage()``), and count
        the part done, as a copy's check does. Raises :class:`SnapshotMutationError`."""
        try:
            if view.nbytes:
                self._check_probes(ctypes.addressof(ctypes.c_char.from_buffer(view)), start, stop)
            live = self.source
            if live is not None and (self._live_changed(live) or self._now(live) != self._version):
                raise self._changed_error(live)
            self._parts_done += 1
            self._parts_verified += 1
        finally:
            with _live_lock:
                self._live_busy -= 1
                _live_lock.notify_all()

    def check_unchanged(self, rank: int) -> None:
        if self._torn is not None:
            raise SnapshotMutationError(
                fqn=self.fqn, rank=rank, before=self._version, after=self._torn
            )
        if self._frozen is not None:
            return  # copies read the private copy, which nothing else can change
        if self.parts and self._parts_verified >= self.parts:
            return  # every byte was copied before any change (copy_into)
        live = self.source
        now = self._now(live) if live is not None else self._version
        if now != self._version:
            raise SnapshotMutationError(fqn=self.fqn, rank=rank, before=self._version, after=now)

    def freeze(self) -> int:
        """Take a private copy of the live tensor now (on the caller's thread, on its device),
        unless every byte was copied already; later copies read it, so the live tensor may
        change from here on. Returns the bytes copied.

        Called before the caller's next write (by ``stage()`` for small tensors, and by the
        forward gate for module buffers). A live tensor that changed before the freeze is
        recorded: the snapshot then fails with :class:`SnapshotMutationError`.
        """
        if self._nbytes < LIVE_MIN_BYTES:  # never written live
            return self._freeze()
        with _live_lock:
            # A live write of this tensor in flight reads the bytes the caller is about to
            # change: it ends first (a part it wrote counts as copied), and none starts after.
            _live_lock.wait_for(lambda: not self._live_busy)
            return self._freeze()

    def _freeze(self) -> int:
        live = self.source
        if (
            live is None
            or self._frozen is not None
            or self._nbytes == 0
            or (self.parts and self._parts_done >= self.parts)
        ):
            return 0
        if self._now(live) != self._version:
            self._torn = self._now(live)
            return 0
        frozen = live.clone()
        if self._now(live) != self._version:  # pragma: no cover - another thread wrote meanwhile
            self._torn = self._now(live)
            return 0
        self._frozen = frozen
        return self._nbytes

    def release(self) -> None:
        """Drop the references to the live tensor and any private copy (the save is over)."""
        self.source = None
        self._frozen = None
        self._owner = None


def storage_key(tensor: torch.Tensor) -> int:
    """The base address of ``tensor``'s storage, from cheap accessors (no storage object)."""
    return tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()


#: Bytes sampled at each probe offset of a tensor at stage time (``probe``).
PROBE_BYTES = 32
#: Elements per task below which ATen runs an elementwise op on one thread
#: (``at::internal::GRAIN_SIZE``): larger tensors are split into one range per thread.
_GRAIN = 32768
#: Tensors of at least this many bytes are probed on the caller's thread in ``stage()``
#: (``snapshot/capture.py``, ``replay.py``); smaller ones on the planning thread. Each probe
#: read on the caller misses the caches (about 6 us per tensor after the training evicted
#: them): at 1 MiB the 99-tensor, 0.1 GB benchmark state's 48 probed tensors blocked the call
#: 0.6 ms longer (1.3 against 0.7 ms, 20 saves each, alternating), about 1/10 of stock's
#: blocked time there. An in-place op on a smaller tensor ends within about 0.4 ms, mostly
#: before its copy starts, and its version counter then catches it.
PROBE_AT_CALL_BYTES = 4 << 20


def probe_offsets(nbytes: int, itemsize: int) -> list[int]:
    """Where :func:`probe` samples a contiguous tensor of ``nbytes``: its head, middle and tail,
    and the start of each range an elementwise in-place op of this process's thread count
    writes in parallel (ATen splits ``numel`` into ``min(threads, numel / GRAIN)`` equal
    ranges, each written from its start). An op running while a copy reads the tensor has
    written the start of at least one range before any other byte (its version counter moves
    only when it returns), so reading these offsets again after the copy finds it."""
    if nbytes == 0:
        return []
    k = min(PROBE_BYTES, nbytes)
    offsets = {0, (nbytes // 2) - ((nbytes // 2) % 8), nbytes - k}
    numel = nbytes // max(1, itemsize)
    if numel > _GRAIN:
        tasks = min(torch.get_num_threads(), -(-numel // _GRAIN))
        chunk = -(-numel // tasks) * itemsize
        offsets.update(range(chunk, nbytes, chunk))
    return sorted(offsets)


def probe(t: torch.Tensor, nbytes: int) -> list[tuple[int, bytes]]:
    """``(offset, bytes)`` at :func:`probe_offsets` of a contiguous CPU tensor, read at stage
    time (about 4 us per tensor); other tensors are checked by version counter only, as are
    conjugate and negative views, whose provider copies them resolved, bytes that differ from
    the raw ones sampled here (a user sweep: every async save of one of 4 MiB and more, sampled
    in ``stage()``, failed as changed)."""
    if nbytes == 0 or t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return []
    ptr = t.data_ptr()
    return [
        (at, ctypes.string_at(ptr + at, min(PROBE_BYTES, nbytes - at)))
        for at in probe_offsets(nbytes, t.element_size())
    ]


def host_copy(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` between host addresses on the calling thread alone (a ``memmove`` that
    releases the GIL).

    ``Tensor.copy_`` of a large CPU tensor runs an OpenMP parallel region, and from a thread
    other than the caller's OpenMP gives that thread a team of its own, as many threads as
    ``torch.get_num_threads()``: every copy worker brought a team that competed with the
    training's own for its cores (measured on the 2-core VM, 0.33 GB in 32 MiB chunks from one
    background thread: 0.024 s on the thread, 0.048-0.061 s of process CPU; ``memmove`` 0.039-0.046
    s, all of it on the thread). The copy workers are this library's parallelism
    (``copy_workers``, chosen from the machine)."""
    ctypes.memmove(dst, src, nbytes)


#: An integer dtype of each element size: a view numpy copies bit for bit, whatever the dtype.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def strided_host_copy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy the strided CPU tensor ``src`` into ``dst`` (same shape) with numpy, on the calling
    thread alone; False where numpy cannot view it (16-byte elements), for ``Tensor.copy_``.

    Not ``Tensor.copy_`` first, for the reason ``host_copy`` gives: a copy large enough to run in
    parallel gives a background thread an OpenMP team of its own, and while that thread lives
    the process has more OpenMP threads than cores, and every parallel region of the training
    waits longer (``docs/design.md``, "Threads")."""
    bits = _BITS.get(src.element_size())
    if bits is None:
        return False
    np.copyto(dst.view(bits).numpy(), src.view(bits).numpy())
    return True


def _holds(t: torch.Tensor, nbytes: int) -> bool:
    """Whether ``t`` is contiguous and its storage still has ``nbytes`` from its first element:
    ``host_copy`` reads raw memory, so it must never run past a storage (one resized since the
    provider was made would make it read freed memory)."""
    offset = t.storage_offset() * t.element_size()
    return t.is_contiguous() and offset + nbytes <= t.untyped_storage().nbytes()


def probes_differ(probes: list[tuple[int, bytes]], dst_ptr: int, start: int, stop: int) -> bool:
    """Whether the copy of data bytes ``[start, stop)`` at ``dst_ptr`` differs from a probe."""
    for at, expected in probes:
        lo, hi = max(at, start), min(at + len(expected), stop)
        if (
            lo < hi
            and ctypes.string_at(dst_ptr + lo - start, hi - lo) != expected[lo - at : hi - at]
        ):
            return True
    return False


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ShardProvider(TensorProvider):
    """The local chunk of a DTensor or ShardedTensor; its global offsets ride on the WriteItem."""

    kind = "shard"
