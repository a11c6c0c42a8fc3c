"""Retention of committed checkpoints, the one rule both checkpointers follow.

Keep the ``keep`` newest committed steps; delete the older ones, oldest first, each uncommitted
(``.metadata`` removed) before its data goes, so that a crash mid-delete leaves an uncommitted
prefix, never a torn checkpoint that still looks committed; pass over a step the caller still
needs (being read or uploaded: :class:`InUse`; not yet copied elsewhere: ``needed``); and go on
past a step that cannot be deleted, reporting it. What differs between
:class:`~dcp_datastates.checkpointers.checkpointer.Checkpointer` (raises the first failure once
the rest is done) and :class:`~dcp_datastates.checkpointers.tiers.TieredCheckpointer` (logs
it, protects steps in use) comes in as the arguments of :func:`delete_expired`.

May import: ``storage`` and the leaves.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from ..format import METADATA_NAME
from ..storage.base import LocalStorage, Storage


def expired(committed: Sequence[int], keep: int) -> list[int]:
    """The steps of ``committed`` beyond its ``keep`` newest, oldest first (with ``keep >= 1``
    never the newest)."""
    steps = sorted(committed)
    return steps[: max(0, len(steps) - keep)]


@dataclass
class Retained:
    """What one pass of retention did.

    Attributes:
        deleted: Steps deleted, oldest first.
        failed: Steps that could not be deleted, oldest first, with the error each raised.
    """

    deleted: list[int] = field(default_factory=list)
    failed: list[tuple[int, Exception]] = field(default_factory=list)


class InUse:
    """How many readers and uploaders hold each checkpoint (keyed as the caller likes).
    Retention passes over a held one, and holds the one it deletes while it deletes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: Counter[Hashable] = Counter()

    def add(self, key: Hashable, by: int) -> None:
        """Hold ``key`` (``by=1``) or let it go (``by=-1``)."""
        with self._lock:
            self._count[key] += by

    @contextlib.contextmanager
    def claim(self, key: Hashable) -> Iterator[bool]:
        """Yields False if anyone holds ``key``; otherwise True, holding it until the block ends."""
        with self._lock:
            if self._count[key] > 0:
                claimed = False
            else:
                self._count[key] += 1
                claimed = True
        try:
            yield claimed
        finally:
            if claimed:
                self.add(key, -1)


def delete_expired(
    committed: Sequence[int],
    keep: int,
    delete: Callable[[int], None],
    *,
    needed: Callable[[int], bool] | None = None,
    claim: Callable[[int], contextlib.AbstractContextManager[bool]] | None = None,
    errors: type[Exception] | tuple[type[Exception], ...] = Exception,
    on_error: Callable[[int, Exception], None] | None = None,
) -> Retained:
    """Delete the steps of ``committed`` beyond its ``keep`` newest, oldest first, with
    ``delete(step)`` (:func:`delete_checkpoint`, uncommitting first).

    Args:
        committed: The committed steps retention may count (the caller lists them).
        keep: How many of the newest to keep (``>= 1``: never the newest).
        delete: Deletes one step.
        needed: Steps to keep anyway (a local copy not yet uploaded), asked first.
        claim: Per step, a context yielding whether the step is free, held while it is
            deleted (:meth:`InUse.claim`); a step in use is passed over.
        errors: The errors of ``delete`` that retention goes on past; any other propagates.
        on_error: Called with the step and the error as each failure happens (to log it).
    """
    done = Retained()
    for step in expired(committed, keep):
        if needed is not None and needed(step):
            continue
        with claim(step) if claim is not None else contextlib.nullcontext(True) as free:
            if not free:
                continue
            try:
                delete(step)
            except errors as exc:  # one stuck step must not hold every older one for good
                if on_error is not None:
                    on_error(step, exc)
                done.failed.append((step, exc))
                continue
            done.deleted.append(step)
    return done


def delete_checkpoint(storage: Storage, *, missing_ok: bool = True) -> None:
    """Uncommit the checkpoint in ``storage`` (remove its ``.metadata``), then remove its data
    (locally the whole directory, best effort).

    With ``missing_ok=False`` a local ``.metadata`` is unlinked as is, so that one already gone,
    or one that cannot be removed, raises the OS's own error naming its path (what
    ``Checkpointer`` reports); otherwise through :meth:`Storage.remove`."""
    if missing_ok or not isinstance(storage, LocalStorage):
        storage.remove(METADATA_NAME)
    else:
        os.unlink(storage.describe(METADATA_NAME))
    if isinstance(storage, LocalStorage):
        shutil.rmtree(storage.root, ignore_errors=True)
    else:
        for name in storage.list_names():
            storage.remove(name)
