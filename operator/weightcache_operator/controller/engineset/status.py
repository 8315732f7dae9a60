"""An EngineSet's status and conditions, from what one pass saw and did.

The steps of a pass add to a ``Tally`` as they go: one entry per group, the counts the
printer columns and the scale subresource show, why each group that does not serve
does not, and the writes the API server refused or found taken. At the end the tally
becomes the status keys this reconcile owns (``STATUS_KEYS``) and the Ready, Degraded
and Progressing conditions, worded for the platform engineer who reads them. No I/O.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from ... import owned_status
from ...api.v1alpha1.engineset_types import EngineSetSpec
from ...conditions import DEGRADED, PROGRESSING, READY, Desired, now_rfc3339
from ...kube import merge_patch_for
from .cache_view import CacheView
from .groups import GroupRoles, standby_names
from .inventory import GroupPods
from .manifests import ANNOTATION_MODEL, LABEL_TEMPLATE_HASH, claim_name
from .placement import Placement
from .pods import labels, meta, pod_failure, pod_ready, template_hash_of
from .rollout import Step

STATUS_KEYS = (
    "observedGeneration", "replicas", "readyGroups", "servingGroups", "standbys", "selector",
    "rollout", "groups", "conditions",
)
MAX_GROUP_ENTRIES = 64
MAX_REASONS = 4  # groups named in the Ready condition's message; the rest counted


def _counts() -> dict[str, int]:
    return {"replicas": 0, "ready": 0, "serving": 0, "standbys": 0, "pods": 0, "updated": 0}


@dataclasses.dataclass
class Tally:
    """What one pass found of its groups and met at the API server, for the status and conditions."""

    counts: dict[str, int] = dataclasses.field(default_factory=_counts)
    groups: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    not_serving: dict[int, str] = dataclasses.field(default_factory=dict)  # group -> why, for Ready
    conflicts: list[str] = dataclasses.field(default_factory=list)  # names taken by objects not ours
    rejected: list[str] = dataclasses.field(default_factory=list)  # what the API server refused, and why

    def waiting(self, group: int, p: Placement) -> None:
        """A group whose old objects are going away (scaled down and up, moved): a later pass creates anew."""
        self.groups.append({"index": group, "phase": "Starting", "node": p.node, "gpus": list(p.gpus)})
        self.not_serving[group] = "waiting for its previous pods and claim to go"

    def unplaced(self, group: int) -> None:
        self.groups.append({"index": group, "phase": "Unplaced"})
        self.not_serving[group] = "not placed (see Degraded)"


def problem_conditions(reason: str, message: str) -> list[Desired]:
    return [
        Desired(READY, "False", reason, "the EngineSet cannot be reconciled; running pods were not changed"),
        Desired(DEGRADED, "True", reason, message),
    ]


def _changed(old: Any, new: Any) -> Any:
    # A dict (rollout) is patched key by key: a key it no longer has must go (null).
    return merge_patch_for(old, new) if isinstance(new, dict) else new


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    return owned_status.status_patch(old, new, STATUS_KEYS, _changed)


def _not_attached(view: CacheView, node: str) -> str:
    if view.unnamed.get(node):
        return (f"the agent on {node} holds {view.unnamed[node]} lease(s) but names the engines holding them only "
                "to its control token, and this operator's control key is missing or not the agents' "
                "(install with the chart, or set WEIGHTCACHE_CONTROL_KEY_FILE)")
    misses = view.misses.get(node, 0)
    if misses:
        return (f"no engine attached to the agent on {node}, which has refused {misses} attach(es) since it "
                "started (another fingerprint or a failed load: the engines' logs name the fields)")
    return f"no engine attached to the agent on {node} yet (starting, or not reaching its socket)"


def why_not_serving(view: CacheView, p: Placement, gp: GroupPods, serving_pod: Mapping[str, Any] | None) -> str:
    """Why a placed group does not serve, in the words a platform engineer acts on: the agent, the pods,
    the attaches (what the node's agent holds for them), the promotion, readiness."""
    node = p.node
    if node in view.unreachable:
        return f"the agent on {node} does not answer ({view.unreachable[node]})"
    if not gp.live:
        return "no engine pod yet"
    for pod in gp.live.values():
        if (failure := pod_failure(pod)) is not None:
            return f"pod {meta(pod).get('name')}: {failure}"
    roles = view.roles.get(node, {})
    attached = sorted(name for x in gp.live.values() if (name := meta(x).get("name")) in roles)
    if not attached:
        return _not_attached(view, node)
    if serving_pod is None:
        return f"waiting for promotion: {', '.join(attached)} attached as standby, none as primary"
    name = meta(serving_pod).get("name")
    if not pod_ready(serving_pod):
        return f"primary {name} is not Ready yet"
    return f"primary {name} is not labelled serving yet"


def group_entry(name: str, mode: str, p: Placement, gp: GroupPods, roles: GroupRoles,
                old: Mapping[str, Any]) -> dict[str, Any]:
    """A placed group's ``status.groups[]`` entry: where it runs, who serves, its standbys;
    the last failover carried over from the previous status (``old``: its entry there)."""
    serving_pod = roles.serving_pod
    entry: dict[str, Any] = {"index": p.group, "node": p.node, "gpus": list(p.gpus)}
    if mode == "dra":
        entry["claim"] = claim_name(name, p.group)
    if serving_pod is not None:
        entry["primary"] = meta(serving_pod)["name"]
    entry["standbys"] = standby_names(gp, serving_pod)
    for key in ("lastFailoverTime", "lastFailoverSeconds"):
        if key in old:
            entry[key] = old[key]
    return entry


def record_failover(entry: dict[str, Any], old: Mapping[str, Any], primary: str,
                    seen: MutableMapping[int, tuple[str, float]], now_mono: float,
                    clock: Callable[[], str] = now_rfc3339) -> str | None:
    """Note the group's primary as seen now; when it is another pod than the status names, put
    the failover in the entry and return the primary it replaced.

    ``seen``: group -> (primary, monotonic time last seen), kept across passes in the memo: the
    failover's duration is measured from the last pass that saw the old primary, and is left
    out when no pass of this operator run saw it."""
    group = entry["index"]
    before, last = old.get("primary"), seen.get(group)
    replaced = None
    if before and before != primary:
        entry["lastFailoverTime"] = clock()
        if last is not None and last[0] == before:
            entry["lastFailoverSeconds"] = round(now_mono - last[1], 3)
        else:
            entry.pop("lastFailoverSeconds", None)
        replaced = before
    seen[group] = (primary, now_mono)
    return replaced


def tally_group(tally: Tally, view: CacheView, p: Placement, gp: GroupPods, roles: GroupRoles,
                entry: dict[str, Any], labelled_now: Sequence[Mapping[str, Any]], thash: str,
                step: Step | None) -> None:
    """Count a placed group and finish its entry: serving or not (and why), its rollout state.

    ``labelled_now``: the pods this pass labels serving; ``step``: the group's rollout step, when
    the rollout works on it."""
    serving_pod, counts = roles.serving_pod, tally.counts
    ready_primary = serving_pod is not None and pod_ready(serving_pod)
    if gp.live:
        counts["replicas"] += 1
    counts["ready"] += int(ready_primary)
    served = ready_primary and (serving_pod in labelled_now or serving_pod in roles.labelled)
    counts["serving"] += int(served)
    if not served:
        tally.not_serving[p.group] = why_not_serving(view, p, gp, serving_pod)
    counts["standbys"] += sum(1 for x in gp.live.values() if x is not serving_pod and pod_ready(x))
    updated = sum(1 for x in gp.live.values() if template_hash_of(x) == thash)
    counts["pods"] += len(gp.live)
    counts["updated"] += updated
    entry["phase"] = "Serving" if ready_primary else "Starting"
    # The rollout per group: what serves now (hash, model) against status.rollout.templateHash.
    if serving_pod is not None:
        entry["templateHash"] = labels(serving_pod).get(LABEL_TEMPLATE_HASH, "")[:64]
        if model := (meta(serving_pod).get("annotations") or {}).get(ANNOTATION_MODEL):
            entry["model"] = model[:512]
    entry.update(updatedPods=updated, pods=len(gp.live))
    if step is not None:
        entry["rollout"] = "Stalled" if step.kind == "stalled" else "Progressing"
    else:
        entry["rollout"] = "Updated" if updated == len(gp.live) else "Pending"
    tally.groups.append(entry)


def rollout_status(thash: str, counts: Mapping[str, int], rolling: int | None, step: Step | None) -> dict[str, Any]:
    """``status.rollout``: the template every pod should run, how many do, and the group being rolled."""
    out: dict[str, Any] = {"templateHash": thash, "updatedPods": counts["updated"], "pods": counts["pods"]}
    if rolling is None or step is None:
        out["phase"] = "Complete" if counts["updated"] == counts["pods"] else "Outdated"
    else:
        out.update(phase="Stalled" if step.kind == "stalled" else "Progressing", group=rolling,
                   message=step.reason[:1024] or step.kind)
    return out


def progressing(rolling: int | None, step: Step | None) -> Desired:
    if rolling is None or step is None:
        return Desired(PROGRESSING, "True", "RolloutComplete", "every group runs the current template")
    if step.kind == "stalled":
        return Desired(PROGRESSING, "False", "RolloutStalled",
                       f"group {rolling}: {step.reason}; the other groups keep their old primaries")
    return Desired(PROGRESSING, "True", "RolloutInProgress", f"group {rolling}: {step.reason or step.kind}")


def _ready(es: EngineSetSpec, tally: Tally) -> Desired:
    wanted, serving = es.replicas, tally.counts["serving"]
    if wanted == 0:
        return Desired(READY, "True", "ScaledToZero", "replicas is 0")
    if serving >= wanted:
        return Desired(READY, "True", "AllGroupsServing", f"{serving}/{wanted} groups serving")
    whys = [f"group {g}: {why}" for g, why in sorted(tally.not_serving.items())]
    more = f"; and {len(whys) - MAX_REASONS} more" if len(whys) > MAX_REASONS else ""
    return Desired(READY, "False", "GroupsNotServing",
                   f"{serving}/{wanted} groups serving; " + "; ".join(whys[:MAX_REASONS]) + more)


def _degraded(es: EngineSetSpec, view: CacheView, tally: Tally, unplaced: list[int],
              placed: Mapping[int, Placement]) -> Desired:
    """The first thing that keeps the EngineSet from its spec, most actionable first."""
    unreachable = sorted({p.node for p in placed.values() if p.node in view.unreachable})
    if tally.rejected:
        return Desired(DEGRADED, "True", "Rejected", "the API server refused " + "; ".join(tally.rejected[:3]))
    if tally.conflicts:
        return Desired(DEGRADED, "True", "OwnershipConflict",
                       f"{', '.join(tally.conflicts[:3])} already exist(s) and are not controlled by this EngineSet; "
                       "rename or delete them")
    if unplaced and not view.ready:
        return Desired(DEGRADED, "True", "CacheNotReady",
                       f"{len(unplaced)} group(s) not placed: WeightCache {es.cache_name} is not Ready "
                       f"({view.ready_message})")
    if unplaced:
        return Desired(DEGRADED, "True", "NoFreeReplica",
                       f"{len(unplaced)} group(s) not placed: every Ready replica of WeightCache "
                       f"{es.cache_name} ({len(view.replicas)}) holds a group; add nodes or lower replicas")
    if unreachable:
        return Desired(DEGRADED, "True", "AgentUnreachable",
                       "agents not answering on " + ", ".join(f"{n} ({view.unreachable[n]})" for n in unreachable[:3]))
    return Desired(DEGRADED, "False", "AsExpected", "every group is placed")


def conditions(es: EngineSetSpec, view: CacheView, tally: Tally, unplaced: list[int],
               placed: Mapping[int, Placement]) -> list[Desired]:
    """Ready (do the groups serve) and Degraded (what stands in the way) after a pass."""
    return [_ready(es, tally), _degraded(es, view, tally, unplaced, placed)]


def fill_status(new_status: dict[str, Any], tally: Tally, thash: str, rolling: int | None, step: Step | None) -> None:
    """The owned status keys a converged pass sets (conditions apart)."""
    tally.groups.sort(key=lambda g: g["index"])
    counts = tally.counts
    new_status.update(
        replicas=counts["replicas"], readyGroups=counts["ready"], servingGroups=counts["serving"],
        standbys=counts["standbys"], groups=tally.groups[:MAX_GROUP_ENTRIES],
        rollout=rollout_status(thash, counts, rolling, step),
    )
