"""What a new user of the operator reads, against kmock: the status behind `kubectl get wc`'s
columns (counts written as 0, never left out), the Warning events of a cache no node runs and
of a cache whose PersistentVolumeClaim does not exist, and the operator's log at INFO, which
says nothing on a poll that finds nothing new. `kubectl get` itself, on a real control plane:
tests/test_newcomer_k8s.py."""
from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from operator_fixtures import (
    DS_RESOURCE,
    LLAMA_SPEC,
    POD_RESOURCE,
    POLL,
    WC_RESOURCE,
    KubeClient,
    condition,
    emulated_cluster,
    events_for,
    get_object,
    requests_of,
    running_operator,
    wait_for,
    weightcache,
    write_kubeconfig,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


@pytest_asyncio.fixture()
async def cluster(kmock: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeClient]:
    async with emulated_cluster(kmock, tmp_path, monkeypatch) as client:
        yield client


def wc_of(kmock: Any, name: str) -> dict[str, Any] | None:
    return get_object(kmock, WC_RESOURCE, "default", name)


def warnings_for(kmock: Any, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in events_for(kmock, name) if e["type"] == "Warning" and e["reason"] == reason]


async def daemonset_scheduled(client: KubeClient, name: str, desired: int) -> None:
    """The DaemonSet controller's status: `desired` nodes match the cache's selector."""
    await client.patch(DS_RESOURCE, "default", f"{name}-agent", {"status": {
        "desiredNumberScheduled": desired, "updatedNumberScheduled": desired, "currentNumberScheduled": desired,
        "numberReady": 0}}, subresource="status")


async def test_counts_are_0_not_absent_and_no_node_is_a_warning(cluster: KubeClient, kmock: Any) -> None:
    async with running_operator(kmock, "weightcaches"):
        # Rejected by the operator before any agent exists: still READY 0 and NODES 0.
        await cluster.create(WC_RESOURCE, weightcache("bad", {**LLAMA_SPEC, "quantization": "awq"}))
        bad = await wait_for(lambda: condition(wc_of(kmock, "bad"), "Ready") and wc_of(kmock, "bad"))
        assert (bad["status"]["readyNodes"], bad["status"]["desiredNodes"]) == (0, 0)
        assert condition(bad, "Ready")["reason"] == "RefusedQuantization"
        await wait_for(lambda: warnings_for(kmock, "bad", "RefusedQuantization"), what="its Warning event")

        # Rendered, and no node matches: NoNodes on the Ready condition (the STATUS column), a Warning.
        await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))
        await wait_for(lambda: get_object(kmock, DS_RESOURCE, "default", "llama-agent"), what="the DaemonSet")
        starting = await wait_for(lambda: condition(wc_of(kmock, "llama"), "Ready") and wc_of(kmock, "llama"))
        assert (starting["status"]["readyNodes"], starting["status"]["desiredNodes"]) == (0, 0)
        await daemonset_scheduled(cluster, "llama", 0)
        ready = await wait_for(lambda: (c := condition(wc_of(kmock, "llama"), "Ready")) and c["reason"] == "NoNodes"
                               and c, what="Ready NoNodes")
        assert ready["status"] == "False" and "nodeSelector" in ready["message"]
        assert condition(wc_of(kmock, "llama"), "Degraded")["reason"] == "NoNodes"
        warned = await wait_for(lambda: warnings_for(kmock, "llama", "NoNodes"), what="a NoNodes Warning event")
        assert any("no node runs an agent" in e["message"] for e in warned), warned
        assert not [e for e in events_for(kmock, "llama") if e["reason"] == "NoNodes" and e["type"] != "Warning"]


def unschedulable_agent_pod(cache: str, node: str, message: str) -> dict[str, Any]:
    """A DaemonSet pod the scheduler cannot place: no nodeName, PodScheduled False with its words."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{cache}-agent-{node}", "namespace": "default", "uid": f"pod-uid-{node}",
                     "creationTimestamp": "2025-01-01T00:00:00Z",
                     "labels": {"app.kubernetes.io/name": "weightcache-agent", "weightcache.io/cache": cache}},
        "spec": {"containers": [{"name": "agent", "image": "x"}]},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]},
    }


async def test_a_missing_claim_is_named_with_its_namespace_in_the_condition_and_a_warning(cluster: KubeClient,
                                                                                          kmock: Any) -> None:
    spec = {**LLAMA_SPEC, "model": {"pvc": "qwen2-7b-instruct"}}
    async with running_operator(kmock, "weightcaches"):
        await cluster.create(WC_RESOURCE, weightcache("qwen", spec))
        await wait_for(lambda: get_object(kmock, DS_RESOURCE, "default", "qwen-agent"), what="the DaemonSet")
        await daemonset_scheduled(cluster, "qwen", 1)
        # The kube-scheduler's words on a pod whose claim does not exist (tests/test_newcomer_k8s.py
        # has them from a real one).
        await cluster.create(POD_RESOURCE, unschedulable_agent_pod("qwen", "node-a", (
            '0/1 nodes are available: persistentvolumeclaim "qwen2-7b-instruct" not found. preemption: 0/1 nodes '
            "are available: 1 Preemption is not helpful for scheduling.")))
        ready = await wait_for(lambda: (c := condition(wc_of(kmock, "qwen"), "Ready")) and
                               c["reason"] == "ClaimNotFound" and c, what="Ready ClaimNotFound")
        assert "PersistentVolumeClaim qwen2-7b-instruct not found in namespace default" in ready["message"]
        assert condition(wc_of(kmock, "qwen"), "Degraded")["status"] == "True"
        assert condition(wc_of(kmock, "qwen"), "Loading")["status"] == "False"
        warned = await wait_for(lambda: warnings_for(kmock, "qwen", "ClaimNotFound"), what="a ClaimNotFound Warning")
        assert all("qwen2-7b-instruct" in e["message"] and "namespace default" in e["message"] for e in warned)

        # Another cache whose pods wait for some other reason is not said to lack its claim.
        await cluster.patch(POD_RESOURCE, "default", "qwen-agent-node-a", {"status": {"conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/1 nodes are available: 1 Insufficient memory."}]}})
        await wait_for(lambda: condition(wc_of(kmock, "qwen"), "Ready")["reason"] != "ClaimNotFound",
                       what="ClaimNotFound gone once the scheduler says something else")


async def test_the_operator_log_at_info_does_not_repeat_a_line_per_poll(cluster: KubeClient, kmock: Any,
                                                                         tmp_path: Any) -> None:
    """`weightcache operator` as a user runs it, for six polls of caches that do not change (one of them
    invalid: said once, not on every poll)."""
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig-cli", str(kmock.url))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "weightcache_agent", "operator", "--all-namespaces", "--kubeconfig", str(kubeconfig),
        "--poll-interval", str(POLL), env=dict(os.environ), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    lines: list[str] = []

    async def read() -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            lines.append(line.decode(errors="replace").rstrip("\n"))

    reader = asyncio.create_task(read())
    try:
        await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))
        await cluster.create(WC_RESOURCE, weightcache("bad", {**LLAMA_SPEC, "quantization": "awq"}))
        await wait_for(lambda: condition(wc_of(kmock, "llama"), "Ready") and condition(wc_of(kmock, "bad"), "Ready"),
                       timeout=20, what="the caches' status")
        await asyncio.sleep(2 * POLL)  # settled: from here on each poll finds nothing new
        settled, polls = len(lines), len(requests_of(kmock, "GET", "pods"))
        await wait_for(lambda: len(requests_of(kmock, "GET", "pods")) >= polls + 6, timeout=20,
                       what="six more polls")
        await asyncio.sleep(0.2)  # the last poll's lines, if any, are read
        polled = len(lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), timeout=20)
        await reader
    text = "\n".join(lines)
    assert proc.returncode == 0, text[-3000:]
    assert any(" INFO " in line for line in lines[:settled]), text  # it does say what it created and changed
    assert "awq is refused" in "\n".join(lines[:settled]), text  # said once, at WARNING
    quiet = [re.sub(r"^\S+ \S+ (INFO|WARNING) ", "", line) for line in lines[settled:polled]
             if " INFO " in line or " WARNING " in line]
    repeated = {line: n for line, n in collections.Counter(quiet).items() if n > 1}
    assert repeated == {}, text
    assert not [line for line in quiet if "Timer 'poll'" in line], text
