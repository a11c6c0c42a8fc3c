"""Loading a ``Checkpointer``'s checkpoints on every rank: one step, or the newest that loads.

Every rank loads the same step, always. Rank 0 picks the order to try (``latest``'s step, then
the older committed ones, newest first) and broadcasts it; for each step the ranks agree, one
all-reduce each, that every rank sees it committed and then that every rank loaded it, and move
on together otherwise. DCP's own collectives report a failure inside ``dcp.load`` to every rank;
the second vote covers one they do not (a ``Stateful``'s ``load_state_dict`` raising on one
rank). DCP's ``CheckpointException`` is a ``BaseException``: it never leaves here unwrapped.

May import: ``steps``, ``load`` and the leaves.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import CheckpointLoadError, CheckpointNotCommittedError
from ..format import METADATA_NAME
from ..load.reader import DataStatesReader
from . import steps

logger = logging.getLogger(__name__)

_PARTIAL = "app_state may hold part of it"


@dataclass(frozen=True)
class Ranks:
    """The ranks a load runs on.

    Attributes:
        rank: This rank in ``vote_group`` (0 without one).
        dcp_kwargs: What ``dcp.load`` needs to run on them (``process_group``, or ``no_dist``).
        vote_group: The group the ranks agree on (the checkpointer's gloo group); None alone.
    """

    rank: int
    dcp_kwargs: dict[str, Any]
    vote_group: dist.ProcessGroup | None

    def failing(self, failed: bool) -> list[int]:
        """The ranks where ``failed`` is true (one all-reduce; called by every rank)."""
        if self.vote_group is None:
            return [0] if failed else []
        flags = torch.zeros(dist.get_world_size(self.vote_group), dtype=torch.uint8)
        flags[self.rank] = int(failed)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.vote_group)
        return [int(r) for r in flags.nonzero().flatten().tolist()]

    def from_rank_0(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.vote_group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, group_src=0, group=self.vote_group)
        return box[0]


def why(exc: BaseException) -> str:
    """One line per failing rank: DCP's ``CheckpointException`` holds every rank's error (as
    ``(exception, traceback)``), anything else is this rank's."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return f"{type(exc).__name__}: {exc}"
    errors = {r: e[0] if isinstance(e, tuple) else e for r, e in failures.items()}
    return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items()))


def try_step(
    root: str,
    step: int,
    app_state: dict[str, Any],
    reader_options: dict[str, Any],
    ranks: Ranks,
    problem: str | None = None,
) -> tuple[str | None, BaseException | None]:
    """Load step ``step`` into ``app_state`` on every rank. Returns ``(None, None)`` once every
    rank loaded it; otherwise why not (the same decision on every rank) and this rank's error.
    ``problem``: why this rank cannot read it there, found by the caller (the memory tier's
    completeness check)."""
    found = steps.committed_path(root, step) if problem is None else None
    missing = ranks.failing(found is None)
    if missing:
        place = steps.path(root, step)
        if problem is not None:
            return f"{problem} (rank(s) {missing})", None
        if found is not None:  # the others see it: not one file system for all ranks?
            return f"not committed on rank(s) {missing}; is {root} shared by all ranks?", None
        if not os.path.isdir(place):
            return f"not committed: there is no {place}", None
        return f"not committed: {place} has no {METADATA_NAME}", None
    reader = DataStatesReader(found, **reader_options)  # a bad option raises on every rank
    error: BaseException | None = None
    try:
        dcp.load(app_state, storage_reader=reader, **ranks.dcp_kwargs)
    except (Exception, dcp.CheckpointException) as exc:
        error = exc
    failed = ranks.failing(error is not None)
    if not failed:
        return None, None
    if error is None:
        return f"failed on rank(s) {failed}; their logs say why", None
    return why(error), error


def load_step(
    root: str, step: int, app_state: dict[str, Any], reader_options: dict[str, Any], ranks: Ranks
) -> None:
    """Load step ``step`` on every rank, or raise naming it (no fallback: it was asked for)."""
    reason, error = try_step(root, step, app_state, reader_options, ranks)
    if reason is None:
        return
    if error is None and reason.startswith("not committed"):
        committed = sorted(s for s, ok in steps.listing(root).items() if ok)
        raise CheckpointNotCommittedError(
            f"rank {ranks.rank}: step {step} has no committed checkpoint in {root} ({reason}); "
            f"the committed steps are {committed}: load one of those"
        )
    raise CheckpointLoadError(
        f"rank {ranks.rank}: loading step {step} from {root} failed: {reason}; {_PARTIAL}. "
        f"`dcp-datastates verify {steps.path(root, step)}` checks its data",
        {step: reason},
    ) from error


@dataclass(frozen=True)
class Candidate:
    """One place to resume from, in the order tried: a step in one tier.

    Attributes:
        step: The step.
        tier: The tier's name for the logs (``memory``, ``durable``).
        root: The directory holding ``step_N`` in that tier (on this rank).
        problem: Why this rank cannot read it there (None: try it).
    """

    step: int
    tier: str
    root: str
    problem: str | None = None


def load_newest(
    root: str,
    order: Sequence[int],
    app_state: dict[str, Any],
    reader_options: dict[str, Any],
    ranks: Ranks,
) -> int | None:
    """Load the first step of ``order`` (rank 0's) that every rank loads; returns it, or None
    when ``order`` is empty. Each step passed over is logged with why; when none loads,
    :class:`CheckpointLoadError` lists them all."""
    order = ranks.from_rank_0(list(order))
    places = [Candidate(s, "durable", root) for s in order]
    found = load_first(places, app_state, reader_options, ranks)
    return None if found is None else found.step


def load_first(
    candidates: Sequence[Candidate],
    app_state: dict[str, Any],
    reader_options: dict[str, Any],
    ranks: Ranks,
) -> Candidate | None:
    """Load the first of ``candidates`` (the same list on every rank) that every rank loads;
    returns it, or None when there are none. Each one passed over is logged with its tier,
    place and why; when none loads, :class:`CheckpointLoadError` lists them all."""
    failures: dict[int, str] = {}
    last_error: BaseException | None = None
    where = candidates[0].root if candidates else ""
    several_tiers = len({c.tier for c in candidates}) > 1
    for i, c in enumerate(candidates):
        reason, error = try_step(c.root, c.step, app_state, reader_options, ranks, c.problem)
        if reason is None:
            if failures:
                logger.warning(
                    "rank %d: resumed from step %d of %s (%s tier), passing over step(s) %s",
                    ranks.rank,
                    c.step,
                    c.root,
                    c.tier,
                    list(failures),
                )
            return c
        said = f"{c.tier}: {reason}" if several_tiers else reason
        failures[c.step] = "; ".join(filter(None, [failures.get(c.step), said]))
        last_error = error or last_error
        then = (
            f"trying step {candidates[i + 1].step} in {candidates[i + 1].root} "
            f"({candidates[i + 1].tier} tier)"
            if i + 1 < len(candidates)
            else "no older checkpoint"
        )
        logger.warning(
            "rank %d: cannot resume from step %d in %s (%s tier): %s; %s",
            ranks.rank,
            c.step,
            c.root,
            c.tier,
            reason,
            then,
        )
    if not failures:
        return None
    tried = "; ".join(f"step {s}: {r}" for s, r in failures.items())
    raise CheckpointLoadError(
        f"rank {ranks.rank}: no checkpoint in {where} could be loaded ({_PARTIAL}). Tried, newest "
        f"first: {tried}. `dcp-datastates verify DIR` checks a step's data; fix or remove the "
        "damaged steps, or start afresh in another root",
        failures,
    ) from last_error
