"""The WeightCache reconcile: one level-based pass per WeightCache, run on every trigger.

Triggers (registered by ``registry``): the object appears (create), the operator
starts and finds it (resume), its spec changes (update), and a timer every
``poll_interval`` seconds. All of them run the same ``Reconciler.reconcile``, which
does not care why it runs:

1. parse the spec (``api.v1alpha1.weightcache_types.parse_spec``); an invalid one
   sets Degraded + an Event and leaves the running agents alone (no exception, so no
   retry storm, and other WeightCaches are not affected);
2. make sure the namespace has the agents' ServiceAccount ``weightcache-agent`` and
   its RoleBinding to the chart's ClusterRole (shared by every WeightCache in the
   namespace: each one adds itself as a non-controller owner, so garbage collection
   removes them with the last cache); then render the DaemonSet (and ConfigMap for
   sharding rules) and create-or-patch them, owned by the WeightCache (controller
   reference; owner-reference garbage collection deletes them with it, so no
   finalizer is needed for cleanup); an unchanged spec hash means no write at all. A
   new model path or revision leaves the DaemonSet as it is while a node lacks the
   memory for a second copy of a rank (``transition``): Degraded, reason
   ``InsufficientMemory``, until every node has room;
3. list the agent pods, ask each for ``/status``, roll the answers up;
4. compute the conditions (a model claim the scheduler finds missing on the agent pods:
   ``ClaimNotFound``), patch the status subresource only if something changed (the
   node counts always present, 0 until known), and post an Event for each condition
   that changed status or reason.

Restarting the operator at any moment converges to the same state: nothing is
remembered between runs that is not in the API (the spec hash lives on the
DaemonSet, the conditions on the WeightCache). How a WeightCache's deletion waits
while an EngineSet uses it: see ``registry``.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from ... import owned_status
from ...api.v1alpha1.weightcache_types import SpecError, parse_spec, plain
from ...conditions import DEGRADED, Desired, holds, merge
from ...kube import merge_patch_for
from ...owned_status import carried_status, publish_status
from ...reconciler import ObjectReconciler
from .agents import ask_agents
from .control import render_control_secret, status_token
from .manifests import (
    ANNOTATION_SPEC_HASH,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    daemonset_name,
    model_dir,
    render_agent_role_binding,
    render_agent_service_account,
    render_daemonset,
    render_sharding_configmap,
    selector_labels,
    socket_dir,
)
from .rollup import (agent_conditions, claim_conditions, daemonset_rollout, integrity_news, node_entry, spec_conditions,
                     summarize)
from .transition import HELD_FOR_MEMORY, daemonset_model, hold_message, memory_shortfalls

ARENA_INTEGRITY = "ArenaIntegrity"  # Event and condition reason: an agent found its arena changed

# Status keys this operator owns (anything else in .status is left alone).
STATUS_KEYS = (
    "observedGeneration", "daemonSet", "model", "socketDir", "desiredNodes", "readyNodes",
    "nodeCounts", "nodesOmitted", "nodes", "conditions",
)


_UNREAD = object()  # `_ensure`: the live object was not read yet


class OwnershipConflict(Exception):
    """A child object with our name exists but is not controlled by this WeightCache."""


def _controlled_by(obj: Mapping[str, Any], owner_uid: str | None) -> bool:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return owner_uid is not None and ref.get("uid") == owner_uid
    return False


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Only the owned status keys that differ; keys we no longer set become null."""
    return owned_status.status_patch(old, new, STATUS_KEYS)


class Reconciler(ObjectReconciler):
    """The WeightCache reconcile; one instance per operator run."""

    # --- children -------------------------------------------------------------------

    def _ensure(self, kind: str, desired: dict[str, Any], owner_uid: str | None,
                current: Any = _UNREAD) -> tuple[dict[str, Any], str]:
        """Create-or-patch one child; returns (live object, "created" | "patched" | "unchanged").

        `current`: the live object (None: absent) when the caller has just read it."""
        assert self.api is not None
        ns, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
        get, create, patch = {
            "DaemonSet": (self.api.get_daemonset, self.api.create_daemonset, self.api.patch_daemonset),
            "ConfigMap": (self.api.get_configmap, self.api.create_configmap, self.api.patch_configmap),
        }[kind]
        if current is _UNREAD:
            current = get(ns, name)
        if current is None:
            try:
                return create(desired), "created"
            except ApiException as e:
                if e.status != 409:
                    raise
                current = get(ns, name)  # created concurrently (another trigger): adopt the patch path
                if current is None:
                    raise
        if not _controlled_by(current, owner_uid):
            raise OwnershipConflict(
                f"{kind} {name} already exists and is not controlled by this WeightCache; "
                "rename or delete it")

        meta = current.get("metadata") or {}
        if kind == "DaemonSet":
            if (meta.get("annotations") or {}).get(ANNOTATION_SPEC_HASH) == desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH]:
                return current, "unchanged"
            body: dict[str, Any] = {
                "metadata": {
                    "labels": desired["metadata"]["labels"],
                    "annotations": desired["metadata"]["annotations"],
                },
                # The selector is immutable and never changes for a given name.
                "spec": merge_patch_for(
                    {k: v for k, v in (current.get("spec") or {}).items() if k != "selector"},
                    {k: v for k, v in desired["spec"].items() if k != "selector"},
                ),
            }
        else:
            if current.get("data") == desired["data"]:
                return current, "unchanged"
            body = {"metadata": {"labels": desired["metadata"]["labels"]}, "data": merge_patch_for(current.get("data") or {}, desired["data"])}
        # Optimistic concurrency: a write by someone else since our read makes this
        # patch fail with 409 instead of silently overwriting it.
        if meta.get("resourceVersion"):
            body["metadata"]["resourceVersion"] = meta["resourceVersion"]
        return patch(ns, name, body), "patched"

    def _create_once(self, desired: dict[str, Any]) -> bool:
        """Create an object whose content never changes (it is derived); an existing one is left
        alone -- the operator may create Secrets, never read or change them."""
        assert self.api is not None
        try:
            self.api.create(desired)
            return True
        except ApiException as e:
            if e.status != 409:
                raise
            return False

    def _ensure_shared(self, desired: dict[str, Any], owner: Mapping[str, Any]) -> str:
        """Create-or-adopt an object every WeightCache of the namespace shares (agent identity).

        Each cache is a non-controller owner: the object outlives any one cache and
        goes with the last. An object of that name we did not create (no managed-by
        label) is used as it is and never written.
        """
        assert self.api is not None
        kind, ns, name = desired["kind"], desired["metadata"]["namespace"], desired["metadata"]["name"]
        ref = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
               "uid": owner["metadata"].get("uid"), "controller": False, "blockOwnerDeletion": False}
        current = self.api.get(kind, ns, name)
        if current is None:
            body = {**desired, "metadata": {**desired["metadata"], "ownerReferences": [ref]}}
            try:
                self.api.create(body)
                return "created"
            except ApiException as e:
                if e.status != 409:
                    raise
                current = self.api.get(kind, ns, name)
                if current is None:
                    raise
        meta = current.get("metadata") or {}
        if (meta.get("labels") or {}).get(LABEL_MANAGED_BY) != MANAGED_BY:
            return "unchanged"
        refs = list(meta.get("ownerReferences") or [])
        patch: dict[str, Any] = {"metadata": {}}
        if ref["uid"] and all(r.get("uid") != ref["uid"] for r in refs):
            patch["metadata"]["ownerReferences"] = refs + [ref]
        if kind == "RoleBinding" and current.get("subjects") != desired["subjects"]:
            patch["subjects"] = desired["subjects"]
        if patch == {"metadata": {}}:
            return "unchanged"
        if meta.get("resourceVersion"):
            patch["metadata"]["resourceVersion"] = meta["resourceVersion"]
        self.api.patch(kind, ns, name, patch)
        return "patched"

    # --- the reconcile ----------------------------------------------------------------

    async def _reconcile(self, body: kopf.Body, memo: kopf.Memo, logger: Any) -> None:
        assert self.api is not None  # reconcile() waits for the login
        meta = body.get("metadata") or {}
        namespace, name = meta["namespace"], meta["name"]
        uid, generation = meta.get("uid"), meta.get("generation")
        old_status, new_status = carried_status(body, memo, STATUS_KEYS)
        new_status["socketDir"] = socket_dir(namespace, name)

        try:
            cs = parse_spec(plain(body.get("spec") or {}))
            # Privileged agents: only the image, model paths and nodes the admin allows this namespace.
            self.config.admit_cache(cs, namespace)
        except SpecError as e:
            if not holds(old_status.get("conditions"), DEGRADED, "True", e.reason):  # once, not every poll
                logger.warning(f"invalid spec, agents left unchanged: {e.message}")
            desired = spec_conditions(e.reason, e.message)
        else:
            new_status["model"] = cs.model_display
            new_status["daemonSet"] = daemonset_name(name)
            ds = render_daemonset(cs, namespace, name, self.config, uid)
            cm = render_sharding_configmap(cs, namespace, name)
            children = [o for o in (cm, ds) if o is not None]  # ConfigMap first: the pods mount it
            kopf.append_owner_reference(children, owner=body)
            try:
                live_ds = await asyncio.to_thread(self.api.get_daemonset, namespace, daemonset_name(name))
                agents = await self._agents(namespace, name)
                held = self._held_for_memory(live_ds, cs, *agents)
                if held is not None:
                    children = [c for c in children if c["kind"] != "DaemonSet"]
                for shared in (render_agent_service_account(namespace), render_agent_role_binding(namespace)):
                    action = await asyncio.to_thread(self._ensure_shared, shared, body)
                    if action == "created":
                        logger.info(f"created {shared['kind']} {shared['metadata']['name']}")
                if self.config.control_key is not None:
                    secret = render_control_secret(self.config.control_key, namespace, name)
                    kopf.append_owner_reference(secret, owner=body)
                    if await asyncio.to_thread(self._create_once, secret):
                        logger.info(f"created Secret {secret['metadata']['name']}")
                for child in children:
                    live, action = await asyncio.to_thread(self._ensure, child["kind"], child, uid,
                                                           live_ds if child["kind"] == "DaemonSet" else _UNREAD)
                    if action != "unchanged":
                        logger.info(f"{action} {child['kind']} {child['metadata']['name']}")
                        # kopf.event, not kopf.info: explicit events ignore the posting level.
                        kopf.event(body, type="Normal", reason=f"{child['kind']}{action.capitalize()}",
                                   message=f"{action} {child['kind']} {child['metadata']['name']}")
                    if child["kind"] == "DaemonSet":
                        live_ds = live
            except OwnershipConflict as e:
                desired = spec_conditions("OwnershipConflict", str(e))
            else:
                desired = self._agent_conditions(live_ds, new_status, *agents, cs.tensor)
                desired = self._integrity(body, old_status, *agents, desired)
                if held is not None:
                    desired = [d for d in desired if d.type != DEGRADED] + [Desired(DEGRADED, "True", HELD_FOR_MEMORY, held)]
                if cs.model_pvc is not None:
                    desired = claim_conditions(namespace, cs.model_pvc, agents[0]) or desired

        # The printer columns' counts: 0 until agents say otherwise, never blank.
        for key in ("readyNodes", "desiredNodes"):
            new_status.setdefault(key, 0)
        new_status["conditions"] = merge(old_status.get("conditions"), desired, generation)
        await self._write_status(body, memo, old_status, new_status, logger)

    async def _agents(self, namespace: str, name: str) -> tuple[list[Any], dict[str, Any]]:
        """The agent pods and what each answered to `/status`."""
        assert self.api is not None
        _, pods, answers = await ask_agents(self.api, namespace, selector_labels(name), self.config.agent_http_timeout,
                                            status_token(self.config.control_key, namespace, name))
        return pods, answers

    @staticmethod
    def _held_for_memory(live_ds: dict[str, Any] | None, cs: Any, pods: list[Any],
                         answers: dict[str, Any]) -> str | None:
        """Why a model change must wait for memory (see `transition`), or None."""
        old, new = daemonset_model(live_ds), (model_dir(cs), cs.revision)
        if old is None or old == new:
            return None
        short = memory_shortfalls([node_entry(p, answers.get(p.name)) for p in pods if p.node is not None])
        return hold_message(old, new, short) if short else None

    def _agent_conditions(self, live_ds: dict[str, Any] | None, new_status: dict[str, Any], pods: list[Any],
                          answers: dict[str, Any], tp: int) -> list[Desired]:
        rollout = daemonset_rollout(live_ds)
        summary = summarize(pods, answers, rollout.desired, self.config.max_node_entries, tp)
        new_status.update(summary)
        return agent_conditions(summary, rollout)

    @staticmethod
    def _integrity(body: kopf.Body, old_status: dict[str, Any], pods: list[Any], answers: dict[str, Any],
                   desired: list[Desired]) -> list[Desired]:
        """A Warning Event for each node whose agent found more changed arenas than the status last
        said; Degraded (reason ArenaIntegrity) while an arena is changed now and nothing worse is."""
        before = old_status.get("nodes") or []
        rises, now = integrity_news(pods, answers, before, complete=not old_status.get("nodesOmitted"))
        for line in rises:
            # The operator's log, not kopf's per-object logger (which would post the line as a second Event).
            logging.getLogger(__name__).warning("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"],
                                                line)
            kopf.event(body, type="Warning", reason=ARENA_INTEGRITY, message=line)
        if now is not None and not any(d.type == DEGRADED and d.status == "True" for d in desired):
            desired = [d for d in desired if d.type != DEGRADED] + [Desired(DEGRADED, "True", ARENA_INTEGRITY, now)]
        return desired

    async def _write_status(
        self, body: kopf.Body, memo: kopf.Memo, old: dict[str, Any], new: dict[str, Any], logger: Any
    ) -> None:
        assert self.api is not None
        await publish_status(body, memo, logger, old, new, STATUS_KEYS, status_patch(old, new),
                             self.api.patch_cache_status)
