"""The EngineSet reconcile: engine pods on a cache's GPUs, and serving labels that follow the agents.

Runs on the same triggers as the WeightCache reconcile (create, resume, spec change
including ``kubectl scale``, and a timer), on the same registry (``registry``
registers it), and, like it, does not care why it runs. One pass is a sequence of
named steps, each a method of ``EngineSetReconciler`` that works on the pass's
``EngineSetScope`` and returns early when it has nothing to do; the decisions are
pure functions in the sibling modules, the steps only read and write the API:

1. parse the spec (``api.v1alpha1.engineset_types``) and read the cache
   (``cache_view``): the WeightCache it names, checked against the template (and, mode
   dra, the DeviceClass), and each agent's ``/status``: the Ready replicas per node,
   and per lease group the pod the agent holds as primary. Any problem: Ready=False,
   Degraded=True with the reason, an Event, nothing touched, no exception (no retry
   storm; other EngineSets go on);
2. ``_take_inventory``: this EngineSet's pods and claims (label
   ``weightcache.io/engineset`` and controller owner reference) by group
   (``inventory``);
3. ``_place_groups``: existing groups stay where their objects say, new ones spread
   (``placement``); ``_remove_groups`` clears away groups no longer wanted or moved;
4. ``_switchover_on_request``: the ``weightcache.io/switchover-to`` annotation
   (``switchover``);
5. ``_ensure_group`` per placed group (``groups``): the claim, failed and misplaced
   pods replaced, missing pods created in the lowest free slots (a deleted pod is
   replaced by the next pass; pods are counted, so after a rollout they may sit in any
   slots), excess standbys deleted highest slot first, never a group's serving pod. The
   first group with a pod of an older template is rolled instead, one step per pass
   (``_roll``, ``rollout.plan_group``: surge a standby on the new template, a planned
   switchover to it through the agent's ``POST /switchover``, retire old pods once
   nothing routes to them); the groups after it wait, so a bad template stops after one
   group (Progressing=False, RolloutStalled);
6. ``_ensure_serving_labels``: from the agents' truth, ``"true"`` on each group's
   primary, ``"false"`` on the others, one patch per pod that needs a change, all the
   ``"true"`` patches before any ``"false"`` one, so a group with a live primary always
   has a serving pod. A group whose agent did not answer keeps its labels (the node's
   rank 0 writes the label itself at a failover);
7. ``_ensure_engine_service``: create or patch the Service (``owned``);
   ``_clean_compile_caches``: the nodes of its compile caches recorded, and the keys an
   image or model change left behind removed once no pod uses them
   (``compile_cache_cleanup``);
8. status (groups, counts, selector for the scale subresource, conditions;
   ``status``), written only when it changed; an Event for every condition change and
   every failover seen (the agent's primary of a group changed).

Everything the operator writes is owned by the EngineSet (controller reference), so
deleting it removes pods, claims and the Service through garbage collection (its compile
caches on the nodes: the deletion handler, ``compile_cache_cleanup``); the
WeightCache is never touched. Nothing is remembered between passes that is not in
the API, except the time each primary was last seen (for the failover duration).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from ...api.v1alpha1.engineset_types import parse_engineset
from ...api.v1alpha1.weightcache_types import SpecError, plain
from ...conditions import DEGRADED, Desired, holds, merge
from ...config import OperatorConfig
from ...kube import KubeApi
from ...owned_status import carried_status, publish_status
from ...reconciler import ObjectReconciler
from ..weightcache.control import SwitchoverError, control_token, post_switchover
from .cache_view import AGENT_SNAPSHOT_AGE_S, cache_view, still_not_primary
from .compile_cache import compile_cache_dir
from .compile_cache_cleanup import CompileCacheCleanup
from .groups import (
    GroupRoles,
    engine_pods,
    excess_standbys,
    group_roles,
    pods_to_replace,
    slot_budget,
    slots_to_fill,
)
from .inventory import (
    GroupPods,
    Inventory,
    recorded_placements,
    rolling_group,
    running_groups,
    take_inventory,
    unwanted_groups,
)
from .manifests import (
    claim_name,
    lease_group,
    model_label,
    pod_name,
    render_claim,
    render_pod,
    render_service,
    selector_string,
    template_hash,
)
from .owned import Rejected, create_owned, ensure_service, list_owned, set_serving
from .placement import Placement, orphaned, place
from .pods import meta
from .rollout import Step, Target, plan_group
from .scope import EngineSetScope
from .status import (
    STATUS_KEYS,
    conditions,
    fill_status,
    group_entry,
    problem_conditions,
    progressing,
    record_failover,
    status_patch,
    tally_group,
)
from .switchover import ANNOTATION_SWITCHOVER, requested_group, requested_switchover, switchover_refusal


class EngineSetReconciler(ObjectReconciler):
    """One instance per operator run; shares the API client with the WeightCache reconciler."""

    def __init__(self, config: OperatorConfig, api: KubeApi | None = None) -> None:
        super().__init__(config, api)
        self.compile_caches = CompileCacheCleanup(config)

    async def _reconcile(self, body: kopf.Body, memo: kopf.Memo, logger: Any) -> None:
        assert self.api is not None  # reconcile() waits for the login
        m = body.get("metadata") or {}
        namespace, name = m["namespace"], m["name"]
        old_status, new_status = carried_status(body, memo, STATUS_KEYS)
        new_status["selector"] = selector_string(name)

        try:
            es = parse_engineset(name, plain(body.get("spec") or {}))
            view = await cache_view(self.api, self.config, namespace, es)
        except SpecError as e:
            if not holds(old_status.get("conditions"), DEGRADED, "True", e.reason):  # once, not every poll
                logger.warning(f"not reconciling, pods left unchanged: {e.message}")
            desired = problem_conditions(e.reason, e.message)
        else:
            desired = await self._converge(EngineSetScope(body, memo, logger, namespace, name, m.get("uid"), es, view,
                                                          old_status, new_status))

        for key in ("replicas", "readyGroups", "servingGroups", "standbys"):  # printer columns: 0, never blank
            new_status.setdefault(key, 0)
        new_status["conditions"] = merge(old_status.get("conditions"), desired, m.get("generation"))
        await publish_status(body, memo, logger, old_status, new_status, STATUS_KEYS,
                             status_patch(old_status, new_status), self.api.patch_engineset_status)

    async def _converge(self, scope: EngineSetScope) -> list[Desired]:
        """The steps of a pass on a valid EngineSet, in order; returns its conditions."""
        inv = await self._take_inventory(scope)
        existing, placed, unplaced = self._place_groups(scope, inv)
        await self._remove_groups(scope, inv, unwanted_groups(inv, placed, existing))
        if (to_pod := requested_switchover(scope.body)) is not None:
            await self._switchover_on_request(scope, to_pod, inv, placed)

        scope.thash = template_hash(scope.es, scope.view.spec, self.config)
        scope.rolling = rolling_group(placed, inv, scope.thash)
        scope.now_mono = time.monotonic()
        for p in placed.values():
            await self._ensure_group(scope, inv, p)
        for group in unplaced:
            scope.tally.unplaced(group)

        await self._ensure_serving_labels(scope)
        await self._ensure_engine_service(scope)
        await self._clean_compile_caches(scope)
        fill_status(scope.new_status, scope.tally, scope.thash, scope.rolling, scope.step)
        return [*conditions(scope.es, scope.view, scope.tally, unplaced, placed), progressing(scope.rolling, scope.step)]

    # --- what exists, and where it goes -------------------------------------------------

    async def _take_inventory(self, scope: EngineSetScope) -> Inventory:
        assert self.api is not None
        pods = await asyncio.to_thread(list_owned, self.api, "Pod", scope.namespace, scope.name, scope.uid)
        scope.pods = pods
        claims = await asyncio.to_thread(list_owned, self.api, "ResourceClaim", scope.namespace, scope.name,
                                         scope.uid) if scope.es.mode == "dra" else []
        return take_inventory(scope.name, pods, claims)

    @staticmethod
    def _place_groups(scope: EngineSetScope, inv: Inventory,
                      ) -> tuple[dict[int, Placement], dict[int, Placement], list[int]]:
        """(recorded, placed, unplaced): where the groups are, where they go, and which find no replica."""
        existing = recorded_placements(inv, scope.view.spec.tensor)
        for group in orphaned(existing, scope.view.agent_nodes, running_groups(inv)):
            scope.logger.info(f"group {group}: node {existing[group].node} has no agent and no running pod; "
                              "placing it again")
            del existing[group]
        placed, unplaced = place(scope.es.replicas, existing, scope.view.replicas)
        return existing, placed, unplaced

    async def _remove_groups(self, scope: EngineSetScope, inv: Inventory, groups: list[int]) -> None:
        """Delete the pods and claims of groups no longer wanted or moved; they wait until those are gone."""
        assert self.api is not None
        for group in groups:
            gp = inv.group(group)
            for slot, pod in sorted(gp.live.items()):
                await self._delete_pod(scope, pod, f"group {group} is not wanted or moved")
                gp.terminating.add(slot)
            gp.live.clear()
            if group in inv.claims:
                claim = inv.claims.pop(group)
                if await asyncio.to_thread(self.api.delete, "ResourceClaim", scope.namespace, meta(claim)["name"],
                                           meta(claim).get("uid")):
                    scope.note("deleted", "ResourceClaim", meta(claim)["name"])
            inv.waiting.add(group)

    async def _delete_pod(self, scope: EngineSetScope, pod: Mapping[str, Any], why: str) -> None:
        assert self.api is not None
        if await asyncio.to_thread(self.api.delete, "Pod", scope.namespace, meta(pod)["name"], meta(pod).get("uid")):
            scope.note("deleted", "Pod", meta(pod)["name"], why)

    # --- one group ----------------------------------------------------------------------

    async def _ensure_group(self, scope: EngineSetScope, inv: Inventory, p: Placement) -> None:
        """Bring one placed group to its spec (or one rollout step nearer), then report it."""
        gp = inv.pods.setdefault(p.group, GroupPods())
        if p.group in inv.waiting:
            scope.tally.waiting(p.group, p)
            return
        await self._ensure_claim(scope, inv, p)
        await self._replace_pods(scope, p, gp)
        rolling = p.group == scope.rolling
        if rolling:
            scope.step = await self._rollout_step(scope, p, gp)
        slots = slot_budget(scope.view, scope.es.slots)
        await self._ensure_pods(scope, p, gp, slots)
        roles = group_roles(scope.view, p.node, lease_group(scope.namespace, scope.name, p.group), gp)
        to_true, to_false = roles.label_changes()
        scope.serving_true += to_true
        scope.serving_false += to_false
        await self._remove_excess_standbys(scope, gp, slots, roles, keep_all=rolling and not scope.view.memory_hold)
        self._report_group(scope, p, gp, roles)

    async def _ensure_claim(self, scope: EngineSetScope, inv: Inventory, p: Placement) -> None:
        if scope.es.mode != "dra" or p.group in inv.claims:
            return
        assert self.api is not None
        try:
            created = await asyncio.to_thread(create_owned, self.api,
                                              render_claim(scope.es, scope.namespace, scope.name, p), scope.body)
        except Rejected as e:
            scope.tally.rejected.append(str(e))
            return
        if created is None:
            return
        scope.note("created", "ResourceClaim", claim_name(scope.name, p.group), f"{p.node} {','.join(p.gpus)}")
        inv.claims[p.group] = created

    async def _replace_pods(self, scope: EngineSetScope, p: Placement, gp: GroupPods) -> None:
        """Failed or finished pods go (the next step replaces them); a stale placement means the pod goes too."""
        keep = scope.thash if p.group == scope.rolling else None
        for slot, pod, why in pods_to_replace(gp, p.group, p, keep):
            await self._delete_pod(scope, pod, why)
            del gp.live[slot]
            gp.terminating.add(slot)

    async def _ensure_pods(self, scope: EngineSetScope, p: Placement, gp: GroupPods, slots: int) -> None:
        """Create the pods a group lacks (a rolling group's pods are the rollout's)."""
        assert self.api is not None
        for slot in slots_to_fill(gp, slots, p.group == scope.rolling, p.node in scope.view.current):
            pod = render_pod(scope.es, scope.view.spec, self.config, scope.namespace, scope.name, p, slot)
            try:
                created = await asyncio.to_thread(create_owned, self.api, pod, scope.body)
            except Rejected as e:
                scope.tally.rejected.append(str(e))
                return  # the other slots would be refused for the same reason
            if created is None:
                scope.tally.conflicts.append(pod_name(scope.name, p.group, slot))
                continue
            scope.note("created", "Pod", pod_name(scope.name, p.group, slot),
                       f"group {p.group} slot {slot} on {p.node}")
            gp.live[slot] = created

    async def _remove_excess_standbys(self, scope: EngineSetScope, gp: GroupPods, slots: int, roles: GroupRoles,
                                      keep_all: bool) -> None:
        why = ("the cache needs the memory for a new model" if scope.view.memory_hold
               else f"standbys is {scope.es.standbys}")
        for slot, pod in excess_standbys(gp, slots, roles, keep_all):
            await self._delete_pod(scope, pod, why)
            del gp.live[slot]

    @staticmethod
    def _report_group(scope: EngineSetScope, p: Placement, gp: GroupPods, roles: GroupRoles) -> None:
        """The group's status entry and counts; an Event when its agent promoted another pod."""
        old = scope.old_group(p.group)
        entry = group_entry(scope.name, scope.es.mode, p, gp, roles, old)
        if roles.ref is not None and roles.primary is not None:
            seen = scope.memo.setdefault("primary_seen", {})
            before = record_failover(entry, old, roles.ref.name, seen, scope.now_mono)
            if before is not None:
                kopf.event(scope.body, type="Normal", reason="Failover",
                           message=f"group {p.group} on {p.node}: the agent promoted {roles.ref.name} (was {before})")
                scope.logger.info(f"group {p.group}: failover {before} -> {roles.ref.name}")
        step = scope.step if p.group == scope.rolling else None
        tally_group(scope.tally, scope.view, p, gp, roles, entry, scope.serving_true, scope.thash, step)

    # --- the rollout --------------------------------------------------------------------

    async def _rollout_step(self, scope: EngineSetScope, p: Placement, gp: GroupPods) -> Step:
        """The rolling group's step this pass: wait for the cache, or take the planner's next step."""
        view = scope.view
        if view.memory_hold:
            return Step("wait", p.group, reason=f"the WeightCache holds {model_label(view.spec)} until every node has "
                        "room for a second copy (its Degraded condition says which); standbys are stopped meanwhile")
        if p.node not in view.current:
            return Step("wait", p.group, reason=f"waiting for the agent on {p.node} to load {model_label(view.spec)}")
        return await self._roll(scope, p, gp)

    async def _roll(self, scope: EngineSetScope, p: Placement, gp: GroupPods) -> Step:
        """Take the rollout planner's next step for one group (see ``rollout``)."""
        now = datetime.datetime.now(datetime.timezone.utc)
        pods = engine_pods(gp, scope.view.roles.get(p.node, {}), now)
        step = plan_group(p.group, pods, Target(scope.thash, ""), scope.es.standbys, scope.es.progress_deadline)
        if step.kind == "create":
            await self._surge(scope, p, gp, step)
        elif step.kind == "switchover":
            return await self._planned_switchover(scope, p, step)
        elif step.kind == "retire":
            await self._retire(scope, p, gp, step)
        return step

    async def _surge(self, scope: EngineSetScope, p: Placement, gp: GroupPods, step: Step) -> None:
        assert self.api is not None and step.slot is not None
        pod = render_pod(scope.es, scope.view.spec, self.config, scope.namespace, scope.name, p, step.slot,
                         role=step.role)
        try:
            created = await asyncio.to_thread(create_owned, self.api, pod, scope.body)
        except Rejected as e:
            scope.tally.rejected.append(str(e))
            return
        if created is None:
            return
        scope.note("created", "Pod", pod_name(scope.name, p.group, step.slot),
                   f"rollout of group {p.group}: {step.reason}")
        gp.live[step.slot] = created

    async def _planned_switchover(self, scope: EngineSetScope, p: Placement, step: Step) -> Step:
        """Ask the node's agent to make the step's pod primary; the step becomes a wait (or a stall) if it cannot."""
        assert step.pod is not None
        url = scope.view.agent_urls.get(p.node)
        if self.config.control_key is None:
            return dataclasses.replace(step, kind="stalled", reason=(
                "the operator has no control key, so it cannot ask agents for a switchover "
                "(install with the chart, or set WEIGHTCACHE_CONTROL_KEY_FILE)"))
        if url is None:
            return dataclasses.replace(step, kind="wait", reason=f"the agent on {p.node} does not answer")
        try:
            reply = await self._post_switchover(scope, url, p.group, step.pod)
        except SwitchoverError as e:
            return dataclasses.replace(step, kind="wait", reason=f"switchover to {step.pod}: {e}")
        kopf.event(scope.body, type="Normal", reason="Switched",
                   message=f"group {p.group}: {step.pod} is primary (planned switchover in "
                           f"{float(reply.get('seconds') or 0) * 1e3:.1f} ms)")
        return step

    async def _retire(self, scope: EngineSetScope, p: Placement, gp: GroupPods, step: Step) -> None:
        for slot, x in list(gp.live.items()):
            if meta(x)["name"] == step.pod:
                await self._delete_pod(scope, x, f"rollout of group {p.group}: {step.reason}")
                del gp.live[slot]
                gp.terminating.add(slot)

    async def _post_switchover(self, scope: EngineSetScope, url: str, group: int, to_pod: str) -> Mapping[str, Any]:
        assert self.config.control_key is not None
        token = control_token(self.config.control_key, scope.namespace, scope.es.cache_name)
        return await asyncio.to_thread(post_switchover, url, token, lease_group(scope.namespace, scope.name, group),
                                       to_pod, self.config.agent_http_timeout)

    async def _switchover_on_request(self, scope: EngineSetScope, to_pod: str, inv: Inventory,
                                     placed: Mapping[int, Placement]) -> None:
        """`kubectl annotate engineset NAME weightcache.io/switchover-to=POD`: make a warm standby primary.

        A one-shot request: done or refused, the annotation is removed and an Event says which
        (a refused one names why); while the agent cannot be reached it stays for the next pass.
        """
        assert self.api is not None
        group, p = requested_group(inv, placed, to_pod)
        why = switchover_refusal(scope.view, scope.name, to_pod, group, p, self.config.control_key is not None)
        if not why:
            assert p is not None
            if (url := scope.view.agent_urls.get(p.node)) is None:
                scope.logger.info(f"switchover to {to_pod}: the agent on {p.node} does not answer; retrying")
                return
            why = await self._switch_as_requested(scope, url, p, to_pod)
        if why:
            kopf.event(scope.body, type="Warning", reason="SwitchoverRefused",
                       message=f"switchover to {to_pod}: {why}"[:1024])
            scope.logger.warning(f"switchover to {to_pod} refused: {why}")
        with contextlib.suppress(ApiException):  # a newer request in between stays for the next pass
            await asyncio.to_thread(self.api.remove_engineset_annotation, scope.namespace, scope.name,
                                    ANNOTATION_SWITCHOVER, meta(scope.body).get("resourceVersion"))

    async def _switch_as_requested(self, scope: EngineSetScope, url: str, p: Placement, to_pod: str) -> str:
        """Ask the agent for the requested switchover: empty when done, else the agent's refusal."""
        try:
            reply = await self._post_switchover(scope, url, p.group, to_pod)
        except SwitchoverError as e:
            return str(e)
        kopf.event(scope.body, type="Normal", reason="Switched",
                   message=f"group {p.group}: {to_pod} is primary (requested by annotation; planned "
                           f"switchover in {float(reply.get('seconds') or 0) * 1e3:.1f} ms)")
        scope.logger.info(f"group {p.group}: switchover to {to_pod} as requested")
        return ""

    # --- after every group: labels, Service -----------------------------------------------

    async def _ensure_serving_labels(self, scope: EngineSetScope) -> None:
        """The new serving pods first, then the old ones stop: never a gap in a group with a live primary."""
        assert self.api is not None
        for pod in scope.serving_true:
            await asyncio.to_thread(set_serving, self.api, pod, "true")
            scope.logger.info(f"serving: {meta(pod)['name']}")
        if not scope.serving_false:
            return
        for pod in await self._still_not_primary(scope, scope.serving_false):
            await asyncio.to_thread(set_serving, self.api, pod, "false")
            scope.logger.info(f"not serving: {meta(pod)['name']}")

    async def _still_not_primary(self, scope: EngineSetScope, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Of `pods` (labelled serving, not the primary the agents reported), those a fresh read of
        the agents still does not hold as primary.

        An agent's ``/status`` is a snapshot its supervisor refreshes every half second, so the
        view this reconcile started from can predate a promotion whose serving label is already
        in the pod list (the agent writes it right after promoting): taking that label away
        would leave the group without a serving endpoint until the next poll. So the agents are
        read again once any snapshot taken before the pod list has been replaced; a pod on a node
        whose agent does not answer keeps its label.
        """
        assert self.api is not None
        await asyncio.sleep(AGENT_SNAPSHOT_AGE_S)
        return still_not_primary(await cache_view(self.api, self.config, scope.namespace, scope.es), pods)

    async def _ensure_engine_service(self, scope: EngineSetScope) -> None:
        assert self.api is not None
        service = render_service(scope.es, scope.namespace, scope.name)
        try:
            action = await asyncio.to_thread(ensure_service, self.api, service, scope.body, scope.uid)
        except Rejected as e:
            scope.tally.rejected.append(str(e))
            return
        if action in ("created", "patched"):
            scope.note(action, "Service", scope.es.service_name)
        elif action == "conflict":
            scope.tally.conflicts.append(f"Service {scope.es.service_name}")

    async def _clean_compile_caches(self, scope: EngineSetScope) -> None:
        assert self.api is not None
        directory = compile_cache_dir(scope.es, scope.view.spec, self.config, scope.namespace, scope.name)
        await asyncio.to_thread(self.compile_caches.after_pass, self.api, scope.body, scope.pods, directory)
