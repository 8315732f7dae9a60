"""The chart installs on every Kubernetes it claims, and is safe on each.

`Chart.yaml` claims Kubernetes 1.28 and later, but ValidatingAdmissionPolicy
(`admissionregistration.k8s.io/v1`) is served only from 1.30. Before it, an unconditional
policy would fail the install, and without the policy an agent's write to pods would be
unbounded. So the chart renders its policies only where the API server lists that kind
(`.Capabilities.APIVersions`), and where it does not, agents get no right to write and run
with `--label-pods off` (the operator alone labels pods).

Both capability sets are real here: a control plane with ValidatingAdmissionPolicy turned
off (its resources disabled, as on 1.28 and 1.29, where it is not served at v1) beside the
session's ordinary one; Helm installs the chart into each through its own Go library, which
reads the API server's discovery as `helm install` does.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from k8s_lab import Lab, agent_identity, install_chart, pods_path, unavailable_reason, wait_for

VAP = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
# What a cluster before 1.30 serves: no ValidatingAdmissionPolicy at admissionregistration.k8s.io/v1.
WITHOUT_POLICIES = {
    "RUNTIME_CONFIG": "admissionregistration.k8s.io/v1/validatingadmissionpolicies=false,"
                      "admissionregistration.k8s.io/v1/validatingadmissionpolicybindings=false",
    "APISERVER_EXTRA_ARGS": "--disable-admission-plugins=ValidatingAdmissionPolicy",
}


def operator_env(lab: Lab) -> dict[str, str]:
    deployment = lab.api.get("/apis/apps/v1/namespaces/weightcache-system/deployments/weightcache")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def helm() -> None:
    try:
        import helm_sdkpy  # noqa: F401
    except Exception as e:
        pytest.skip(f"helm-sdkpy not available: {e}")


@pytest.fixture(scope="module")
def old_cluster() -> Iterator[Lab]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no Kubernetes control plane: {reason}")
    helm()
    lab = Lab.start(nodes=("node-1",), settings=WITHOUT_POLICIES)
    try:
        yield lab
    finally:
        lab.stop()
    assert not lab.leftover_pids()


def test_the_chart_installs_without_validating_admission_policies_and_agents_cannot_write(
        old_cluster: Lab, tmp_path: Path) -> None:
    lab = old_cluster
    assert "validatingadmissionpolicies" not in lab.kubectl("api-resources",
                                                            "--api-group=admissionregistration.k8s.io")
    install_chart(lab)  # raises where a template names a kind the cluster does not serve
    # No policy, so nothing that only a policy makes safe.
    assert lab.api.request("GET", VAP)[0] == 404
    assert lab.api.get_or_none("/apis/rbac.authorization.k8s.io/v1/clusterroles/weightcache-agent") is None
    assert operator_env(lab)["WEIGHTCACHE_AGENT_LABEL_PODS"] == "off"
    # An agent's bound token (its namespace's RoleBinding, as the operator makes it) writes nothing.
    ns = lab.namespace("old")
    agent = agent_identity(lab, ns, "node-1", name="llama-agent-x7k2p", token_dir=tmp_path)
    lab.api.create(pods_path(ns), {
        "metadata": {"name": "chat-0-0", "labels": {"weightcache.io/engineset": "chat", "weightcache.io/cache": "llama",
                                                    "weightcache.io/serving": "false"}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "engine", "image": "engine:1"}]}})
    status, body = lab.client(agent.token).request("PATCH", pods_path(ns, "chat-0-0"),
                                                   {"metadata": {"labels": {"weightcache.io/serving": "true"}}},
                                                   content_type="application/merge-patch+json")
    assert status == 403 and "cannot patch resource" in body["message"], body
    # The operator's own rights are RBAC's alone here (watchNamespaces narrows them).
    assert lab.api.get_or_none("/apis/rbac.authorization.k8s.io/v1/clusterroles/weightcache") is not None


def test_the_chart_installs_the_policies_where_the_api_serves_them(k8s_chart: Lab) -> None:
    lab = k8s_chart
    names = {p["metadata"]["name"] for p in lab.api.get(VAP)["items"]}
    assert {"weightcache-agent-serving-label", "weightcache-operator-writes"} <= names
    assert lab.api.get_or_none("/apis/rbac.authorization.k8s.io/v1/clusterroles/weightcache-agent") is not None
    wait_for(lambda: operator_env(lab).get("WEIGHTCACHE_AGENT_LABEL_PODS") == "auto", timeout=10,
             what="agents allowed to label promoted pods")
