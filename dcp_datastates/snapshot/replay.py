"""Replaying the previous save's walk: ``stage()`` of a state dict laid out as before.

A training loop saves a state of the same layout again and again: the same keys, tensors of the
same kinds and sizes (often the same objects, updated in place), only scalars (a step, an epoch)
replaced. For such a state the per-item walk of ``capture.py`` (about a microsecond of Python per
tensor, two more per eager copy) repeats the same decisions. After a save planned from a walk,
the planning thread records the live state's layout (:class:`_Record`: its containers, their
keys, the type of every value in order; which tensors are copied eagerly, grouped by shape and
dtype, and the size of the others) and allocates the buffers of the next save's eager copies.
The next ``stage()`` checks, with loops that run in C (``map``, ``itertools``, one per depth of
the structure), that the live state still has that layout, and records it:

* every container has the recorded type, length and keys, and every value the recorded type (a
  scalar leaf may be replaced by another scalar, read now);
* the eagerly copied tensors of each group still have its shape and dtype, and are copied by
  one ``torch.stack`` into the buffer prepared for the group (the copies are its rows);
* every other tensor's version counter is read, and where the process has an accelerator, that
  it is still on the CPU (without one no tensor can be elsewhere but on ``meta``, whose copy
  fails the save). Its size is checked on the planning thread (``learn``): it only decides
  whether the walk would copy the tensor eagerly, and a tensor recorded as big is saved
  correctly at any size (read live, version-checked); one of another size has the layout
  learnt again there for the next save.

These are the decisions the walk makes on each value, made on the value found now: a tensor
replaced by another object of the same kind, or a new container (``model.state_dict()`` builds
new dicts of new tensor objects at each call) is recorded exactly as the walk would record it.
Anything else (a key added or removed, a value of another kind, a small tensor resized or
retyped, a tensor moved) is a miss: ``capture()`` walks the state as before, and the planning
thread records the new layout. The structure copy that the planning thread plans from is built
there, from the values read here. The record holds no reference to the caller's objects (a
finished save holds none).

Cost at 20,000 tensors (9,993 big, 10,005 eager, 9 MB) on a 2-core AMD EPYC VM, inside
``dcp_datastates.async_save`` right after the previous save (12 steady saves): 15-33 ms of
the caller's CPU, median about 24 ms (35 ms before the size and device checks left the caller
and the dtype check came after the stack, 2026-12-01): the structure 2-3.4 ms, the types 0.5-1,
the big tensors' ``_version`` 4.6-8.9, the eager groups' ``torch.stack`` and dtype check
7.5-19. Nearly all of it is TLB and cache misses on the tensors' metadata and data, which the
previous save and the training between saves evicted: one ``_version`` read costs 76 ns on a
warm tensor and 0.5-0.7 us on each of 10,000 (their metadata lies on 10,000 pages), and every
further pass over the same tensors pays it again, which is why each tensor is visited once
where it can be. Reading the version counter of every one of the 20,000 tensors alone takes
10-14 ms there. A tuple per tensor (one ``attrgetter`` of two attributes) measured no faster:
10,000 tuples set off a dozen collections of the cyclic GC on the caller, 3-4 ms. A helper
thread running the big tensors' pass while the caller's ``torch.stack`` ran without the GIL
measured slower (20.7 ms against 15.5 ms in isolation): the GIL came back to the caller only
after the 5 ms switch interval.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from itertools import chain, compress, count
from operator import attrgetter, is_not
from typing import Any

import torch

from ..providers import _REGISTRY
from ..providers.tensor import PROBE_AT_CALL_BYTES, probe
from .capture import _PLAIN, _SCALARS, Capture, capture, keep_attributes
from .device import chosen
from .hostmem import zeroed

_DICTS = (dict, OrderedDict)  # types whose values() order is their keys' order
_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
_nbytes = attrgetter("nbytes")
_is_cpu = attrgetter("is_cpu")
_version = attrgetter("_version")
_detach = torch.Tensor.detach
_SCALAR_SET = frozenset(_SCALARS)
#: Sets the grad mode without ``torch.set_grad_enabled``'s frames (it is a class; its
#: ``__init__`` reads the mode back), on the caller.
_set_grad_enabled = getattr(torch._C, "_set_grad_enabled", torch.set_grad_enabled)
#: Whether this process has an accelerator (asked at the first replay, not at import, which
#: must not touch a device runtime). Without one no tensor can be on a device but the CPU (or
#: ``meta``, which has no bytes: its copy fails the save), so the replay does not check the big
#: tensors' devices, a pass that costs 5 ms at 10,000 tensors here.
_accelerator: bool | None = None


def _has_accelerator() -> bool:
    global _accelerator
    if _accelerator is None:
        _accelerator = torch.accelerator.current_accelerator() is not None
    return _accelerator


def _scalar(value: Any) -> bool:
    t = type(value)
    return t in _SCALARS or (t is tuple and _SCALAR_SET.issuperset(map(type, value)))


class _Record:
    """The layout of a state dict as the planning thread found it after a save."""

    def __init__(self) -> None:
        # Containers are numbered breadth first from the top-level state dict (0); values are
        # numbered in that order, each container's in its own order. No reference to the
        # caller's objects is kept (a finished save holds none).
        self.kinds: list[type] = []  # per container: dict, OrderedDict or list
        self.is_dict: list[bool] = []
        self.lens: list[int] = []
        self.parent_pos: list[int] = []  # per container: its position among the values (top: 0)
        self.keys: list[Any] = []  # keys of the dict containers, in order
        self.key_tuples: list[tuple[Any, ...] | None] = []  # per container (None: a list)
        self.types: list[type] = []  # per value: its type
        self.tuples: list[int] = []  # positions of tuples of scalars (checked at every replay)
        #: Containers by depth: per level, the slice of container numbers, the kinds, lengths,
        #: the positions where the level's containers are found, and whether all are dicts.
        self.levels: list[tuple[slice, list[type], list[int], list[int], bool]] = []
        self.small: list[int] = []  # positions of the tensors copied eagerly, by group
        self.groups: list[list[int]] = []  # positions of eager tensors of one shape and dtype
        self.group_kinds: list[tuple[torch.Size, torch.dtype]] = []
        self.big: list[int] = []  # positions of the other tensors
        self.big_nbytes: list[int] = []
        #: Indices into ``big`` of the tensors probed in ``stage()`` (``PROBE_AT_CALL_BYTES``).
        self.probed: list[int] = []
        self.scalars: set[int] = set()
        self.eager_bytes = 0
        #: Per group, the buffer the next save stacks into: allocated and faulted in on the
        #: planning thread (a fresh allocation faults its pages in on the caller: 10-15 ms for
        #: the 9 MB of eager copies of the 20,000-tensor benchmark state).
        self.spare: list[torch.Tensor] | None = None
        #: The DCP local plan of the last save of this layout (no tensors: keys, sizes,
        #: properties), for the next one to reuse where it still holds (``planner.replans_to``).
        self.local_plan: Any = None


def _learn(state_dict: Mapping[Any, Any], eager_limit: int) -> _Record | None:
    """The layout of ``state_dict``, or ``None`` for one the replay does not cover (a DTensor,
    an object, a container other than a dict or list, one reached twice)."""
    if not state_dict:
        return None  # the caller's path refuses it with the full message
    rec = _Record()
    seen: set[int] = set()
    groups: dict[tuple[torch.Size, torch.dtype], list[int]] = {}
    conts: list[Any] = [state_dict]
    values: list[Any] = []
    rec.parent_pos.append(0)
    depth = [0]  # per container (breadth first: never decreasing)
    i = 0
    while i < len(conts):
        c = conts[i]
        i += 1
        if id(c) in seen:
            return None  # shared or cyclic: the walk copies it twice; keep the walk
        seen.add(id(c))
        is_dict = type(c) in _DICTS
        if not is_dict and type(c) is not list:
            return None
        items = list(c.items()) if is_dict else list(enumerate(c))
        rec.kinds.append(type(c))
        rec.is_dict.append(is_dict)
        rec.lens.append(len(items))
        rec.key_tuples.append(tuple(k for k, _ in items) if is_dict else None)
        for key, value in items:
            if is_dict:
                if type(key) is not str and (type(key) is not int or str(key) in c):
                    return None
                rec.keys.append(key)
            pos = len(values)
            values.append(value)
            kind = type(value)
            rec.types.append(kind)
            if kind in _PLAIN:
                if not value.is_cpu:
                    return None
                nbytes = value.nbytes
                if eager_limit and 0 < nbytes <= eager_limit:
                    groups.setdefault((value.shape, value.dtype), []).append(pos)
                    rec.eager_bytes += nbytes
                else:
                    rec.big.append(pos)
                    rec.big_nbytes.append(nbytes)
            elif kind in _DICTS or kind is list:
                conts.append(value)
                rec.parent_pos.append(pos)
                depth.append(depth[i - 1] + 1)
            elif _scalar(value):
                rec.scalars.add(pos)
                if kind is tuple:
                    rec.tuples.append(pos)
            else:
                return None
    start = 1
    while start < len(conts):
        end = start
        while end < len(conts) and depth[end] == depth[start]:
            end += 1
        level = slice(start, end)
        rec.levels.append(
            (
                level,
                rec.kinds[level],
                rec.lens[level],
                rec.parent_pos[level],
                all(rec.is_dict[level]),
            )
        )
        start = end
    rec.probed = [i for i, n in enumerate(rec.big_nbytes) if n >= PROBE_AT_CALL_BYTES]
    rec.group_kinds = list(groups)
    rec.groups = list(groups.values())
    rec.small = [pos for group in rec.groups for pos in group]
    return rec


class CaptureCache:
    """One writer's record of its last layout; :meth:`capture` replays it or walks."""

    def __init__(self, eager_bytes: int) -> None:
        self.eager_bytes = eager_bytes
        self._lock = threading.Lock()
        self._record: _Record | None = None
        #: Saves recorded by replay / by the walk (for tests and the benchmarks).
        self.replays = 0
        self.walks = 0

    def capture(self, state_dict: Mapping[str, Any]) -> Capture | None:
        """Record ``state_dict`` for the planning thread (replaying the last layout when it
        still holds), or ``None`` where the caller must plan (``capture.capture``)."""
        if _REGISTRY or chosen() is not None:
            return None
        with self._lock:
            rec = self._record
            spare = rec.spare if rec is not None else None
            if rec is not None:
                rec.spare = None  # one save's copies: the next gets new buffers
        if rec is not None:
            captured = self._replay(rec, state_dict, spare)
            if captured is not None:
                self.replays += 1
                return captured
        captured = capture(state_dict, eager_bytes=self.eager_bytes)
        if captured is not None:
            self.walks += 1
            captured.source = state_dict
        return captured

    def _replay(
        self, rec: _Record, state_dict: Mapping[str, Any], spare: list[torch.Tensor] | None
    ) -> Capture | None:
        if type(state_dict) is not rec.kinds[0] or len(state_dict) != rec.lens[0]:
            return None
        values: list[Any] = list(state_dict.values())
        conts = [state_dict]
        for _level, kinds, lens, found_at, all_dicts in rec.levels:  # loops in C, per depth
            level = list(map(values.__getitem__, found_at))
            if list(map(type, level)) != kinds or list(map(len, level)) != lens:
                return None
            conts += level
            if all_dicts:
                values.extend(chain.from_iterable(map(dict.values, level)))
            else:
                values.extend(
                    chain.from_iterable([c if type(c) is list else c.values() for c in level])
                )
        if list(chain.from_iterable(compress(conts, rec.is_dict))) != rec.keys:
            return None
        # Values of the types recorded; the checks below are those the walk makes on each
        # value (a tensor's type, device and size; a small one's shape and dtype), so a tensor
        # replaced by another object of the same kind is recorded as the walk would record it
        # (its version read now, or copied now), as is a new container
        # (``model.state_dict()`` builds new dicts of new tensor objects at each call).
        types = list(map(type, values))
        if types != rec.types:
            for pos in compress(count(), map(is_not, types, rec.types)):
                if pos not in rec.scalars or not _scalar(values[pos]):
                    return None  # a value replaced by one of another kind
        if not all(map(_scalar, map(values.__getitem__, rec.tuples))):
            return None  # a tuple of scalars replaced by one holding other objects
        big = list(map(values.__getitem__, rec.big))
        # Each big tensor is visited once, for its version counter (each visit of a tensor's
        # C++ side misses the TLB: 0.3-0.7 us apiece here), and a second time for its device
        # only where the process has an accelerator. Its size is left to the planning thread
        # (``learn``): it only decides whether the walk would have copied the tensor eagerly,
        # and one recorded as big is saved correctly at any size (read live, version-checked).
        if _has_accelerator() and not all(map(_is_cpu, big)):
            return None  # a tensor moved to a device: its copy needs the device gate
        versions = list(map(_version, big))
        # Aliases made now hold each tensor's storage at the call: a `.data = other` or
        # `torch.utils.swap_tensors` afterwards reaches the caller's object, not the snapshot
        # (``capture.alias``; a swap right after the call of a tensor grown past the probed
        # size was committed on a replayed save). The planning thread puts them in place of
        # the originals. About 0.45 us a tensor (10,000: 4.5 ms of the caller's time).
        aliases = list(map(_detach, big))
        # The big ones' bytes sampled before the caller can write them (the planning thread's
        # samples may come after an in-place op started: providers.tensor.probe_offsets).
        probes = {id(t): probe(t, t.nbytes) for t in map(aliases.__getitem__, rec.probed)}
        stacks = _stack_groups(rec, values, spare) if rec.groups else []
        if stacks is None:
            return None
        captured = Capture({}, {}, len(rec.small) + len(big), rec.eager_bytes, probes=probes)
        captured.finish = lambda: _build(rec, values, stacks, aliases, versions)
        captured.sizes_held = lambda: list(map(_nbytes, aliases)) == rec.big_nbytes
        captured.source = state_dict
        captured.replayed = True
        captured.previous_plan = rec.local_plan
        return captured

    def learn(self, captured: Capture) -> None:
        """On the planning thread, after planning ``captured``: record the live state's layout
        (after a walk), and prepare the buffers of the next save's eager copies."""
        source = captured.source
        captured.source = None
        if source is None:
            return
        sizes_held, captured.sizes_held = captured.sizes_held, None  # set by a replay only
        if sizes_held is not None and sizes_held():
            rec = self._record
        else:  # walked, or replayed with a big tensor of another size: learn the layout again
            try:
                rec = _learn(source, self.eager_bytes)
            except RuntimeError:  # the caller changed a dict while we read it: walk next time
                rec = None
        spare = None
        if rec is not None:
            spare = [
                zeroed((len(group), *shape), dtype)  # pages faulted in here, by memset
                for group, (shape, dtype) in zip(rec.groups, rec.group_kinds, strict=True)
            ]
        with self._lock:
            if rec is not None:
                rec.spare = spare
                rec.local_plan = captured.local_plan
            self._record = rec

    def has_record(self) -> bool:
        """Whether a layout is recorded (a save, or ``warm_up``, learnt one)."""
        return self._record is not None

    def forget(self) -> None:
        """Drop the record (its references to the live state): the writer is closing."""
        with self._lock:
            self._record = None


def _stack_groups(
    rec: _Record, values: list[Any], spare: list[torch.Tensor] | None
) -> list[torch.Tensor] | None:
    """The eager copies: one ``torch.stack`` per group of the record, into the buffer prepared
    for it; None where a member no longer fits its group (the caller walks instead)."""
    stacks = []
    # Without autograd: a parameter's copy needs no graph, and torch.stack(out=) refuses one.
    # The grad mode is set directly: torch.no_grad()'s frames cost 30-40 us cold here.
    grad = torch.is_grad_enabled()
    _set_grad_enabled(False)
    try:
        for i, (positions, (shape, dtype)) in enumerate(
            zip(rec.groups, rec.group_kinds, strict=True)
        ):
            members = list(map(values.__getitem__, positions))
            try:
                if spare is not None:
                    stacked = torch.stack(members, out=spare[i])
                else:
                    stacked = torch.stack(members)
            except (RuntimeError, TypeError):
                # Resized or moved (RuntimeError), or retyped to a dtype the group's buffer
                # cannot take (TypeError: a float where an int64 step was; a user sweep).
                return None
            # After the stack, which brought the tensors' metadata into the caches: the dtypes,
            # which torch.stack would have converted silently.
            if set(map(_dtype, members)) != {dtype}:
                return None
            if stacked.shape[1:] != shape or not stacked.is_cpu:
                return None
            stacks.append(stacked)
    finally:
        _set_grad_enabled(grad)
    return stacks


def _build(
    rec: _Record,
    values: list[Any],
    stacks: list[torch.Tensor],
    big: list[torch.Tensor],
    versions: list[int],
) -> tuple[dict[str, Any], dict[int, int], set[int]]:
    """On the planning thread: the structure copy, versions and private copies the walk would
    have recorded; an eager copy is a row of its group's stacked copy; ``big`` are the aliases
    ``stage()`` made of the other tensors."""
    recorded = {id(t): v for t, v in zip(big, versions, strict=True)}
    for pos, made in zip(rec.big, big, strict=True):
        live = values[pos]
        if live.requires_grad:  # DCP's metadata records it (capture.alias)
            made.requires_grad_()
        values[pos] = keep_attributes(made, live)
    private: set[int] = set()
    for positions, stacked in zip(rec.groups, stacks, strict=True):
        version = stacked._version  # private: nothing wrote it since the copy
        for pos, copy in zip(positions, stacked.unbind(0), strict=True):
            values[pos] = keep_attributes(copy, values[pos])  # as the walk's copy does
            recorded[id(copy)] = version
            private.add(id(copy))
    offsets = [0]
    for n in rec.lens:
        offsets.append(offsets[-1] + n)
    state: Any = None
    for ci in range(len(rec.lens) - 1, -1, -1):  # children come after their parents
        chunk = values[offsets[ci] : offsets[ci + 1]]
        keys = rec.key_tuples[ci]
        built = dict(zip(keys, chunk, strict=True)) if keys is not None else chunk
        if ci:
            values[rec.parent_pos[ci]] = built
        else:
            state = built
    return state, recorded, private
