"""What an EngineSet pass knows of its WeightCache: spec, readiness, and what each agent reports.

Read once at the start of a pass (``cache_view``) and passed to every step after it:
the WeightCache object gives the spec (checked against the EngineSet's template here,
so a mismatch is a condition, not a broken pod) and its Ready condition; the agents'
``/status`` answers give the Ready replicas to place groups on, each group's primary,
each pod's role, and why a node cannot be counted on (``view_from_agents``, pure). A
second, later read decides which serving labels really go (``still_not_primary``).
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ...api.v1alpha1.engineset_types import EngineSetSpec, check_gpu_resources
from ...api.v1alpha1.weightcache_types import SpecError, WeightCacheSpec, parse_spec, plain
from ...config import OperatorConfig
from ...kube import KubeApi
from ..weightcache.agents import AgentPod, AgentStatusError, ask_agents
from ..weightcache.control import status_token
from ..weightcache.manifests import model_dir
from ..weightcache.manifests import selector_labels as agent_selector_labels
from ..weightcache.rollup import node_replicas
from ..weightcache.transition import holds_for_memory, model_of
from .compile_cache import check_template_host_paths
from .leases import PodRef, pod_roles, primaries, unnamed_leases
from .placement import Replica
from .pods import meta

# An agent's /status is refreshed by its supervisor every 0.5 s: a read this long after the pod
# list reflects every promotion whose serving label the list shows.
AGENT_SNAPSHOT_AGE_S = 1.0


@dataclasses.dataclass(frozen=True)
class CacheState:
    """The WeightCache object as an EngineSet reads it."""

    spec: WeightCacheSpec
    ready: bool
    ready_message: str
    memory_hold: bool


@dataclasses.dataclass
class CacheView:
    """What the reconcile knows about the WeightCache: its spec, Ready condition and agents."""

    spec: WeightCacheSpec
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


def read_cache(api: KubeApi, namespace: str, es: EngineSetSpec) -> CacheState:
    """The WeightCache the EngineSet names, checked against it; a ``SpecError`` says what does not fit."""
    cache = api.get_cache(namespace, es.cache_name)
    if cache is None:
        raise SpecError("CacheNotFound", f"spec.cacheRef: WeightCache {namespace}/{es.cache_name} does not exist")
    try:
        cs = parse_spec(plain(cache.get("spec") or {}))
    except SpecError as e:
        raise SpecError("CacheInvalid", f"spec.cacheRef: WeightCache {es.cache_name} is invalid: {e.message}") from None
    check_gpu_resources(es, cs.tensor)
    if es.mode == "dra" and api.get_device_class(es.device_class) is None:
        raise SpecError("UnknownDeviceClass",
                        f"spec.gpuBinding.deviceClassName: DeviceClass {es.device_class} does not exist "
                        "(install the GPU's DRA driver, or use gpuBinding.mode visibleDevices)")
    conditions = {c.get("type"): c for c in (cache.get("status") or {}).get("conditions") or []}
    ready, degraded = conditions.get("Ready") or {}, conditions.get("Degraded") or {}
    message = str(ready.get("message") or "no Ready condition yet")
    if ready.get("status") != "True" and degraded.get("status") == "True" and degraded.get("message"):
        # The cause the agents reported to the cache, so that the EngineSet waiting on it says why.
        message += f"; {degraded.get('reason') or 'Degraded'}: {degraded['message']}"
    return CacheState(cs, ready.get("status") == "True", message, holds_for_memory(cache))


def view_from_agents(state: CacheState, raw: Sequence[Mapping[str, Any]], agents: Sequence[AgentPod],
                     answers: Mapping[str, Any]) -> CacheView:
    """The cache as its agents report it (``raw``: the agent pods as listed, for the model each runs)."""
    cs = state.spec
    view = CacheView(cs, state.ready, state.ready_message, [], {}, {},
                     {a.node for a in agents if a.node is not None}, memory_hold=state.memory_hold)
    raw_by_name = {meta(x).get("name"): x for x in raw}
    for agent in agents:
        if agent.node is None:
            continue
        doc = answers.get(agent.name)
        if not isinstance(doc, dict):
            view.unreachable[agent.node] = \
                str(doc) if isinstance(doc, AgentStatusError) else f"agent pod is {agent.phase}"
            continue
        view.primaries[agent.node] = primaries(doc)
        view.roles[agent.node] = pod_roles(doc)
        view.unnamed[agent.node] = unnamed_leases(doc)
        view.misses[agent.node] = sum(r["misses"] for r in doc.get("ranks") or []
                                      if isinstance(r, Mapping) and isinstance(r.get("misses"), int))
        if agent.url:
            view.agent_urls[agent.node] = agent.url.rsplit("/status", 1)[0]
        if doc.get("phase") == "Ready" and \
                model_of((raw_by_name.get(agent.name) or {}).get("spec") or {}) == (model_dir(cs), cs.revision):
            view.current.add(agent.node)
        if doc.get("phase") != "Ready" and not isinstance(doc.get("replicas"), list):
            continue
        for r in node_replicas(doc, cs.tensor) or []:
            if r["phase"] == "Ready" and len(r["gpus"]) == cs.tensor:
                view.replicas.append(Replica(agent.node, r["index"], tuple(r["gpus"])))
    return view


async def cache_view(api: KubeApi, config: OperatorConfig, namespace: str, es: EngineSetSpec) -> CacheView:
    """Read the WeightCache and ask its agents for ``/status``: the view one pass works from."""
    check_template_host_paths(es, config)  # the compile cache's root is the operator's alone
    state = await asyncio.to_thread(read_cache, api, namespace, es)
    raw, agents, answers = await ask_agents(api, namespace, agent_selector_labels(es.cache_name),
                                            config.agent_http_timeout,
                                            status_token(config.control_key, namespace, es.cache_name))
    return view_from_agents(state, raw, agents, answers)


def still_not_primary(fresh: CacheView, pods: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of `pods`, those no agent of a fresh view holds as primary; a pod whose node's agent
    does not answer (or reports no leases) is left out, so it keeps its label."""
    out = []
    for pod in pods:
        m, node = meta(pod), (pod.get("spec") or {}).get("nodeName") or ""
        if node in fresh.unreachable or node not in fresh.primaries:
            continue
        if any(ref.name == m.get("name") and (ref.uid is None or ref.uid == m.get("uid"))
               for ref in fresh.primaries[node].values()):
            continue
        out.append(pod)
    return out
