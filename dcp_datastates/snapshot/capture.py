"""What ``stage()`` records on the caller's thread, so that planning can run on another.

DCP's local planning (flattening, a ``WriteItem`` per tensor) and building the providers cost
10-30 us per tensor: at 20,000 tensors that is most of a second of the training loop. None of it
has to run while the caller waits, provided the caller's thread records what the state *was* at
``stage()``:

* the structure: a copy of every dict and list of the state dict (same keys, same order), whose
  leaves are aliases of the caller's tensors made now (:func:`alias`), so neither a later
  ``sd["x"] = other`` nor ``x.data = other`` reaches the snapshot;
* each tensor's version counter, which the snapshot compares with the live one after copying;
* eager copies of tensors of at most ``eager_bytes`` (counters, small statistics), which forward
  may update in place before the optimizer step that the guard holds back.

The walk costs about a microsecond per tensor. It declines (returns ``None``: the caller plans as
before) for what it cannot record this way: a tensor that is not a plain dense CPU tensor or a
DTensor with a CPU local tensor (a device tensor needs the device gate recorded on the caller's
streams; other subclasses are resolved by DCP, other layouts refused naming the item), an
object that is not an immutable scalar (it is serialized on the caller, as before), a key other
than a string or an int (``check_state_dict`` refuses it on the caller's path), any provider the
user registered (it may claim any type), or a copy device chosen for this thread
(``device.use_device``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..providers import _REGISTRY
from ..providers.tensor import PROBE_AT_CALL_BYTES, probe
from .device import chosen

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_SCALARS = (int, float, bool, str, bytes, complex, type(None))


class _Decline(Exception):
    """The state holds something the fast walk cannot record; plan on the caller."""


@dataclass
class Capture:
    """The state dict as ``stage()`` saw it.

    Attributes:
        state: Copy of the dict/list structure; leaves are aliases of the caller's tensors,
            eager copies of small ones, or immutable scalars.
        versions: ``id(tensor) -> tensor._version`` for every tensor leaf of ``state``.
        private: ``id``s of the plain tensor leaves that are eager copies: nothing but the
            snapshot holds them, so their providers neither probe bytes nor join the forward
            gate.
        tensors: Tensor leaves recorded (eager copies included).
        eager_bytes: Bytes copied eagerly.
        finish: Builds ``state``, ``versions`` and ``private`` on the planning thread, for a
            capture that replayed the previous save's layout (``replay.py``); ``None`` once
            built.
        source: The caller's state dict, for the planning thread to record its layout.
        replayed: Whether ``replay.py`` recorded this capture.
        sizes_held: For a replayed capture, on the planning thread: whether its big tensors
            still have the sizes of the layout replayed (else that layout is learnt again).
        previous_plan: For a replayed capture, the local plan of the save whose layout it
            replayed (its items are reused where they still hold, ``planner.replans_to``).
        local_plan: The local plan made for this capture, once planned (the next replay's
            ``previous_plan``).
    """

    state: dict[str, Any]
    versions: dict[int, int]
    tensors: int = 0
    eager_bytes: int = 0
    finish: Callable[[], tuple[dict[str, Any], dict[int, int], set[int]]] | None = None
    source: Mapping[str, Any] | None = None
    replayed: bool = False
    sizes_held: Callable[[], bool] | None = None
    previous_plan: Any = None
    local_plan: Any = None
    private: set[int] = field(default_factory=set)
    #: ``id(tensor) -> probes`` (``providers.tensor.probe``) of the contiguous host tensors of
    #: at least ``PROBE_AT_CALL_BYTES``, read here, before the caller can write them.
    probes: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)

    def resolve(self) -> None:
        """Build what a replayed capture left to the planning thread (no-op otherwise)."""
        if self.finish is not None:
            self.state, self.versions, self.private = self.finish()
            self.finish = None

    def tensor_bytes(self) -> int:
        """Bytes of the tensors recorded (for sizing the pool before planning ends)."""
        return _tensor_bytes(self.state)


def _tensor_bytes(value: Any) -> int:
    if type(value) is DTensor:
        return value._local_tensor.nbytes
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def capture(state_dict: Mapping[str, Any], *, eager_bytes: int = 0) -> Capture | None:
    """Record ``state_dict`` for planning on another thread, or ``None`` where it cannot be."""
    if _REGISTRY or chosen() is not None or not isinstance(state_dict, Mapping) or not state_dict:
        return None  # the caller's path refuses a bad state dict with the full message
    if not all(type(k) is str for k in state_dict):
        return None  # top-level int keys: the caller's path checks them (check_state_dict)
    walker = _Walker(eager_bytes)
    collecting = gc.isenabled()
    gc.disable()  # the walk allocates a dict per dict; a full collection here costs 0.5 s
    try:
        with torch.no_grad():  # eager copies of parameters: no autograd node, half the cost
            state = walker.mapping(state_dict)
    except _Decline:
        return None
    finally:
        if collecting:
            gc.enable()
    return Capture(
        state,
        walker.versions,
        len(walker.versions),
        walker.eager,
        private=walker.private,
        probes=walker.probes,
    )


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor over ``tensor``'s storage now (sharing its version counter): a later
    ``tensor.data = other`` (EMA evaluation swapping in the shadow weights with
    ``state_dict(keep_vars=True)``, a buffer or optimizer state replaced that way, or
    ``torch.utils.swap_tensors``) gives ``tensor`` another storage, not the snapshot. About
    0.5 us a tensor."""
    made = keep_attributes(tensor.detach(), tensor)
    return made.requires_grad_() if tensor.requires_grad else made  # DCP's metadata records it


def keep_attributes(copy: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``copy`` with ``tensor``'s Python attributes: DCP plans from some (torch 2.14's
    ``CheckpointableTensor`` fields, ``global_shape`` and the shards' offsets and sizes, make
    SHARD items of a plain tensor), and a bare copy would be planned as a whole tensor."""
    attributes = tensor.__dict__
    if attributes:
        copy.__dict__.update(attributes)
    return copy


class _Walker:
    def __init__(self, eager_bytes: int) -> None:
        self.versions: dict[int, int] = {}
        self.private: set[int] = set()
        self.probes: dict[int, list[tuple[int, bytes]]] = {}
        self.eager_limit = eager_bytes
        self.eager = 0

    def mapping(self, value: Mapping[Any, Any]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        versions, eager = self.versions, self.eager_limit
        for key, item in value.items():
            if type(key) is not str and (type(key) is not int or str(key) in value):
                raise _Decline  # a key DCP may not take back: check_state_dict says why
            if type(item) in _PLAIN:  # the common case, inlined: about a microsecond
                if not item.is_cpu or item.layout is not _STRIDED or item.is_quantized:
                    raise _Decline  # (on the caller's path, TensorProvider says why)
                if item.is_nested:
                    raise _Decline
                nbytes = item.nbytes
                if eager and 0 < nbytes <= eager:
                    # A private copy now; the snapshot copies it, nothing else can change it.
                    item = keep_attributes(item.clone(), item)
                    self.eager += nbytes
                    self.private.add(id(item))
                else:
                    item = alias(item)
                    if nbytes >= PROBE_AT_CALL_BYTES:
                        self.probes[id(item)] = probe(item, nbytes)
                versions[id(item)] = item._version
                out[key] = item
            elif type(item) is DTensor:
                out[key] = self.dtensor(item)
            else:
                out[key] = self.any(item)
        return out

    def dtensor(self, item: DTensor) -> DTensor:
        """A DTensor stays one (DCP plans its shard from its spec); its local tensor's version
        is what the snapshot checks, and a small one is copied now as for plain tensors."""
        local = item._local_tensor
        if type(local) not in _PLAIN or not local.is_cpu:
            raise _Decline
        if self.eager_limit and 0 < local.nbytes <= self.eager_limit:
            # The constructor, as process_staging does: same spec, a private local copy.
            self.eager += local.nbytes
            item = DTensor(local.clone(), item._spec, requires_grad=False)
            local = item._local_tensor
        elif local.nbytes >= PROBE_AT_CALL_BYTES:
            self.probes[id(item)] = probe(local, local.nbytes)
        # Its own counter too: its in-place ops move it, not the local tensor's.
        self.versions[id(item)] = local._version + item._version
        return item

    def any(self, value: Any) -> Any:
        if isinstance(value, Mapping):
            return self.mapping(value)
        if type(value) is list:
            return [self.mapping({0: v})[0] for v in value]
        if type(value) in _SCALARS:
            return value
        if type(value) is tuple and all(type(v) in _SCALARS for v in value):
            return value
        raise _Decline  # tensor subclasses, objects: the caller's path handles them
