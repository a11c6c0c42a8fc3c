"""Planning: the DCP ``SavePlanner`` that maps every ``WriteItem`` to a typed state provider."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..errors import InvalidStateDictError
from ..providers import (
    ObjectProvider,
    StateProvider,
    TensorProvider,
    has_registered_provider,
    provider_for,
)
from ..providers.tensor import is_dense, not_dense_error
from .global_plan import GlobalPlanMemo

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


#: How DCP's ``flatten_state_dict`` refuses two keys flattened to one (torch 2.13).
_DUPLICATED = "duplicated flatten key "


class DataStatesSavePlanner(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` (same flattening, same dedup, same metadata, so stock readers
    understand the result) that also hands out the state provider of each write item."""

    #: ``id(tensor) -> version`` recorded by ``stage()`` when planning runs after it returned.
    versions: dict[int, int] | None = None
    #: ``id(tensor) -> probes`` read by ``stage()`` (``Capture.probes``).
    probes: dict[int, list[tuple[int, bytes]]] | None = None
    #: ``id``s of tensors ``stage()`` copied eagerly (``Capture.private``).
    private: set[int] | None = None

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        try:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
        except ValueError as exc:
            key = str(exc).removeprefix(_DUPLICATED)
            if key == str(exc):
                raise
            raise InvalidStateDictError(
                f"two keys of the state dict name one item, {key!r}, once nested keys are "
                "joined with dots (a nested key and a dotted one, such as {'a': {'b': ...}} "
                "and 'a.b'); rename one of them"
            ) from None

    def provider(self, item: WriteItem) -> StateProvider:
        if item.type == WriteItemType.BYTE_IO:
            value = self.lookup_object(item.index)
        else:
            value = self._plain_tensor(item)
            if value is None:
                value = self.resolve_data(item)  # the local tensor or shard
        if self.private and item.type is WriteItemType.TENSOR and id(value) in self.private:
            # An eager copy: no registered provider applies (stage() records no state when
            # one is registered), and nothing but the snapshot holds it.
            provider: StateProvider = TensorProvider(item.index.fqn, value, private=True)
        else:
            provider = provider_for(item, value)
        # A shard's DTensor (the state dict's value at its fqn): its in-place ops move its own
        # version counter, and stage() recorded its samples.
        owner = self.state_dict.get(item.index.fqn) if item.type is WriteItemType.SHARD else None
        if type(owner) is DTensor and isinstance(provider, TensorProvider):
            provider.watch_owner(owner)
        if self.versions is not None and isinstance(provider, TensorProvider):
            # The snapshot must match the tensor as stage() saw it, not as it is now. A shard's
            # version was recorded for its DTensor (the state dict's value at this fqn).
            recorded = self.versions.get(id(value))
            if recorded is None:
                recorded = self.versions[id(self.state_dict[item.index.fqn])]
            provider.staged_version(recorded, value)
            staged = self.probes and (
                self.probes.get(id(value)) or (owner is not None and self.probes.get(id(owner)))
            )
            if staged:
                provider.staged_probes(staged)
        return provider

    def _plain_tensor(self, item: WriteItem) -> torch.Tensor | None:
        """``resolve_data`` for a plain tensor, without DCP's per-item DTensor/ShardedTensor
        probing (most of ``stage()``'s time with thousands of tensors)."""
        value = self.state_dict.get(item.index.fqn)
        if type(value) not in _PLAIN_TENSORS or hasattr(value, "global_offsets"):
            return None  # (torch 2.14's CheckpointableTensor: its shards are slices of it)
        offset = item.index.offset
        if offset is not None and (len(offset) != value.dim() or any(offset)):
            return None  # let DCP raise its error
        return value


def provider_from_any_planner(item: WriteItem, planner: SavePlanner) -> StateProvider:
    """A provider for ``item`` when DCP was given some other planner: use what it resolves."""
    if isinstance(planner, DataStatesSavePlanner):
        return planner.provider(item)
    if item.type == WriteItemType.BYTE_IO and isinstance(planner, DefaultSavePlanner):
        # resolve_data would torch.save the object before a registered provider could see it.
        value = planner.lookup_object(item.index)
        if has_registered_provider(value):
            return provider_for(item, value)
    try:
        data = planner.resolve_data(item)
    except Exception as exc:
        if item.type != WriteItemType.BYTE_IO:
            raise
        # DCP's resolve_data torch.saves the object; its pickling error names no item.
        raise InvalidStateDictError(
            f"item {item.index.fqn!r} cannot be serialized: {exc}. Make it picklable, drop it "
            "from the state dict, or register a provider for its type"
        ) from exc
    if isinstance(data, io.BytesIO):
        return ObjectProvider(item.index.fqn, data.getvalue())
    return provider_for(item, data)


def check_state_dict(state_dict: Any, prefix: str = "") -> None:
    """Reject what DCP would fail on (or load back wrongly) later, deep in a background thread.

    Keys are strings, or ints as in ``optimizer.state_dict()["state"]``: DCP names an item by
    ``str(key)`` along its path and loads both back as themselves. Other key types (``None``,
    floats, tuples, ...) do not reliably come back as themselves, and two keys with the same
    ``str`` would name one item.
    """
    if not isinstance(state_dict, Mapping):
        raise InvalidStateDictError(f"state dict must be a dict, got {type(state_dict).__name__}")
    if not prefix and not state_dict:
        raise InvalidStateDictError("state dict is empty: there is nothing to checkpoint")
    where = prefix or "<root>"
    if not prefix and len({type(k) for k in state_dict if type(k) in (int, str)}) > 1:
        # dcp.load sorts the top-level keys (stock's too): the save worked, every load failed
        # with "'<' not supported between instances of 'str' and 'int'" (a user sweep).
        ints = [k for k in state_dict if type(k) is int][:3]
        raise InvalidStateDictError(
            f"the state dict's top-level keys mix ints ({', '.join(map(repr, ints))}) and "
            "strings: dcp.load sorts them and would fail on every load of this checkpoint; "
            "make them all strings (nested dicts, such as optimizer state, may keep int keys)"
        )
    names: dict[str, Any] = {}
    for key, value in state_dict.items():
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise InvalidStateDictError(
                f"state dict key {key!r} under {where!r} is a {type(key).__name__}; DCP keys "
                "must be strings (or ints, as in optimizer.state_dict()); convert it with str()"
            )
        name = str(key)
        if name in names:
            raise InvalidStateDictError(
                f"state dict keys {names[name]!r} and {key!r} under {where!r} both name the "
                f"item {prefix}{name}; rename one of them"
            )
        names[name] = key
        if isinstance(value, Mapping):
            check_state_dict(value, f"{prefix}{key}.")


def plan_providers(
    state_dict: dict[str, Any],
    *,
    versions: dict[int, int] | None = None,
    previous: SavePlan | None = None,
    private: set[int] | None = None,
    probes: dict[int, list[tuple[int, bytes]]] | None = None,
) -> PlannedItems:
    """This rank's write items for ``state_dict`` and their providers, in snapshot order.

    Runs the same local planning DCP will run on the save thread, so the items' indices match.
    Objects are serialized here (eagerly); tensors are only described. ``versions``: the
    tensors' version counters recorded at ``stage()`` (``snapshot/capture.py``), when this runs
    on another thread after it. ``previous``: the local plan of the save before, whose items
    are this save's where DCP's planning would make them again (:func:`replans_to`).
    ``private``: the tensors ``stage()`` copied eagerly (``Capture.private``). ``probes``:
    the big tensors' bytes sampled by ``stage()`` (``Capture.probes``).
    """
    check_state_dict(state_dict)
    planner = DataStatesSavePlanner()
    planner.versions = versions
    planner.private = private
    planner.probes = probes
    try:
        planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=False)
        if previous is not None and replans_to(previous, planner):
            planner.plan = plan = previous
        else:
            plan = planner.create_local_plan()
    except Exception as exc:
        # DCP's planning fails on some tensors (a nested one has no sizes) with an error that
        # names no item: name it, if that is the cause (looked for only then).
        culprit = _first_not_dense(state_dict, "")
        if culprit is None:
            raise
        raise not_dense_error(*culprit) from exc
    return PlannedItems([(item, planner.provider(item)) for item in plan.items], plan)


def _first_not_dense(value: Any, fqn: str) -> tuple[str, torch.Tensor] | None:
    """``(fqn, tensor)`` of the first tensor in ``value`` that ``is_dense`` refuses."""
    if isinstance(value, torch.Tensor):
        return None if is_dense(value) else (fqn, value)
    children: Any = ()
    if isinstance(value, Mapping):
        children = value.items()
    elif isinstance(value, (list, tuple)):
        children = enumerate(value)
    for key, child in children:
        found = _first_not_dense(child, f"{fqn}.{key}" if fqn else str(key))
        if found is not None:
            return found
    return None


def replans_to(plan: SavePlan, planner: DefaultSavePlanner) -> bool:
    """Whether DCP's local planning of ``planner``'s state (set up, so flattened) would make
    ``plan``'s items again: the same keys, paths and order, each plain tensor of the same size
    and properties (DCP's own ``TensorProperties.create_from_tensor``), every other value an
    object.

    A save that replays the layout of the one before (``snapshot/replay.py``) then keeps that
    save's write items instead of making new ones: at 322 items the 2,800 objects they are
    (WriteItem, MetadataIndex, TensorWriteData, ChunkStorageMetadata, TensorProperties, Sizes)
    were a third of what a save kept alive for the cyclic GC's young collections to promote
    into full ones, and making them 3 ms of the planning thread's CPU. Anything DCP would plan
    differently (a tensor with attributes, a DTensor, an object that plans itself) is planned
    again."""
    flat = planner.state_dict
    items = plan.items
    if len(items) != len(flat) or plan.planner_data != planner.mappings:
        return False
    for item, (fqn, value) in zip(items, flat.items(), strict=True):
        if item.index.fqn != fqn:
            return False
        if type(value) in _PLAIN_TENSORS:
            data = item.tensor_data
            if (
                item.type is not WriteItemType.TENSOR
                or data is None
                or value.__dict__  # e.g. torch 2.14's CheckpointableTensor fields: SHARD items
                or value.size() != data.size
                or TensorProperties.create_from_tensor(value) != data.properties
            ):
                return False
        elif (
            item.type is not WriteItemType.BYTE_IO
            or isinstance(value, torch.Tensor)
            or hasattr(value, "__create_write_items__")
        ):
            return False
    return True


class PlannedItems(list):
    """``plan_providers``' (item, provider) pairs, with the ``SavePlan`` they came from."""

    def __init__(self, pairs: list[tuple[WriteItem, StateProvider]], local_plan: SavePlan):
        super().__init__(pairs)
        self.local_plan = local_plan


class StagedSavePlanner(DataStatesSavePlanner):
    """The planner of ``dcp_datastates.async_save``'s save thread (``api.py``).

    ``dcp.save`` plans its state dict on the save thread: the same local planning the writer
    already ran for the snapshot being saved (``plan_providers``, on its planning thread, on the
    state ``stage()`` recorded). Where ``local_plan()`` finds that plan, it is this planner's
    local plan; the state dict is flattened only if something resolves an item through this
    planner (the writer writes the snapshot, so nothing does). Where it finds none (a process
    executor's save, a plain ``dcp.save``), this is a ``DataStatesSavePlanner``. With a ``memo``
    (:class:`~.global_plan.GlobalPlanMemo`, the writer's) the global plan is DCP's, made in time
    linear in the items (``global_plan.plan_globally``), and a save whose local plans are those
    of the save before (a replay, on every rank) takes that save's plans and metadata from the
    memo without planning: the ranks send empty plans. On the train scenario's state
    (350 items) the save thread's local planning took 25 ms of CPU per save; at 20,000 items it
    is linear in them.
    """

    def __init__(
        self, local_plan: Callable[[], SavePlan | None], memo: GlobalPlanMemo | None = None
    ) -> None:
        super().__init__()
        self._find_plan = local_plan
        self._memo = memo
        self._reused: SavePlan | None = None
        #: set_up_planner's arguments while the state dict is not flattened yet.
        self._unflattened: tuple[Any, ...] | None = None

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self._reused = self._find_plan()
        if self._reused is None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        self.state_dict, self.is_coordinator = state_dict, is_coordinator
        self.mappings = self._reused.planner_data
        self._unflattened = (state_dict, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        if self._reused is None:
            plan = super().create_local_plan()
        else:
            self.plan = plan = self._reused
        return plan if self._memo is None else self._memo.local(plan)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self._memo is None:
            return super().create_global_plan(all_plans)
        self.global_plan, self.metadata = self._memo.plan(all_plans)
        return self.global_plan, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if self._memo is not None:
            new_plan = self._memo.finish(new_plan, self.plan)
        self.plan = new_plan
        return new_plan

    def lookup_object(self, index: Any) -> Any:  # resolve_data goes through it
        if self._unflattened is not None:
            args, self._unflattened = self._unflattened, None
            super().set_up_planner(*args)
        return super().lookup_object(index)


#: The one key of the state dict ``stage()`` hands a plain ``dcp.async_save`` that makes DCP's
#: default planner, when the writer planned the snapshot itself (``PlannedElsewhere``).
PLANNED_KEY = "__dcp_datastates_planned__"


class PlannedElsewhere:
    """The value under :data:`PLANNED_KEY`: the snapshot's items were planned by the writer.

    ``dcp.async_save(sd, storage_writer=writer)`` saves what ``stage()`` returns with a
    ``DefaultSavePlanner`` of DCP's own, which plans that state dict on the save thread: the
    same local planning the writer's planning thread already ran (25 ms per save at 350 items
    here, linear in them). Handed this instead, DCP's planner makes no write item of it
    (``__create_write_items__``, DCP's protocol for objects that plan themselves), and the
    writer's ``prepare_local_plan`` puts the plan it made in place of the empty one
    (:func:`is_planned_elsewhere`). The global plan and the metadata are DCP's, as before."""

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        return []

    def __repr__(self) -> str:
        return "<dcp_datastates: planned by the writer>"


def planned_elsewhere() -> dict[str, Any]:
    return {PLANNED_KEY: PlannedElsewhere()}


def is_planned_elsewhere(plan: SavePlan) -> bool:
    """Whether ``plan`` is DCP's local plan of :func:`planned_elsewhere`'s state dict."""
    data = plan.planner_data
    return not plan.items and isinstance(data, dict) and list(data) == [PLANNED_KEY]
