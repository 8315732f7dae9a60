"""What exists of one EngineSet, by group: its pods by slot, its claims, and what they record.

The first step of every pass. The reconcile lists the pods and claims it controls and
hands them here; out come the groups as the API holds them (``take_inventory``), the
placement each group's objects carry (``recorded_placements``), the groups to clear away
before anything is placed again (``unwanted_groups``), and the one group a rollout works
on (``rolling_group``). Nothing is remembered between passes, so this is rebuilt from
the API every time; no I/O here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from .manifests import LABEL_GROUP, placement_of
from .pods import labels, meta, slot_of, template_hash_of
from .placement import Placement


@dataclasses.dataclass
class GroupPods:
    """The live pods of one group by slot (terminating ones apart: their names are still taken)."""

    live: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    terminating: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Inventory:
    """An EngineSet's objects by group, as the steps of one pass change them."""

    pods: dict[int, GroupPods] = dataclasses.field(default_factory=dict)
    claims: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Groups whose old objects are still going away: nothing is created for them this pass.
    waiting: set[int] = dataclasses.field(default_factory=set)

    def group(self, group: int) -> GroupPods:
        """A group's pods; an empty record (not stored) for a group without any."""
        return self.pods.get(group, GroupPods())

    @property
    def groups(self) -> set[int]:
        """Every group with a pod or a claim."""
        return set(self.pods) | set(self.claims)


def _group_label(obj: Mapping[str, Any]) -> int | None:
    try:
        return int(labels(obj).get(LABEL_GROUP, ""))
    except ValueError:
        return None


def take_inventory(name: str, pods: Iterable[dict[str, Any]], claims: Iterable[dict[str, Any]]) -> Inventory:
    """Sort an EngineSet's pods and claims into groups; objects whose labels or names say no group are left out."""
    inv = Inventory()
    for pod in pods:
        group = _group_label(pod)
        if group is None:
            continue
        slot = slot_of(meta(pod).get("name", ""), name, group)
        if slot is None:
            continue
        gp = inv.pods.setdefault(group, GroupPods())
        if meta(pod).get("deletionTimestamp"):
            gp.terminating.add(slot)
        else:
            gp.live[slot] = pod
    for claim in claims:
        group = _group_label(claim)
        if group is None:
            continue
        # A claim being deleted still holds its name (and, while pods use it, its devices):
        # its group waits for it to go before anything is created for it again.
        if meta(claim).get("deletionTimestamp"):
            inv.waiting.add(group)
        else:
            inv.claims[group] = claim
    return inv


def recorded_placements(inv: Inventory, tensor: int) -> dict[int, Placement]:
    """Where each group's objects say it runs: its claim's annotations first, then its live pods'."""
    existing: dict[int, Placement] = {}
    for group in inv.groups:
        sources = ([inv.claims[group]] if group in inv.claims else []) + list(inv.group(group).live.values())
        for obj in sources:
            # A placement of another size than the cache's tp (its parallelism changed) is void.
            if (p := placement_of(obj, group)) is not None and len(p.gpus) == tensor:
                existing[group] = p
                break
    return existing


def running_groups(inv: Inventory) -> set[int]:
    """Groups with a pod in phase Running: such a group is never moved off its node."""
    return {g for g, gp in inv.pods.items()
            if any((x.get("status") or {}).get("phase") == "Running" for x in gp.live.values())}


def unwanted_groups(inv: Inventory, placed: Mapping[int, Placement], existing: Mapping[int, Placement]) -> list[int]:
    """Groups whose objects must go, lowest first: not wanted any more, or placed elsewhere than they record.

    A group with only terminating pods and no claim is left out: nothing of it remains to remove.
    """
    out = []
    for group in sorted(inv.groups):
        if group in placed and existing.get(group) == placed[group]:
            continue
        if not inv.group(group).live and group not in inv.claims:
            continue
        out.append(group)
    return out


def rolling_group(placed: Mapping[int, Placement], inv: Inventory, thash: str) -> int | None:
    """The group a rollout works on: the lowest placed one with a pod of another template.

    One group at a time, so that a bad template stops after it while the other groups keep
    their old primaries; a group still waiting for its old objects to go is not rolled.
    """
    return next((g for g in sorted(placed) if g not in inv.waiting and any(
        template_hash_of(x) != thash for x in inv.group(g).live.values())), None)
