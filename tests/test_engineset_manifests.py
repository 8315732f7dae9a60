"""EngineSet builders, placement and the agent-status readers: field by field and against schemas.

Every object the EngineSet reconcile writes (engine pod in both GPU binding modes,
ResourceClaim, Service, the agents' ServiceAccount and RoleBinding) is validated
strictly with ``kubernetes-validate``: resource.k8s.io/v1 exists from Kubernetes
1.34, so claims are checked against 1.34 and the newest schemas; the rest also
against 1.28. The claim's CEL selector is compiled and run with cel-python on
devices shaped as a DRA driver publishes them.
"""
from __future__ import annotations

import copy
from typing import Any

import celpy
import kubernetes_validate
import pytest
from weightcache_operator.api.v1alpha1.engineset_types import check_gpu_resources, parse_engineset
from weightcache_operator.api.v1alpha1.weightcache_types import SpecError, parse_spec
from weightcache_operator.config import OperatorConfig
from weightcache_operator.controller.engineset.leases import primaries
from weightcache_operator.controller.engineset.manifests import (
    placement_of,
    render_claim,
    render_pod,
    render_service,
    template_hash,
)
from weightcache_operator.controller.engineset.placement import Placement, Replica, orphaned, place
from weightcache_operator.controller.weightcache.agents import AgentPod
from weightcache_operator.controller.weightcache.manifests import (
    render_agent_role_binding,
    render_agent_service_account,
)
from weightcache_operator.controller.weightcache.rollup import node_entry, node_replicas

LATEST = kubernetes_validate.utils.latest_version()
CONFIG = OperatorConfig()
CACHE = parse_spec({"model": {"path": "qwen"}, "parallelism": {"tensor": 2}})
PVC_CACHE = parse_spec({"model": {"pvc": "weights"}, "parallelism": {"tensor": 2}})
TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"app": "chat", "weightcache.io/serving": "true"}, "annotations": {"team": "llm"}},
    "spec": {
        "nodeSelector": {"pool": "h200"},
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "containers": [
            {"name": "engine", "image": "engine:1",
             "env": [{"name": "LOG", "value": "1"}, {"name": "WEIGHTCACHE_ROLE", "value": "primary"}],
             "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
             "resources": {"limits": {"nvidia.com/gpu": "2", "memory": "32Gi"}, "requests": {"cpu": "4"}}},
            {"name": "sidecar", "image": "proxy:1"},
        ],
    },
}
GROUP = Placement(1, "node-a", ("GPU-a2", "GPU-a3"))


def engineset(**change: Any) -> Any:
    return parse_engineset("chat", {"cacheRef": {"name": "qwen"}, "template": TEMPLATE, **change})


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# --- schemas --------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["1.34.0", LATEST])
def test_every_object_validates_against_kubernetes_schemas(version: str) -> None:
    for mode in ("dra", "visibleDevices"):
        es = engineset(gpuBinding={"mode": mode})
        for cache in (CACHE, PVC_CACHE):
            kubernetes_validate.validate(render_pod(es, cache, CONFIG, "ml", "chat", GROUP, 0), version, strict=True)
    kubernetes_validate.validate(render_claim(engineset(), "ml", "chat", GROUP), version, strict=True)
    for obj in (render_service(engineset(), "ml", "chat"), render_agent_service_account("ml"),
                render_agent_role_binding("ml")):
        kubernetes_validate.validate(obj, version, strict=True)


def test_pods_without_claims_validate_on_older_clusters() -> None:
    es = engineset(gpuBinding={"mode": "visibleDevices"})
    kubernetes_validate.validate(render_pod(es, CACHE, CONFIG, "ml", "chat", GROUP, 0), "1.28.0", strict=True)
    kubernetes_validate.validate(render_service(es, "ml", "chat"), "1.28.0", strict=True)


def test_schema_validation_has_teeth() -> None:
    claim = render_claim(engineset(), "ml", "chat", GROUP)
    claim["spec"]["devices"]["requests"][0]["exactly"]["count"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(claim, LATEST, strict=True)


# --- the engine pod -------------------------------------------------------------------

def test_dra_pod_carries_the_contract() -> None:
    pod = render_pod(engineset(), CACHE, CONFIG, "ml", "chat", GROUP, 2)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "chat-1-2" and meta["namespace"] == "ml"
    assert meta["labels"] == {
        "app": "chat", "app.kubernetes.io/managed-by": "weightcache-operator", "weightcache.io/engineset": "chat",
        "weightcache.io/group": "1", "weightcache.io/serving": "false",  # the template cannot make a pod serve
        "weightcache.io/template-hash": template_hash(engineset(), CACHE, CONFIG),
        "weightcache.io/cache": "qwen"}  # whose agents may mark it serving (the admission policy)
    assert meta["annotations"] == {"team": "llm", "weightcache.io/node": "node-a",
                                   "weightcache.io/gpus": "GPU-a2,GPU-a3", "weightcache.io/model": "/models/qwen"}
    assert spec["nodeSelector"] == {"pool": "h200", "kubernetes.io/hostname": "node-a"}
    assert spec["resourceClaims"] == [{"name": "weightcache-gpus", "resourceClaimName": "chat-1"}]
    assert "runtimeClassName" not in spec
    engine, sidecar = spec["containers"]
    for c in (engine, sidecar):
        assert c["resources"]["claims"] == [{"name": "weightcache-gpus"}]
        env = env_of(c)
        assert env["WEIGHTCACHE_SOCKET_DIR"] == "/run/weightcache/ml.qwen.e6rorg4tt5ntlnrxgqawn5k3"
        assert env["WEIGHTCACHE_DEVICES"] == "GPU-a2,GPU-a3"
        assert env["WEIGHTCACHE_GROUP"] == "ml/chat-1"
        assert env["WEIGHTCACHE_ROLE"] == "auto"  # the template's "primary" is replaced: the agent decides
        assert env["WEIGHTCACHE_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["WEIGHTCACHE_POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert env["WEIGHTCACHE_POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
        assert "NVIDIA_VISIBLE_DEVICES" not in env
        # read-only: the engine connects, and cannot replace the socket, lock or state files
        assert {"name": "weightcache-sockets", "mountPath": "/run/weightcache/ml.qwen.e6rorg4tt5ntlnrxgqawn5k3",
                "readOnly": True} in c["volumeMounts"]
        assert {"name": "weightcache-models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert {"name": "weightcache-identity", "mountPath": "/var/run/secrets/weightcache.io",
                "readOnly": True} in c["volumeMounts"]
        assert env["WEIGHTCACHE_IDENTITY_TOKEN"] == "/var/run/secrets/weightcache.io/token"
    assert env_of(engine)["LOG"] == "1"
    # The device plugin's GPU count goes (the claim brings the GPUs); everything else stays.
    assert engine["resources"] == {"limits": {"memory": "32Gi"}, "requests": {"cpu": "4"},
                                   "claims": [{"name": "weightcache-gpus"}]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["cache"] == {"name": "cache", "emptyDir": {}}
    assert volumes["weightcache-sockets"]["hostPath"] == {"path": "/run/weightcache/ml.qwen.e6rorg4tt5ntlnrxgqawn5k3", "type": "Directory"}
    assert volumes["weightcache-models"]["hostPath"] == {"path": "/models", "type": "Directory"}
    # the pod's proof of identity for the agent: bound to the pod, for weightcache's audience only
    assert volumes["weightcache-identity"]["projected"] == {"sources": [{"serviceAccountToken": {
        "audience": "weightcache.io", "expirationSeconds": 3600, "path": "token"}}]}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    # The template itself is not modified by rendering.
    assert engineset().template == TEMPLATE


def test_vllms_engine_core_is_forked_unless_the_template_says_otherwise() -> None:
    pod = render_pod(engineset(), CACHE, CONFIG, "ml", "chat", GROUP, 0)
    assert [env_of(c)["VLLM_WORKER_MULTIPROC_METHOD"] for c in pod["spec"]["containers"]] == ["fork", "fork"]
    template = copy.deepcopy(TEMPLATE)
    template["spec"]["containers"][0]["env"].append({"name": "VLLM_WORKER_MULTIPROC_METHOD", "value": "spawn"})
    engine, sidecar = render_pod(engineset(template=template), CACHE, CONFIG, "ml", "chat", GROUP, 0)["spec"]["containers"]
    assert [e for e in engine["env"] if e["name"] == "VLLM_WORKER_MULTIPROC_METHOD"] == [
        {"name": "VLLM_WORKER_MULTIPROC_METHOD", "value": "spawn"}]  # the template's, once
    assert env_of(sidecar)["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def test_visible_devices_pod_uses_the_runtime_and_no_gpu_request() -> None:
    es = engineset(gpuBinding={"mode": "visibleDevices", "runtimeClassName": "nvidia-cdi"})
    pod = render_pod(es, PVC_CACHE, CONFIG, "ml", "chat", GROUP, 0, serving=True)
    spec = pod["spec"]
    assert spec["runtimeClassName"] == "nvidia-cdi"
    assert "resourceClaims" not in spec
    engine = spec["containers"][0]
    assert env_of(engine)["NVIDIA_VISIBLE_DEVICES"] == "GPU-a2,GPU-a3"
    assert "nvidia.com/gpu" not in str(engine.get("resources"))
    assert "claims" not in engine["resources"]
    assert "resources" not in spec["containers"][1]
    assert pod["metadata"]["labels"]["weightcache.io/serving"] == "true"
    assert {v["name"]: v for v in spec["volumes"]}["weightcache-models"] == {
        "name": "weightcache-models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}


def test_template_hash_moves_with_the_template_not_with_placement() -> None:
    base = template_hash(engineset(), CACHE, CONFIG)
    assert template_hash(engineset(replicas=5, standbys=3), CACHE, CONFIG) == base
    other = copy.deepcopy(TEMPLATE)
    other["spec"]["containers"][0]["image"] = "engine:2"
    assert template_hash(parse_engineset("chat", {"cacheRef": {"name": "qwen"}, "template": other}),
                         CACHE, CONFIG) != base
    assert template_hash(engineset(gpuBinding={"mode": "visibleDevices"}), CACHE, CONFIG) != base
    a = render_pod(engineset(), CACHE, CONFIG, "ml", "chat", GROUP, 0)
    b = render_pod(engineset(), CACHE, CONFIG, "ml", "chat", Placement(0, "node-b", ("GPU-b0", "GPU-b1")), 1)
    assert a["metadata"]["labels"]["weightcache.io/template-hash"] == b["metadata"]["labels"]["weightcache.io/template-hash"]
    # Placement is read back from the annotations it was written to.
    assert placement_of(a, 1) == GROUP and placement_of(b, 0) == Placement(0, "node-b", ("GPU-b0", "GPU-b1"))
    assert placement_of({"metadata": {}}, 0) is None


@pytest.mark.parametrize("limit, ok", [("2", True), (2, True), (4, False), ("1", False), ("2Gi", False)])
def test_a_gpu_request_must_equal_the_tensor_parallel_size(limit: Any, ok: bool) -> None:
    template = copy.deepcopy(TEMPLATE)
    template["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": limit}}
    es = parse_engineset("chat", {"cacheRef": {"name": "qwen"}, "template": template})
    if ok:
        check_gpu_resources(es, 2)
        return
    with pytest.raises(SpecError) as e:
        check_gpu_resources(es, 2)
    assert e.value.reason == "TensorParallelMismatch"
    assert "containers[0] (engine) limits nvidia.com/gpu=" in e.value.message and "tensor-parallel size 2" in e.value.message


# --- claim and Service ----------------------------------------------------------------

CEL = celpy.Environment()


def device(uuid: str, driver: str = "gpu.nvidia.com") -> Any:
    return celpy.json_to_cel({"driver": driver, "attributes": {driver: {"uuid": uuid, "productName": "H200"}}})


def test_claim_pins_exactly_the_groups_gpus() -> None:
    claim = render_claim(engineset(gpuBinding={"deviceClassName": "gpu.example.com"}), "ml", "chat", GROUP)
    assert claim["apiVersion"] == "resource.k8s.io/v1" and claim["metadata"]["name"] == "chat-1"
    assert claim["metadata"]["annotations"] == {"weightcache.io/node": "node-a", "weightcache.io/gpus": "GPU-a2,GPU-a3"}
    (request,) = claim["spec"]["devices"]["requests"]
    exactly = request["exactly"]
    assert (exactly["deviceClassName"], exactly["allocationMode"], exactly["count"]) == ("gpu.example.com", "ExactCount", 2)
    program = CEL.program(CEL.compile(exactly["selectors"][0]["cel"]["expression"]))
    assert program.evaluate({"device": device("GPU-a2")}) and program.evaluate({"device": device("GPU-a3")})
    assert not program.evaluate({"device": device("GPU-a0")})
    assert program.evaluate({"device": device("GPU-a3", driver="gpu.example.com")})  # whichever driver publishes it


def test_service_selects_the_serving_pods_only() -> None:
    svc = render_service(engineset(service={"name": "chat-api", "port": 80, "targetPort": 8000}), "ml", "chat")
    assert svc["metadata"]["name"] == "chat-api"
    assert svc["spec"]["selector"] == {"weightcache.io/engineset": "chat", "weightcache.io/serving": "true"}
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": 8000, "protocol": "TCP"}]
    assert render_service(engineset(), "ml", "chat")["metadata"]["name"] == "chat"


def test_agent_identity_objects() -> None:
    sa, rb = render_agent_service_account("ml"), render_agent_role_binding("ml")
    assert sa["metadata"]["name"] == "weightcache-agent" and sa["metadata"]["namespace"] == "ml"
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "weightcache-agent"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "weightcache-agent", "namespace": "ml"}]


# --- placement ------------------------------------------------------------------------

def replicas(node: str, n: int, tp: int = 2) -> list[Replica]:
    return [Replica(node, r, tuple(f"GPU-{node}{r * tp + i}" for i in range(tp))) for r in range(n)]


def test_new_groups_spread_over_nodes_deterministically() -> None:
    ready = replicas("b", 4) + replicas("a", 4)
    placed, unplaced = place(3, {}, ready)
    assert unplaced == []
    assert [(p.node, p.gpus) for p in placed.values()] == [
        ("a", ("GPU-a0", "GPU-a1")), ("b", ("GPU-b0", "GPU-b1")), ("a", ("GPU-a2", "GPU-a3"))]
    assert place(3, {}, list(reversed(ready))) == (placed, [])


def test_existing_groups_keep_their_place_and_never_share_a_replica() -> None:
    ready = replicas("a", 2) + replicas("b", 2)
    existing = {0: Placement(0, "b", ("GPU-b2", "GPU-b3")),
                1: Placement(1, "b", ("GPU-b2", "GPU-b3")),  # overlaps group 0: placed again
                5: Placement(5, "a", ("GPU-a0", "GPU-a1"))}  # beyond replicas: not placed (scaled down)
    placed, unplaced = place(3, existing, ready)
    assert placed[0] == existing[0]
    assert placed[1].node == "a" and placed[2].node == "a"
    assert 5 not in placed and unplaced == []
    gpus = [g for p in placed.values() for g in p.gpus]
    assert len(gpus) == len(set(gpus))
    # A placed group stays where it is even when its replica is not Ready right now.
    placed2, _ = place(1, {0: Placement(0, "gone", ("GPU-x", "GPU-y"))}, ready)
    assert placed2[0].node == "gone"


def test_only_a_group_with_no_running_pod_on_a_node_without_agent_moves() -> None:
    existing = {0: Placement(0, "gone", ("GPU-x", "GPU-y")), 1: Placement(1, "a", ("GPU-a0", "GPU-a1")),
                2: Placement(2, "gone", ("GPU-z", "GPU-w"))}
    # Group 2's pods still run (the node is only between two agent pods): it stays.
    assert orphaned(existing, agent_nodes={"a"}, running={2}) == {0}
    assert orphaned(existing, agent_nodes={"a", "gone"}, running=set()) == set()
    stale = orphaned(existing, agent_nodes={"a"}, running={1, 2})
    placed, _ = place(3, {g: p for g, p in existing.items() if g not in stale}, replicas("a", 2) + replicas("b", 1))
    assert placed[0].node == "b" and placed[1] == existing[1] and placed[2] == existing[2]


def test_groups_beyond_the_ready_replicas_stay_unplaced() -> None:
    placed, unplaced = place(3, {}, replicas("a", 2))
    assert sorted(placed) == [0, 1] and unplaced == [2]
    assert place(2, {}, []) == ({}, [0, 1])


# --- reading the agents ---------------------------------------------------------------

def test_node_replicas_from_the_agent_or_chunked_by_tp() -> None:
    reported = {"phase": "Loading", "gpuUUIDs": ["g0", "g1", "g2", "g3"],
                "replicas": [{"index": 0, "gpus": ["g0", "g1"], "phase": "Ready"},
                             {"index": 1, "gpus": ["g2", "g3"], "phase": "Loading"}]}
    assert node_replicas(reported, 2) == reported["replicas"]
    older = {"phase": "Ready", "gpuUUIDs": ["g0", "g1", "g2", "g3", "g4"]}
    assert node_replicas(older, 2) == [{"index": 0, "gpus": ["g0", "g1"], "phase": "Ready"},
                                       {"index": 1, "gpus": ["g2", "g3"], "phase": "Ready"}]
    assert node_replicas({"phase": "Ready"}, 2) is None
    assert node_replicas({"phase": "Ready", "replicas": [{"gpus": "x", "phase": "Bogus"}, 7]}, 2) == [
        {"index": 0, "gpus": [], "phase": "Ready"}]


def test_weightcache_node_entries_carry_the_replicas() -> None:
    pod = AgentPod(name="qwen-agent-x", node="node-a", ip="10.0.0.1", port=9464, phase="Running", ready=True,
                   terminating=False, created="", waiting=None)
    doc = {"phase": "Ready", "gpuUUIDs": ["g0", "g1", "g2", "g3", "g4", "g5", "g6", "g7"]}
    entry = node_entry(pod, doc, 2)
    assert [r["gpus"] for r in entry["replicas"]] == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"], ["g6", "g7"]]
    assert len(node_entry(pod, doc, 8)["replicas"]) == 1
    assert "replicas" not in node_entry(pod, {"phase": "Ready", "gpuUUIDs": ["g0"]}, 2)  # no whole replica


def test_primaries_prefer_rank_zero_and_skip_malformed_leases() -> None:
    pod = {"namespace": "ml", "name": "chat-0-1", "uid": "u1"}
    doc = {"ranks": [
        {"rank": 1, "leases": [{"role": "primary", "group": "ml/chat-0", "pod": {"name": "chat-0-0", "uid": "u0"}},
                               {"role": "primary", "group": "ml/chat-1", "pod": {"name": "chat-1-0", "uid": "u2"}}]},
        {"rank": 0, "leases": [{"role": "standby", "group": "ml/chat-0", "pod": {"name": "chat-0-0", "uid": "u0"}},
                               {"role": "primary", "group": "ml/chat-0", "pod": pod, "pid": 7},
                               {"role": "primary", "group": "ml/chat-9", "pod": None},
                               "garbage"],
         "clients": 3},
    ]}
    got = primaries(doc)
    assert set(got) == {"ml/chat-0", "ml/chat-1"}
    assert (got["ml/chat-0"].name, got["ml/chat-0"].uid, got["ml/chat-0"].namespace) == ("chat-0-1", "u1", "ml")
    assert got["ml/chat-1"].name == "chat-1-0"
    assert primaries({}) == {} and primaries({"ranks": "x"}) == {}
