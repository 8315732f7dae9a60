"""One placed group's decisions: which pods go, which slots get new ones, who is primary.

The per-group step of the reconcile asks these in order, and writes what they answer:
pods that cannot serve where they are (``pods_to_replace``), the slots to fill
(``slots_to_fill``), the roles the agent gives the group's pods (``group_roles``, from
which the serving labels follow), the standbys beyond the wanted count
(``excess_standbys``), and for the group a rollout works on, its pods as the rollout
planner takes them (``engine_pods``). Each answer is computed from the group's pods as
the earlier steps of the same pass left them; no I/O here.
"""
from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from .cache_view import CacheView
from .inventory import GroupPods
from .leases import PodRef
from .manifests import placement_of
from .placement import Placement
from .pods import labelled_serving, meta, pod_age, pod_failure, pod_ready, template_hash_of
from .rollout import EnginePod


@dataclasses.dataclass
class GroupRoles:
    """A group's pods as its agent and its labels see them."""

    ref: PodRef | None  # the primary the agent reports for the group's lease group
    primary: dict[str, Any] | None  # the live pod that primary is, if any
    labelled: list[dict[str, Any]]  # the live pods labelled serving

    @property
    def serving_pod(self) -> dict[str, Any] | None:
        """The pod the group serves from: the agent's primary, else one still labelled serving."""
        if self.primary is not None:
            return self.primary
        return self.labelled[0] if self.labelled else None

    def label_changes(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(pods to label serving, pods to unlabel); none while the agent names no live primary."""
        if self.primary is None:
            return [], []
        to_true = [] if labelled_serving(self.primary) else [self.primary]
        return to_true, [pod for pod in self.labelled if pod is not self.primary]


def slot_budget(view: CacheView, slots: int) -> int:
    """Pods a group keeps: one while the cache waits for memory for a new model (standbys hold
    the memory it waits for), else the primary and its standbys."""
    return 1 if view.memory_hold else slots


def pods_to_replace(gp: GroupPods, group: int, p: Placement,
                    keep_hash: str | None) -> list[tuple[int, dict[str, Any], str]]:
    """(slot, pod, why) of the pods that go: finished or failed ones, and ones placed elsewhere.

    ``keep_hash``: the template a rollout of this group moves to; a failed pod of it stops the
    rollout and stays to be looked at, so it is not replaced.
    """
    out = []
    for slot, pod in sorted(gp.live.items()):
        phase = (pod.get("status") or {}).get("phase")
        wrong_place = placement_of(pod, group) not in (None, p)
        if keep_hash is not None and not wrong_place and template_hash_of(pod) == keep_hash:
            continue
        if phase in ("Failed", "Succeeded") or wrong_place:
            out.append((slot, pod, f"pod {phase}" if not wrong_place else "placement changed"))
    return out


def slots_to_fill(gp: GroupPods, slots: int, rolling: bool, node_current: bool) -> list[int]:
    """The lowest free slots for the pods a group lacks.

    Counted, not slot by slot: after a rollout the pods may sit in any slots. A rolling
    group's pods are the rollout planner's, and a group that has pods gets no more while its
    node's agent does not serve the cache's model yet (they could not attach).
    """
    missing = 0 if rolling or (gp.live and not node_current) else slots - len(gp.live) - len(gp.terminating)
    return [s for s in range(slots + len(gp.live) + len(gp.terminating))
            if s not in gp.live and s not in gp.terminating][:max(missing, 0)]


def group_roles(view: CacheView, node: str, lease: str, gp: GroupPods) -> GroupRoles:
    """Roles from the agent's truth, matched to live pods by name and uid."""
    ref = view.primaries.get(node, {}).get(lease)
    primary = None
    if ref is not None:
        for pod in gp.live.values():
            m = meta(pod)
            if m.get("name") == ref.name and (ref.uid is None or m.get("uid") in (None, ref.uid)):
                primary = pod
    return GroupRoles(ref, primary, [pod for pod in gp.live.values() if labelled_serving(pod)])


def excess_standbys(gp: GroupPods, slots: int, roles: GroupRoles, keep_all: bool) -> list[tuple[int, dict[str, Any]]]:
    """(slot, pod) of the standbys beyond `slots`, highest slot first; never the primary or a pod
    still labelled serving (traffic may still reach it). ``keep_all``: a rollout owns the count."""
    excess = 0 if keep_all else len(gp.live) - slots
    out: list[tuple[int, dict[str, Any]]] = []
    for slot, pod in sorted(gp.live.items(), reverse=True):
        if excess <= 0:
            break
        if pod is not roles.primary and pod not in roles.labelled:
            out.append((slot, pod))
            excess -= 1
    return out


def standby_names(gp: GroupPods, serving_pod: Mapping[str, Any] | None) -> list[str]:
    return sorted(meta(x)["name"] for x in gp.live.values() if x is not serving_pod)[:9]


def engine_pods(gp: GroupPods, roles: Mapping[str, str], now: datetime.datetime) -> list[EnginePod]:
    """A group's live pods as the rollout planner sees them (``roles``: pod name -> the agent's role)."""
    return [EnginePod(meta(x)["name"], slot, template_hash_of(x) or "", "", role=roles.get(meta(x)["name"]),
                      ready=pod_ready(x), serving=labelled_serving(x), failed=pod_failure(x), age=pod_age(x, now))
            for slot, x in sorted(gp.live.items())]
