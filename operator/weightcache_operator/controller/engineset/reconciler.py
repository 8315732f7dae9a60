"""The EngineSet reconcile: engine pods on a cache's GPUs, and serving labels that follow the agents.

Runs on the same triggers as the WeightCache reconcile (create, resume, spec change
including ``kubectl scale``, and a timer), on the same registry (``registry``
registers it), and, like it, does not care why it runs. One pass:

1. parse the spec (``api.v1alpha1.engineset_types``); read the WeightCache it names
   and check the template against the cache's tensor-parallel size, and (mode dra)
   that the DeviceClass exists. Any problem: Ready=False, Degraded=True with the reason,
   an Event, nothing touched, no exception (no retry storm; other EngineSets go on);
2. ask the cache's agents for ``/status`` (``controller.weightcache.agents.ask_agents``):
   the Ready replicas of the cache per node, and per lease group the pod the agent holds
   as primary (``leases``);
3. read back this EngineSet's pods and claims (label ``weightcache.io/engineset``
   and controller owner reference), their placement from their annotations, and
   place the groups (``placement.place``: existing groups stay, new ones spread);
4. per group: create the claim, create the missing pods in the lowest free slots
   (a deleted pod is replaced by the next pass; pods are counted, so after a rollout
   they may sit in any slots), delete excess standbys highest slot first, delete failed pods and pods of groups or slots that
   are no longer wanted (never a group's serving pod while the group keeps running);
   create or patch the Service. The first group with a pod of an older template is
   rolled instead, one step per pass (``rollout.plan_group``: surge a standby on the
   new template, a planned switchover to it through the agent's ``POST /switchover``,
   retire old pods once nothing routes to them); the groups after it wait, so a bad
   template stops after one group (Progressing=False, RolloutStalled);
5. serving labels from the agents' truth: ``"true"`` on each group's primary,
   ``"false"`` on the others, one patch per pod that needs a change, all the
   ``"true"`` patches before any ``"false"`` one, so a group with a live primary
   always has a serving pod. A group whose agent did not answer keeps its labels
   (the node's rank 0 writes the label itself at a failover);
6. status (groups, counts, selector for the scale subresource, conditions), written
   only when it changed; an Event for every condition change and every failover
   seen (the agent's primary of a group changed).

Everything the operator writes is owned by the EngineSet (controller reference), so
deleting it removes pods, claims and the Service through garbage collection; the
WeightCache is never touched. Nothing is remembered between passes that is not in
the API, except the time each primary was last seen (for the failover duration).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from ... import owned_status
from ...api.v1alpha1.engineset_types import EngineSetSpec, check_gpu_resources, parse_engineset
from ...api.v1alpha1.weightcache_types import CacheSpec, SpecError, parse_spec, plain
from ...conditions import DEGRADED, PROGRESSING, READY, Desired, holds, merge, now_rfc3339
from ...kube import merge_patch_for
from ...owned_status import carried_status, publish_status
from ...reconciler import ObjectReconciler
from ..weightcache.agents import AgentStatusError, ask_agents
from ..weightcache.control import SwitchoverError, control_token, post_switchover, status_token
from ..weightcache.manifests import model_dir
from ..weightcache.manifests import selector_labels as agent_selector_labels
from ..weightcache.rollup import node_replicas
from ..weightcache.transition import holds_for_memory, model_of
from .leases import PodRef, pod_roles, primaries, unnamed_leases
from .manifests import (
    ANNOTATION_MODEL,
    LABEL_ENGINESET,
    LABEL_GROUP,
    LABEL_SERVING,
    LABEL_TEMPLATE_HASH,
    claim_name,
    lease_group,
    model_label,
    placement_of,
    pod_name,
    render_claim,
    render_pod,
    render_service,
    selector_labels,
    selector_string,
    template_hash,
)
from .placement import Placement, Replica, orphaned, place
from .rollout import EnginePod, Step, Target, plan_group

STATUS_KEYS = (
    "observedGeneration", "replicas", "readyGroups", "servingGroups", "standbys", "selector",
    "rollout", "groups", "conditions",
)
MAX_GROUP_ENTRIES = 64
MAX_REASONS = 4  # groups named in the Ready condition's message; the rest counted
# `kubectl annotate engineset NAME weightcache.io/switchover-to=POD`: a planned switchover on request.
ANNOTATION_SWITCHOVER = "weightcache.io/switchover-to"

# A pod in one of these states will not become ready by waiting: a rollout stops on it.
FAILING_REASONS = ("CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                   "CreateContainerConfigError", "CreateContainerError", "RunContainerError")
RESTARTS_FAILED = 3


class Rejected(Exception):
    """The API server refused to create an object as rendered (message says which and why)."""


def _api_message(e: ApiException) -> str:
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)[:512]
    except (ValueError, AttributeError):
        return str(e.reason)


def pod_failure(pod: Mapping[str, Any]) -> str | None:
    """Why a pod cannot become ready (failed, crash-looping, image or config errors), or None."""
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return f"pod Failed: {status.get('reason') or status.get('message') or 'its container exited'}"
    for c in status.get("containerStatuses") or []:
        waiting = ((c.get("state") or {}).get("waiting") or {})
        if waiting.get("reason") in FAILING_REASONS:
            return f"container {c.get('name')}: {waiting['reason']}: {waiting.get('message') or ''}".strip(": ")
        if (c.get("restartCount") or 0) >= RESTARTS_FAILED:
            return f"container {c.get('name')} restarted {c['restartCount']} times"
    return None


def why_not_serving(view: "CacheView", p: Placement, gp: "GroupPods", serving_pod: Mapping[str, Any] | None) -> str:
    """Why a placed group does not serve, in the words a platform engineer acts on: the agent, the pods,
    the attaches (what the node's agent holds for them), the promotion, readiness."""
    node = p.node
    if node in view.unreachable:
        return f"the agent on {node} does not answer ({view.unreachable[node]})"
    if not gp.live:
        return "no engine pod yet"
    for pod in gp.live.values():
        if (failure := pod_failure(pod)) is not None:
            return f"pod {_meta(pod).get('name')}: {failure}"
    roles = view.roles.get(node, {})
    attached = sorted(name for x in gp.live.values() if (name := _meta(x).get("name")) in roles)
    if not attached:
        if view.unnamed.get(node):
            return (f"the agent on {node} holds {view.unnamed[node]} lease(s) but names the engines holding them only "
                    "to its control token, and this operator's control key is missing or not the agents' "
                    "(install with the chart, or set WEIGHTCACHE_CONTROL_KEY_FILE)")
        misses = view.misses.get(node, 0)
        if misses:
            return (f"no engine attached to the agent on {node}, which has refused {misses} attach(es) since it "
                    "started (another fingerprint or a failed load: the engines' logs name the fields)")
        return f"no engine attached to the agent on {node} yet (starting, or not reaching its socket)"
    if serving_pod is None:
        return f"waiting for promotion: {', '.join(attached)} attached as standby, none as primary"
    name = _meta(serving_pod).get("name")
    if not pod_ready(serving_pod):
        return f"primary {name} is not Ready yet"
    return f"primary {name} is not labelled serving yet"


def pod_age(pod: Mapping[str, Any], now: datetime.datetime) -> float:
    created = _meta(pod).get("creationTimestamp")
    try:
        return (now - datetime.datetime.fromisoformat(str(created).replace("Z", "+00:00"))).total_seconds()
    except ValueError:
        return 0.0  # unknown: never "too old"


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def controlled_by(obj: Mapping[str, Any], owner_uid: str | None) -> bool:
    for ref in _meta(obj).get("ownerReferences") or []:
        if ref.get("controller"):
            return owner_uid is not None and ref.get("uid") == owner_uid
    return False


def pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _slot_of(pod_name_: str, name: str, group: int) -> int | None:
    prefix = f"{name}-{group}-"
    rest = pod_name_[len(prefix):] if pod_name_.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


@dataclasses.dataclass
class GroupPods:
    """The live pods of one group by slot (terminating ones apart: their names are still taken)."""

    live: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    terminating: set[int] = dataclasses.field(default_factory=set)


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


# An agent's /status is refreshed by its supervisor every 0.5 s: a read this long after the pod
# list reflects every promotion whose serving label the list shows.
AGENT_SNAPSHOT_AGE_S = 1.0


@dataclasses.dataclass
class CacheView:
    """What the reconcile knows about the WeightCache: its spec, Ready condition and agents."""

    spec: CacheSpec
    ready: bool
    ready_message: str
    replicas: list[Replica]
    primaries: dict[str, dict[str, PodRef]]  # node -> lease group -> primary
    unreachable: dict[str, str]  # node -> why its agent did not answer
    agent_nodes: set[str]  # nodes with an agent pod of the cache (answering or not)
    roles: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)  # node -> pod name -> role
    agent_urls: dict[str, str] = dataclasses.field(default_factory=dict)  # node -> http://ip:port
    # Nodes whose agent runs the cache's current model and revision and has it loaded: a group
    # is rolled onto a new model only there (its new pods could not attach anywhere else).
    current: set[str] = dataclasses.field(default_factory=set)
    # The cache holds a model change until its nodes have room for a second copy: standbys stop meanwhile.
    memory_hold: bool = False
    # node -> attaches its agent refused since it started (another fingerprint, a failed load)
    misses: dict[str, int] = dataclasses.field(default_factory=dict)
    # node -> leases its agent named no engine of (it shows who holds them only to its control token)
    unnamed: dict[str, int] = dataclasses.field(default_factory=dict)


class EngineSetReconciler(ObjectReconciler):
    """One instance per operator run; shares the API client with the WeightCache reconciler."""

    # --- reading ------------------------------------------------------------------------

    def _read_cache(self, namespace: str, es: EngineSetSpec) -> tuple[CacheSpec, bool, str, bool]:
        assert self.api is not None
        cache = self.api.get_cache(namespace, es.cache_name)
        if cache is None:
            raise SpecError("CacheNotFound", f"spec.cacheRef: WeightCache {namespace}/{es.cache_name} does not exist")
        try:
            cs = parse_spec(plain(cache.get("spec") or {}))
        except SpecError as e:
            raise SpecError("CacheInvalid", f"spec.cacheRef: WeightCache {es.cache_name} is invalid: {e.message}") from None
        check_gpu_resources(es, cs.tensor)
        if es.mode == "dra" and self.api.get_device_class(es.device_class) is None:
            raise SpecError("UnknownDeviceClass",
                            f"spec.gpuBinding.deviceClassName: DeviceClass {es.device_class} does not exist "
                            "(install the GPU's DRA driver, or use gpuBinding.mode visibleDevices)")
        conditions = {c.get("type"): c for c in (cache.get("status") or {}).get("conditions") or []}
        ready, degraded = conditions.get("Ready") or {}, conditions.get("Degraded") or {}
        message = str(ready.get("message") or "no Ready condition yet")
        if ready.get("status") != "True" and degraded.get("status") == "True" and degraded.get("message"):
            # The cause the agents reported to the cache, so that the EngineSet waiting on it says why.
            message += f"; {degraded.get('reason') or 'Degraded'}: {degraded['message']}"
        return cs, ready.get("status") == "True", message, holds_for_memory(cache)

    async def _cache_view(self, namespace: str, es: EngineSetSpec) -> CacheView:
        assert self.api is not None
        cs, ready, message, memory_hold = await asyncio.to_thread(self._read_cache, namespace, es)
        raw, agents, answers = await ask_agents(self.api, namespace, agent_selector_labels(es.cache_name),
                                                self.config.agent_http_timeout,
                                                status_token(self.config.control_key, namespace, es.cache_name))
        replicas: list[Replica] = []
        prim: dict[str, dict[str, PodRef]] = {}
        roles: dict[str, dict[str, str]] = {}
        urls: dict[str, str] = {}
        unreachable: dict[str, str] = {}
        misses: dict[str, int] = {}
        unnamed: dict[str, int] = {}
        current: set[str] = set()
        raw_by_name = {_meta(x).get("name"): x for x in raw}
        for agent in agents:
            if agent.node is None:
                continue
            doc = answers.get(agent.name)
            if not isinstance(doc, dict):
                unreachable[agent.node] = str(doc) if isinstance(doc, AgentStatusError) else f"agent pod is {agent.phase}"
                continue
            prim[agent.node] = primaries(doc)
            roles[agent.node] = pod_roles(doc)
            unnamed[agent.node] = unnamed_leases(doc)
            misses[agent.node] = sum(r["misses"] for r in doc.get("ranks") or []
                                     if isinstance(r, Mapping) and isinstance(r.get("misses"), int))
            if agent.url:
                urls[agent.node] = agent.url.rsplit("/status", 1)[0]
            if doc.get("phase") == "Ready" and \
                    model_of((raw_by_name.get(agent.name) or {}).get("spec") or {}) == (model_dir(cs), cs.revision):
                current.add(agent.node)
            if doc.get("phase") != "Ready" and not isinstance(doc.get("replicas"), list):
                continue
            for r in node_replicas(doc, cs.tensor) or []:
                if r["phase"] == "Ready" and len(r["gpus"]) == cs.tensor:
                    replicas.append(Replica(agent.node, r["index"], tuple(r["gpus"])))
        return CacheView(cs, ready, message, replicas, prim, unreachable,
                         {a.node for a in agents if a.node is not None}, roles, urls, current, memory_hold, misses,
                         unnamed)

    async def _still_not_primary(self, namespace: str, es: EngineSetSpec,
                                 pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Of `pods` (labelled serving, not the primary the agents reported), those a fresh read of
        the agents still does not hold as primary.

        An agent's ``/status`` is a snapshot its supervisor refreshes every half second, so the
        view this reconcile started from can predate a promotion whose serving label is already
        in the pod list (the agent writes it right after promoting): taking that label away
        would leave the group without a serving endpoint until the next poll. So the agents are
        read again once any snapshot taken before the pod list has been replaced; a pod on a node
        whose agent does not answer keeps its label.
        """
        await asyncio.sleep(AGENT_SNAPSHOT_AGE_S)
        fresh = await self._cache_view(namespace, es)
        out = []
        for pod in pods:
            m, node = _meta(pod), (pod.get("spec") or {}).get("nodeName") or ""
            if node in fresh.unreachable or node not in fresh.primaries:
                continue
            if any(ref.name == m.get("name") and (ref.uid is None or ref.uid == m.get("uid"))
                   for ref in fresh.primaries[node].values()):
                continue
            out.append(pod)
        return out

    def _owned(self, kind: str, namespace: str, name: str, uid: str | None) -> list[dict[str, Any]]:
        assert self.api is not None
        try:
            items = self.api.list(kind, namespace, selector_labels(name))
        except ApiException as e:
            if kind == "ResourceClaim" and e.status == 404:
                return []  # no resource.k8s.io/v1 on this cluster: nothing of ours can exist
            raise
        # Repeat the label filter (servers that ignore selectors) and keep only what we control.
        return [o for o in items
                if (_meta(o).get("labels") or {}).get(LABEL_ENGINESET) == name and controlled_by(o, uid)]

    # --- writing ------------------------------------------------------------------------

    def _create(self, obj: dict[str, Any], owner: kopf.Body) -> dict[str, Any] | None:
        """Create an owned object; None when the name is taken (by a previous pass or by someone else).

        A refusal that says the object itself is wrong or not allowed (400, 403, 422:
        an invalid template, a quota, a Pod Security level) is the user's input, not a
        transient failure: it becomes ``Rejected`` for a condition, never a retry storm.
        """
        assert self.api is not None
        kopf.append_owner_reference(obj, owner=owner)
        try:
            return self.api.create(obj)
        except ApiException as e:
            if e.status == 409:
                return None
            if e.status in (400, 403, 422):
                raise Rejected(f"{obj['kind']} {obj['metadata']['name']}: {_api_message(e)}") from None
            raise

    def _ensure_service(self, desired: dict[str, Any], owner: kopf.Body, uid: str | None) -> str:
        assert self.api is not None
        ns, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
        current = self.api.get("Service", ns, name)
        if current is None:
            return "created" if self._create(desired, owner) is not None else "conflict"
        if not controlled_by(current, uid):
            return "conflict"
        spec = current.get("spec") or {}
        want = {"selector": desired["spec"]["selector"], "ports": desired["spec"]["ports"]}
        have = {"selector": spec.get("selector"),
                "ports": [{k: p.get(k) for k in ("name", "port", "targetPort", "protocol")} for p in spec.get("ports") or []]}
        if have == want:
            return "unchanged"
        patch: dict[str, Any] = {"spec": merge_patch_for(have, want)}
        if _meta(current).get("resourceVersion"):
            patch["metadata"] = {"resourceVersion": _meta(current)["resourceVersion"]}
        self.api.patch("Service", ns, name, patch)
        return "patched"

    def _set_serving(self, pod: Mapping[str, Any], value: str) -> None:
        assert self.api is not None
        meta = _meta(pod)
        patch: dict[str, Any] = {"metadata": {"labels": {LABEL_SERVING: value}}}
        if meta.get("uid"):
            patch["metadata"]["uid"] = meta["uid"]  # precondition: never a replacement of that name
        self.api.patch("Pod", meta["namespace"], meta["name"], patch)

    # --- the reconcile ------------------------------------------------------------------

    async def _reconcile(self, body: kopf.Body, memo: kopf.Memo, logger: Any) -> None:
        assert self.api is not None  # reconcile() waits for the login
        meta = body.get("metadata") or {}
        namespace, name = meta["namespace"], meta["name"]
        uid, generation = meta.get("uid"), meta.get("generation")
        old_status, new_status = carried_status(body, memo, STATUS_KEYS)
        new_status["selector"] = selector_string(name)

        try:
            es = parse_engineset(name, plain(body.get("spec") or {}))
            view = await self._cache_view(namespace, es)
        except SpecError as e:
            if not holds(old_status.get("conditions"), DEGRADED, "True", e.reason):  # once, not every poll
                logger.warning(f"not reconciling, pods left unchanged: {e.message}")
            desired = problem_conditions(e.reason, e.message)
        else:
            desired = await self._converge(body, memo, logger, namespace, name, uid, es, view, old_status, new_status)

        for key in ("replicas", "readyGroups", "servingGroups", "standbys"):  # printer columns: 0, never blank
            new_status.setdefault(key, 0)
        new_status["conditions"] = merge(old_status.get("conditions"), desired, generation)
        await publish_status(body, memo, logger, old_status, new_status, STATUS_KEYS,
                             status_patch(old_status, new_status), self.api.patch_engineset_status)

    async def _converge(
        self, body: kopf.Body, memo: kopf.Memo, logger: Any, namespace: str, name: str, uid: str | None,
        es: EngineSetSpec, view: CacheView, old_status: Mapping[str, Any], new_status: dict[str, Any],
    ) -> list[Desired]:
        assert self.api is not None
        api = self.api
        pods = await asyncio.to_thread(self._owned, "Pod", namespace, name, uid)
        claims = await asyncio.to_thread(self._owned, "ResourceClaim", namespace, name, uid) if es.mode == "dra" else []

        def note(action: str, kind: str, obj_name: str, why: str = "") -> None:
            message = f"{action} {kind} {obj_name}" + (f": {why}" if why else "")
            logger.info(message)
            kopf.event(body, type="Normal", reason=f"{kind}{action.capitalize()}", message=message[:1024])

        # What exists, by group.
        by_group: dict[int, GroupPods] = {}
        for pod in pods:
            try:
                group = int((_meta(pod).get("labels") or {}).get(LABEL_GROUP, ""))
            except ValueError:
                continue
            slot = _slot_of(_meta(pod).get("name", ""), name, group)
            if slot is None:
                continue
            gp = by_group.setdefault(group, GroupPods())
            if _meta(pod).get("deletionTimestamp"):
                gp.terminating.add(slot)
            else:
                gp.live[slot] = pod
        claim_by_group: dict[int, dict[str, Any]] = {}
        # A claim being deleted still holds its name (and, while pods use it, its devices):
        # its group waits for it to go before anything is created for it again.
        waiting: set[int] = set()
        for claim in claims:
            try:
                group = int((_meta(claim).get("labels") or {}).get(LABEL_GROUP, ""))
            except ValueError:
                continue
            if _meta(claim).get("deletionTimestamp"):
                waiting.add(group)
            else:
                claim_by_group[group] = claim

        existing: dict[int, Placement] = {}
        for group in set(by_group) | set(claim_by_group):
            sources = ([claim_by_group[group]] if group in claim_by_group else []) + list(by_group.get(group, GroupPods()).live.values())
            for obj in sources:
                # A placement of another size than the cache's tp (its parallelism changed) is void.
                if (p := placement_of(obj, group)) is not None and len(p.gpus) == view.spec.tensor:
                    existing[group] = p
                    break
        running = {g for g, gp in by_group.items()
                   if any((x.get("status") or {}).get("phase") == "Running" for x in gp.live.values())}
        for group in orphaned(existing, view.agent_nodes, running):
            logger.info(f"group {group}: node {existing[group].node} has no agent and no running pod; placing it again")
            del existing[group]
        placed, unplaced = place(es.replicas, existing, view.replicas)

        # Groups no longer wanted, and groups whose recorded placement lost (overlap): remove.
        for group in sorted(set(by_group) | set(claim_by_group)):
            if group in placed and existing.get(group) == placed[group]:
                continue
            gp = by_group.get(group, GroupPods())
            if not gp.live and group not in claim_by_group:
                continue  # only terminating pods: nothing to remove, and nothing stands in the way
            for slot, pod in sorted(gp.live.items()):
                if await asyncio.to_thread(api.delete, "Pod", namespace, _meta(pod)["name"], _meta(pod).get("uid")):
                    note("deleted", "Pod", _meta(pod)["name"], f"group {group} is not wanted or moved")
                gp.terminating.add(slot)
            gp.live.clear()
            if group in claim_by_group:
                claim = claim_by_group.pop(group)
                if await asyncio.to_thread(api.delete, "ResourceClaim", namespace, _meta(claim)["name"], _meta(claim).get("uid")):
                    note("deleted", "ResourceClaim", _meta(claim)["name"])
            waiting.add(group)

        if (wanted := (_meta(body).get("annotations") or {}).get(ANNOTATION_SWITCHOVER)) is not None:
            await self._manual_switchover(body, es, view, namespace, name, str(wanted), by_group, placed, logger)

        thash = template_hash(es, view.spec, self.config)
        # One group at a time is rolled to a new template (the first with an outdated pod),
        # so a bad template stops after it while the other groups keep their old primaries.
        rolling = next((g for g in sorted(placed) if g not in waiting and any(
            (_meta(x).get("labels") or {}).get(LABEL_TEMPLATE_HASH) != thash
            for x in by_group.get(g, GroupPods()).live.values())), None)
        step: Step | None = None
        serving_true: list[dict[str, Any]] = []
        serving_false: list[dict[str, Any]] = []
        seen = memo.setdefault("primary_seen", {})
        old_groups = {g.get("index"): g for g in old_status.get("groups") or [] if isinstance(g, Mapping)}
        groups_status: list[dict[str, Any]] = []
        conflicts: list[str] = []
        rejected: list[str] = []
        now_mono = time.monotonic()
        counts = {"replicas": 0, "ready": 0, "serving": 0, "standbys": 0, "pods": 0, "updated": 0}

        not_serving: dict[int, str] = {}  # group -> why it does not serve, for the Ready condition
        for group, p in placed.items():
            gp = by_group.setdefault(group, GroupPods())
            if group in waiting:
                # Its old objects are going away (scaled down and up, moved): a later pass creates anew.
                groups_status.append({"index": group, "phase": "Starting", "node": p.node, "gpus": list(p.gpus)})
                not_serving[group] = "waiting for its previous pods and claim to go"
                continue
            if es.mode == "dra" and group not in claim_by_group:
                try:
                    created = await asyncio.to_thread(self._create, render_claim(es, namespace, name, p), body)
                except Rejected as e:
                    rejected.append(str(e))
                    created = None
                if created is not None:
                    note("created", "ResourceClaim", claim_name(name, group), f"{p.node} {','.join(p.gpus)}")
                    claim_by_group[group] = created
            # Failed or finished pods are replaced; a stale placement means the pod goes too.
            for slot, pod in sorted(gp.live.items()):
                phase = (pod.get("status") or {}).get("phase")
                wrong_place = placement_of(pod, group) not in (None, p)
                if group == rolling and not wrong_place and \
                        (_meta(pod).get("labels") or {}).get(LABEL_TEMPLATE_HASH) == thash:
                    continue  # a failed pod of the new template stops the rollout; it stays to be looked at
                if phase in ("Failed", "Succeeded") or wrong_place:
                    if await asyncio.to_thread(api.delete, "Pod", namespace, _meta(pod)["name"], _meta(pod).get("uid")):
                        note("deleted", "Pod", _meta(pod)["name"], f"pod {phase}" if not wrong_place else "placement changed")
                    del gp.live[slot]
                    gp.terminating.add(slot)
            if group == rolling and view.memory_hold:
                step = Step("wait", group, reason=f"the WeightCache holds {model_label(view.spec)} until every node has "
                            "room for a second copy (its Degraded condition says which); standbys are stopped meanwhile")
            elif group == rolling and p.node not in view.current:
                step = Step("wait", group, reason=f"waiting for the agent on {p.node} to load {model_label(view.spec)}")
            elif group == rolling:
                step = await self._roll(body, es, view, namespace, name, p, gp, thash, note, rejected)
            # Missing pods, in the lowest free slots (a rolling group's pods are the planner's).
            # Counted, not slot by slot: after a rollout the pods may sit in any slots.
            # While the cache waits for memory for a new model, no standbys (their memory is what it waits
            # for); and a standby is only started where the agent already serves the cache's model.
            slots = 1 if view.memory_hold else es.slots
            missing = 0 if group == rolling or (gp.live and p.node not in view.current) else \
                slots - len(gp.live) - len(gp.terminating)
            free = [s for s in range(slots + len(gp.live) + len(gp.terminating))
                    if s not in gp.live and s not in gp.terminating][:max(missing, 0)]
            for slot in free:
                pod = render_pod(es, view.spec, self.config, namespace, name, p, slot)
                try:
                    created = await asyncio.to_thread(self._create, pod, body)
                except Rejected as e:
                    rejected.append(str(e))
                    break  # the other slots would be refused for the same reason
                if created is None:
                    conflicts.append(pod_name(name, group, slot))
                    continue
                note("created", "Pod", pod_name(name, group, slot), f"group {group} slot {slot} on {p.node}")
                gp.live[slot] = created

            # Roles: the agent's truth, by pod name and uid.
            ref = view.primaries.get(p.node, {}).get(lease_group(namespace, name, group))
            primary = None
            if ref is not None:
                for pod in gp.live.values():
                    m = _meta(pod)
                    if m.get("name") == ref.name and (ref.uid is None or m.get("uid") in (None, ref.uid)):
                        primary = pod
            labelled = [pod for pod in gp.live.values() if (_meta(pod).get("labels") or {}).get(LABEL_SERVING) == "true"]
            if primary is not None:
                if (_meta(primary).get("labels") or {}).get(LABEL_SERVING) != "true":
                    serving_true.append(primary)
                serving_false += [pod for pod in labelled if pod is not primary]
            # Excess standbys go, highest slot first; never the primary or a pod still routed to.
            excess = 0 if group == rolling and not view.memory_hold else len(gp.live) - slots
            for slot, pod in sorted(gp.live.items(), reverse=True):
                if excess <= 0:
                    break
                if pod is not primary and pod not in labelled:
                    if await asyncio.to_thread(api.delete, "Pod", namespace, _meta(pod)["name"], _meta(pod).get("uid")):
                        note("deleted", "Pod", _meta(pod)["name"], "the cache needs the memory for a new model" if view.memory_hold
                             else f"standbys is {es.standbys}")
                    del gp.live[slot]
                    excess -= 1

            serving_pod = primary if primary is not None else (labelled[0] if labelled else None)
            entry: dict[str, Any] = {"index": group, "node": p.node, "gpus": list(p.gpus)}
            if es.mode == "dra":
                entry["claim"] = claim_name(name, group)
            if serving_pod is not None:
                entry["primary"] = _meta(serving_pod)["name"]
            entry["standbys"] = sorted(_meta(x)["name"] for x in gp.live.values() if x is not serving_pod)[:9]
            old = old_groups.get(group) or {}
            for key in ("lastFailoverTime", "lastFailoverSeconds"):
                if key in old:
                    entry[key] = old[key]
            if ref is not None and primary is not None:
                before = old.get("primary")
                last = seen.get(group)
                if before and before != ref.name:
                    seconds = None
                    if last is not None and last[0] == before:
                        seconds = round(now_mono - last[1], 3)
                    entry["lastFailoverTime"] = now_rfc3339()
                    if seconds is not None:
                        entry["lastFailoverSeconds"] = seconds
                    else:
                        entry.pop("lastFailoverSeconds", None)
                    kopf.event(body, type="Normal", reason="Failover",
                               message=f"group {group} on {p.node}: the agent promoted {ref.name} (was {before})")
                    logger.info(f"group {group}: failover {before} -> {ref.name}")
                seen[group] = (ref.name, now_mono)

            ready_primary = serving_pod is not None and pod_ready(serving_pod)
            if gp.live:
                counts["replicas"] += 1
            counts["ready"] += int(ready_primary)
            served = ready_primary and (serving_pod in serving_true or serving_pod in labelled)
            counts["serving"] += int(served)
            if not served:
                not_serving[group] = why_not_serving(view, p, gp, serving_pod)
            counts["standbys"] += sum(1 for x in gp.live.values() if x is not serving_pod and pod_ready(x))
            updated = sum(1 for x in gp.live.values() if (_meta(x).get("labels") or {}).get(LABEL_TEMPLATE_HASH) == thash)
            counts["pods"] += len(gp.live)
            counts["updated"] += updated
            entry["phase"] = "Serving" if ready_primary else "Starting"
            # The rollout per group: what serves now (hash, model) against status.rollout.templateHash.
            if serving_pod is not None:
                entry["templateHash"] = (_meta(serving_pod).get("labels") or {}).get(LABEL_TEMPLATE_HASH, "")[:64]
                if model := (_meta(serving_pod).get("annotations") or {}).get(ANNOTATION_MODEL):
                    entry["model"] = model[:512]
            entry.update(updatedPods=updated, pods=len(gp.live))
            if group == rolling and step is not None:
                entry["rollout"] = "Stalled" if step.kind == "stalled" else "Progressing"
            else:
                entry["rollout"] = "Updated" if updated == len(gp.live) else "Pending"
            groups_status.append(entry)
        for group in unplaced:
            groups_status.append({"index": group, "phase": "Unplaced"})
            not_serving[group] = "not placed (see Degraded)"

        # The new serving pods first, then the old ones stop: never a gap in a group with a live primary.
        for pod in serving_true:
            await asyncio.to_thread(self._set_serving, pod, "true")
            logger.info(f"serving: {_meta(pod)['name']}")
        if serving_false:
            serving_false = await self._still_not_primary(namespace, es, serving_false)
        for pod in serving_false:
            await asyncio.to_thread(self._set_serving, pod, "false")
            logger.info(f"not serving: {_meta(pod)['name']}")

        service = render_service(es, namespace, name)
        try:
            action = await asyncio.to_thread(self._ensure_service, service, body, uid)
        except Rejected as e:
            rejected.append(str(e))
            action = "rejected"
        if action in ("created", "patched"):
            note(action, "Service", es.service_name)
        elif action == "conflict":
            conflicts.append(f"Service {es.service_name}")

        groups_status.sort(key=lambda g: g["index"])
        new_status.update(
            replicas=counts["replicas"], readyGroups=counts["ready"], servingGroups=counts["serving"],
            standbys=counts["standbys"], groups=groups_status[:MAX_GROUP_ENTRIES],
            rollout=self._rollout_status(thash, counts, rolling, step),
        )
        return self._conditions(es, view, counts, unplaced, conflicts, rejected, placed, not_serving) + [
            self._progressing(rolling, step)]

    @staticmethod
    def _rollout_status(thash: str, counts: Mapping[str, int], rolling: int | None,
                        step: Step | None) -> dict[str, Any]:
        out: dict[str, Any] = {"templateHash": thash, "updatedPods": counts["updated"], "pods": counts["pods"]}
        if rolling is None or step is None:
            out["phase"] = "Complete" if counts["updated"] == counts["pods"] else "Outdated"
        else:
            out.update(phase="Stalled" if step.kind == "stalled" else "Progressing", group=rolling,
                       message=step.reason[:1024] or step.kind)
        return out

    @staticmethod
    def _progressing(rolling: int | None, step: Step | None) -> Desired:
        if rolling is None or step is None:
            return Desired(PROGRESSING, "True", "RolloutComplete", "every group runs the current template")
        if step.kind == "stalled":
            return Desired(PROGRESSING, "False", "RolloutStalled",
                           f"group {rolling}: {step.reason}; the other groups keep their old primaries")
        return Desired(PROGRESSING, "True", "RolloutInProgress", f"group {rolling}: {step.reason or step.kind}")

    async def _roll(self, body: kopf.Body, es: EngineSetSpec, view: CacheView, namespace: str, name: str,
                    p: Placement, gp: "GroupPods", thash: str, note: Any, rejected: list[str]) -> Step:
        """Take the rollout planner's next step for one group (see ``rollout``)."""
        assert self.api is not None
        roles = view.roles.get(p.node, {})
        now = datetime.datetime.now(datetime.timezone.utc)
        pods = [EnginePod(_meta(x)["name"], slot, (_meta(x).get("labels") or {}).get(LABEL_TEMPLATE_HASH, ""), "",
                          role=roles.get(_meta(x)["name"]), ready=pod_ready(x),
                          serving=(_meta(x).get("labels") or {}).get(LABEL_SERVING) == "true",
                          failed=pod_failure(x), age=pod_age(x, now))
                for slot, x in sorted(gp.live.items())]
        step = plan_group(p.group, pods, Target(thash, ""), es.standbys, es.progress_deadline)
        if step.kind == "create":
            assert step.slot is not None
            pod = render_pod(es, view.spec, self.config, namespace, name, p, step.slot, role=step.role)
            try:
                created = await asyncio.to_thread(self._create, pod, body)
            except Rejected as e:
                rejected.append(str(e))
                return step
            if created is not None:
                note("created", "Pod", pod_name(name, p.group, step.slot), f"rollout of group {p.group}: {step.reason}")
                gp.live[step.slot] = created
        elif step.kind == "switchover":
            assert step.pod is not None
            url, key = view.agent_urls.get(p.node), self.config.control_key
            if key is None:
                return dataclasses.replace(step, kind="stalled", reason=(
                    "the operator has no control key, so it cannot ask agents for a switchover "
                    "(install with the chart, or set WEIGHTCACHE_CONTROL_KEY_FILE)"))
            if url is None:
                return dataclasses.replace(step, kind="wait", reason=f"the agent on {p.node} does not answer")
            try:
                reply = await asyncio.to_thread(post_switchover, url, control_token(key, namespace, es.cache_name),
                                                lease_group(namespace, name, p.group), step.pod,
                                                self.config.agent_http_timeout)
            except SwitchoverError as e:
                return dataclasses.replace(step, kind="wait", reason=f"switchover to {step.pod}: {e}")
            kopf.event(body, type="Normal", reason="Switched",
                       message=f"group {p.group}: {step.pod} is primary (planned switchover in "
                               f"{float(reply.get('seconds') or 0) * 1e3:.1f} ms)")
        elif step.kind == "retire":
            for slot, x in list(gp.live.items()):
                if _meta(x)["name"] == step.pod:
                    if await asyncio.to_thread(self.api.delete, "Pod", namespace, step.pod, _meta(x).get("uid")):
                        note("deleted", "Pod", step.pod, f"rollout of group {p.group}: {step.reason}")
                    del gp.live[slot]
                    gp.terminating.add(slot)
        return step

    async def _manual_switchover(self, body: kopf.Body, es: EngineSetSpec, view: CacheView, namespace: str,
                                 name: str, to_pod: str, by_group: Mapping[int, "GroupPods"],
                                 placed: Mapping[int, Placement], logger: Any) -> None:
        """`kubectl annotate engineset NAME weightcache.io/switchover-to=POD`: make a warm standby primary.

        A one-shot request: done or refused, the annotation is removed and an Event says which
        (a refused one names why); while the agent cannot be reached it stays for the next pass.
        """
        assert self.api is not None
        group = next((g for g, gp in by_group.items()
                      if any(_meta(x).get("name") == to_pod for x in gp.live.values())), None)
        p = placed.get(group) if group is not None else None
        why = ""
        if p is None:
            why = f"{to_pod} is not a live engine pod of EngineSet {name}"
        elif view.roles.get(p.node, {}).get(to_pod) == "primary":
            why = f"{to_pod} is already the primary of group {group}"
        elif view.roles.get(p.node, {}).get(to_pod) != "standby":
            why = f"{to_pod} is not attached as a standby (the agent on {p.node} reports " \
                  f"{view.roles.get(p.node, {}).get(to_pod) or 'nothing'} for it)"
        elif self.config.control_key is None:
            why = "the operator has no control key (install with the chart, or set WEIGHTCACHE_CONTROL_KEY_FILE)"
        elif (url := view.agent_urls.get(p.node)) is None:
            logger.info(f"switchover to {to_pod}: the agent on {p.node} does not answer; retrying")
            return
        else:
            try:
                reply = await asyncio.to_thread(
                    post_switchover, url, control_token(self.config.control_key, namespace, es.cache_name),
                    lease_group(namespace, name, p.group), to_pod, self.config.agent_http_timeout)
            except SwitchoverError as e:
                why = str(e)
            else:
                kopf.event(body, type="Normal", reason="Switched",
                           message=f"group {p.group}: {to_pod} is primary (requested by annotation; planned "
                                   f"switchover in {float(reply.get('seconds') or 0) * 1e3:.1f} ms)")
                logger.info(f"group {p.group}: switchover to {to_pod} as requested")
        if why:
            kopf.event(body, type="Warning", reason="SwitchoverRefused", message=f"switchover to {to_pod}: {why}"[:1024])
            logger.warning(f"switchover to {to_pod} refused: {why}")
        with contextlib.suppress(ApiException):  # a newer request in between stays for the next pass
            await asyncio.to_thread(self.api.remove_engineset_annotation, namespace, name, ANNOTATION_SWITCHOVER,
                                    _meta(body).get("resourceVersion"))

    @staticmethod
    def _conditions(es: EngineSetSpec, view: CacheView, counts: Mapping[str, int], unplaced: list[int],
                    conflicts: list[str], rejected: list[str], placed: Mapping[int, Placement],
                    not_serving: Mapping[int, str]) -> list[Desired]:
        wanted, serving = es.replicas, counts["serving"]
        if wanted == 0:
            ready = Desired(READY, "True", "ScaledToZero", "replicas is 0")
        elif serving >= wanted:
            ready = Desired(READY, "True", "AllGroupsServing", f"{serving}/{wanted} groups serving")
        else:
            whys = [f"group {g}: {why}" for g, why in sorted(not_serving.items())]
            more = f"; and {len(whys) - MAX_REASONS} more" if len(whys) > MAX_REASONS else ""
            ready = Desired(READY, "False", "GroupsNotServing",
                            f"{serving}/{wanted} groups serving; " + "; ".join(whys[:MAX_REASONS]) + more)
        unreachable = sorted({p.node for p in placed.values() if p.node in view.unreachable})
        if rejected:
            degraded = Desired(DEGRADED, "True", "Rejected",
                               "the API server refused " + "; ".join(rejected[:3]))
        elif conflicts:
            degraded = Desired(DEGRADED, "True", "OwnershipConflict",
                               f"{', '.join(conflicts[:3])} already exist(s) and are not controlled by this EngineSet; "
                               "rename or delete them")
        elif unplaced and not view.ready:
            degraded = Desired(DEGRADED, "True", "CacheNotReady",
                               f"{len(unplaced)} group(s) not placed: WeightCache {es.cache_name} is not Ready "
                               f"({view.ready_message})")
        elif unplaced:
            degraded = Desired(DEGRADED, "True", "NoFreeReplica",
                               f"{len(unplaced)} group(s) not placed: every Ready replica of WeightCache "
                               f"{es.cache_name} ({len(view.replicas)}) holds a group; add nodes or lower replicas")
        elif unreachable:
            degraded = Desired(DEGRADED, "True", "AgentUnreachable",
                               "agents not answering on " + ", ".join(
                                   f"{n} ({view.unreachable[n]})" for n in unreachable[:3]))
        else:
            degraded = Desired(DEGRADED, "False", "AsExpected", "every group is placed")
        return [ready, degraded]
