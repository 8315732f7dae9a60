"""Dynamic Resource Allocation as an EngineSet group uses it: one ResourceClaim, two pods.

The claim asks for exactly `tp` devices of the GPU DeviceClass, pinned by UUID with a CEL
selector; every pod of the group (primary and standby) references it by name. The real
scheduler must allocate it once, put both pods on the node that has those GPUs, and
reserve the claim for both.
"""
from __future__ import annotations

import uuid as uuidlib
from collections.abc import Iterator
from typing import Any

import pytest

from k8s_lab import GPU_DRIVER, Lab, ns_path, pods_path, wait_for

NODE1_GPUS = [f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f'node-1-{i}')}" for i in range(8)]
NODE2_GPUS = [f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f'node-2-{i}')}" for i in range(8)]

# How the operator pins a group's GPUs. Both spellings work on v1.36: the attribute
# domain is the driver's name, looked up dynamically or written out.
EXPRESSIONS = {
    "driver-lookup": "device.attributes[device.driver].uuid in {uuids}",
    "qualified-name": f'device.attributes["{GPU_DRIVER}"].uuid in {{uuids}}',
}


@pytest.fixture(scope="module")
def gpus(k8s_lab: Lab) -> Lab:
    k8s_lab.publish_gpus("node-1", NODE1_GPUS)
    k8s_lab.publish_gpus("node-2", NODE2_GPUS)
    return k8s_lab


@pytest.fixture
def ns(gpus: Lab) -> Iterator[str]:
    name = gpus.namespace("dra")
    yield name
    gpus.delete_namespace(name)


def claim(name: str, uuids: list[str], expression: str) -> dict[str, Any]:
    cel = expression.format(uuids="[" + ", ".join(f'"{u}"' for u in uuids) + "]")
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                "deviceClassName": GPU_DRIVER, "allocationMode": "ExactCount", "count": len(uuids),
                "selectors": [{"cel": {"expression": cel}}]}}]}}}


def pod(name: str, claim_name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"weightcache.io/engineset": "chat"}},
            "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimName": claim_name}],
                     "containers": [{"name": "engine", "image": "engine:1",
                                     "resources": {"claims": [{"name": "gpus"}]}}]}}


def device_uuids(lab: Lab, results: list[dict[str, Any]]) -> list[str]:
    """The `uuid` attribute of each allocated device, from the ResourceSlices."""
    slices = lab.api.get("/apis/resource.k8s.io/v1/resourceslices")["items"]
    by_name = {(s["spec"]["pool"]["name"], d["name"]): d["attributes"]["uuid"]["string"]
               for s in slices if s["spec"]["driver"] == GPU_DRIVER for d in s["spec"]["devices"]}
    return [by_name[(r["pool"], r["device"])] for r in results]


@pytest.mark.parametrize("expression", list(EXPRESSIONS.values()), ids=list(EXPRESSIONS))
def test_one_claim_pinned_by_uuid_is_shared_by_both_pods_of_a_group(gpus: Lab, ns: str, expression: str) -> None:
    # not the first devices of the first node; each case its own pair (a claim being deleted may hold the other)
    first = 5 if expression == EXPRESSIONS["driver-lookup"] else 2
    pinned = [NODE2_GPUS[first], NODE2_GPUS[first + 1]]
    gpus.api.create(ns_path(ns, "resourceclaims", group="resource.k8s.io"), claim("chat-0", pinned, expression))
    for name in ("chat-0-0", "chat-0-1"):
        gpus.api.create(pods_path(ns), pod(name, "chat-0"))

    def placed() -> list[str] | None:
        nodes = [gpus.api.get(pods_path(ns, n))["spec"].get("nodeName") for n in ("chat-0-0", "chat-0-1")]
        return nodes if all(nodes) else None
    assert wait_for(placed, timeout=30, what="both pods scheduled") == ["node-2", "node-2"]

    c = wait_for(lambda: (c := gpus.api.get(ns_path(ns, "resourceclaims", "chat-0", group="resource.k8s.io")))
                 .get("status", {}).get("reservedFor") and len(c["status"]["reservedFor"]) == 2 and c,
                 timeout=30, what="the claim reserved for both pods")
    uids = {gpus.api.get(pods_path(ns, n))["metadata"]["uid"] for n in ("chat-0-0", "chat-0-1")}
    assert {r["uid"] for r in c["status"]["reservedFor"]} == uids
    results = c["status"]["allocation"]["devices"]["results"]
    assert sorted(device_uuids(gpus, results)) == sorted(pinned)
    assert {r["driver"] for r in results} == {GPU_DRIVER}


def test_a_selector_pinning_absent_gpus_leaves_the_pod_unscheduled(gpus: Lab, ns: str) -> None:
    """The selector really filters: UUIDs no node publishes are never allocated."""
    absent = [NODE1_GPUS[0], "GPU-00000000-0000-0000-0000-000000000000"]
    gpus.api.create(ns_path(ns, "resourceclaims", group="resource.k8s.io"),
                    claim("chat-1", absent, EXPRESSIONS["driver-lookup"]))
    gpus.api.create(pods_path(ns), pod("chat-1-0", "chat-1"))

    def unschedulable() -> bool:
        conds = gpus.api.get(pods_path(ns, "chat-1-0")).get("status", {}).get("conditions", [])
        return any(c["type"] == "PodScheduled" and c["status"] == "False" for c in conds)
    wait_for(unschedulable, timeout=30, what="the scheduler to report the pod unschedulable")
    assert not gpus.api.get(pods_path(ns, "chat-1-0"))["spec"].get("nodeName")
    c = gpus.api.get(ns_path(ns, "resourceclaims", "chat-1", group="resource.k8s.io"))
    assert "allocation" not in c.get("status", {})
