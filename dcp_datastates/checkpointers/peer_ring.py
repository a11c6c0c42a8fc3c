"""Which rank keeps whose peer replica: a ring of nodes, each rank paired with the rank of the
same local index ``distance`` nodes further on (see :mod:`.peers`).

May import: the leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PeerRing:
    """Which rank keeps whose replica.

    Attributes:
        node_of_rank: the node id of each rank (group ranks, in order). Every node has the same
            number of ranks; a rank's local index is its position among its node's ranks.
        distance: how many nodes round the ring (nodes in the order of their ids) a rank's peer
            is; not a multiple of the number of nodes, which would put it on its own node.
    """

    node_of_rank: tuple[int, ...]
    distance: int = 1

    def __post_init__(self) -> None:
        nodes = sorted(set(self.node_of_rank))
        if len(nodes) < 2:
            raise ValueError(
                f"node_of_rank={list(self.node_of_rank)} puts every rank on one node: a peer "
                "replica must live on another node (give each rank its node's id)"
            )
        sizes = {n: self.node_of_rank.count(n) for n in nodes}
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"node_of_rank gives nodes different numbers of ranks ({sizes}); peers pair "
                "ranks by their index on a node, so every node needs the same number"
            )
        if not isinstance(self.distance, int) or self.distance < 1:
            raise ValueError(f"distance={self.distance!r}: give a whole number of nodes >= 1")
        if self.distance % len(nodes) == 0:
            raise ValueError(
                f"distance={self.distance} is a multiple of the {len(nodes)} nodes: each rank's "
                "peer would be on its own node"
            )

    @classmethod
    def of(
        cls,
        world_size: int,
        *,
        node_of_rank: Sequence[int] | None,
        ranks_per_node: int | None,
        distance: int,
    ) -> PeerRing:
        if (node_of_rank is None) == (ranks_per_node is None):
            raise ValueError("give exactly one of node_of_rank and ranks_per_node")
        if ranks_per_node is not None:
            if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
                raise ValueError(f"ranks_per_node={ranks_per_node!r}: give a whole number >= 1")
            if world_size % ranks_per_node:
                raise ValueError(
                    f"ranks_per_node={ranks_per_node} does not divide the world size {world_size}"
                )
            node_of_rank = [r // ranks_per_node for r in range(world_size)]
        node_of_rank = tuple(node_of_rank)
        if len(node_of_rank) != world_size:
            raise ValueError(
                f"node_of_rank has {len(node_of_rank)} entries for a group of {world_size} ranks"
            )
        return cls(node_of_rank=node_of_rank, distance=distance)

    def _layout(self) -> tuple[list[int], list[list[int]]]:
        nodes = sorted(set(self.node_of_rank))
        return nodes, [[r for r, n in enumerate(self.node_of_rank) if n == node] for node in nodes]

    def _shift(self, rank: int, by: int) -> int:
        nodes, members = self._layout()
        at = nodes.index(self.node_of_rank[rank])
        return members[(at + by) % len(nodes)][members[at].index(rank)]

    def peer(self, rank: int) -> int:
        """The rank that keeps ``rank``'s replica."""
        return self._shift(rank, self.distance)

    def source(self, rank: int) -> int:
        """The rank whose replica ``rank`` keeps."""
        return self._shift(rank, -self.distance)


__all__ = ["PeerRing"]
