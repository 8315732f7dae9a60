"""Which replica of a WeightCache (node, GPUs) each serving group of an EngineSet gets.

Input: the number of groups wanted, where the existing groups already are (read
back from their claims' and pods' placement annotations), and the replicas of the
cache that are Ready now (from the agents' ``/status``). Output: a placement per
group index that could be placed, and the indexes that could not.

Rules, in order:

1. an existing group keeps its node and GPUs, Ready or not: moving it would restart
   its engines (the agent's own restart is not a reason to move). The exception
   (``orphaned``): a group none of whose pods runs, on a node where no agent of the
   cache runs either (the node is gone, or the cache no longer selects it);
2. no two groups share a GPU: a later existing group that overlaps an earlier one
   loses its placement and is placed again;
3. a new group goes to a free Ready replica on the node with the fewest groups
   (spread: one node's loss takes as few groups as possible), ties by node name,
   then replica index, so the same inputs always give the same answer;
4. groups that find no free Ready replica stay unplaced (reported, retried on the
   next reconcile).

Pure: no I/O, no clocks.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class Replica:
    """One replica of the cache on one node: ``tp`` GPUs in rank order."""

    node: str
    index: int
    gpus: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one group runs."""

    group: int
    node: str
    gpus: tuple[str, ...]


def place(
    wanted: int,
    existing: Mapping[int, Placement],
    ready: Iterable[Replica],
) -> tuple[dict[int, Placement], list[int]]:
    """Placements for groups ``0 .. wanted-1``; returns (placed by index, unplaced indexes)."""
    placed: dict[int, Placement] = {}
    taken: set[tuple[str, str]] = set()  # (node, GPU UUID)
    for group in sorted(g for g in existing if 0 <= g < wanted):
        p = existing[group]
        gpus = {(p.node, u) for u in p.gpus}
        if not p.gpus or gpus & taken:
            continue
        placed[group] = Placement(group, p.node, tuple(p.gpus))
        taken |= gpus

    per_node = Counter(p.node for p in placed.values())
    free = [r for r in ready if r.gpus and not ({(r.node, u) for u in r.gpus} & taken)]
    unplaced: list[int] = []
    for group in range(wanted):
        if group in placed:
            continue
        candidates = [r for r in free if not ({(r.node, u) for u in r.gpus} & taken)]
        if not candidates:
            unplaced.append(group)
            continue
        best = min(candidates, key=lambda r: (per_node[r.node], r.node, r.index))
        placed[group] = Placement(group, best.node, best.gpus)
        taken |= {(best.node, u) for u in best.gpus}
        per_node[best.node] += 1
    return dict(sorted(placed.items())), unplaced


def orphaned(existing: Mapping[int, Placement], agent_nodes: Iterable[str], running: Iterable[int]) -> set[int]:
    """Groups to place again: no pod of theirs runs and their node has no agent of the cache.

    Both conditions, so that an agent pod replaced during the DaemonSet's rolling
    update (a moment with no agent pod on the node) never moves a serving group.
    """
    nodes, alive = set(agent_nodes), set(running)
    return {g for g, p in existing.items() if p.node not in nodes and g not in alive}
