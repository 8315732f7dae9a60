"""Owner-reference garbage collection: deleting the owner removes what it owns.

The operator relies on it instead of deleting children (its RBAC has no delete): the
pods, ResourceClaims and Services of an EngineSet carry an owner reference to it. The
owner here stands in for it: a WeightCache, a custom resource created from the project's
CRD (what matters to the collector is an owner of a custom kind); the fake kubelet
confirms the pods' deletion as a kubelet would.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from fake_kubelet import FakeKubelet
from k8s_lab import CRDS, GPU_DRIVER, Lab, ns_path, pods_path, wait_for
from operator_fixtures import LLAMA_SPEC


@pytest.fixture
def ns(k8s_lab: Lab) -> Iterator[str]:
    name = k8s_lab.namespace("gc")
    yield name
    k8s_lab.delete_namespace(name)


def owner_object(lab: Lab, ns: str) -> tuple[str, dict[str, Any]]:
    """(collection path, created object) of a custom resource to own the children."""
    kinds = {}
    for path in CRDS.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                kinds[doc["spec"]["names"]["kind"]] = doc
    crd = kinds["WeightCache"]
    group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
    version = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
    path = f"/apis/{group}/{version}/namespaces/{ns}/{plural}"
    obj = lab.api.create(path, {"apiVersion": f"{group}/{version}", "kind": "WeightCache",
                                "metadata": {"name": "owner"}, "spec": LLAMA_SPEC})
    return path, obj


@pytest.mark.parametrize("propagation", ["Background", "Foreground"])
def test_deleting_the_owner_removes_its_pods_claims_and_services(k8s_lab: Lab, ns: str, propagation: str) -> None:
    path, owner = owner_object(k8s_lab, ns)
    ref = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
           "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    api = k8s_lab.api
    children = {
        pods_path(ns, "chat-0-0"): api.create(pods_path(ns), {
            "metadata": {"name": "chat-0-0", "ownerReferences": [ref]},
            "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "x", "command": ["sleep", "600"]}]}}),
        ns_path(ns, "resourceclaims", "chat-0", group="resource.k8s.io"): api.create(
            ns_path(ns, "resourceclaims", group="resource.k8s.io"), {
                "metadata": {"name": "chat-0", "ownerReferences": [ref]},
                "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                    "deviceClassName": GPU_DRIVER, "allocationMode": "ExactCount", "count": 1}}]}}}),
        ns_path(ns, "services", "chat"): api.create(ns_path(ns, "services"), {
            "metadata": {"name": "chat", "ownerReferences": [ref]},
            "spec": {"selector": {"weightcache.io/engineset": "chat"}, "ports": [{"port": 8000}]}}),
    }
    unowned = api.create(ns_path(ns, "services"), {"metadata": {"name": "bystander"},
                                                   "spec": {"ports": [{"port": 8000}]}})
    with FakeKubelet(k8s_lab, ["node-1"], namespace=ns) as kubelet:
        wait_for(lambda: kubelet.process(ns, "chat-0-0"), timeout=10, what="the pod's process")
        proc = kubelet.process(ns, "chat-0-0")
        api.delete(f"{path}/owner", propagation=propagation)
        for child in children:
            wait_for(lambda child=child: api.get_or_none(child) is None, timeout=30, what=f"{child} collected")
        wait_for(lambda: api.get_or_none(f"{path}/owner") is None, timeout=30, what="the owner gone")
        assert proc is not None and proc.poll() is not None
        assert not kubelet.errors, kubelet.errors
    assert api.get_or_none(ns_path(ns, "services", unowned["metadata"]["name"])) is not None
