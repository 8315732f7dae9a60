"""The EngineSet reconcile end to end against kmock, with agents as real HTTP servers.

The operator runs as ``weightcache operator`` runs it (``build_registry`` +
``build_settings`` in kopf's ``KopfRunner``); each node agent is an ``AgentServer``
answering ``/status`` with replicas and leases as the contract describes. The
emulator has no scheduler, kubelet or garbage collector and assigns no uids, so the
test plays those parts where it matters: it gives the pods the operator creates a
uid and a Ready status, as the API server and kubelet would, and checks owner
references instead of collection.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from kopf.testing import KopfRunner
from operator_fixtures import (
    POD_RESOURCE,
    POLL,
    WC_RESOURCE,
    AgentServer,
    KubeClient,
    agent_pod,
    condition,
    declare_resources,
    emulated_cluster,
    events_for,
    get_object,
    requests_of,
    running_operator,
    wait_for,
    weightcache,
)
from weightcache_agent.serve import agent_http

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]

ES_RESOURCE = "weightcache.io/v1alpha1/enginesets"
CLAIM_RESOURCE = "resource.k8s.io/v1/resourceclaims"
SVC_RESOURCE = "v1/services"
DEVICECLASS_RESOURCE = "resource.k8s.io/v1/deviceclasses"

CACHE_SPEC = {"model": {"path": "qwen"}, "parallelism": {"tensor": 2}, "gpusPerNode": 4}
TEMPLATE = {"metadata": {"labels": {"app": "chat"}},
            "spec": {"containers": [{"name": "engine", "image": "registry.local/engine:1",
                                     "ports": [{"containerPort": 8000}]}]}}


def declare(kmock: Any) -> None:
    declare_resources(kmock)
    info = kmock.ResourceInfo
    kmock.resources[ES_RESOURCE] = info(
        kind="EngineSet", singular="engineset", namespaced=True, shortnames={"wces"},
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"})
    kmock.resources[POD_RESOURCE] = info(kind="Pod", namespaced=True,
                                         verbs={"get", "list", "watch", "create", "patch", "delete"})
    kmock.resources[SVC_RESOURCE] = info(kind="Service", namespaced=True, verbs={"get", "list", "create", "patch"})
    kmock.resources[CLAIM_RESOURCE] = info(kind="ResourceClaim", namespaced=True,
                                           verbs={"get", "list", "create", "delete"})
    kmock.resources[DEVICECLASS_RESOURCE] = info(kind="DeviceClass", namespaced=False, verbs={"get", "create"})


def engineset(name: str, spec: dict[str, Any], uid: str | None = None) -> dict[str, Any]:
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "EngineSet",
            "metadata": {"name": name, "namespace": "default", "uid": uid or f"uid-es-{name}",
                         "generation": 1, "resourceVersion": "1"},
            "spec": copy.deepcopy(spec)}


def node_status(node: str, leases: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A Ready agent with 4 GPUs (two tp=2 replicas) and these leases on rank 0."""
    uuids = [f"GPU-{node}-{i}" for i in range(4)]
    return {
        "node": node, "phase": "Ready", "message": "", "gpuUUIDs": uuids, "tpSize": 2,
        "socketDir": "/run/weightcache/default/qwen",
        "replicas": [{"index": 0, "gpus": uuids[:2], "phase": "Ready"},
                     {"index": 1, "gpus": uuids[2:], "phase": "Ready"}],
        "ranks": [{"rank": 0, "phase": "Ready", "leases": leases or []},
                  {"rank": 1, "phase": "Ready", "leases": []}],
    }


def lease(pod: dict[str, Any], role: str, group: str) -> dict[str, Any]:
    m = pod["metadata"]
    return {"id": 1, "pid": 100, "role": role, "group": group,
            "pod": {"namespace": m["namespace"], "name": m["name"], "uid": m["uid"]}}


def pod(kmock: Any, name: str) -> dict[str, Any] | None:
    return get_object(kmock, POD_RESOURCE, "default", name)


def es_of(kmock: Any, name: str) -> dict[str, Any] | None:
    return get_object(kmock, ES_RESOURCE, "default", name)


def serving(kmock: Any, name: str) -> str | None:
    return ((pod(kmock, name) or {}).get("metadata", {}).get("labels") or {}).get("weightcache.io/serving")


async def kubelet(cluster: KubeClient, kmock: Any, name: str) -> dict[str, Any]:
    """What the API server and kubelet add to a created pod: a uid, a node, Running and Ready."""
    p = await wait_for(lambda: pod(kmock, name), what=f"pod {name}")
    node = p["spec"]["nodeSelector"]["kubernetes.io/hostname"]
    return await cluster.patch(POD_RESOURCE, "default", name, {
        "metadata": {"uid": f"uid-{name}-{len(requests_of(kmock, 'POST', 'pods', name=None))}"},
        "spec": {"nodeName": node},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    })


def operator(kmock: Any) -> contextlib.AbstractAsyncContextManager[KopfRunner]:
    """Run the operator until the block ends; starts only once kopf watches EngineSets."""
    return running_operator(kmock, "enginesets", timeout=30.0)


@pytest_asyncio.fixture()
async def cluster(kmock: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeClient]:
    async with emulated_cluster(kmock, tmp_path, monkeypatch, declare) as client:
        yield client


async def create_device_class(cluster: KubeClient, name: str = "gpu.nvidia.com") -> None:
    async with cluster._session.post("/apis/resource.k8s.io/v1/deviceclasses", json={
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}}) as r:
        assert r.status < 300, await r.text()


async def test_engineset_places_groups_follows_the_agent_and_replaces_pods(cluster: KubeClient, kmock: Any) -> None:
    with AgentServer(node_status("node-a")) as a, AgentServer(node_status("node-b")) as b:
        await create_device_class(cluster)
        await cluster.create(WC_RESOURCE, weightcache("qwen", CACHE_SPEC))
        await cluster.create(POD_RESOURCE, agent_pod("qwen", "node-a", a.port, model="/models/qwen"))
        await cluster.create(POD_RESOURCE, agent_pod("qwen", "node-b", b.port, model="/models/qwen"))
        async with operator(kmock):
            await cluster.create(ES_RESOURCE, engineset("chat", {
                "cacheRef": {"name": "qwen"}, "replicas": 2, "standbys": 1, "template": TEMPLATE}))

            # Two groups, spread over the two nodes, two pods each, a claim each, one Service.
            names = ["chat-0-0", "chat-0-1", "chat-1-0", "chat-1-1"]
            await wait_for(lambda: all(pod(kmock, n) for n in names), what="four engine pods")
            claims = [get_object(kmock, CLAIM_RESOURCE, "default", f"chat-{g}") for g in (0, 1)]
            assert all(claims)
            nodes = {c["metadata"]["annotations"]["weightcache.io/node"] for c in claims}
            assert nodes == {"node-a", "node-b"}
            for c in claims:
                node = c["metadata"]["annotations"]["weightcache.io/node"]
                exactly = c["spec"]["devices"]["requests"][0]["exactly"]
                assert exactly["count"] == 2 and exactly["deviceClassName"] == "gpu.nvidia.com"
                assert f'"GPU-{node}-0", "GPU-{node}-1"' in exactly["selectors"][0]["cel"]["expression"]
            svc = await wait_for(lambda: get_object(kmock, SVC_RESOURCE, "default", "chat"), what="the Service")
            assert svc["spec"]["selector"] == {"weightcache.io/engineset": "chat", "weightcache.io/serving": "true"}
            owner = {"apiVersion": "weightcache.io/v1alpha1", "kind": "EngineSet", "name": "chat",
                     "uid": "uid-es-chat", "controller": True, "blockOwnerDeletion": True}
            for obj in [svc, *claims, *(pod(kmock, n) for n in names)]:
                assert obj["metadata"]["ownerReferences"] == [owner]
            p00 = pod(kmock, "chat-0-0")
            assert p00["spec"]["resourceClaims"] == [{"name": "weightcache-gpus", "resourceClaimName": "chat-0"}]
            env = {e["name"]: e.get("value") for e in p00["spec"]["containers"][0]["env"]}
            assert env["WEIGHTCACHE_GROUP"] == "default/chat-0" and env["WEIGHTCACHE_ROLE"] == "auto"
            assert all(serving(kmock, n) == "false" for n in names)  # nobody serves before the agent says so

            # The pods start; the agent on group 0's node holds chat-0-0 as primary.
            pods = {n: await kubelet(cluster, kmock, n) for n in names}
            node0 = claims[0]["metadata"]["annotations"]["weightcache.io/node"]
            agent0 = a if node0 == "node-a" else b
            agent0.doc = node_status(node0, [lease(pods["chat-0-0"], "primary", "default/chat-0"),
                                             lease(pods["chat-0-1"], "standby", "default/chat-0")])
            await wait_for(lambda: serving(kmock, "chat-0-0") == "true", what="chat-0-0 serving")
            assert serving(kmock, "chat-0-1") == "false"
            es = await wait_for(lambda: (e := es_of(kmock, "chat"))["status"].get("servingGroups") == 1 and e,
                                what="one group serving")
            assert es["status"]["selector"] == "weightcache.io/engineset=chat"
            assert es["status"]["replicas"] == 2
            g0 = es["status"]["groups"][0]
            assert (g0["index"], g0["node"], g0["claim"], g0["primary"], g0["standbys"]) == \
                (0, node0, "chat-0", "chat-0-0", ["chat-0-1"])

            # Failover: the agent promoted chat-0-1. The new one is labelled before the old one stops.
            patches_before = len(requests_of(kmock, "PATCH", "pods"))
            agent0.doc = node_status(node0, [lease(pods["chat-0-1"], "primary", "default/chat-0")])
            await wait_for(lambda: serving(kmock, "chat-0-0") == "false", what="the old primary to stop serving")
            assert serving(kmock, "chat-0-1") == "true"
            label_patches = [r for r in requests_of(kmock, "PATCH", "pods")[patches_before:]
                             if "weightcache.io/serving" in ((r.data or {}).get("metadata", {}).get("labels") or {})]
            assert [(r.name, r.data["metadata"]["labels"]["weightcache.io/serving"]) for r in label_patches] == \
                [("chat-0-1", "true"), ("chat-0-0", "false")]
            assert label_patches[0].data["metadata"]["uid"] == pods["chat-0-1"]["metadata"]["uid"]
            await wait_for(lambda: any(e["reason"] == "Failover" and "chat-0-1" in e["message"]
                                       for e in events_for(kmock, "chat")), what="a Failover event")
            g0 = await wait_for(lambda: (g := es_of(kmock, "chat")["status"]["groups"][0])["primary"] == "chat-0-1" and g)
            assert "lastFailoverTime" in g0 and g0["lastFailoverSeconds"] >= 0

            # A deleted pod comes back under the same name, on the same node and GPUs.
            posts = len(requests_of(kmock, "POST", "pods", name=None))
            await cluster.delete(POD_RESOURCE, "default", "chat-1-1")
            back = await wait_for(lambda: pod(kmock, "chat-1-1"), what="chat-1-1 recreated")
            assert len(requests_of(kmock, "POST", "pods")) > posts
            assert back["metadata"]["annotations"] == pods["chat-1-1"]["metadata"]["annotations"]
            # Steady state otherwise: no second claim, no second Service.
            assert len(requests_of(kmock, "POST", "resourceclaims")) == 2
            assert len(requests_of(kmock, "POST", "services")) == 1

            # Scale down (as kubectl scale would, through spec.replicas): group 1 goes, group 0 stays.
            await cluster.patch(ES_RESOURCE, "default", "chat", {"metadata": {"generation": 2}, "spec": {"replicas": 1}})
            await wait_for(lambda: pod(kmock, "chat-1-0") is None and pod(kmock, "chat-1-1") is None
                           and get_object(kmock, CLAIM_RESOURCE, "default", "chat-1") is None, what="group 1 removed")
            deletes = requests_of(kmock, "DELETE", "pods")
            assert {r.name for r in deletes if r.name.startswith("chat-1-")} == {"chat-1-0", "chat-1-1"}
            # Deletes name the incarnation they mean (a replacement of that name is never hit).
            assert all((r.data or {}).get("preconditions", {}).get("uid") for r in deletes if r.name == "chat-1-0")
            assert pod(kmock, "chat-0-0") and pod(kmock, "chat-0-1") and serving(kmock, "chat-0-1") == "true"
            es = await wait_for(lambda: (e := es_of(kmock, "chat"))["status"].get("replicas") == 1 and e)
            assert [g["index"] for g in es["status"]["groups"]] == [0]


async def test_bad_enginesets_get_a_condition_and_others_keep_going(cluster: KubeClient, kmock: Any) -> None:
    with AgentServer(node_status("node-a")) as a:
        await create_device_class(cluster)
        await cluster.create(WC_RESOURCE, weightcache("qwen", CACHE_SPEC))
        await cluster.create(POD_RESOURCE, agent_pod("qwen", "node-a", a.port, model="/models/qwen"))
        await cluster.create(WC_RESOURCE, weightcache("cold", CACHE_SPEC))  # no agent answers for it yet
        async with operator(kmock):
            tp4 = copy.deepcopy(TEMPLATE)
            tp4["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 4}}
            bad = {
                "mismatch": ({"cacheRef": {"name": "qwen"}, "template": tp4}, "TensorParallelMismatch", "nvidia.com/gpu=4"),
                "nocache": ({"cacheRef": {"name": "llama"}, "template": TEMPLATE}, "CacheNotFound", "default/llama"),
                "negative": ({"cacheRef": {"name": "qwen"}, "standbys": -1, "template": TEMPLATE},
                             "InvalidStandbys", "spec.standbys must not be negative"),
                "noclass": ({"cacheRef": {"name": "qwen"}, "template": TEMPLATE,
                             "gpuBinding": {"deviceClassName": "tpu.example.com"}},
                            "UnknownDeviceClass", "DeviceClass tpu.example.com does not exist"),
                "notready": ({"cacheRef": {"name": "cold"}, "template": TEMPLATE},
                             "CacheNotReady", "1 group(s) not placed: WeightCache cold is not Ready"),
            }
            for name, (spec, _, _) in bad.items():
                await cluster.create(ES_RESOURCE, engineset(name, spec))
            await cluster.create(ES_RESOURCE, engineset("good", {"cacheRef": {"name": "qwen"}, "standbys": 0,
                                                                  "template": TEMPLATE}))

            await wait_for(lambda: pod(kmock, "good-0-0"), what="the good EngineSet's pod")
            for name, (_, reason, fragment) in bad.items():
                degraded = await wait_for(lambda: condition(es_of(kmock, name), "Degraded"), what=f"Degraded on {name}")
                assert degraded["status"] == "True" and degraded["reason"] == reason, degraded
                assert fragment in degraded["message"]
                await wait_for(lambda: any(e["reason"] == reason and e["type"] == "Warning"
                                           for e in events_for(kmock, name)), what=f"a Warning event on {name}")
                assert not any(p[0].plural == "pods" and p[2].startswith(f"{name}-") for p in kmock.objects)

            # Still bad on later polls: no repeated status writes, no retry storm (once the
            # cold cache's own status, quoted in its EngineSet's message, has settled there).
            cold = await wait_for(lambda: condition(get_object(kmock, WC_RESOURCE, "default", "cold"), "Ready"),
                                  what="the cold cache's Ready condition")
            await wait_for(lambda: f"({cold['message']})" in condition(es_of(kmock, "notready"), "Degraded")["message"],
                           what="notready quoting the cold cache's status")
            await asyncio.sleep(2 * POLL)
            writes = {n: len(requests_of(kmock, "PATCH", "enginesets", name=n, subresource="status")) for n in bad}
            await asyncio.sleep(4 * POLL)
            assert {n: len(requests_of(kmock, "PATCH", "enginesets", name=n, subresource="status")) for n in bad} == writes


async def test_a_pod_the_api_server_refuses_is_a_condition_not_a_retry_storm(cluster: KubeClient, kmock: Any) -> None:
    with AgentServer(node_status("node-a")) as a:
        await create_device_class(cluster)
        await cluster.create(WC_RESOURCE, weightcache("qwen", CACHE_SPEC))
        await cluster.create(POD_RESOURCE, agent_pod("qwen", "node-a", a.port, model="/models/qwen"))
        # What a Pod Security admission or a quota says about a pod it will not admit. (The
        # emulator stores the pod anyway, so only the first pass sees the refusal.)
        kmock["post /api/v1/namespaces/default/pods"] << 403 << {
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403,
            "message": 'pods "chat-0-0" is forbidden: violates PodSecurity "restricted:latest": hostPath volumes'}
        async with operator(kmock):
            await cluster.create(ES_RESOURCE, engineset("chat", {"cacheRef": {"name": "qwen"}, "template": TEMPLATE}))
            degraded = await wait_for(lambda: (c := condition(es_of(kmock, "chat"), "Degraded")) and
                                      c["reason"] == "Rejected" and c, what="Degraded=Rejected")
            assert degraded["status"] == "True"
            assert "Pod chat-0-0: pods \"chat-0-0\" is forbidden: violates PodSecurity" in degraded["message"]
            await wait_for(lambda: any(e["reason"] == "Rejected" and e["type"] == "Warning"
                                       for e in events_for(kmock, "chat")), what="a Warning event")
            # The claim and Service were still made: only the pod is refused.
            assert get_object(kmock, CLAIM_RESOURCE, "default", "chat-0")
            assert get_object(kmock, SVC_RESOURCE, "default", "chat")


async def test_standbys_make_room_while_the_cache_waits_for_memory_for_a_new_model(
        cluster: KubeClient, kmock: Any) -> None:
    """A new revision needs a second copy of each rank beside the first; node-a's GPUs lack the room.
    The cache holds the change, the EngineSet stops its standby (its memory is what is missing) and
    its primary keeps serving; once the room is there the DaemonSet moves to the new revision, and no
    standby starts before the agent runs it."""
    gib = 2**30
    short = {**node_status("node-a"), "rankBytes": 30 * gib, "freeBytes": 20 * gib}
    with AgentServer(short) as a:
        await cluster.create(WC_RESOURCE, weightcache("qwen", CACHE_SPEC))
        await cluster.create(POD_RESOURCE, agent_pod("qwen", "node-a", a.port, model="/models/qwen"))
        async with operator(kmock):
            await cluster.create(ES_RESOURCE, engineset("chat", {
                "cacheRef": {"name": "qwen"}, "replicas": 1, "standbys": 1, "gpuBinding": {"mode": "visibleDevices"},
                "template": TEMPLATE}))
            await wait_for(lambda: pod(kmock, "chat-0-0") and pod(kmock, "chat-0-1"), what="two engine pods")
            pods = {n: await kubelet(cluster, kmock, n) for n in ("chat-0-0", "chat-0-1")}
            a.doc = {**short, **node_status("node-a", [lease(pods["chat-0-0"], "primary", "default/chat-0"),
                                                       lease(pods["chat-0-1"], "standby", "default/chat-0")])}
            await wait_for(lambda: serving(kmock, "chat-0-0") == "true", what="chat-0-0 serving")

            cache = get_object(kmock, WC_RESOURCE, "default", "qwen")
            await cluster.patch(WC_RESOURCE, "default", "qwen", {
                "metadata": {"generation": cache["metadata"].get("generation", 1) + 1},
                "spec": {"model": {"path": "qwen", "revision": "v2"}}})
            held = await wait_for(lambda: next((c for c in get_object(kmock, WC_RESOURCE, "default", "qwen")
                                                .get("status", {}).get("conditions", [])
                                                if c["reason"] == "InsufficientMemory"), None), what="the hold")
            assert "node-a has 20.0 GiB free on its tightest device, a second copy of a rank needs 30.0 GiB" \
                in held["message"]
            await wait_for(lambda: pod(kmock, "chat-0-1") is None, what="the standby stopped")
            assert serving(kmock, "chat-0-0") == "true"
            await wait_for(lambda: any(e["reason"] == "PodDeleted" and "memory for a new model" in e["message"]
                                       for e in events_for(kmock, "chat")), what="the Event saying why")
            await wait_for(lambda: "room for a second copy" in es_of(kmock, "chat")["status"]["rollout"].get("message", ""),
                           what="the rollout saying why it waits")

            # The standby's memory came back: the change goes ahead, the DaemonSet runs v2.
            a.doc = {**a.doc, "freeBytes": 40 * gib}
            await wait_for(lambda: "--revision=v2" in get_object(kmock, "apps/v1/daemonsets", "default", "qwen-agent")
                           ["spec"]["template"]["spec"]["containers"][0]["args"], what="the DaemonSet on v2")
            await wait_for(lambda: "waiting for the agent on node-a to load /models/qwen@v2"
                           in es_of(kmock, "chat")["status"]["rollout"].get("message", ""), what="the rollout waiting")
            await asyncio.sleep(3 * POLL)  # no standby on a node whose agent still runs the old model
            assert pod(kmock, "chat-0-1") is None and serving(kmock, "chat-0-0") == "true"


async def test_an_engineset_that_does_not_serve_says_why_per_group(cluster: KubeClient, kmock: Any) -> None:
    """Pods Ready, no primary: Ready=False names each group's reason, from what the agent reports --
    nothing attached, attaches refused, only standbys, the agent silent -- and a cause the agents
    reported to the WeightCache is carried into the EngineSet that waits on it."""
    too_wide = "tensor-parallel size 16 needs 16 GPUs on this node, only 8 selected"
    with AgentServer(node_status("node-a")) as a, AgentServer({"node": "node-b", "phase": "Failed",
                                                               "message": too_wide}) as b:
        await create_device_class(cluster)
        await cluster.create(WC_RESOURCE, weightcache("qwen", CACHE_SPEC))
        await cluster.create(POD_RESOURCE, agent_pod("qwen", "node-a", a.port, model="/models/qwen"))
        await cluster.create(WC_RESOURCE, weightcache("wide", CACHE_SPEC))
        await cluster.create(POD_RESOURCE, agent_pod("wide", "node-b", b.port, model="/models/qwen"))
        async with operator(kmock):
            await cluster.create(ES_RESOURCE, engineset("chat", {
                "cacheRef": {"name": "qwen"}, "replicas": 1, "standbys": 1, "template": TEMPLATE}))
            await cluster.create(ES_RESOURCE, engineset("big", {"cacheRef": {"name": "wide"}, "template": TEMPLATE}))

            def ready_message(name: str) -> str:
                return (condition(es_of(kmock, name), "Ready") or {}).get("message", "")

            await wait_for(lambda: pod(kmock, "chat-0-0") and pod(kmock, "chat-0-1"), what="two engine pods")
            pods = {n: await kubelet(cluster, kmock, n) for n in ("chat-0-0", "chat-0-1")}
            await wait_for(lambda: "group 0: no engine attached to the agent on node-a yet" in ready_message("chat"),
                           what="no engine attached")
            ready = condition(es_of(kmock, "chat"), "Ready")
            assert ready["status"] == "False" and ready["reason"] == "GroupsNotServing"
            assert ready["message"].startswith("0/1 groups serving; group 0: ")

            refused = node_status("node-a")
            refused["ranks"][0]["misses"] = 3
            a.doc = refused
            await wait_for(lambda: "which has refused 3 attach(es)" in ready_message("chat"), what="refusals named")

            # What an agent shows a reader without its control token: each lease's role, no pod.
            a.doc = agent_http._without_identities(node_status("node-a", [
                lease(pods["chat-0-0"], "primary", "default/chat-0"), lease(pods["chat-0-1"], "standby", "default/chat-0")]))
            await wait_for(lambda: "the agent on node-a holds 2 lease(s) but names the engines holding them only to its "
                                   "control token" in ready_message("chat"), what="the missing control key named")

            a.doc = node_status("node-a", [lease(pods["chat-0-0"], "standby", "default/chat-0"),
                                           lease(pods["chat-0-1"], "standby", "default/chat-0")])
            await wait_for(lambda: "group 0: waiting for promotion: chat-0-0, chat-0-1 attached as standby, none as "
                                   "primary" in ready_message("chat"), what="waiting for promotion")

            a.raw = b"{half a document"  # an agent answering garbage is no answer
            await wait_for(lambda: "group 0: the agent on node-a does not answer" in ready_message("chat"),
                           what="the agent silent")

            a.raw, a.doc = None, node_status("node-a", [lease(pods["chat-0-0"], "primary", "default/chat-0")])
            await wait_for(lambda: condition(es_of(kmock, "chat"), "Ready")["status"] == "True", what="serving")

            # The cause found on the WeightCache, carried over.
            degraded = await wait_for(lambda: (c := condition(es_of(kmock, "big"), "Degraded")) and
                                      too_wide in c.get("message", "") and c, what="the cache's cause on the EngineSet")
            assert degraded["reason"] == "CacheNotReady" and "AgentFailed" in degraded["message"]
            assert "group 0: not placed" in ready_message("big")
