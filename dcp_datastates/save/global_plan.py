"""The coordinator's global plan, in time that grows with the items, and a plan cache per writer.

DCP's ``DefaultSavePlanner.create_global_plan`` dedups the ranks' plans, makes the metadata and
then validates it (``_validate_global_plan``): its overlap check sweeps each tensor's chunks along
the tensor's *largest* dimension, and FSDP2 shards along the first, so for every weight wider
than it is tall (``down_proj``, grouped-query ``k_proj``/``v_proj``) all chunks overlap on the
sweep and each is compared with every other: W^2/2 box checks per tensor. The simulator
(``python scripts/bench.py simulate``) puts that at minutes per save on 4,096 ranks of a 70B
model. :func:`validate_global_plan` makes the same checks sweeping the dimension whose chunk
offsets take the most distinct values (the sharded one).

:class:`GlobalPlanMemo` is DCP's ``enable_plan_caching`` done per writer (DCP keeps its cache on
the planner *class*, shared by every writer of the process): a rank whose local plan is the one
of its save before (a replay keeps the plan object, ``planner.replans_to``) sends an empty,
unusable plan carrying the token of the global plan it was finished with; a coordinator holding
that global plan hands back the cached plans and a fresh copy of the cached metadata, with no
planning at all. A rank replans whenever its last save did not reach ``finish_plan``, and the
coordinator refuses a token it does not hold, so a cache can never pair the metadata of one
global plan with the write plans of another. The coordinator process also keeps the last global
plan any of its memos made (one, replaced by the next): a writer made anew on the coordinator
only (the old one closed after an error) still serves the tokens the other ranks' writers send,
where refusing them failed that save on every rank (a user sweep).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import uuid
from bisect import bisect_right, insort
from collections.abc import Sequence

from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from .. import _dcp_private
from ..errors import WriterUsageError


@dataclasses.dataclass(frozen=True)
class PlanToken:
    """``planner_data`` of the plans a coordinator finished (and of a rank's unchanged plan):
    which global plan they belong to."""

    token: str


def plan_globally(all_plans: Sequence[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """DCP's global plan of ``all_plans`` (dedup, index hints, metadata with the merged
    flattening mappings), validated by :func:`validate_global_plan`."""
    deduped = _dcp_private.dedup_save_plans(list(all_plans), False)
    global_plan, metadata = default_planner.create_default_global_save_plan(deduped)
    merged: dict = {}
    for plan in reversed(global_plan):  # DCP's ChainMap: the first rank's mapping wins
        if plan.planner_data:
            merged.update(plan.planner_data)
    metadata = dataclasses.replace(metadata, planner_data=merged)
    errors = validate_global_plan(global_plan, metadata)
    if errors:
        summary = "; ".join(errors)
        summary = summary[:500] + "... (truncated)" if len(summary) > 500 else summary
        raise ValueError(f"Failed to validate global plan: {summary}")
    return global_plan, metadata


def validate_global_plan(global_plan: Sequence[SavePlan], metadata: Metadata) -> list[str]:
    """DCP's ``_validate_global_plan`` checks (every chunk inside its tensor, no two chunks
    overlapping, the chunks covering the tensor when several ranks saved it), with the overlap
    sweep along the dimension that separates the chunks most."""
    errors: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) or len(value.size) == 0:
            continue
        size, chunks = tuple(value.size), value.chunks
        volume = 0
        for chunk in chunks:
            offsets, sizes = chunk.offsets, chunk.sizes
            if any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)
            ):
                errors.append(
                    f"key:{key} has out of bounds chunk: tensor-size:{value.size} chunk: {chunk}"
                )
            volume += math.prod(sizes)
        if len(chunks) > 1:
            errors += _overlaps(key, chunks)
        if len(global_plan) > 1 and volume != math.prod(size):
            errors.append(
                f"key:{key} invalid fill tensor-volume: {math.prod(size)} chunks-volume: {volume}"
            )
    return errors


def _overlaps(key: str, chunks: Sequence[ChunkStorageMetadata]) -> list[str]:
    dims = len(chunks[0].offsets)
    sweep = max(range(dims), key=lambda d: len({c.offsets[d] for c in chunks}))
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].offsets[sweep], *chunks[i].offsets))
    errors = []
    active: list[tuple[int, int]] = []  # (end on the sweep, index), sorted
    for i in order:
        current = chunks[i]
        start = current.offsets[sweep]
        cutoff = bisect_right(active, (start, sys.maxsize))
        if cutoff:
            del active[:cutoff]
        for _, j in active:
            other = chunks[j]
            if all(
                a < b + m and b < a + n
                for a, n, b, m in zip(
                    current.offsets, current.sizes, other.offsets, other.sizes, strict=True
                )
            ):
                errors.append(f"key:{key} has overlapping chunks: {current} {other}")
        insort(active, (start + current.sizes[sweep], i))
    return errors


#: The last (token, (all local plans, global plan, metadata)) any memo of this process made.
_last_made: tuple[str, tuple[list[SavePlan], list[SavePlan], Metadata]] | None = None


class GlobalPlanMemo:
    """One writer's plan cache: its rank's last local and final plans, and on the coordinator
    the last global plan (module docstring). Saves of one writer to one directory plan one at a
    time (``path_turns``); saves to different directories (a step directory each) may plan at
    once, on their own threads: a save that overlaps another sends its whole plan, and the final
    plans of the last few tokens stay held, so an overlapped save served from the cache still
    finds its own."""

    #: Final plans held per token: a save answered from the cache finds the one it offered even
    #: when a later save finished first.
    HELD = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (local plan, token) this rank offers next: its last save's, if no save overlapped.
        self._offer: tuple[SavePlan, str] | None = None
        #: token -> this rank's final plan of that global plan, oldest first.
        self._held: dict[str, SavePlan] = {}
        #: Saves that entered create_local_plan and finish_plan: unequal when one failed in
        #: between or another is planning; this rank then sends its whole plan, the safe side.
        self._started = self._finished = 0
        #: The coordinator's token -> (all local plans, global plan, metadata), oldest first.
        self._globals: dict[str, tuple[list[SavePlan], list[SavePlan], Metadata]] = {}
        #: Global plans this coordinator made, and served from the cache (for tests, stats).
        self.made = self.served = 0

    # -- every rank ---------------------------------------------------------------------------
    def local(self, plan: SavePlan) -> SavePlan:
        """What this rank sends the coordinator for ``plan``: an empty plan naming the cached
        global plan when ``plan`` is the local plan that one was made from, and no other save
        of this writer is planning or failed while planning."""
        with self._lock:
            if self._started != self._finished:
                self._offer = None
                self._finished = self._started
            self._started += 1
            offer = self._offer
            if offer is not None and offer[0] is plan:
                return SavePlan([], planner_data=PlanToken(offer[1]), usable=False)
            return plan

    def finish(self, central: SavePlan, local: SavePlan) -> SavePlan:
        """This rank's final plan (``local``: its local plan): the coordinator's, or the
        cached one it points to."""
        with self._lock:
            self._finished += 1
            alone = self._finished == self._started  # no other save planned meanwhile
            token = (
                central.planner_data.token if isinstance(central.planner_data, PlanToken) else None
            )
            if central.usable:
                if token is not None:
                    self._held[token] = central
                    while len(self._held) > self.HELD:
                        del self._held[next(iter(self._held))]
                self._offer = (local, token) if token is not None and alone else None
                return central
            held = self._held.get(token) if token is not None else None
            if held is None:
                self._offer = None
                raise WriterUsageError(
                    "the coordinator answered with a cached global plan this rank does not "
                    "hold; save again (every rank then sends its whole plan)"
                )
            if not alone:
                self._offer = None
            return held

    # -- the coordinator ----------------------------------------------------------------------
    def plan(self, all_plans: Sequence[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """The global plan of ``all_plans``: cached where every rank's plan is unchanged,
        made again (from the cached plans of the unchanged ranks) where some changed."""
        global _last_made
        with self._lock:
            unchanged = [i for i, p in enumerate(all_plans) if not p.usable]
            if unchanged:
                tokens = {getattr(all_plans[i].planner_data, "token", None) for i in unchanged}
                token = next(iter(tokens)) if len(tokens) == 1 else None
                cached = self._globals.get(token) if token is not None else None
                made = _last_made
                if cached is None and made is not None and made[0] == token:
                    cached = self._globals[token] = made[1]  # another writer of this process
                if cached is None or len(cached[0]) != len(all_plans):
                    raise WriterUsageError(
                        f"ranks {unchanged[:4]} sent a cached plan the coordinator does not "
                        "hold (a save failed part way, or the ranks' writers differ); save "
                        "again: every rank then sends its whole plan"
                    )
                if len(unchanged) == len(all_plans):
                    # The ranks' own empty plans: their storage_data names this save's
                    # checkpoint, which the writer's global step compares across ranks.
                    self.served += 1
                    return list(all_plans), _fresh(cached[2])
                all_plans = [
                    p
                    if p.usable
                    else dataclasses.replace(cached[0][i], storage_data=p.storage_data)
                    for i, p in enumerate(all_plans)
                ]
        # Outside the lock: planning a large job takes seconds, and a failure caches nothing.
        global_plan, metadata = plan_globally(all_plans)
        token = uuid.uuid4().hex
        mark = PlanToken(token)
        global_plan = [dataclasses.replace(p, planner_data=mark) for p in global_plan]
        with self._lock:
            self.made += 1
            self._globals[token] = (list(all_plans), global_plan, _fresh(metadata))
            _last_made = (token, self._globals[token])
            while len(self._globals) > self.HELD:
                del self._globals[next(iter(self._globals))]
        return global_plan, metadata

    def forget(self) -> None:
        with self._lock:
            self._offer = None
            self._held.clear()
            self._globals.clear()


def _fresh(metadata: Metadata) -> Metadata:
    """A ``Metadata`` of its own for one save: ``finish`` sets its ``storage_data`` and
    ``version``, and each save's result is that save's. The per-item entries, which nothing
    changes once planned, are shared; the dicts holding them are not."""
    planner_data = metadata.planner_data
    return dataclasses.replace(
        metadata,
        state_dict_metadata=dict(metadata.state_dict_metadata),
        planner_data=dict(planner_data) if isinstance(planner_data, dict) else planner_data,
        storage_data=None,
    )
