"""Cooperative load, the plan: each record read from storage once, by a rank that needs it.

Runs on the coordinator in ``prepare_global_plan``, with every rank's read plan. A record (one
saved chunk or object in a data file) that several ranks need -- replicas (HSDP, DDP), replicated
non-sharded state, resharding where shards overlap -- gets one owner among those ranks; the owner
reads it and sends each other rank the region of it that rank asked for (a :class:`Transfer`).
Owners are picked biggest record first, each to the needing rank that reads the fewest bytes so
far, so reads spread over ranks. Each owner's records are cut into rounds of at most
``round_bytes`` (in file order, so neighbours still share reads): a round's reads, then its
transfers, bound what an owner holds for others at once.

The result rides to each rank in its ``LoadPlan.storage_data`` as a :class:`Schedule`; the ranks
run it in :mod:`dcp_datastates.load.coop`. Every rank derives its sends and receives from the
same global order, so the two ends of each transfer agree without further talk. Records written
through stream transforms (stock compression) are read by each rank that needs them, as before.
Work grows with the plan items, not ranks x items.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

#: Transfers smaller than this travel packed, one message per (round, owner, receiver).
PACK_BYTES = 1 << 20

RecordKey = tuple[str, int]  # (data file, record offset)
Region = tuple[MetadataIndex, tuple[int, ...] | None, tuple[int, ...] | None]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One region of a record, from its owner to one rank that needs it.

    ``offsets``/``lengths`` are the region inside the saved chunk (as in a ``ReadItem``); both
    None for an object item, which travels whole. ``peer`` is the other end: the receiver on the
    owner's side, the owner on the receiver's."""

    tag: int
    round: int
    peer: int
    index: MetadataIndex
    offsets: tuple[int, ...] | None
    lengths: tuple[int, ...] | None
    nbytes: int

    @property
    def region(self) -> Region:
        return (self.index, self.offsets, self.lengths)

    @property
    def packed(self) -> bool:
        return self.nbytes < PACK_BYTES


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One rank's part of a cooperative load (the same ``rounds`` and ``pack_tag`` on all)."""

    rounds: int
    pack_tag: int  # tag of round k's packed message: pack_tag + k
    reads: dict[RecordKey, int]  # records this rank reads from storage -> their round
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


def region_of(item: ReadItem) -> Region:
    if item.type == LoadItemType.BYTE_IO:
        return (item.storage_index, None, None)
    return (item.storage_index, tuple(item.storage_offsets), tuple(item.lengths))


def plan_cooperative(
    plans: list[LoadPlan],
    metadata: Metadata,
    record_length: Callable[[MetadataIndex], int],
    *,
    round_bytes: int,
) -> list[LoadPlan]:
    """``plans`` with a :class:`Schedule` in each ``storage_data``; unchanged when no record is
    needed by two ranks (nothing to share: the plain load is as good)."""
    needs: dict[RecordKey, dict[Region, list[int]]] = {}
    lengths: dict[RecordKey, int] = {}
    private: list[set[RecordKey]] = [set() for _ in plans]
    for rank, plan in enumerate(plans):
        for item in plan.items:
            sinfo = metadata.storage_data[item.storage_index]
            key = (sinfo.relative_path, sinfo.offset)
            if getattr(sinfo, "transform_descriptors", None):
                private[rank].add(key)  # decoded whole by each reader, as stock does
                continue
            lengths.setdefault(key, record_length(item.storage_index))
            ranks = needs.setdefault(key, {}).setdefault(region_of(item), [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    if not any(len({r for rs in regions.values() for r in rs}) > 1 for regions in needs.values()):
        return plans

    owner: dict[RecordKey, int] = {}
    load = [0] * len(plans)
    for key in sorted(needs, key=lambda k: (-lengths[k], k)):
        candidates = sorted({r for rs in needs[key].values() for r in rs})
        chosen = min(candidates, key=lambda r: (load[r], r))
        owner[key] = chosen
        load[chosen] += lengths[key]

    reads: list[dict[RecordKey, int]] = [{} for _ in plans]
    filled = [0] * len(plans)
    for key in sorted(set(owner) | {k for keys in private for k in keys}):
        takers = ([owner[key]] if key in owner else []) + [
            r for r in range(len(plans)) if key in private[r]
        ]
        for rank in takers:
            done = reads[rank]
            current = max(done.values(), default=0)
            if filled[rank] and filled[rank] + lengths.get(key, 0) > round_bytes:
                current, filled[rank] = current + 1, 0
            done[key] = current
            filled[rank] += lengths.get(key, 0)

    sends: list[list[Transfer]] = [[] for _ in plans]
    recvs: list[list[Transfer]] = [[] for _ in plans]
    tag = 0
    for key in sorted(needs):
        src = owner[key]
        for region, ranks in needs[key].items():
            takers = [r for r in ranks if r != src]
            if not takers:
                continue
            nbytes = _region_bytes(metadata, region, lengths[key])
            at = reads[src][key]
            for dst in takers:
                sends[src].append(Transfer(tag, at, dst, *region, nbytes))
                recvs[dst].append(Transfer(tag, at, src, *region, nbytes))
            tag += 1
    rounds = 1 + max(r for done in reads for r in (*done.values(), 0))
    return [
        dataclasses.replace(
            plan,
            storage_data=Schedule(
                rounds=rounds,
                pack_tag=tag,
                reads=reads[rank],
                sends=tuple(sends[rank]),
                recvs=tuple(recvs[rank]),
            ),
        )
        for rank, plan in enumerate(plans)
    ]


def _region_bytes(metadata: Metadata, region: Region, record_length: int) -> int:
    index, _, lengths = region
    if lengths is None:
        return record_length  # an object item travels as its whole record
    dtype = metadata.state_dict_metadata[index.fqn].properties.dtype  # type: ignore[union-attr]
    return math.prod(lengths) * dtype.itemsize


__all__ = ["PACK_BYTES", "Schedule", "Transfer", "plan_cooperative", "region_of"]
