"""What a :class:`~dcp_datastates.Checkpointer` does with its memory tier: where a save goes,
when the flush to disk starts, and the order a restart tries the tiers in.

One commit rule for both tiers: a step is loadable from a tier when it is committed there
(``.metadata``) on every rank's view of it. A restart tries steps newest first and, for each
step, memory before the durable root; a place that is incomplete, committed on only some
ranks, or fails to load (a record's checksum) is passed over with a log line naming the tier,
the directory and why. Every rank tries the same list, agreeing on each try (``resume.py``), so
no rank loads a mix of steps.

May import: ``load``, ``storage`` and the leaves.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import resume, steps
from .memflush import Flusher
from .memory import MemoryTier, Segment
from .peers import PeerReplicator, PeerRestoreError

logger = logging.getLogger(__name__)

MEMORY, DURABLE = "memory", "durable"


def no_space(exc: BaseException | None, depth: int = 0) -> bool:
    """Whether ``exc`` (or what it wraps: its cause, DCP's per-rank failures) is ENOSPC."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    failures = getattr(exc, "failures", None) or {}
    inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    inner += [exc.__cause__, exc.__context__]
    return any(isinstance(e, BaseException) and no_space(e, depth + 1) for e in inner)


class MemorySide:
    """A checkpointer's memory tier on this rank: its segment and its flusher.

    Args:
        tier: The options.
        root: The checkpointer's durable root.
        rank / world: This rank and the number of ranks.
        group: A gloo group for the flusher alone (None without a process group).
        on_durable: Rank 0, once a step is durable (``latest``, retention).
        on_error: Called with a flush's error (from the flush thread).
        flusher_class: The :class:`Flusher` to make (a test's subclass blocks the disk).
    """

    def __init__(
        self,
        tier: MemoryTier,
        root: str,
        rank: int,
        world: int,
        group: dist.ProcessGroup | None,
        on_durable: Callable[[int], None],
        on_error: Callable[[BaseException], None],
        flusher_class: type[Flusher] = Flusher,
    ) -> None:
        self.tier, self.root, self.rank, self.world = tier, root, rank, world
        #: Committed steps kept in memory while the next is written; 0 once memory was full.
        self.keep = tier.keep
        #: Saves go to ``root`` directly: memory was full even with no step kept.
        self.direct = False
        self._full: int | None = None  # the step whose save into memory found it full
        self._crowded = False  # and memory held committed steps then
        self._settled = False  # memory holds only this run's steps (after a load or a save)
        self.segment = Segment(tier, root, rank, world)
        self.flusher = flusher_class(self.segment, root, rank, group, on_durable, on_error)
        self.peers: PeerReplicator | None = None
        if tier.peer_distance and group is not None and self.segment.usable:
            self.peers = self._replicator(group)
            self.flusher.peers = self.peers

    def _replicator(self, group: dist.ProcessGroup) -> PeerReplicator | None:
        """Every rank's node (one all-gather), then the replicator (collective)."""
        nodes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(nodes, self.segment.node, group=group)
        ids = {n: i for i, n in enumerate(sorted(set(nodes)))}
        try:
            return PeerReplicator(
                node_of_rank=[ids[n] for n in nodes],
                distance=self.tier.peer_distance,
                keep=self.tier.keep + 1,
            )
        except ValueError as exc:  # one node, or nodes of unequal sizes: the same on all ranks
            logger.warning("rank %d: no peer copies: %s", self.rank, exc)
            return None

    @classmethod
    def open(
        cls,
        tier: MemoryTier,
        root: str,
        ranks: resume.Ranks,
        on_durable: Callable[[int], None],
        on_error: Callable[[BaseException], None],
        flusher_class: type[Flusher] = Flusher,
    ) -> MemorySide | None:
        """The memory tier of a checkpointer on ``ranks`` (collective: its flusher's group),
        or None when some rank cannot use its segment (said why)."""
        group = ranks.vote_group
        world = dist.get_world_size(group) if group is not None else 1
        flush_group = dist.new_group(backend="gloo") if group is not None else None
        side = cls(tier, root, ranks.rank, world, flush_group, on_durable, on_error, flusher_class)
        return side if side.agree_usable(ranks) else None

    def load_newest(
        self,
        order: list[int],
        app_state: dict[str, Any],
        reader_options: dict[str, Any],
        ranks: resume.Ranks,
    ) -> int | None:
        """``Checkpointer.load_latest`` with the memory tier: rank 0's durable ``order``, the
        memory steps, tried newest first (see the module docstring)."""
        places = self.candidates(ranks.from_rank_0(order), ranks)
        found = resume.load_first(places, app_state, reader_options, ranks)
        self.after_load(found)
        return None if found is None else found.step

    def load_step(
        self,
        step: int,
        app_state: dict[str, Any],
        reader_options: dict[str, Any],
        ranks: resume.Ranks,
    ) -> None:
        """``Checkpointer.load(step=...)``: from memory when every rank's memory holds ``step``
        whole and it loads there, else from ``root`` (raising as ``resume.load_step`` does).
        Then, as after ``load_newest``, memory keeps only ``step`` (a newer step there belongs
        to a course the run left: a restart must not resume from it) and flushes it."""
        loaded = resume.Candidate(step, MEMORY, self.segment.root)
        if not self._load_from_memory(step, app_state, reader_options, ranks):
            resume.load_step(self.root, step, app_state, reader_options, ranks)
            loaded = resume.Candidate(step, DURABLE, self.root)
        self.after_load(loaded)

    def _load_from_memory(
        self,
        step: int,
        app_state: dict[str, Any],
        reader_options: dict[str, Any],
        ranks: resume.Ranks,
    ) -> bool:
        problem = self.segment.problem
        if problem is None and self.segment.saved_world not in (None, self.world):
            problem = f"it holds a save of {self.segment.saved_world} ranks"
        if problem is None and step not in self.segment.committed_steps():
            problem = "not committed in this node's memory"
        if problem is None:
            try:
                missing = self.segment.missing_files(step)
            except Exception as exc:  # an unreadable .metadata: the durable copy may load
                problem = f"unreadable: {exc}"
            else:
                problem = f"{len(missing)} data file(s) missing" if missing else None
        if ranks.failing(problem is not None):
            return False
        reason, _ = resume.try_step(self.segment.root, step, app_state, reader_options, ranks)
        if reason is not None:
            logger.warning(
                "rank %d: step %d did not load from memory (%s): %s; loading it from %s",
                self.rank,
                step,
                self.segment.root,
                reason,
                self.root,
            )
        return reason is None

    def agree_usable(self, ranks: resume.Ranks) -> bool:
        """Whether every rank can use its segment (one all-reduce); logs why not."""
        if not ranks.failing(not self.segment.usable):
            return True
        if self.segment.problem is not None:
            logger.warning(
                "rank %d: the memory tier is off: %s; saving to %s directly",
                self.rank,
                self.segment.problem,
                self.root,
            )
        self.close(remove=False)
        return False

    def step_path(self, step: int) -> str:
        return self.segment.step_path(step)

    def before_save(self, ranks: resume.Ranks) -> bool:
        """Bound what memory holds before a save (may wait for a flush); returns whether the
        save goes to memory (every rank agrees: one all-reduce). After a save found memory full
        on some rank while it held committed steps, the next ones keep none there; after one
        found it full even so, they go to ``root`` directly (each change logged once)."""
        full = ranks.failing(self._full is not None)
        if full:
            crowded = ranks.failing(self._full is not None and self._crowded)
            self._full = None
            if self.keep > 0 and crowded:  # without the committed steps it kept, it may fit
                self.keep = 0
                how = "keeping no committed step in memory (a save waits for the last flush)"
            else:
                self.direct = True
                how = "saving to the durable root directly"
            logger.warning(
                "rank %d: the memory tier %s was full on rank(s) %s: from now on %s; give it "
                "more room (MemoryTier(base=...) on a larger file system) for memory-speed saves",
                self.rank,
                self.segment.root,
                full,
                how,
            )
        if not self._settled:  # the first save of a run that loaded nothing
            if stale := self.segment.committed_steps() + self.segment.replica_steps():
                logger.warning(
                    "rank %d: deleting step(s) %s from %s: an earlier run left them and this run "
                    "did not resume from them (load_latest or load first to resume)",
                    self.rank,
                    sorted(set(stale)),
                    self.segment.root,
                )
            self.after_load(None)
        if self.direct:
            self.flusher.wait()  # `latest` moves in step order
            return False
        self.flusher.make_room(self.keep)
        return True

    def save_failed(self, step: int, exc: BaseException) -> None:
        """A save into memory failed (on DCP's save thread): delete what it wrote there, and
        remember when memory was full."""
        self.segment.delete_step(step)
        if no_space(exc):
            self._full, self._crowded = step, bool(self.segment.committed_steps())

    def flush(self, step: int) -> Future[None]:
        return self.flusher.submit(step)

    def bytes_held(self) -> int:
        return self.segment.bytes_held()

    # -- restart ------------------------------------------------------------------------------
    def candidates(self, durable_order: list[int], ranks: resume.Ranks) -> list[resume.Candidate]:
        """Every place to try, newest step first and memory before disk for one step; the same
        list on every rank (one all-gather of what each rank's memory holds)."""
        self.segment.drop_uncommitted()
        self._recover(ranks)
        mine: dict[int, str | None] = {}
        unusable = self.segment.problem
        if unusable is None and self.segment.saved_world not in (None, self.world):
            unusable = (
                f"it holds a save of {self.segment.saved_world} ranks and this run has "
                f"{self.world} (resharding from memory is not supported)"
            )
        if unusable is None:
            for step in self.segment.committed_steps():
                try:
                    missing = self.segment.missing_files(step)
                except Exception as exc:  # an unreadable .metadata: fails the same on load
                    mine[step] = f"its {self.segment.step_path(step)} is unreadable: {exc}"
                    continue
                mine[step] = (
                    f"incomplete on this node: {len(missing)} data file(s) missing, such as "
                    f"{missing[0]} (written on another node; no peer copy)"
                    if missing
                    else None
                )
        views: list[Any] = [(unusable, mine)]
        if ranks.vote_group is not None:
            views = [None] * dist.get_world_size(ranks.vote_group)
            dist.all_gather_object(views, (unusable, mine), group=ranks.vote_group)
        problems = sorted({u for u, _ in views if u is not None})
        if problems:
            logger.warning(
                "rank %d: the memory tier %s is not used: %s; resuming from the durable tier %s",
                self.rank,
                self.segment.root,
                "; ".join(problems),
                self.root,
            )
            memory_steps: set[int] = set()
        else:
            memory_steps = {s for _, held in views for s in held}
        found = [
            resume.Candidate(
                s, MEMORY, self.segment.root, mine.get(s, "not committed in this node's memory")
            )
            for s in memory_steps
        ]
        finished = self._finish_on_disk(views, durable_order)
        found += [resume.Candidate(s, DURABLE, self.root) for s in finished + durable_order]
        # The durable order is `latest` first: keep it among the durable ones of one step.
        return sorted(found, key=lambda c: (-c.step, c.tier != MEMORY))

    def _recover(self, ranks: resume.Ranks) -> None:
        """With peers: the newest step any rank holds (its own or a replica); each rank that
        lost its own copy gets its files back from its peer (collective; all or none)."""
        if self.peers is None:
            return
        own = self.segment.own_steps()
        newest = max(own + self.segment.replica_steps(), default=-1)
        views: list[Any] = [None] * dist.get_world_size(ranks.vote_group)
        dist.all_gather_object(views, newest, group=ranks.vote_group)
        step = max(views)
        if step < 0:
            return
        lost = step not in own
        try:
            place, root = Path(self.step_path(step)), Path(self.segment.root)
            got = self.peers.restore(step, lost, place, root)
        except PeerRestoreError as exc:
            logger.warning("rank %d: step %d not restored from peers: %s", self.rank, step, exc)
            return
        if lost:
            logger.warning(
                "rank %d: this node's memory had lost step %d; restored %d file(s) from rank %d",
                self.rank,
                step,
                len(got),
                self.peers.peer,
            )

    def _finish_on_disk(self, views: list[Any], durable_order: list[int]) -> list[int]:
        """The newest memory step every rank holds its own part of, when no node's memory holds
        all of it (several nodes) and ``root`` lacks it: flushed to ``root`` now, so that the
        restart loads it from there (collective). Returns ``[step]`` once it is durable."""
        held = [set(h) for _, h in views]
        common = set.intersection(*held) if held else set()
        if not common or any(u is not None for u, _ in views):
            return []
        step = max(common)
        if step in durable_order or all(h[step] is None for _, h in views):
            return []  # on disk already, or some node's memory loads it whole
        if any(not str(h[step]).startswith("incomplete") for _, h in views if h[step]):
            return []  # unreadable somewhere: not this rank's own part missing
        try:
            self.flusher._flush(step)  # noqa: SLF001 - on this thread: no flush is queued now
        except Exception as exc:
            logger.warning("rank %d: step %d could not be made durable: %s", self.rank, step, exc)
            return []
        logger.warning(
            "rank %d: step %d was in memory only, spread over several nodes: flushed to %s to "
            "resume from there",
            self.rank,
            step,
            self.root,
        )
        return [step]

    def after_load(self, loaded: resume.Candidate | None) -> None:
        """Keep only the memory step just loaded (a newer one did not load on every rank, an
        older one is superseded); flush it when it came from memory (it may not be durable)."""
        keep = loaded.step if loaded is not None and loaded.tier == MEMORY else None
        for step in self.segment.committed_steps():
            if step == keep:
                continue
            if steps.committed_path(self.root, step) is None:
                logger.warning(
                    "rank %d: deleting step %d from %s, never made durable in %s: this run "
                    "goes on from %s",
                    self.rank,
                    step,
                    self.segment.root,
                    self.root,
                    "nothing loaded" if loaded is None else f"step {loaded.step}",
                )
            self.segment.delete_step(step)
        # Peer copies of newer steps too: a restart's recovery takes the newest it finds.
        self.segment.delete_replicas(after=None if loaded is None else loaded.step)
        self.segment.claim_world(self.root)
        self._settled = True
        if keep is not None:
            self.flush(keep)

    def close(self, *, remove: bool) -> None:
        self.flusher.close()
        if self.peers is not None:
            self.peers.close()
        if remove:
            self.segment.remove()
