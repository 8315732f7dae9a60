"""The agent's one write and the admission policy that limits it, on a real API server.

The chart is installed for real (its ClusterRole `weightcache-agent` and the
ValidatingAdmissionPolicy `weightcache-agent-serving-label`); the agent is a pod of cache
`llama`'s DaemonSet (`llama-agent-<5 characters>`) on node-1 whose service account is
`weightcache-agent`, with a token bound to that pod as the kubelet would mount it. The
writer (`serve/serving_label.py`) then talks to the API server with nothing but that token
file and the cluster CA. What it may do is a promotion and nothing more: mark an EngineSet
pod of its own cache, on its own node, in its own namespace, serving.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from k8s_lab import AGENT_SA, AgentIdentity, ApiClient, Lab, agent_identity, pods_path, wait_for
from weightcache_agent.serve.serving_label import SERVING_LABEL, ServingLabelError, ServingLabelWriter

POLICY = "weightcache-agent-serving-label"
CACHE = "llama"
AGENT_POD = f"{CACHE}-agent-x7k2p"  # as the DaemonSet controller names its pods


@dataclass
class Scene:
    lab: Lab
    ns: str
    agent: AgentIdentity
    writer: ServingLabelWriter
    as_agent: ApiClient  # raw requests with the agent's token
    uids: dict[str, str]


def engine_pod(name: str, node: str, *, engineset: str | None = "chat", cache: str | None = CACHE) -> dict[str, Any]:
    labels = {"app.kubernetes.io/managed-by": "weightcache-operator"}
    if engineset:
        labels |= {"weightcache.io/engineset": engineset, "weightcache.io/group": "0", SERVING_LABEL: "false"}
    if engineset and cache:
        labels["weightcache.io/cache"] = cache
    return {"metadata": {"name": name, "labels": labels, "annotations": {"weightcache.io/node": node}},
            "spec": {"nodeName": node, "containers": [{"name": "engine", "image": "engine:1"}]}}


@pytest.fixture(scope="module")
def scene(k8s_chart: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    lab = k8s_chart
    ns = lab.namespace("policy")
    agent = agent_identity(lab, ns, "node-1", name=AGENT_POD, token_dir=tmp_path_factory.mktemp("token"))
    uids = {}
    for name, node, es, cache in (("chat-0-0", "node-1", "chat", CACHE), ("chat-1-0", "node-2", "chat", CACHE),
                                  ("plain", "node-1", None, None), ("qwen-0-0", "node-1", "qwen", "qwen"),
                                  ("llama2-0-0", "node-1", "llama2", "llama2"),
                                  ("nocache-0-0", "node-1", "nocache", None)):
        uids[name] = lab.api.create(pods_path(ns), engine_pod(name, node, engineset=es, cache=cache))["metadata"]["uid"]
    writer = ServingLabelWriter(lab.server, token_path=agent.token_path, ca_path=lab.ca_path, timeout=5)
    as_agent = lab.client(agent.token)
    # A new policy takes effect once the API server has loaded it: wait for its first denial.
    wait_for(lambda: as_agent.request("PATCH", pods_path(ns, "chat-1-0"), {"metadata": {"labels": {"x": "1"}}},
                                      content_type="application/merge-patch+json")[0] == 403,
             timeout=30, what="the admission policy to take effect")
    writer.connect()
    yield Scene(lab, ns, agent, writer, as_agent, uids)
    writer.close()
    lab.delete_namespace(ns)


def labels_of(scene: Scene, name: str) -> dict[str, str]:
    return scene.lab.api.get(pods_path(scene.ns, name))["metadata"].get("labels", {})


def set_serving(scene: Scene, name: str, value: str) -> None:
    scene.lab.api.patch(pods_path(scene.ns, name), {"metadata": {"labels": {SERVING_LABEL: value}}})


ONLY_PROMOTION = 'may only set the weightcache.io/serving label to "true" (a promotion), and change nothing else'


def agent_patch(scene: Scene, name: str, patch: dict[str, Any]) -> tuple[int, Any]:
    return scene.as_agent.request("PATCH", pods_path(scene.ns, name), patch,
                                  content_type="application/merge-patch+json")


def test_the_api_server_type_checks_the_policy_without_warnings(scene: Scene) -> None:
    policy = scene.lab.api.get(f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{POLICY}")
    assert policy["status"]["observedGeneration"] == policy["metadata"]["generation"]
    assert not policy["status"].get("typeChecking", {}).get("expressionWarnings"), policy["status"]
    role = scene.lab.api.get("/apis/rbac.authorization.k8s.io/v1/clusterroles/weightcache-agent")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"]}]


def test_agent_marks_an_engine_pod_on_its_own_node_serving(scene: Scene, time_bar) -> None:
    set_serving(scene, "chat-0-0", "false")
    seconds = scene.writer.mark_serving(scene.ns, "chat-0-0", scene.uids["chat-0-0"])
    assert labels_of(scene, "chat-0-0")[SERVING_LABEL] == "true"
    assert seconds > 0
    time_bar("the agent's serving-label write", seconds, 5.0)
    # one kept-alive connection, opened by connect(), serves every write
    for _ in range(3):
        set_serving(scene, "chat-0-0", "false")
        scene.writer.mark_serving(scene.ns, "chat-0-0", scene.uids["chat-0-0"])
    assert scene.writer.connections_opened == 1


def test_writer_from_the_pods_environment(scene: Scene, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KUBERNETES_SERVICE_HOST", "WEIGHTCACHE_KUBE_API"):
        monkeypatch.delenv(var, raising=False)
    assert ServingLabelWriter.from_environment() is None  # not in a cluster: no writer, no error
    server = urllib.parse.urlsplit(scene.lab.server)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", server.hostname or "")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    monkeypatch.setenv("WEIGHTCACHE_KUBE_TOKEN", str(scene.agent.token_path))
    monkeypatch.setenv("WEIGHTCACHE_KUBE_CA", str(scene.lab.ca_path))
    writer = ServingLabelWriter.from_environment()
    assert writer is not None and writer.connections_opened == 1  # connected ahead of the first promotion
    set_serving(scene, "chat-0-0", "false")
    writer.mark_serving(scene.ns, "chat-0-0", scene.uids["chat-0-0"])
    assert labels_of(scene, "chat-0-0")[SERVING_LABEL] == "true" and writer.connections_opened == 1
    writer.close()


def test_writer_keeps_its_connection_open_between_promotions(scene: Scene) -> None:
    writer = ServingLabelWriter(scene.lab.server, token_path=scene.agent.token_path, ca_path=scene.lab.ca_path,
                                timeout=5, keepalive=0.1)
    writer.connect()
    wait_for(lambda: writer.keepalives_sent >= 3, timeout=10, what="keep-alive requests")
    set_serving(scene, "chat-0-0", "false")
    writer.mark_serving(scene.ns, "chat-0-0", scene.uids["chat-0-0"])
    assert writer.connections_opened == 1
    writer.close()


def test_agent_is_denied_a_pod_on_another_node(scene: Scene, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), pytest.raises(ServingLabelError) as err:
        scene.writer.mark_serving(scene.ns, "chat-1-0", scene.uids["chat-1-0"])
    message = str(err.value)
    assert "403" in message and POLICY in message and "node node-1 may not write a pod on another node" in message
    assert "\n" not in message
    records = [r for r in caplog.records if r.name.endswith("serving_label")]
    assert len(records) == 1 and records[0].exc_info is None and "\n" not in records[0].getMessage()
    assert labels_of(scene, "chat-1-0")[SERVING_LABEL] == "false"


def test_promotion_hook_labels_the_pod_a_lease_names(scene: Scene, caplog: pytest.LogCaptureFixture) -> None:
    set_serving(scene, "chat-0-0", "false")
    pod = {"namespace": scene.ns, "name": "chat-0-0", "uid": scene.uids["chat-0-0"]}
    assert scene.writer.label_promoted(pod) is not None
    assert labels_of(scene, "chat-0-0")[SERVING_LABEL] == "true"
    # no pod in the lease, or a refused write: nothing raised, the agent goes on
    assert scene.writer.label_promoted(None) is None
    assert scene.writer.label_promoted({"namespace": scene.ns, "name": "chat-1-0", "uid": scene.uids["chat-1-0"]}) \
        is None
    assert labels_of(scene, "chat-1-0")[SERVING_LABEL] == "false"


def test_agent_is_denied_a_pod_outside_an_engineset(scene: Scene) -> None:
    with pytest.raises(ServingLabelError, match="may only write EngineSet pods of its own cache"):
        scene.writer.mark_serving(scene.ns, "plain", scene.uids["plain"])
    assert SERVING_LABEL not in labels_of(scene, "plain")


@pytest.mark.parametrize("pod", ["qwen-0-0", "llama2-0-0", "nocache-0-0"],
                         ids=["another-cache", "a-cache-whose-name-extends-ours", "no-cache-label"])
def test_agent_is_denied_the_engines_of_another_cache_on_its_node(scene: Scene, pod: str) -> None:
    """The namespace's agents share one ServiceAccount: the token's agent pod names the cache."""
    with pytest.raises(ServingLabelError, match="may only write EngineSet pods of its own cache"):
        scene.writer.mark_serving(scene.ns, pod, scene.uids[pod])
    assert labels_of(scene, pod)[SERVING_LABEL] == "false"


def test_agent_may_not_take_the_serving_label_away(scene: Scene) -> None:
    """A promotion only ever adds a serving engine: "false" and removal are the operator's."""
    set_serving(scene, "chat-0-0", "true")
    for labels in ({SERVING_LABEL: "false"}, {SERVING_LABEL: None}):
        status, body = agent_patch(scene, "chat-0-0", {"metadata": {"labels": labels}})
        assert status == 403 and 'may only set the weightcache.io/serving label to "true"' in body["message"], body
    assert labels_of(scene, "chat-0-0")[SERVING_LABEL] == "true"


def test_agent_is_denied_pods_of_another_namespace_even_when_rbac_allows_it(scene: Scene) -> None:
    lab = scene.lab
    other = lab.namespace("policy-other")
    try:
        uid = lab.api.create(pods_path(other), engine_pod("chat-0-0", "node-1"))["metadata"]["uid"]
        lab.api.call("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
            "metadata": {"name": f"{scene.ns}-agent-everywhere"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": AGENT_SA},
            "subjects": [{"kind": "ServiceAccount", "name": AGENT_SA, "namespace": scene.ns}]}, ok=(409,))
        try:
            def attempt() -> tuple[int, Any]:
                return scene.as_agent.request("PATCH", pods_path(other, "chat-0-0"),
                                              {"metadata": {"uid": uid, "labels": {SERVING_LABEL: "true"}}},
                                              content_type="application/merge-patch+json")
            status, body = wait_for(lambda: (r := attempt())[0] != 403 or "cannot patch" not in r[1]["message"]
                                    and r, timeout=15, what="the cluster-wide RBAC to apply")
            assert status == 403 and "may only write pods of its own namespace" in body["message"], body
            assert lab.api.get(pods_path(other, "chat-0-0"))["metadata"]["labels"][SERVING_LABEL] == "false"
        finally:
            lab.api.delete(f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{scene.ns}-agent-everywhere")
    finally:
        lab.delete_namespace(other)


@pytest.mark.parametrize("patch, denial", [
    ({"metadata": {"labels": {"weightcache.io/group": "7"}}}, ONLY_PROMOTION),
    ({"metadata": {"labels": {"team": "x"}}}, ONLY_PROMOTION),
    ({"metadata": {"labels": {"weightcache.io/engineset": None}}}, ONLY_PROMOTION),
    ({"metadata": {"labels": {SERVING_LABEL: "maybe"}}}, ONLY_PROMOTION),
    ({"metadata": {"labels": {SERVING_LABEL: "true", "team": "x"}}}, ONLY_PROMOTION),
    ({"metadata": {"labels": {SERVING_LABEL: "true", "weightcache.io/cache": "qwen"}}}, ONLY_PROMOTION),
    ({"metadata": {"annotations": {"weightcache.io/gpus": "GPU-x"}}}, "annotations, finalizers, owners or spec"),
    ({"metadata": {"finalizers": ["example.com/hold"]}}, "annotations, finalizers, owners or spec"),
    ({"spec": {"activeDeadlineSeconds": 30}}, "annotations, finalizers, owners or spec"),
    ({"metadata": {"labels": {SERVING_LABEL: "true"}}, "spec": {"activeDeadlineSeconds": 30}},
     "annotations, finalizers, owners or spec"),
], ids=["group-label", "new-label", "drop-engineset", "bad-value", "serving-plus-label", "serving-plus-cache",
        "annotation", "finalizer", "spec", "serving-plus-spec"])
def test_agent_may_change_nothing_but_the_serving_label(scene: Scene, patch: dict[str, Any], denial: str) -> None:
    before = scene.lab.api.get(pods_path(scene.ns, "chat-0-0"))
    status, body = agent_patch(scene, "chat-0-0", patch)
    assert status == 403, body
    assert POLICY in body["message"] and denial in body["message"]
    after = scene.lab.api.get(pods_path(scene.ns, "chat-0-0"))
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


def test_agent_token_without_a_node_is_denied(scene: Scene) -> None:
    unbound = scene.lab.client(scene.lab.bound_token(scene.ns, AGENT_SA))  # not bound to a pod: no node
    status, body = unbound.request("PATCH", pods_path(scene.ns, "chat-0-0"),
                                   {"metadata": {"labels": {SERVING_LABEL: "true"}}},
                                   content_type="application/merge-patch+json")
    assert status == 403 and "token is not bound to a pod on a node" in body["message"]


def test_agent_may_write_nothing_else_even_when_rbac_allows_it(scene: Scene) -> None:
    lab, ns = scene.lab, scene.ns
    lab.api.call("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", {
        "metadata": {"name": "extra"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps", "pods"], "verbs": ["create", "delete"]}]},
        ok=(409,))
    lab.api.call("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", {
        "metadata": {"name": "extra"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "extra"},
        "subjects": [{"kind": "ServiceAccount", "name": AGENT_SA, "namespace": ns}]}, ok=(409,))
    # RBAC now allows these; the policy still refuses them
    def create_configmap() -> tuple[int, Any]:
        return scene.as_agent.request("POST", f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "x"}})
    status, body = wait_for(lambda: (r := create_configmap())[0] != 403 or "cannot create" not in r[1]["message"]
                            and r, timeout=15, what="the extra RBAC to apply")
    assert status == 403 and "may only update pods, not CREATE configmaps" in body["message"]
    status, body = scene.as_agent.request("DELETE", pods_path(ns, "chat-0-0"))
    assert status == 403 and "may only update pods, not DELETE pods" in body["message"]
    assert lab.api.get_or_none(pods_path(ns, "chat-0-0")) is not None


def test_other_service_accounts_are_not_limited_by_the_policy(scene: Scene, tmp_path: Path) -> None:
    lab, ns = scene.lab, scene.ns
    lab.service_account(ns, "other", cluster_role=AGENT_SA)  # same grants, another name
    lab.api.create(pods_path(ns), {"metadata": {"name": "other-node-1"},
                                   "spec": {"nodeName": "node-1", "serviceAccountName": "other",
                                            "containers": [{"name": "c", "image": "x"}]}})
    token = tmp_path / "token"
    token.write_text(lab.bound_token(ns, "other", "other-node-1"))
    # the very write the agent is denied (a pod on node-2), from a token bound to a pod on node-1
    set_serving(scene, "chat-1-0", "false")
    writer = ServingLabelWriter(lab.server, token_path=token, ca_path=lab.ca_path, timeout=5)
    writer.mark_serving(ns, "chat-1-0", scene.uids["chat-1-0"])
    writer.close()
    assert labels_of(scene, "chat-1-0")[SERVING_LABEL] == "true"
    other = lab.client(token.read_text())
    status, body = other.request("PATCH", pods_path(ns, "chat-1-0"),  # and any other change RBAC allows
                                 {"metadata": {"labels": {"team": "x", SERVING_LABEL: "false"},
                                               "annotations": {"a": "b"}}},
                                 content_type="application/merge-patch+json")
    assert status == 200, body
    assert labels_of(scene, "chat-1-0")["team"] == "x"
    lab.service_account(ns, "nobody")  # no grants: RBAC, not the policy, refuses
    nobody = lab.client(lab.bound_token(ns, "nobody"))
    status, body = nobody.request("PATCH", pods_path(ns, "chat-1-0"), {"metadata": {"labels": {"team": "y"}}},
                                  content_type="application/merge-patch+json")
    assert status == 403 and "cannot patch resource" in body["message"] and POLICY not in body["message"]


def test_uid_precondition_leaves_a_replacement_pod_alone(scene: Scene) -> None:
    set_serving(scene, "chat-0-0", "false")
    with pytest.raises(ServingLabelError, match="422"):
        scene.writer.mark_serving(scene.ns, "chat-0-0", "00000000-0000-0000-0000-000000000000")
    assert labels_of(scene, "chat-0-0")[SERVING_LABEL] == "false"
    with pytest.raises(ServingLabelError, match="404"):
        scene.writer.mark_serving(scene.ns, "chat-9-0", scene.uids["chat-0-0"])


def test_writer_reads_a_rotated_token(scene: Scene, tmp_path: Path) -> None:
    """A refused token is one 401 line; a new token file (as the kubelet swaps it in) is picked up."""
    lab, ns = scene.lab, scene.ns
    token_path = tmp_path / "token"
    token_path.write_text("not-a-token")
    writer = ServingLabelWriter(lab.server, token_path=token_path, ca_path=lab.ca_path, timeout=5)
    writer.connect()
    set_serving(scene, "chat-0-0", "false")
    with pytest.raises(ServingLabelError, match="401"):
        writer.mark_serving(ns, "chat-0-0", scene.uids["chat-0-0"])
    new = tmp_path / "token.new"
    new.write_text(scene.agent.token)
    new.replace(token_path)
    writer.mark_serving(ns, "chat-0-0", scene.uids["chat-0-0"])
    assert labels_of(scene, "chat-0-0")[SERVING_LABEL] == "true"
    assert writer.connections_opened == 1  # a 401 does not cost the connection
    writer.close()


def test_writer_gives_up_within_its_timeout(scene: Scene, time_bar) -> None:
    """An API server that accepts and never answers costs the agent `timeout`, no more."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        held: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            silent.settimeout(0.1)
            while not stop.is_set():
                try:
                    held.append(silent.accept()[0])
                except OSError:
                    pass
        t = threading.Thread(target=accept, daemon=True)
        t.start()
        writer = ServingLabelWriter(f"https://127.0.0.1:{port}", token_path=scene.agent.token_path,
                                    ca_path=scene.lab.ca_path, timeout=0.5)
        start = time.monotonic()
        with pytest.raises(ServingLabelError, match="timed out|connect"):
            writer.mark_serving(scene.ns, "chat-0-0", scene.uids["chat-0-0"])
        elapsed = time.monotonic() - start
        stop.set()
        t.join()
        for s in held:
            s.close()
    time_bar("a label write to an API server that never answers (timeout 0.5 s)", elapsed, 1.0)
