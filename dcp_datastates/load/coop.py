"""Cooperative load, on each rank: read what this rank owns, send others their parts, receive.

A rank runs its :class:`~dcp_datastates.load.coop_plan.Schedule` in rounds, the same number on
every rank (a rank with nothing to do in a round still takes part in its agreement):

1. **read** round k's records from storage (the reader's usual fetch: in parallel, verified),
   into this rank's own targets and, for regions only others need or that its targets cannot
   hold as sent, into staging tensors; then hand its own items to the planner;
2. **agree**: one small all-reduce says whether any rank failed (a read of round k, or a receive
   of round k-1); if one did, every rank raises -- the failing rank its own error, the others a
   :class:`~dcp_datastates.errors.CooperativeLoadError` naming the failed rank, item and file --
   so that no rank waits for bytes that will not come;
3. **exchange**: point-to-point sends and receives over the group, posted at once (each
   transfer's tag is its place in the global order; small ones travel packed, one message per
   round and pair). Receives land straight in the target when it is a contiguous CPU tensor of
   the saved dtype and shape, else in a buffer copied into it. They complete while the next
   round reads, and are finished (copied, committed) before that round's agreement.

Memory held for others is one or two rounds of an owner's reads (``COOP_ROUND_BYTES`` each).
The bytes travel as CPU tensors: the group needs a backend that takes them (gloo, or a
``cpu:gloo,cuda:nccl`` group); CUDA targets receive into host buffers and are copied to the device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..errors import CooperativeLoadError
from ..snapshot import cow as _cow
from .coop_plan import Region, Schedule, Transfer, region_of

logger = logging.getLogger(__name__)

#: At most this many bytes of records per owner and round.
COOP_ROUND_BYTES = 256 << 20


def cooperative_group_fits(group: Any, world_size: int) -> bool:
    """Whether a cooperative load over ``group`` can run for ``world_size`` plans (else the
    coordinator plans the usual load, and says why once)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if dist.get_world_size(group) != world_size:
        logger.warning(
            "cooperative load off: the reader's process group has %d ranks, the load %d (pass "
            "DataStatesReader(process_group=) the group given to dcp.load)",
            dist.get_world_size(group),
            world_size,
        )
        return False
    config = dist.get_backend_config(group)
    if "gloo" not in config:
        logger.warning(
            "cooperative load off: its transfers need a backend for CPU tensors and the group "
            "has %r (create it with backend='cpu:gloo,cuda:nccl')",
            config,
        )
        return False
    return True


@dataclass
class _Round:
    """Round k's transfers in flight on this rank, and what they need once they complete."""

    works: list[Any] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)  # send buffers alive until the sends end
    landed: list[tuple[Transfer, torch.Tensor, bool]] = field(default_factory=list)


class CooperativeRead:
    """One rank's part of a cooperative load (``reader`` is the :class:`DataStatesReader`)."""

    def __init__(
        self, reader: Any, plan: LoadPlan, planner: LoadPlanner, schedule: Schedule, group: Any
    ) -> None:
        self.reader = reader
        self.planner = planner
        self.schedule = schedule
        self.group = group
        self.rank = dist.get_rank(group)
        self.metadata = reader.metadata
        received = {t.region for t in schedule.recvs}
        self.own: dict[int, list[ReadItem]] = {}  # round -> items read from storage here
        self.wanted: dict[Region, list[ReadItem]] = {}  # received regions -> this rank's items
        for item in plan.items:
            at = schedule.reads.get(self._key(item.storage_index))
            if at is None and region_of(item) in received:
                self.wanted.setdefault(region_of(item), []).append(item)
            else:  # (an item the schedule missed: a planner's finish_plan changed the plan)
                self.own.setdefault(at or 0, []).append(item)
        self.targets: dict[ReadItem, torch.Tensor] = {}
        self.direct: set[ReadItem] = set()

    def run(self) -> None:
        pending: _Round | None = None
        for k in range(self.schedule.rounds):
            error: BaseException | None = None
            sources: dict[Region, torch.Tensor] = {}
            try:
                sources = self._read_round(k)
                if pending is not None:
                    self._finish(pending)
            except Exception as exc:
                error = exc
            self._agree(error, k)
            pending = self._post(k, sources)
        error = None
        try:
            if pending is not None:
                self._finish(pending)
        except Exception as exc:
            error = exc
        self._agree(error, self.schedule.rounds)

    # -- 1. read -------------------------------------------------------------------------------
    def _read_round(self, k: int) -> dict[Region, torch.Tensor]:
        items = self.own.get(k, [])
        sends = [t for t in self.schedule.sends if t.round == k]
        if not items and not sends:
            return {}
        mine = {region_of(it): it for it in items}
        targets = {
            it: self.planner.resolve_tensor(it).detach()
            for it in items
            if it.type != LoadItemType.BYTE_IO
        }
        staged: dict[ReadItem, torch.Tensor | None] = {}
        source_item: dict[Region, ReadItem] = {}
        for t in sends:
            if t.region in source_item:
                continue
            item = mine.get(t.region)
            if item is not None and (t.lengths is None or self._fits(targets[item], t)):
                source_item[t.region] = item
                continue
            item = _staging_item(t)
            if t.lengths is not None:
                staged[item] = torch.empty(t.lengths, dtype=self._dtype(t.index))
                targets[item] = staged[item]  # type: ignore[assignment]
            else:
                staged[item] = None
            source_item[t.region] = item
        try:
            fetch, targets = self.reader.fetch_items([*items, *staged], self.planner, targets)
            self.reader.commit_items(fetch, targets, self.planner, skip=staged)
        except Exception as exc:
            raise _ReadFailed(exc, self._describe([*items, *staged])) from exc
        sources: dict[Region, torch.Tensor] = {}
        for region, item in source_item.items():
            if item.type == LoadItemType.BYTE_IO:
                sources[region] = torch.frombuffer(bytearray(fetch.blobs[item]), dtype=torch.uint8)
            else:
                sources[region] = _flat_bytes(targets[item])
        return sources

    # -- 2. agree ------------------------------------------------------------------------------
    def _agree(self, error: BaseException | None, k: int) -> None:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not flag.item():
            return
        said = None if error is None else _say(error)
        said_all: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(said_all, said, group=self.group)
        if error is not None:
            raise error.__cause__ if isinstance(error, _ReadFailed) else error  # type: ignore[misc]
        failed = {r: s for r, s in enumerate(said_all) if s}
        first = min(failed)
        raise CooperativeLoadError(
            f"rank {self.rank}: rank {first} of this cooperative load failed in round {k}, so "
            f"it stops on every rank: {failed[first]}"
            + (f" (and {len(failed) - 1} other rank(s) failed)" if len(failed) > 1 else "")
            + ". Fix what that rank's error names, or load with DataStatesReader("
            "cooperative=False) to read every item on the rank that needs it",
            failures=failed,
        )

    # -- 3. exchange ---------------------------------------------------------------------------
    def _post(self, k: int, sources: dict[Region, torch.Tensor]) -> _Round:
        out = _Round()
        tag = self.schedule.pack_tag + k
        packs: dict[int, list[torch.Tensor]] = {}
        for t in (t for t in self.schedule.sends if t.round == k):
            if t.packed:
                packs.setdefault(t.peer, []).append(sources[t.region])
            else:
                out.works.append(self._send(sources[t.region], t.peer, t.tag))
        for peer, parts in packs.items():
            buf = torch.cat(parts) if len(parts) > 1 else parts[0]
            if not buf.numel():  # (empty tensors only: the receiver expects no message)
                continue
            out.keep.append(buf)
            out.works.append(self._send(buf, peer, tag))
        out.keep.append(sources)
        incoming: dict[int, list[Transfer]] = {}
        for t in (t for t in self.schedule.recvs if t.round == k):
            if t.packed:
                incoming.setdefault(t.peer, []).append(t)
                continue
            buf, direct = self._landing(t)  # (not packed: at least PACK_BYTES)
            out.works.append(dist.irecv(buf, group=self.group, group_src=t.peer, tag=t.tag))
            out.landed.append((t, buf, direct))
        for peer, transfers in incoming.items():
            buf = torch.empty(sum(t.nbytes for t in transfers), dtype=torch.uint8)
            if buf.numel():
                out.works.append(dist.irecv(buf, group=self.group, group_src=peer, tag=tag))
            at = 0
            for t in transfers:
                out.landed.append((t, buf[at : at + t.nbytes], False))
                at += t.nbytes
        return out

    def _send(self, buf: torch.Tensor, peer: int, tag: int) -> Any:
        return dist.isend(buf, group=self.group, group_dst=peer, tag=tag)

    def _landing(self, t: Transfer) -> tuple[torch.Tensor, bool]:
        """Where transfer ``t`` lands: this rank's target itself when it can take the bytes."""
        items = self.wanted.get(t.region, [])
        if len(items) == 1 and t.lengths is not None:
            target = self._target(items[0])
            if self._fits(target, t):
                # Written behind torch's back, as the reader's direct reads: a save of it in
                # flight copies it first, and autograd sees the new version.
                _cow.before_write([target], "a load")
                increment_version(target)
                return _flat_bytes(target), True
        return torch.empty(t.nbytes, dtype=torch.uint8), False

    def _finish(self, done: _Round) -> None:
        for work in done.works:
            work.wait()
        for t, buf, direct in done.landed:
            items = self.wanted.get(t.region, [])
            if t.lengths is None:
                blob = buf.numpy().tobytes()
                for item in items:
                    self.reader.load_object(item, blob, self.planner)
                continue
            dtype = self._dtype(t.index)
            if buf.storage_offset() % dtype.itemsize:  # packed after an odd-sized object
                buf = buf.clone()
            saved = buf.view(dtype).view(t.lengths)
            for item in items:
                target = self._target(item)
                if not direct:
                    target.copy_(saved)
                self.planner.commit_tensor(item, target)

    # -- shared --------------------------------------------------------------------------------
    def _target(self, item: ReadItem) -> torch.Tensor:
        target = self.targets.get(item)
        if target is None:
            target = self.targets[item] = self.planner.resolve_tensor(item).detach()
        return target

    def _fits(self, target: torch.Tensor, t: Transfer) -> bool:
        """``target`` holds exactly the bytes of ``t`` (sent from, or received into, as is)."""
        return (
            target.device.type == "cpu"
            and target.is_contiguous()
            and not (target.is_conj() or target.is_neg())
            and target.dtype == self._dtype(t.index)
            and tuple(target.shape) == tuple(t.lengths or ())
        )

    def _dtype(self, index: MetadataIndex) -> torch.dtype:
        return self.metadata.state_dict_metadata[index.fqn].properties.dtype

    def _key(self, index: MetadataIndex) -> tuple[str, int]:
        sinfo = self.metadata.storage_data[index]
        return (sinfo.relative_path, sinfo.offset)

    def _describe(self, items: Sequence[ReadItem]) -> str:
        names = sorted({(self._key(it.storage_index)[0], it.storage_index.fqn) for it in items})
        shown = ", ".join(
            f"item {fqn!r} in {self.reader.storage.describe(name)}" for name, fqn in names[:3]
        )
        return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


class _ReadFailed(Exception):
    """A round's read failed; carries what it was reading, for the other ranks' error."""

    def __init__(self, cause: BaseException, reading: str) -> None:
        super().__init__(reading)
        self.reading = reading


def _say(error: BaseException) -> str:
    if isinstance(error, _ReadFailed):
        cause = error.__cause__
        # The cause first: the round's items (three named) need not include the one it names.
        return f"{type(cause).__name__}: {cause} (that round it read {error.reading})"
    return f"receiving its part: {type(error).__name__}: {error}"


def _staging_item(t: Transfer) -> ReadItem:
    """A read item no planner knows: region ``t`` of a record, read for other ranks."""
    empty = torch.Size([0])
    return ReadItem(
        type=LoadItemType.BYTE_IO if t.lengths is None else LoadItemType.TENSOR,
        dest_index=MetadataIndex(f"<cooperative load: for other ranks, transfer {t.tag}>"),
        dest_offsets=empty if t.offsets is None else torch.Size([0] * len(t.offsets)),
        storage_index=t.index,
        storage_offsets=empty if t.offsets is None else torch.Size(t.offsets),
        lengths=empty if t.lengths is None else torch.Size(t.lengths),
    )


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


__all__ = ["COOP_ROUND_BYTES", "CooperativeRead", "cooperative_group_fits"]
