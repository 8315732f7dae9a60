"""Read each agent pod's state from its HTTP ``/status`` endpoint.

Channel choice: the operator asks the agents (pod IP, port ``http``) instead of the
agents writing into the API. That keeps the agents' Kubernetes rights down to one
write (the serving label of an engine pod they promote, fenced by an admission
policy), keeps the API server's write load at one status patch per WeightCache per
change, and bounds what lands in etcd to what ``rollup`` chooses to keep. The cost is one small GET per agent per
poll interval, made concurrently with a cap.

``fetch_agent_status`` is a plain blocking function over ``urllib`` (tests point it
at a real local HTTP server); ``fetch_all`` runs it in threads for many pods at once;
``ask_agents`` lists a cache's agent pods and asks them all, for both reconciles.
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ...config import AGENT_HTTP_PORT

if TYPE_CHECKING:
    from ...kube import KubeApi

# A node's status is a few KiB; anything larger is not an agent talking.
MAX_STATUS_BYTES = 1 << 20

# Pod IPs are cluster-internal: never send them through an HTTP(S)_PROXY from the
# environment, which urllib would otherwise honour.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class AgentStatusError(Exception):
    """The agent could not be asked, or did not answer with a status document."""


@dataclasses.dataclass(frozen=True)
class AgentPod:
    """The facts about one agent pod that the roll-up needs."""

    name: str
    node: str | None
    ip: str | None
    port: int
    phase: str  # the pod's phase: Pending / Running / Succeeded / Failed / Unknown
    ready: bool
    terminating: bool
    created: str  # creationTimestamp, for picking the newest of two pods on one node
    waiting: str | None  # why the agent container is not running, if it is not
    unschedulable: str | None = None  # why the scheduler places the pod on no node, while it says so

    @property
    def url(self) -> str | None:
        if not self.ip:
            return None
        return status_url(self.ip, self.port)


def status_url(ip: str, port: int) -> str:
    try:
        host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    except ValueError:
        host = ip
    return f"http://{host}:{port}/status"


def fetch_agent_status(url: str, timeout: float, token: str | None = None) -> dict[str, Any]:
    """GET an agent's ``/status`` and return the JSON object; raise AgentStatusError otherwise.
    With the cache's control ``token`` the leases name their pods (without it, roles only)."""
    headers = {"Accept": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            body = response.read(MAX_STATUS_BYTES + 1)
    except urllib.error.HTTPError as e:
        raise AgentStatusError(f"agent answered HTTP {e.code} on /status") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise AgentStatusError(f"agent not reachable: {reason}") from None
    if len(body) > MAX_STATUS_BYTES:
        raise AgentStatusError("agent status larger than 1 MiB")
    try:
        doc = json.loads(body)
    except ValueError:
        raise AgentStatusError("agent status is not JSON") from None
    if not isinstance(doc, dict):
        raise AgentStatusError("agent status is not a JSON object")
    return doc


def _agent_port(pod: Mapping[str, Any], default: int) -> int:
    # The port comes from the pod's own spec (the port named "http"), so pods
    # rendered by an older operator with another port are still read correctly.
    for container in pod.get("spec", {}).get("containers", []) or []:
        for port in container.get("ports", []) or []:
            if port.get("name") == "http" and isinstance(port.get("containerPort"), int):
                return port["containerPort"]
    return default


def _waiting(pod: Mapping[str, Any]) -> str | None:
    for cs in pod.get("status", {}).get("containerStatuses", []) or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:
            reason = waiting.get("reason") or "Waiting"
            message = waiting.get("message")
            return f"{reason}: {message}" if message else reason
    return None


def _unschedulable(status: Mapping[str, Any]) -> str | None:
    for c in status.get("conditions", []) or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return str(c.get("message") or c.get("reason") or "not scheduled")[:1024]
    return None


def agent_pod(pod: Mapping[str, Any], default_port: int) -> AgentPod:
    meta = pod.get("metadata", {})
    status = pod.get("status", {}) or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions", []) or []
    )
    return AgentPod(
        name=meta.get("name", ""),
        node=(pod.get("spec", {}) or {}).get("nodeName") or None,
        ip=status.get("podIP") or None,
        port=_agent_port(pod, default_port),
        phase=status.get("phase") or "Pending",
        ready=ready,
        terminating=bool(meta.get("deletionTimestamp")),
        created=str(meta.get("creationTimestamp") or ""),
        waiting=_waiting(pod),
        unschedulable=_unschedulable(status),
    )


def select_agent_pods(
    pods: Iterable[Mapping[str, Any]], selector: Mapping[str, str], default_port: int
) -> list[AgentPod]:
    """Pods whose labels match ``selector``, one per node (the newest live one).

    The label filter is repeated here although the API call already sends it as a
    label selector: cheap, and correct against servers that ignore selectors.
    """
    best: dict[str, AgentPod] = {}
    unscheduled: list[AgentPod] = []
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        ap = agent_pod(pod, default_port)
        if ap.node is None:
            unscheduled.append(ap)
            continue
        old = best.get(ap.node)
        # During a rolling update a terminating pod and its replacement can share a
        # node: prefer the live one, then the newest.
        if old is None or (not ap.terminating, ap.created) > (not old.terminating, old.created):
            best[ap.node] = ap
    return sorted(best.values(), key=lambda p: p.node or "") + unscheduled


async def fetch_all(
    pods: Iterable[AgentPod], timeout: float, concurrency: int = 16, token: str | None = None
) -> dict[str, dict[str, Any] | AgentStatusError]:
    """Ask every running agent pod for its status, at most ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(pod: AgentPod) -> tuple[str, dict[str, Any] | AgentStatusError]:
        url = pod.url
        if url is None:
            return pod.name, AgentStatusError("pod has no IP yet")
        async with gate:
            try:
                return pod.name, await asyncio.to_thread(fetch_agent_status, url, timeout, token)
            except AgentStatusError as e:
                return pod.name, e

    wanted = [p for p in pods if p.phase == "Running" and not p.terminating]
    results = await asyncio.gather(*(one(p) for p in wanted))
    return dict(results)


async def ask_agents(
    api: KubeApi, namespace: str, selector: Mapping[str, str], timeout: float, token: str | None = None
) -> tuple[list[dict[str, Any]], list[AgentPod], dict[str, dict[str, Any] | AgentStatusError]]:
    """(the listed pods, one agent pod per node, what each running one answered to ``/status``).

    A failed list raises (the reconcile retries); an agent that does not answer in
    ``timeout`` is an ``AgentStatusError`` among the answers, never an exception.
    """
    raw = await asyncio.to_thread(api.list_pods, namespace, selector)
    pods = select_agent_pods(raw, selector, AGENT_HTTP_PORT)
    return raw, pods, await fetch_all(pods, timeout=timeout, token=token)
