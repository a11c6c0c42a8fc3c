"""How the simulated GPU (``device_fake.FakeCuda``) takes an aten op on device memory.

A dispatch mode on each thread that issues device work (:class:`QueueMode`) hands every op to
:func:`queue`: an op on host memory only runs at once; a view runs at once (no byte moves); an
op whose value the host reads (``.item()``, ``torch.equal``) runs once the thread's stream
drained, as ``cudaStreamSynchronize`` would; any other op is *enqueued* on the thread's current
stream and returns at once: the tensors it makes are allocated now (their shapes from its meta
kernel) and hold garbage until the device ran it; the host tensors it reads (0-dim scalars on
CUDA) are read now, and a ``non_blocking`` copy reads or writes host memory when it runs; a host
tensor it writes becomes device memory (a GradScaler's ``found_inf``).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._platform import dispatch

#: Bytes of memory not produced yet: NaN in every float dtype, -1 in every integer one.
GARBAGE = 0xFF

_aten = torch.ops.aten
#: Ops that change a tensor's metadata on the host: run at once, after the stream drained.
_EAGER = {
    _aten.resize_.default,
    _aten.set_.source_Storage,
    _aten.set_.source_Storage_storage_offset,
    _aten.set_.source_Tensor,
    _aten.as_strided_.default,
}
#: Ops that only make a new view of the same memory (their schemas do not say so).
_VIEWS = {_aten._unsafe_view.default}


class QueueMode(dispatch.DispatchMode):
    """Sends every aten op on this thread to :func:`queue`. It stands for the hardware: at the
    bottom of the stack, under copy-on-write's mode (``_platform.dispatch.push_under``), which
    sees a write as it is issued on the host, as on a real GPU."""

    simulates_device = True

    def __init__(self, fake: Any) -> None:
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return queue(self.fake, func, args, kwargs or {})


@contextlib.contextmanager
def below() -> Iterator[None]:
    """Run an op as the device would: no mode (ours or a caller's), no version bump (the host
    bumped it at enqueue), no autograd."""
    with dispatch.disabled(), torch._C._AutoDispatchBelowADInplaceOrView():
        yield


def fill_garbage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.nbytes():
        ctypes.memset(storage.data_ptr(), GARBAGE, storage.nbytes())


def queue(fake: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """The simulated GPU's side of an aten op on the calling thread (the module docstring)."""
    leaves = pytree.tree_leaves((args, kwargs))
    index = None
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            index = fake.device_of(leaf)
            if index is not None:
                break
    if index is None:
        return func(*args, **kwargs)  # host memory only
    schema = func._schema
    returns = schema.returns
    if func in _VIEWS or (
        returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    ):
        return func(*args, **kwargs)  # a view: no byte is read or written
    stream = fake.current_stream(index)
    if func in _EAGER or (
        not schema.is_mutable and any(not _is_tensor_type(r.type) for r in returns)
    ):
        # A value the host reads (.item(), torch.equal) or a metadata change: the stream
        # runs up to here first, as cudaStreamSynchronize would.
        stream.synchronize()
        return func(*args, **kwargs)
    return _defer(fake, func, args, kwargs, index, stream)


def _defer(fake: Any, func: Any, args: tuple, kwargs: dict, index: int, stream: Any) -> Any:
    schema = func._schema
    bound = _bind(schema, args, kwargs)
    written_ids = {
        id(t)
        for name, value in bound.items()
        if _writes(schema, name)
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor)
    }
    is_copy = func in (_aten.copy_.default,)
    non_blocking = bool(bound.get("non_blocking", False))
    d2h = is_copy and fake.device_of(args[0]) is None
    h2d = is_copy and fake.device_of(args[1]) is None
    reads: list[int] = []
    writes: list[int] = []

    def prepare(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        device = fake.device_of(t) is not None
        if id(t) in written_ids:
            if not device and not d2h:
                fake._register(t, index)  # a host tensor a kernel writes lives on the device
            if not d2h:
                writes.append(t.untyped_storage()._cdata)
            return t
        if device:
            reads.append(t.untyped_storage()._cdata)
            return t
        if h2d and non_blocking:
            return t  # the DMA reads it when it runs
        with below():
            return t.clone()  # a scalar argument: read at launch

    run_args, run_kwargs = pytree.tree_map(prepare, (args, kwargs))
    if d2h:
        _fill_garbage_view(args[0])  # undefined until the copy landed

    in_place, alias = _aliased_returns(schema, bound)
    outputs: Any = None
    if in_place:
        result = alias
    else:
        try:
            result = _allocate(fake, func, args, kwargs, index)
        except Exception:
            # No meta kernel: run it here once the stream drained (a synchronous op).
            stream.synchronize()
            with below():
                result = func(*run_args, **run_kwargs)
            for t in pytree.tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    fake._register(t, index)
            return result
        outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        writes.extend(t.untyped_storage()._cdata for t in outputs)

    def kernel() -> None:
        with below():
            got = func(*run_args, **run_kwargs)
            if outputs is not None:
                made = [t for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
                for out, value in zip(outputs, made, strict=True):
                    out.copy_(value)

    label = ("d2h " if d2h else "h2d " if h2d else "") + str(func)
    if d2h:
        fake.d2h_copies += 1
    fake._enqueue(stream, "kernel", label, fn=kernel, reads=reads, writes=writes)
    if is_copy and (d2h or h2d) and not non_blocking:
        stream.synchronize()  # a blocking copy returns once it is done
    return result


def _allocate(fake: Any, func: Any, args: tuple, kwargs: dict, index: int) -> Any:
    """The op's new outputs, shaped as its meta kernel says, full of garbage."""

    def meta(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")

    with below():
        shapes = func(*pytree.tree_map(meta, args), **pytree.tree_map(meta, kwargs))

    def real(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
        fill_garbage(out)
        fake._register(out, index)
        return out

    return pytree.tree_map(real, shapes)


def _fill_garbage_view(t: torch.Tensor) -> None:
    if t.is_contiguous() and t.numel():
        ctypes.memset(t.data_ptr(), GARBAGE, t.numel() * t.element_size())


_TENSOR_TYPES = (
    torch._C.TensorType.get(),
    torch._C.ListType.ofTensors(),
    torch._C.OptionalType.ofTensor(),
)


def _is_tensor_type(t: Any) -> bool:
    return any(t.isSubtypeOf(kind) for kind in _TENSOR_TYPES)


def _bind(schema: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
    return bound


def _writes(schema: Any, name: str) -> bool:
    for arg in schema.arguments:
        if arg.name == name:
            return arg.alias_info is not None and arg.alias_info.is_write
    return False


def _aliased_returns(schema: Any, bound: dict[str, Any]) -> tuple[bool, Any]:
    """``(True, what it returns)`` for an op that returns what it wrote in place (``add_``,
    ``copy_``, ``out=``) or nothing (``_foreach_add_``); ``(False, None)`` for one that makes
    new tensors."""
    returns = schema.returns
    if not returns:
        return True, None
    if not all(r.alias_info is not None and r.alias_info.is_write for r in returns):
        return False, None
    values = []
    for r in returns:
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.before_set == r.alias_info.before_set:
                values.append(bound[arg.name])
                break
        else:
            return False, None
    return True, values[0] if len(values) == 1 else tuple(values)


__all__ = ["GARBAGE", "QueueMode", "below", "fill_garbage", "queue"]
