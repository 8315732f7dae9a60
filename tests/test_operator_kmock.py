"""The operator's handlers end to end against kmock, the Kubernetes API emulator.

The real operator (``build_registry`` + ``build_settings``, as ``weightcache operator``
runs them) runs in kopf's ``KopfRunner`` thread against kmock's HTTP API; agents are
real HTTP servers on 127.0.0.1 answering ``/status``; agent pods point at them.

The emulator has no DaemonSet controller, no generation bumps, no garbage collector
(DESIGN §9), so tests play those parts where it matters: they set the DaemonSet's
status as the controller would, bump ``metadata.generation`` with each spec change as
the API server would, and check owner references instead of collection.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kopf.testing import KopfRunner

from operator_fixtures import (
    CM_RESOURCE,
    DS_RESOURCE,
    LLAMA_SPEC,
    POD_RESOURCE,
    POLL,
    WC_RESOURCE,
    AgentServer,
    KubeClient,
    agent_pod,
    agent_status,
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
from weightcache_operator.controller.weightcache.manifests import ANNOTATION_SPEC_HASH

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

def operator(kmock: Any) -> contextlib.AbstractAsyncContextManager[KopfRunner]:
    """Run the operator until the block ends; starts only once kopf watches WeightCaches."""
    return running_operator(kmock, "weightcaches", timeout=10.0)


@pytest_asyncio.fixture()
async def cluster(kmock: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[KubeClient]:
    async with emulated_cluster(kmock, tmp_path, monkeypatch) as client:
        yield client


def ds_of(kmock: Any, name: str) -> dict[str, Any] | None:
    return get_object(kmock, DS_RESOURCE, "default", f"{name}-agent")


def wc_of(kmock: Any, name: str) -> dict[str, Any] | None:
    return get_object(kmock, WC_RESOURCE, "default", name)


def container_of(ds: dict[str, Any]) -> dict[str, Any]:
    return ds["spec"]["template"]["spec"]["containers"][0]


async def set_spec(client: KubeClient, kmock: Any, name: str, spec_patch: dict[str, Any]) -> int:
    """Patch a WeightCache's spec and bump its generation, as the API server does."""
    generation = wc_of(kmock, name)["metadata"]["generation"] + 1
    await client.patch(WC_RESOURCE, "default", name, {"metadata": {"generation": generation}, "spec": spec_patch})
    return generation


async def daemonset_controller(client: KubeClient, name: str, desired: int) -> None:
    """Publish the DaemonSet status the real controller would."""
    await client.patch(DS_RESOURCE, "default", f"{name}-agent", {"status": {
        "desiredNumberScheduled": desired, "updatedNumberScheduled": desired,
        "currentNumberScheduled": desired, "numberReady": desired}}, subresource="status")


async def test_create_renders_owned_daemonset_and_rolls_up_agent_state(cluster: KubeClient, kmock: Any) -> None:
    with AgentServer(agent_status("node-a", "Loading", progress=0.5)) as a, \
            AgentServer(agent_status("node-b", "Ready", clients=3)) as b:
        async with operator(kmock):
            await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))

            ds = await wait_for(lambda: ds_of(kmock, "llama"), what="the agent DaemonSet")
            assert ds["metadata"]["ownerReferences"] == [{
                "apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "name": "llama",
                "uid": "uid-default-llama", "controller": True, "blockOwnerDeletion": True,
            }]
            args = container_of(ds)["args"]
            assert args[:3] == ["agent", "--model", "/models/meta-llama/Llama-3.1-70B-Instruct"]
            assert "--tp-size" in args and args[args.index("--tp-size") + 1] == "8"
            assert args[args.index("--quantization") + 1] == "fp8-block"
            assert args[args.index("--sharding") + 1] == "llama"

            # Before the DaemonSet controller has acted: Starting, and the generation is observed.
            wc = await wait_for(lambda: condition(wc_of(kmock, "llama"), "Ready") and wc_of(kmock, "llama"))
            assert wc["status"]["observedGeneration"] == 1
            assert condition(wc, "Ready")["reason"] == "Starting"
            assert all(c["observedGeneration"] == 1 for c in wc["status"]["conditions"])
            assert wc["status"]["daemonSet"] == "llama-agent"
            assert wc["status"]["socketDir"] == "/run/weightcache/default.llama.vgnwbha6u4t33oiypxq7stit"

            await daemonset_controller(cluster, "llama", desired=2)
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-a", a.port))
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-b", b.port))

            both = {"pending": 0, "loading": 1, "ready": 1, "failed": 0, "unknown": 0}
            wc = await wait_for(lambda: (w := wc_of(kmock, "llama"))["status"].get("nodeCounts") == both and w,
                                what="one node loading, one ready")
            assert condition(wc, "Loading")["status"] == "True"
            assert condition(wc, "Ready")["status"] == "False"
            nodes = {n["node"]: n for n in wc["status"]["nodes"]}
            assert nodes["node-a"]["phase"] == "Loading" and nodes["node-a"]["progress"] == 50
            assert nodes["node-b"] == {
                "node": "node-b", "pod": "llama-agent-node-b", "phase": "Ready", "bytes": 20 * 2**30,
                "progress": 100, "loadSeconds": 12.5, "clients": 3,
                "gpuUUIDs": ["GPU-node-b-0000", "GPU-node-b-0001"],
                "socketDir": "/run/weightcache/default/llama", "fingerprint": "sha256:abc123",
            }

            a.doc = agent_status("node-a", "Ready")
            wc = await wait_for(lambda: (w := wc_of(kmock, "llama"))["status"].get("readyNodes") == 2 and w,
                                what="both nodes ready")
            assert condition(wc, "Ready")["status"] == "True"
            assert condition(wc, "Ready")["reason"] == "AllNodesReady"
            assert condition(wc, "Loading")["status"] == "False"
            assert condition(wc, "Degraded")["status"] == "False"
            assert wc["status"]["desiredNodes"] == 2

            # Every transition was announced as an Event on the WeightCache.
            reasons = await wait_for(lambda: {e["reason"] for e in events_for(kmock, "llama")} >= {"AllNodesReady", "Loading", "DaemonSetCreated"}
                                     and {e["reason"] for e in events_for(kmock, "llama")}, what="events")
            assert "Starting" in reasons

            # Steady state: agents keep being polled, but nothing is written.
            status_writes = len(requests_of(kmock, "PATCH", "weightcaches", name="llama", subresource="status"))
            ds_writes = len(requests_of(kmock, "PATCH", "daemonsets")) + len(requests_of(kmock, "POST", "daemonsets"))
            hits = a.hits
            await asyncio.sleep(4 * POLL)
            assert a.hits > hits, "agents are polled on a timer"
            assert len(requests_of(kmock, "PATCH", "weightcaches", name="llama", subresource="status")) == status_writes
            assert len(requests_of(kmock, "PATCH", "daemonsets")) + len(requests_of(kmock, "POST", "daemonsets")) == ds_writes

    # The only finalizer is kopf's, for stopping the per-object timer.
    assert wc_of(kmock, "llama")["metadata"]["finalizers"] == ["weightcache.io/operator"]


async def test_spec_change_patches_the_daemonset_in_place(cluster: KubeClient, kmock: Any) -> None:
    async with operator(kmock):
        spec = {**LLAMA_SPEC, "nodeSelector": {"pool": "h200"}}
        await cluster.create(WC_RESOURCE, weightcache("llama", spec))
        ds = await wait_for(lambda: ds_of(kmock, "llama"), what="the agent DaemonSet")
        first_hash = ds["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
        assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "h200"}

        generation = await set_spec(cluster, kmock, "llama", {
            "quantization": "none",
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
            "agent": {"resources": {"limits": {"memory": "64Gi"}}},
        })
        ds = await wait_for(lambda: "none" in container_of(d := ds_of(kmock, "llama"))["args"] and d,
                            what="the DaemonSet to pick up the new quantization")
        assert ds["metadata"]["annotations"][ANNOTATION_SPEC_HASH] != first_hash
        assert {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"} in \
            ds["spec"]["template"]["spec"]["tolerations"]
        assert container_of(ds)["resources"] == {"limits": {"memory": "64Gi"}}
        wc = await wait_for(lambda: (w := wc_of(kmock, "llama"))["status"]["observedGeneration"] == generation and w)
        assert all(c["observedGeneration"] == generation for c in wc["status"]["conditions"])

        # Removing a field removes it from the pod template (an explicit null in the merge patch).
        await set_spec(cluster, kmock, "llama", {"nodeSelector": None})
        await wait_for(lambda: "nodeSelector" not in ds_of(kmock, "llama")["spec"]["template"]["spec"],
                       what="nodeSelector to go away")

        # Explicit sharding rules: a ConfigMap owned by the cache, mounted into the agents.
        rules = [{"pattern": r".*\.q_proj\.weight$", "mode": "column"},
                 {"pattern": r".*\.o_proj\.weight$", "mode": "row"}]
        await set_spec(cluster, kmock, "llama", {"sharding": {"preset": None, "rules": rules}})
        cm = await wait_for(lambda: get_object(kmock, CM_RESOURCE, "default", "llama-sharding"), what="the ConfigMap")
        assert yaml.safe_load(cm["data"]["sharding.yaml"]) == {"rules": rules}
        assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-default-llama"
        ds = await wait_for(lambda: "/etc/weightcache/sharding.yaml" in container_of(d := ds_of(kmock, "llama"))["args"] and d)
        assert {"name": "sharding", "mountPath": "/etc/weightcache", "readOnly": True} in container_of(ds)["volumeMounts"]

        # Created once, patched after: never a second object.
        assert len(requests_of(kmock, "POST", "daemonsets")) == 1
        assert len(requests_of(kmock, "PATCH", "daemonsets", name="llama-agent")) == 3


async def test_operator_restart_converges_without_duplicates(cluster: KubeClient, kmock: Any) -> None:
    with AgentServer(agent_status("node-a", "Ready")) as a:
        async with operator(kmock):
            await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))
            await wait_for(lambda: ds_of(kmock, "llama"), what="the agent DaemonSet")
            await daemonset_controller(cluster, "llama", desired=1)
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-a", a.port))
            await wait_for(lambda: (condition(wc_of(kmock, "llama"), "Ready") or {}).get("status") == "True",
                           what="Ready")
        ready_since = condition(wc_of(kmock, "llama"), "Ready")["lastTransitionTime"]
        writes = {m: len(requests_of(kmock, m, "daemonsets")) for m in ("POST", "PATCH")}
        status_writes = len(requests_of(kmock, "PATCH", "weightcaches", subresource="status"))

        # Same state, new operator: it reads everything, writes nothing.
        async with operator(kmock):
            gets = len(requests_of(kmock, "GET", "daemonsets"))
            await wait_for(lambda: len(requests_of(kmock, "GET", "daemonsets")) > gets + 2, what="a few reconciles")
            assert {m: len(requests_of(kmock, m, "daemonsets")) for m in ("POST", "PATCH")} == writes
            assert len(requests_of(kmock, "PATCH", "weightcaches", subresource="status")) == status_writes

        # The spec changed while no operator ran: the next one converges to it.
        await set_spec(cluster, kmock, "llama", {"dtype": "float16"})
        async with operator(kmock):
            await wait_for(lambda: "float16" in container_of(ds_of(kmock, "llama"))["args"], what="the new dtype")
            # The agent on node-a still runs the old template until the controller rolls it.
            await daemonset_controller(cluster, "llama", desired=1)
            wc = await wait_for(lambda: (w := wc_of(kmock, "llama"))["status"]["observedGeneration"] == 2 and w)
        assert writes["POST"] == 1 and len(requests_of(kmock, "POST", "daemonsets")) == 1
        assert len([k for k in kmock.objects if k[0].plural == "daemonsets"]) == 1
        # Ready stayed True throughout: its transition time did not move.
        assert condition(wc, "Ready")["lastTransitionTime"] == ready_since


async def test_invalid_spec_is_degraded_and_others_keep_reconciling(cluster: KubeClient, kmock: Any) -> None:
    async with operator(kmock):
        # The emulator has no CEL: this is an object that got past validation.
        await cluster.create(WC_RESOURCE, weightcache("bad", {**LLAMA_SPEC, "quantization": "fp8-per-tensor"}))
        await cluster.create(WC_RESOURCE, weightcache("good", LLAMA_SPEC))

        await wait_for(lambda: ds_of(kmock, "good"), what="the good cache's DaemonSet")
        degraded = await wait_for(lambda: condition(wc_of(kmock, "bad"), "Degraded"), what="Degraded on bad")
        assert degraded["status"] == "True"
        assert degraded["reason"] == "RefusedQuantization"
        assert "fp8-per-tensor" in degraded["message"] and "wrong numbers silently" in degraded["message"]
        assert condition(wc_of(kmock, "bad"), "Ready")["status"] == "False"
        assert ds_of(kmock, "bad") is None

        warning = await wait_for(lambda: [e for e in events_for(kmock, "bad")
                                          if e["reason"] == "RefusedQuantization" and e["type"] == "Warning"],
                                 what="a Warning event")
        assert any(e["message"].startswith("Degraded=True: quantization fp8-per-tensor is refused") for e in warning)

        # Still invalid on later polls: no retry storm, no repeated writes.
        writes = len(requests_of(kmock, "PATCH", "weightcaches", name="bad", subresource="status"))
        await asyncio.sleep(3 * POLL)
        assert len(requests_of(kmock, "PATCH", "weightcaches", name="bad", subresource="status")) == writes

        # Fixed: rendered like any other.
        await set_spec(cluster, kmock, "bad", {"quantization": "fp8-block"})
        await wait_for(lambda: ds_of(kmock, "bad"), what="the fixed cache's DaemonSet")
        await wait_for(lambda: condition(wc_of(kmock, "bad"), "Degraded")["status"] == "False")


async def test_agent_failures_become_degraded_with_the_agents_reason(cluster: KubeClient, kmock: Any) -> None:
    failed = agent_status("node-a", "Failed", message="model directory /models/llama not found on this node")
    with AgentServer(failed) as a, AgentServer(agent_status("node-b", "Ready")) as b:
        async with operator(kmock):
            await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))
            await wait_for(lambda: ds_of(kmock, "llama"))
            await daemonset_controller(cluster, "llama", desired=3)
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-a", a.port))
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-b", b.port))
            # node-c's agent does not answer (nothing listens on that port).
            with AgentServer() as gone:
                dead_port = gone.port
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-c", dead_port))

            counts = {"pending": 0, "loading": 0, "ready": 1, "failed": 1, "unknown": 1}
            wc = await wait_for(lambda: (w := wc_of(kmock, "llama"))["status"].get("nodeCounts") == counts and w,
                                what="all three nodes rolled up")
            degraded = condition(wc, "Degraded")
            assert degraded["status"] == "True" and degraded["reason"] == "AgentFailed"
            assert "node-a: model directory /models/llama not found" in degraded["message"]
            # Failed first, then Unknown, then the rest.
            assert [n["phase"] for n in wc["status"]["nodes"]] == ["Failed", "Unknown", "Ready"]
            assert "not reachable" in wc["status"]["nodes"][1]["message"]
            await wait_for(lambda: any(e["reason"] == "AgentFailed" and e["type"] == "Warning"
                                       for e in events_for(kmock, "llama")), what="a Warning event")

            # The agent recovers; the unreachable one still degrades the cache, with its own reason.
            a.doc = agent_status("node-a", "Ready")
            await wait_for(lambda: condition(wc_of(kmock, "llama"), "Degraded")["reason"] == "AgentUnreachable")



def with_integrity(doc: dict[str, Any], failures: int, tampered_rank: int | None = None) -> dict[str, Any]:
    """The node status with rank 1's count of changed arenas (as the supervisor reports each rank's)."""
    for r in doc["ranks"]:
        r["integrityFailures"] = failures if r["rank"] == 1 else 0
        r["integrity"] = "tampered" if r["rank"] == tampered_rank else "verified"
    return doc


async def test_an_arena_found_changed_is_a_warning_event_and_degraded_while_it_lasts(
        cluster: KubeClient, kmock: Any) -> None:
    with AgentServer(with_integrity(agent_status("node-a", "Ready"), 0)) as a, \
            AgentServer(with_integrity(agent_status("node-b", "Ready"), 0)) as b:
        async with operator(kmock):
            await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))
            await wait_for(lambda: ds_of(kmock, "llama"))
            await daemonset_controller(cluster, "llama", desired=2)
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-a", a.port))
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-b", b.port))
            await wait_for(lambda: condition(wc_of(kmock, "llama"), "Ready")["status"] == "True", what="Ready")

            def integrity_events() -> list[dict[str, Any]]:
                """One per rise of a node's count (the condition's own transitions are Events too)."""
                return [e for e in events_for(kmock, "llama") if e["reason"] == "ArenaIntegrity"
                        and not e["message"].startswith("Degraded=")]
            assert integrity_events() == []

            # node-b's rank 1 finds its arena changed: refilling now.
            b.doc = with_integrity(agent_status("node-b", "Ready"), 1, tampered_rank=1)
            degraded = await wait_for(lambda: (d := condition(wc_of(kmock, "llama"), "Degraded"))["reason"] ==
                                      "ArenaIntegrity" and d, what="Degraded for the changed arena")
            assert degraded["status"] == "True"
            assert degraded["message"].startswith("arena changed since it was filled on node-b (rank 1)")
            (event,) = await wait_for(integrity_events, what="an ArenaIntegrity event")
            assert event["type"] == "Warning"
            assert event["message"].startswith("node node-b: the agent found 1 arena(s) changed since it filled them")
            nodes = {n["node"]: n for n in wc_of(kmock, "llama")["status"]["nodes"]}
            assert nodes["node-b"]["integrityFailures"] == 1 and "integrityFailures" not in nodes["node-a"]

            # Refilled: no longer Degraded; the count stays, and polls that see it again add no Event.
            b.doc = with_integrity(agent_status("node-b", "Ready"), 1)
            await wait_for(lambda: condition(wc_of(kmock, "llama"), "Degraded")["status"] == "False",
                           what="the refilled arena")
            hits = b.hits
            await wait_for(lambda: b.hits >= hits + 2, what="two more polls")
            assert len(integrity_events()) == 1

            # Changed again and replaced between two polls: still one more Event.
            b.doc = with_integrity(agent_status("node-b", "Ready"), 2)
            await wait_for(lambda: len(integrity_events()) == 2, what="the second ArenaIntegrity event")
            assert condition(wc_of(kmock, "llama"), "Degraded")["status"] == "False"

async def test_deletion_stops_polling_and_leaves_children_to_the_garbage_collector(cluster: KubeClient, kmock: Any) -> None:
    async with operator(kmock):
        await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))
        ds = await wait_for(lambda: ds_of(kmock, "llama"))
        await wait_for(lambda: condition(wc_of(kmock, "llama"), "Ready"))
        # kopf has finished with the creation: no more writes to the object. The
        # emulator has no resourceVersion, so kopf cannot tell its own patches' echoes
        # from news; a deletion racing that bookkeeping is not what this test is about.
        writes = -1
        while writes != (writes := len(requests_of(kmock, "PATCH", "weightcaches"))):
            await asyncio.sleep(3 * POLL)
        await cluster.delete(WC_RESOURCE, "default", "llama")
        # kopf stops the timer, releases its finalizer, and the object goes.
        await wait_for(lambda: wc_of(kmock, "llama") is None, what="the WeightCache to be gone")
        # No deletion handler touched the DaemonSet: on a real cluster the garbage
        # collector deletes it through its controller owner reference.
        assert requests_of(kmock, "DELETE", "daemonsets") == []
        assert ds["metadata"]["ownerReferences"][0]["controller"] is True
        # The per-object timer stopped with the object.
        gets = len(requests_of(kmock, "GET", "daemonsets", name="llama-agent"))
        await asyncio.sleep(3 * POLL)
        assert len(requests_of(kmock, "GET", "daemonsets", name="llama-agent")) == gets


async def test_deletion_while_a_poll_waits_on_a_slow_agent_goes_within_seconds(cluster: KubeClient,
                                                                                 kmock: Any) -> None:
    # The timer is in the middle of a poll when the deletion comes: kopf lets it finish, then
    # must look again soon (its default is to look again after a minute).
    with AgentServer(agent_status("node-a", "Ready")) as a:
        a.delay = 0.6
        async with operator(kmock):
            await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))
            await wait_for(lambda: ds_of(kmock, "llama"))
            await daemonset_controller(cluster, "llama", desired=1)
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-a", a.port))
            await wait_for(lambda: (wc_of(kmock, "llama")["status"].get("readyNodes") == 1), what="the node ready")
            hits = a.hits
            await wait_for(lambda: a.hits > hits, what="a poll waiting on the agent")
            deleted = time.monotonic()
            await cluster.delete(WC_RESOURCE, "default", "llama")
            await wait_for(lambda: wc_of(kmock, "llama") is None, what="the WeightCache to be gone")
            assert time.monotonic() - deleted < 10


async def test_foreign_daemonset_with_our_name_is_not_taken_over(cluster: KubeClient, kmock: Any) -> None:
    foreign = {"apiVersion": "apps/v1", "kind": "DaemonSet",
               "metadata": {"name": "llama-agent", "namespace": "default", "labels": {"team": "other"}},
               "spec": {"selector": {"matchLabels": {"team": "other"}}, "template": {}}}
    await cluster.create(DS_RESOURCE, foreign)
    async with operator(kmock):
        await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))
        degraded = await wait_for(lambda: condition(wc_of(kmock, "llama"), "Degraded"))
        assert degraded["status"] == "True" and degraded["reason"] == "OwnershipConflict"
        assert "not controlled by this WeightCache" in degraded["message"]
    assert requests_of(kmock, "PATCH", "daemonsets") == []
    assert ds_of(kmock, "llama")["metadata"]["labels"] == {"team": "other"}


async def test_weightcache_operator_command_runs_against_the_cluster(cluster: KubeClient, kmock: Any, tmp_path: Any) -> None:
    """The real entry point in its own process: flags, env settings, kopf.run, SIGTERM."""
    import os
    import signal
    import sys

    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig-cli", str(kmock.url))
    env = {**os.environ, "WEIGHTCACHE_AGENT_IMAGE": "registry.local/agent:cli", "WEIGHTCACHE_PRIORITY_CLASS": ""}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import sys; from weightcache_agent.cli import main; sys.exit(main())",
        "operator", "--all-namespaces", "--kubeconfig", str(kubeconfig), "--poll-interval", "1",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output = b""
    try:
        await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))
        ds = await wait_for(lambda: ds_of(kmock, "llama"), timeout=20, what="the DaemonSet from the CLI operator")
        assert container_of(ds)["image"] == "registry.local/agent:cli"
        assert "priorityClassName" not in ds["spec"]["template"]["spec"]
    except AssertionError:
        proc.kill()
        output, _ = await proc.communicate()
        raise AssertionError(output.decode()[-3000:]) from None
    # kopf stops on SIGTERM (it gives lingering timers a few seconds before cancelling them).
    proc.send_signal(signal.SIGTERM)
    output, _ = await asyncio.wait_for(proc.communicate(), timeout=20)
    assert proc.returncode == 0, output.decode()[-3000:]


async def test_a_model_change_waits_for_room_for_a_second_copy(cluster: KubeClient, kmock: Any) -> None:
    """A new revision loads beside the old one: while a node's tightest GPU has less free memory than
    its largest rank, the DaemonSet keeps the old revision and the cache says why, by node."""
    gib = 2**30
    tight = {**agent_status("node-a", "Ready"), "rankBytes": 10 * gib, "freeBytes": 4 * gib}
    with AgentServer(tight) as a, AgentServer({**agent_status("node-b", "Ready"), "rankBytes": 10 * gib,
                                               "freeBytes": 60 * gib}) as b:
        async with operator(kmock):
            await cluster.create(WC_RESOURCE, weightcache("llama", LLAMA_SPEC))
            await wait_for(lambda: ds_of(kmock, "llama"), what="the agent DaemonSet")
            await daemonset_controller(cluster, "llama", desired=2)
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-a", a.port))
            await cluster.create(POD_RESOURCE, agent_pod("llama", "node-b", b.port))
            # Serving the current revision with little free memory is no problem.
            await wait_for(lambda: condition(wc_of(kmock, "llama"), "Ready")["status"] == "True", what="Ready")
            assert condition(wc_of(kmock, "llama"), "Degraded")["status"] == "False"

            await set_spec(cluster, kmock, "llama", {"model": {"revision": "v2"}})
            degraded = await wait_for(lambda: (c := condition(wc_of(kmock, "llama"), "Degraded"))["reason"]
                                      == "InsufficientMemory" and c, what="the change held for memory")
            assert degraded["status"] == "True"
            assert "main -> /models/meta-llama/Llama-3.1-70B-Instruct@v2" in degraded["message"]
            assert "node-a has 4.0 GiB free on its tightest device, a second copy of a rank needs 10.0 GiB" \
                in degraded["message"] and "node-b" not in degraded["message"]
            args = container_of(ds_of(kmock, "llama"))["args"]
            assert "--revision=main" in args, "the DaemonSet rolled although memory is short"
            await wait_for(lambda: any(e["reason"] == "InsufficientMemory" and e["type"] == "Warning"
                                       for e in events_for(kmock, "llama")), what="a Warning event")

            # The standbys went, memory came back: the change proceeds.
            a.doc = {**tight, "freeBytes": 12 * gib}
            await wait_for(lambda: "--revision=v2" in container_of(ds_of(kmock, "llama"))["args"],
                           what="the DaemonSet on the new revision")
            await wait_for(lambda: condition(wc_of(kmock, "llama"), "Degraded")["reason"] != "InsufficientMemory")
