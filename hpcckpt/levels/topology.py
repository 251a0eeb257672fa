"""Which ranks share a node, which rank leads each node, and whose partner each rank is."""
from __future__ import annotations

from dataclasses import dataclass

from ..ranks import Ranks


@dataclass(frozen=True)
class Topology:
    rank: int
    node_of: tuple[str, ...]  # the node of each rank

    @staticmethod
    def gather(ranks: Ranks, node: str) -> Topology:
        return Topology(ranks.rank, tuple(str(n) for n in ranks.gather_json(node)))

    @property
    def world(self) -> int:
        return len(self.node_of)

    @property
    def nodes(self) -> list[str]:
        """The nodes, in the order of their first rank."""
        return list(dict.fromkeys(self.node_of))

    def ranks_on(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def leader(self, rank: int) -> int:
        """The lowest rank on ``rank``'s node: it commits the node's node-local checkpoints."""
        return self.ranks_on(self.node_of[rank])[0]

    @property
    def is_leader(self) -> bool:
        return self.leader(self.rank) == self.rank

    @property
    def leaders(self) -> list[int]:
        return [self.ranks_on(n)[0] for n in self.nodes]

    def partner(self, rank: int) -> int | None:
        """The rank on the next node (cyclically) at the same place among its node's ranks: it
        keeps a copy of ``rank``'s node-local file. None on a single node."""
        nodes = self.nodes
        if len(nodes) < 2:
            return None
        here = self.node_of[rank]
        index = self.ranks_on(here).index(rank)
        there = self.ranks_on(nodes[(nodes.index(here) + 1) % len(nodes)])
        return there[index % len(there)]

    def wards(self, rank: int) -> list[int]:
        """The ranks whose partner ``rank`` is."""
        return [r for r in range(self.world) if self.partner(r) == rank]
