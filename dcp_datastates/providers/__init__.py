"""Typed state providers and the one dispatch function that picks them.

``provider_for`` maps a DCP ``WriteItem`` and the value it refers to onto a provider:
a tensor item becomes a :class:`TensorProvider` (or :class:`ShardProvider` for the local chunk of a
DTensor / ShardedTensor), a ``BYTE_IO`` item an :class:`ObjectProvider`. Users add their own kinds
with :func:`register_provider`; the most specific registered type wins.

May import: ``format`` and ``errors``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from .base import StateProvider
from .objects import ObjectProvider
from .tensor import ShardProvider, TensorProvider

ProviderFactory = Callable[[str, Any], StateProvider]

_REGISTRY: dict[type, ProviderFactory] = {}


def register_provider(cls: type, factory: ProviderFactory) -> None:
    """Save values of type ``cls`` (and its subclasses) with ``factory(fqn, value)``.

    The factory runs at stage time on the training thread. It returns a :class:`StateProvider`;
    an eager one's ``payload`` must be what the loading planner expects for a ``BYTE_IO`` item
    (``torch.load``-able bytes for stock DCP).
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_provider expects a type, got {cls!r}")
    _REGISTRY[cls] = factory


def unregister_provider(cls: type) -> None:
    _REGISTRY.pop(cls, None)


def has_registered_provider(value: Any) -> bool:
    """Whether a user factory is registered for ``value``'s type (or one of its bases)."""
    return any(klass in _REGISTRY for klass in type(value).__mro__)


def provider_for(item: WriteItem, value: Any) -> StateProvider:
    """The provider that saves ``value``: the tensor DCP's planner resolved for a tensor item, or
    the raw object behind a ``BYTE_IO`` item."""
    fqn = item.index.fqn
    for klass in type(value).__mro__:
        factory = _REGISTRY.get(klass)
        if factory is not None:
            return factory(fqn, value)
    if item.type == WriteItemType.BYTE_IO:
        return ObjectProvider.serialize(fqn, value)
    return (ShardProvider if item.type == WriteItemType.SHARD else TensorProvider)(fqn, value)


__all__ = [
    "ObjectProvider",
    "ShardProvider",
    "StateProvider",
    "TensorProvider",
    "has_registered_provider",
    "provider_for",
    "register_provider",
    "unregister_provider",
]
