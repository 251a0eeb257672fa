"""Which ranks share a node, which rank leads each node, and whose partner each rank is."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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

    @cached_property
    def nodes(self) -> list[str]:
        """The nodes, in the order of their first rank."""
        return list(dict.fromkeys(self.node_of))

    @cached_property
    def _on(self) -> dict[str, list[int]]:
        """Each node's ranks, in order."""
        on: dict[str, list[int]] = {}
        for r, n in enumerate(self.node_of):
            on.setdefault(n, []).append(r)
        return on

    def ranks_on(self, node: str) -> list[int]:
        return list(self._on.get(node, []))

    def leader(self, rank: int) -> int:
        """The lowest rank on ``rank``'s node: it commits the node's node-local checkpoints."""
        return self._on[self.node_of[rank]][0]

    @property
    def is_leader(self) -> bool:
        return self.leader(self.rank) == self.rank

    @property
    def leaders(self) -> list[int]:
        return [self._on[n][0] for n in self.nodes]

    @cached_property
    def _partners(self) -> tuple[int | None, ...]:
        """Each rank's partner: the rank on the next node (cyclically) at the same place among
        its node's ranks. None on a single node. Made once: every save asks."""
        nodes = self.nodes
        if len(nodes) < 2:
            return (None,) * self.world
        out: list[int | None] = [None] * self.world
        for i, node in enumerate(nodes):
            there = self._on[nodes[(i + 1) % len(nodes)]]
            for place, r in enumerate(self._on[node]):
                out[r] = there[place % len(there)]
        return tuple(out)

    def partner(self, rank: int) -> int | None:
        """The rank that keeps a copy of ``rank``'s node-local file (None on a single node)."""
        return self._partners[rank]

    def wards(self, rank: int) -> list[int]:
        """The ranks whose partner ``rank`` is."""
        return [r for r, p in enumerate(self._partners) if p == rank]
