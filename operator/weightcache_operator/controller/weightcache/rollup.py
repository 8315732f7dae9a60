"""Per-node agent states -> the bounded status of one WeightCache.

Input: the agent pods (``agents.AgentPod``) and what each running one answered on
``/status`` (a dict, or the error). Output: a node entry per pod (phase, bytes,
progress, load seconds, clients, GPU UUIDs, replicas, socket dir, fingerprint), counts per
phase, and the Ready / Loading / Degraded conditions they imply.

The status stays small whatever the cluster size: at most ``cap`` node entries
(failed and stuck nodes first, since those are what someone reads the status for),
every node counted in ``nodeCounts``, and ``nodesOmitted`` saying how many entries
were left out. Agent documents are untrusted input from another program: every
field is type-checked and length-capped, and a malformed document makes that one
node Unknown, never the operator fail.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ...conditions import DEGRADED, LOADING, READY, Desired
from .agents import AgentPod, AgentStatusError

PHASES = ("Pending", "Loading", "Ready", "Failed", "Unknown")
NO_NODES = "NoNodes"  # Ready and Degraded: no node runs an agent
NO_NODES_MESSAGE = "no node runs an agent: check nodeSelector, tolerations and gpusPerNode"
CLAIM_NOT_FOUND = "ClaimNotFound"  # Ready and Degraded: the model's PersistentVolumeClaim does not exist
# Listing order when capping: what needs attention first.
_PRIORITY = {"Failed": 0, "Unknown": 1, "Loading": 2, "Pending": 3, "Ready": 4}
MAX_MESSAGE = 1024
MAX_GPUS = 64


def _str(value: Any, limit: int) -> str | None:
    if isinstance(value, str) and value:
        return value[:limit]
    return None


def _nonneg_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, float) and math.isfinite(value) and value >= 0:
        return int(value)
    return None


def _progress(doc: Mapping[str, Any], phase: str) -> int | None:
    """Mean progress of the node's ranks in percent (0..100)."""
    if phase == "Ready":
        return 100
    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        return None
    values = []
    for r in ranks:
        p = r.get("progress") if isinstance(r, Mapping) else None
        if isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p):
            values.append(min(max(float(p), 0.0), 1.0))
        else:
            values.append(0.0)
    return int(100 * sum(values) / len(values))


def node_replicas(answer: Mapping[str, Any], tp: int | None) -> list[dict[str, Any]] | None:
    """The replicas of the cache on one node: ``[{index, gpus, phase}]``.

    A node with ``n`` GPUs and tensor size ``tp`` holds ``n // tp`` replicas, replica
    ``r`` being GPUs ``r*tp .. r*tp+tp-1`` in the agent's UUID order. The agent's own
    ``replicas`` list wins; without it (an older agent) the UUIDs are chunked by ``tp``
    and every replica has the node's phase. None when neither says anything.
    """
    node_phase = answer.get("phase") if answer.get("phase") in PHASES else "Unknown"
    reported = answer.get("replicas")
    if isinstance(reported, list):
        out = []
        for i, r in enumerate(reported[:MAX_GPUS]):
            if not isinstance(r, Mapping):
                continue
            index = r.get("index")
            gpus = r.get("gpus")
            phase = r.get("phase")
            out.append({
                "index": index if isinstance(index, int) and not isinstance(index, bool) and index >= 0 else i,
                "gpus": [g[:64] for g in gpus if isinstance(g, str) and g][:MAX_GPUS] if isinstance(gpus, list) else [],
                "phase": phase if phase in PHASES else node_phase,
            })
        return out
    uuids = answer.get("gpuUUIDs")
    if not tp or tp < 1 or not isinstance(uuids, list):
        return None
    uuids = [u[:64] for u in uuids if isinstance(u, str) and u][:MAX_GPUS]
    return [{"index": r, "gpus": uuids[r * tp:(r + 1) * tp], "phase": node_phase}
            for r in range(len(uuids) // tp)]


def node_entry(pod: AgentPod, answer: Mapping[str, Any] | AgentStatusError | None,
               tp: int | None = None) -> dict[str, Any]:
    """One ``.status.nodes`` entry for an agent pod and what its agent said (if asked)."""
    entry: dict[str, Any] = {"node": pod.node or "", "pod": pod.name}
    if pod.terminating:
        entry.update(phase="Pending", message="agent pod is terminating")
        return entry
    if pod.phase != "Running":
        if pod.phase == "Failed":
            entry.update(phase="Failed", message="agent pod failed")
        else:
            entry.update(phase="Pending", message=(pod.waiting or f"agent pod is {pod.phase}")[:MAX_MESSAGE])
        return entry
    if answer is None or isinstance(answer, AgentStatusError):
        why = str(answer) if answer is not None else "not asked yet"
        # A running pod whose container waits (e.g. CrashLoopBackOff) says more than the HTTP error.
        message = f"{pod.waiting}; {why}" if pod.waiting else why
        entry.update(phase="Unknown", message=message[:MAX_MESSAGE])
        return entry

    phase = answer.get("phase")
    if phase not in ("Pending", "Loading", "Ready", "Failed"):
        entry.update(phase="Unknown", message=f"agent reported an unknown phase {str(phase)[:64]!r}")
        return entry
    entry["phase"] = phase
    if (m := _str(answer.get("message"), MAX_MESSAGE)) is not None:
        entry["message"] = m
    for key in ("bytes", "rankBytes", "freeBytes"):
        if (b := _nonneg_int(answer.get(key))) is not None:
            entry[key] = b
    if (p := _progress(answer, phase)) is not None:
        entry["progress"] = p
    load = answer.get("loadSeconds")
    if isinstance(load, (int, float)) and not isinstance(load, bool) and math.isfinite(load) and load >= 0:
        entry["loadSeconds"] = round(float(load), 3)
    if (c := _nonneg_int(answer.get("clients"))) is not None:
        entry["clients"] = c
    failures, _ = integrity(answer)
    if failures:
        entry["integrityFailures"] = failures
    uuids = answer.get("gpuUUIDs")
    if isinstance(uuids, list):
        entry["gpuUUIDs"] = [u[:64] for u in uuids if isinstance(u, str) and u][:MAX_GPUS]
    if replicas := node_replicas(answer, tp):
        entry["replicas"] = replicas
    if (d := _str(answer.get("socketDir"), 512)) is not None:
        entry["socketDir"] = d
    if (f := _str(answer.get("fingerprint"), 128)) is not None:
        entry["fingerprint"] = f
    return entry


def integrity(answer: Mapping[str, Any] | AgentStatusError | None) -> tuple[int, list[int]]:
    """(arenas found changed since each rank's agent started, the ranks whose arena is changed now)
    from a node's status document (its ranks' integrityFailures and integrity state)."""
    if not isinstance(answer, Mapping) or not isinstance(answer.get("ranks"), list):
        return 0, []
    failures, tampered = 0, []
    for i, r in enumerate(answer["ranks"]):
        if not isinstance(r, Mapping):
            continue
        failures += _nonneg_int(r.get("integrityFailures")) or 0
        if r.get("integrity") == "tampered":
            rank = r.get("rank")
            tampered.append(rank if isinstance(rank, int) and not isinstance(rank, bool) else i)
    return failures, tampered


def integrity_news(pods: Sequence[AgentPod], answers: Mapping[str, Mapping[str, Any] | AgentStatusError],
                   before: Sequence[Mapping[str, Any]], complete: bool = True) -> tuple[list[str], str | None]:
    """(one line per node whose count of changed arenas rose since the last status, a condition
    message while some node's arena is changed now, else None). `before`: the last `.status.nodes`;
    `complete`: it listed every node (else a node missing from it is not news: it was left out)."""
    known = {e.get("node"): _nonneg_int(e.get("integrityFailures")) or 0 for e in before if isinstance(e, Mapping)}
    rises, now = [], []
    for pod in pods:
        if pod.node is None or pod.terminating:
            continue
        failures, tampered = integrity(answers.get(pod.name))
        if failures > known.get(pod.node, 0) and (complete or pod.node in known):
            rises.append(f"node {pod.node}: the agent found {failures - known.get(pod.node, 0)} arena(s) changed "
                         f"since it filled them ({failures} since it started); each is replaced from the "
                         "checkpoint, and engines that mapped the changed arena keep it until they restart")
        if tampered:
            now.append(f"{pod.node} (rank {', '.join(map(str, tampered))})")
    message = None
    if now:
        message = (f"arena changed since it was filled on {'; '.join(now[:3])}"
                   f"{f' and {len(now) - 3} more nodes' if len(now) > 3 else ''}: attaches wait for a fresh copy; "
                   "restart engines that mapped the changed one")[:MAX_MESSAGE]
    return rises, message


def summarize(
    pods: Sequence[AgentPod],
    answers: Mapping[str, Mapping[str, Any] | AgentStatusError],
    desired_nodes: int | None,
    cap: int,
    tp: int | None = None,
) -> dict[str, Any]:
    """Status fields from the agents: counts, capped node entries, ready/desired."""
    counts = {p.lower(): 0 for p in PHASES}
    entries = []
    for pod in pods:
        if pod.node is None:
            counts["pending"] += 1  # not scheduled yet: no node to list it under
            continue
        entry = node_entry(pod, answers.get(pod.name), tp)
        counts[entry["phase"].lower()] += 1
        entries.append(entry)
    entries.sort(key=lambda e: (_PRIORITY[e["phase"]], e["node"]))
    listed = entries[:cap]
    seen = sum(counts.values())
    return {
        # The DaemonSet's own count is authoritative (it includes nodes whose pod
        # does not exist yet); without it, every pod seen counts.
        "desiredNodes": desired_nodes if desired_nodes is not None else seen,
        "readyNodes": counts["ready"],
        "nodeCounts": counts,
        "nodes": listed,
        "nodesOmitted": len(entries) - len(listed),
    }


def _first_problems(entries: Sequence[Mapping[str, Any]], phases: tuple[str, ...], limit: int = 3) -> str:
    bad = [e for e in entries if e["phase"] in phases]
    parts = [f"{e['node']}: {e.get('message') or e['phase']}" for e in bad[:limit]]
    return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What the DaemonSet controller says about the agents (from the DaemonSet's status)."""

    desired: int | None  # desiredNumberScheduled, None before the controller saw the DaemonSet
    updated: int | None  # updatedNumberScheduled: agents running the current pod template
    observed: bool  # the controller has seen the DaemonSet's current generation

    @property
    def rolling(self) -> bool:
        if not self.observed:
            return True
        return self.desired is not None and self.updated is not None and self.updated < self.desired


def daemonset_rollout(ds: Mapping[str, Any] | None) -> Rollout:
    if not ds:
        return Rollout(desired=None, updated=None, observed=False)
    status = ds.get("status") or {}
    generation = (ds.get("metadata") or {}).get("generation")
    observed_gen = status.get("observedGeneration")
    observed = (
        "desiredNumberScheduled" in status
        and (generation is None or (isinstance(observed_gen, int) and observed_gen >= generation))
    )
    desired = status.get("desiredNumberScheduled")
    updated = status.get("updatedNumberScheduled")
    return Rollout(
        desired=desired if isinstance(desired, int) else None,
        updated=updated if isinstance(updated, int) else None,
        observed=observed,
    )


def agent_conditions(summary: Mapping[str, Any], rollout: Rollout) -> list[Desired]:
    """Ready / Loading / Degraded implied by a summary of a valid, rendered spec."""
    c = summary["nodeCounts"]
    desired, ready = summary["desiredNodes"], summary["readyNodes"]
    failed, unknown = c["failed"], c["unknown"]
    busy = c["loading"] + c["pending"]
    entries = summary["nodes"]
    more = f" (+{summary['nodesOmitted']} more nodes not listed)" if summary["nodesOmitted"] else ""

    if not rollout.observed:
        ready_c = Desired(READY, "False", "Starting", "waiting for the DaemonSet controller to schedule agents")
    elif rollout.rolling:
        # Agents still on the previous pod template would report Ready for the old spec.
        ready_c = Desired(READY, "False", "Rolling",
                          f"{rollout.updated}/{rollout.desired} agents run the current spec")
    elif desired == 0:
        ready_c = Desired(READY, "False", NO_NODES, NO_NODES_MESSAGE)
    elif ready >= desired and failed == 0 and unknown == 0 and busy == 0:
        ready_c = Desired(READY, "True", "AllNodesReady", f"{ready}/{desired} nodes hold the model")
    else:
        ready_c = Desired(READY, "False", "NodesNotReady", f"{ready}/{desired} nodes hold the model")

    if busy:
        loading_c = Desired(LOADING, "True", "Loading",
                            f"{c['loading']} loading, {c['pending']} pending of {desired} nodes")
    elif not rollout.observed:
        loading_c = Desired(LOADING, "True", "Starting", "waiting for the DaemonSet controller to schedule agents")
    elif rollout.rolling:
        loading_c = Desired(LOADING, "True", "Rolling",
                            f"{rollout.updated}/{rollout.desired} agents run the current spec")
    else:
        loading_c = Desired(LOADING, "False", "Idle", "no node is loading")

    if rollout.observed and not rollout.rolling and desired == 0:
        degraded_c = Desired(DEGRADED, "True", NO_NODES, NO_NODES_MESSAGE)
    elif failed:
        degraded_c = Desired(DEGRADED, "True", "AgentFailed",
                             f"{failed} node(s) failed: {_first_problems(entries, ('Failed',))}{more}")
    elif unknown:
        degraded_c = Desired(DEGRADED, "True", "AgentUnreachable",
                             f"{unknown} node(s) not answering: {_first_problems(entries, ('Unknown',))}{more}")
    else:
        degraded_c = Desired(DEGRADED, "False", "AsExpected", "no node reports a problem")
    return [ready_c, loading_c, degraded_c]


def claim_conditions(namespace: str, claim: str, pods: Sequence[AgentPod]) -> list[Desired] | None:
    """Ready / Loading / Degraded while the scheduler says the model's PersistentVolumeClaim does not
    exist (its words on the agent pods: ``persistentvolumeclaim "NAME" not found``), else None."""
    words = f'persistentvolumeclaim "{claim}" not found'
    waiting = sum(1 for p in pods if not p.terminating and words in (p.unschedulable or "").lower())
    if not waiting:
        return None
    message = (f"PersistentVolumeClaim {claim} not found in namespace {namespace}: {waiting} agent pod(s) wait "
               "for it; create it, readable from every selected node (ReadOnlyMany), holding the model "
               "directory (safetensors and config.json) at its root")
    return [
        Desired(READY, "False", CLAIM_NOT_FOUND, message),
        Desired(LOADING, "False", CLAIM_NOT_FOUND, "nothing loads until the claim exists"),
        Desired(DEGRADED, "True", CLAIM_NOT_FOUND, message),
    ]


def spec_conditions(reason: str, message: str) -> list[Desired]:
    """Conditions for a spec the operator refuses to render."""
    return [
        Desired(READY, "False", reason, "spec is invalid; the agents were not changed"),
        Desired(LOADING, "False", reason, "spec is invalid; nothing is loading for it"),
        Desired(DEGRADED, "True", reason, message),
    ]
