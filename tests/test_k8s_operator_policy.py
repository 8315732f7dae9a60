"""The operator's reach, on a real API server with the chart installed.

RBAC gives the operator's service account verbs on kinds in every namespace it handles
(create pods, patch DaemonSets, create Secrets and RoleBindings); the chart's
ValidatingAdmissionPolicy `weightcache-operator-writes` narrows that to objects it owns.
Here the operator's own token attacks: it may not touch a pod or DaemonSet that is not
weightcache's, adopt one by labelling it, run another image in an agent DaemonSet, nor
bind anything but the agents' account. Then the real operator (its own process, that same
token) reconciles a WeightCache through the policy, and refuses one whose spec.agent.image
the admin did not allow: a namespace editor does not choose what runs privileged on nodes.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from k8s_lab import REPO, ApiClient, Lab, ns_path, pods_path, wait_for
from operator_fixtures import LLAMA_SPEC

POLICY = "weightcache-operator-writes"
OPERATOR_SA = ("weightcache-system", "weightcache")  # the chart's release `weightcache`
AGENT_IMAGE = "ghcr.io/weightcache/agent:0.1.0"  # the chart's agent.image
OWNED = {"app.kubernetes.io/managed-by": "weightcache-operator"}
WC = "/apis/weightcache.io/v1alpha1"


@pytest.fixture(scope="module")
def ns(k8s_chart: Lab) -> Iterator[str]:
    lab = k8s_chart
    ns = lab.namespace("reach")
    policy = lab.api.get(f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{POLICY}")
    assert not policy.get("status", {}).get("typeChecking", {}).get("expressionWarnings"), policy["status"]
    as_operator = lab.client(lab.bound_token(*OPERATOR_SA))
    # A new policy takes effect once the API server has loaded it: wait for its first denial.
    wait_for(lambda: as_operator.request("POST", ns_path(ns, "configmaps"), {"metadata": {"name": "probe"}})[0] == 403,
             timeout=30, what="the operator policy to take effect")
    yield ns
    lab.delete_namespace(ns)


@pytest.fixture(scope="module")
def as_operator(k8s_chart: Lab) -> ApiClient:
    return k8s_chart.client(k8s_chart.bound_token(*OPERATOR_SA))


def pod(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "app:1"}]}}


def daemonset(name: str, image: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    selector = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"selector": {"matchLabels": selector},
                     "template": {"metadata": {"labels": selector},
                                  "spec": {"containers": [{"name": "agent", "image": image,
                                                           "securityContext": {"privileged": True}}]}}}}


def denied(answer: tuple[int, Any], words: str) -> bool:
    status, body = answer
    return status == 403 and POLICY in body.get("message", "") and words in body["message"]


def test_the_operator_may_not_touch_pods_it_does_not_own(k8s_chart: Lab, ns: str, as_operator: ApiClient) -> None:
    lab = k8s_chart
    lab.api.create(pods_path(ns), pod("victim", {"app": "db"}))
    assert denied(as_operator.request("PATCH", pods_path(ns, "victim"), {"metadata": {"labels": {"x": "1"}}},
                                      content_type="application/merge-patch+json"),
                  "may only UPDATE pods labelled app.kubernetes.io/managed-by=weightcache-operator")
    # nor adopt it by labelling it ours
    assert denied(as_operator.request("PATCH", pods_path(ns, "victim"), {"metadata": {"labels": OWNED}},
                                      content_type="application/merge-patch+json"), "may only UPDATE pods")
    assert denied(as_operator.request("DELETE", pods_path(ns, "victim")), "may only DELETE pods")
    assert lab.api.get(pods_path(ns, "victim"))["metadata"]["labels"] == {"app": "db"}
    assert denied(as_operator.request("POST", pods_path(ns), pod("stray")), "may only CREATE pods")
    # Its own engine pods: created, patched, deleted.
    status, body = as_operator.request("POST", pods_path(ns), pod("engine-0-0", {**OWNED, "app": "chat"}))
    assert status == 201, body
    status, body = as_operator.request("PATCH", pods_path(ns, "engine-0-0"),
                                       {"metadata": {"labels": {"weightcache.io/serving": "true"}}},
                                       content_type="application/merge-patch+json")
    assert status == 200, body
    assert denied(as_operator.request("PATCH", pods_path(ns, "engine-0-0"),  # nor give one away
                                      {"metadata": {"labels": {"app.kubernetes.io/managed-by": "helm"}}},
                                      content_type="application/merge-patch+json"), "may only UPDATE pods")
    assert as_operator.request("DELETE", pods_path(ns, "engine-0-0"), params={"gracePeriodSeconds": 0})[0] == 200
    # Nor, with its label, a pod with the node's privileges: those are the agents' alone.
    for name, change in (("priv", {"containers": [{"name": "c", "image": "app:1",
                                                   "securityContext": {"privileged": True}}]}),
                         ("hostnet", {"hostNetwork": True}), ("hostpid", {"hostPID": True})):
        body = pod(name, OWNED)
        body["spec"].update(change)
        assert denied(as_operator.request("POST", pods_path(ns), body), "may not create privileged pods"), name


def test_an_agent_daemonset_runs_only_the_admins_images(ns: str, as_operator: ApiClient) -> None:
    path = ns_path(ns, "daemonsets", group="apps")
    assert denied(as_operator.request("POST", path, daemonset("evil-agent", "attacker/rootkit:1", OWNED)),
                  "may only run the chart's agent images")
    assert denied(as_operator.request("POST", path, daemonset("plain", AGENT_IMAGE)), "may only CREATE daemonsets")
    status, body = as_operator.request("POST", path, daemonset("llama-agent", AGENT_IMAGE, OWNED))
    assert status == 201, body
    swap = {"spec": {"template": {"spec": {"containers": [{"name": "agent", "image": "attacker/rootkit:1"}]}}}}
    assert denied(as_operator.request("PATCH", f"{path}/llama-agent", swap,
                                      content_type="application/strategic-merge-patch+json"),
                  "may only run the chart's agent images")


def test_secrets_configmaps_and_bindings_only_its_own(ns: str, as_operator: ApiClient) -> None:
    assert denied(as_operator.request("POST", ns_path(ns, "secrets"), {"metadata": {"name": "s"}, "data": {}}),
                  "may only CREATE secrets")
    assert denied(as_operator.request("POST", ns_path(ns, "configmaps"), {"metadata": {"name": "c"}}),
                  "may only CREATE configmaps")
    bindings = ns_path(ns, "rolebindings", group="rbac.authorization.k8s.io")

    def binding(name: str, subject: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": OWNED},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": "weightcache-agent"},
                "subjects": [{"kind": "ServiceAccount", "name": subject, "namespace": ns}]}
    assert denied(as_operator.request("POST", bindings, binding("default-agent", "default")),
                  "may only bind the agents' ServiceAccount")
    status, body = as_operator.request("POST", bindings, binding("weightcache-agent", "weightcache-agent"))
    assert status == 201, body.get("message")


def test_the_operator_reconciles_through_the_policy_and_refuses_an_image_it_does_not_allow(
        k8s_chart: Lab, tmp_path: Path) -> None:
    lab = k8s_chart
    ns = lab.namespace("reach-op")
    kubeconfig = tmp_path / "operator.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "lab", "cluster": {"server": lab.server, "certificate-authority": str(lab.ca_path)}}],
        "users": [{"name": "operator", "user": {"token": lab.bound_token(*OPERATOR_SA)}}],
        "contexts": [{"name": "operator", "context": {"cluster": "lab", "user": "operator"}}]}))
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32).hex().encode())
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'node_agent'}:{REPO / 'operator'}",
           # as the chart's Deployment sets them
           "WEIGHTCACHE_AGENT_IMAGE": AGENT_IMAGE, "WEIGHTCACHE_AGENT_ALLOWED_IMAGES": "",
           "WEIGHTCACHE_AGENT_LABEL_PODS": "auto", "WEIGHTCACHE_CONTROL_KEY_FILE": str(key),
           "WEIGHTCACHE_POLL_INTERVAL": "1"}
    log = open(tmp_path / "operator.log", "w+")
    operator = subprocess.Popen([sys.executable, "-m", "weightcache_agent.cli", "operator", "-n", ns,
                                 "--kubeconfig", str(kubeconfig)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        caches = f"{WC}/namespaces/{ns}/weightcaches"
        lab.api.create(caches, {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache",
                                "metadata": {"name": "good"}, "spec": LLAMA_SPEC})
        lab.api.create(caches, {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache",
                                "metadata": {"name": "bad"},
                                "spec": {**LLAMA_SPEC, "agent": {"image": "attacker/rootkit:1"}}})
        ds = wait_for(lambda: lab.api.get_or_none(ns_path(ns, "daemonsets", "good-agent", group="apps")),
                      timeout=240, what="the operator's DaemonSet")  # its start imports kopf and kubernetes: slow on a busy machine
        assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == AGENT_IMAGE
        for path in (ns_path(ns, "serviceaccounts", "weightcache-agent"), ns_path(ns, "secrets", "good-agent-control"),
                     ns_path(ns, "rolebindings", "weightcache-agent", group="rbac.authorization.k8s.io")):
            wait_for(lambda path=path: lab.api.get_or_none(path), timeout=30, what=path)

        def refusal() -> dict[str, Any] | None:
            conditions = (lab.api.get(f"{caches}/bad").get("status") or {}).get("conditions") or []
            return next((c for c in conditions if c.get("reason") == "AgentImageNotAllowed" and c["type"] == "Degraded"
                         and c["status"] == "True"), None)
        condition = wait_for(refusal, timeout=60, what="the refusal of an image the admin did not allow")
        assert condition["message"].startswith("agent.image 'attacker/rootkit:1' is not an image the cluster admin "
                                               f"allows for agents (allowed: {AGENT_IMAGE};")
        assert lab.api.get_or_none(ns_path(ns, "daemonsets", "bad-agent", group="apps")) is None
        log.seek(0)
        output = log.read()
        assert "Traceback" not in output and POLICY not in output, output[-3000:]
    finally:
        operator.terminate()
        operator.wait(90)
        log.close()
        lab.delete_namespace(ns)
