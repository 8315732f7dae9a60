"""Operator pieces without a cluster: reading agents over HTTP, roll-up, conditions, CLI.

Agents are real HTTP servers on 127.0.0.1 (``AgentServer``), read through the same
``fetch_agent_status`` the operator uses.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest

from operator_fixtures import AgentServer, agent_pod, agent_status, crd_schema
from weightcache_operator.cli import config_from_args, parse_args
from weightcache_operator.conditions import Desired, merge, transitions
from weightcache_operator.controller.weightcache.agents import (
    AgentStatusError,
    fetch_agent_status,
    fetch_all,
    select_agent_pods,
    status_url,
)
from weightcache_operator.controller.weightcache.reconciler import STATUS_KEYS, status_patch
from weightcache_operator.controller.weightcache.rollup import (
    Rollout,
    agent_conditions,
    daemonset_rollout,
    summarize,
)

SELECTOR = {"app.kubernetes.io/name": "weightcache-agent", "weightcache.io/cache": "llama"}
STATUS_SCHEMA = crd_schema()["properties"]["status"]
OBSERVED = Rollout(desired=None, updated=None, observed=True)


# --- reading agents ---------------------------------------------------------------------

def test_fetch_agent_status_reads_the_contract_document() -> None:
    doc = agent_status("node-a", "Loading", progress=0.25)
    with AgentServer(doc) as agent:
        assert fetch_agent_status(agent.url, timeout=2) == doc


@pytest.mark.parametrize("raw, fragment", [
    (b"<html>nope</html>", "not JSON"),
    (b"[1, 2, 3]", "not a JSON object"),
    (b"{" + b" " * (1 << 20) + b"}", "larger than 1 MiB"),
], ids=["html", "list", "huge"])
def test_fetch_agent_status_refuses_what_is_not_a_status(raw: bytes, fragment: str) -> None:
    with AgentServer() as agent:
        agent.raw = raw
        with pytest.raises(AgentStatusError, match=fragment):
            fetch_agent_status(agent.url, timeout=2)


def test_fetch_agent_status_reports_unreachable_and_http_errors() -> None:
    with AgentServer() as gone:
        url = gone.url
    with pytest.raises(AgentStatusError, match="not reachable"):
        fetch_agent_status(url, timeout=1)
    with AgentServer({}) as agent:
        with pytest.raises(AgentStatusError, match="HTTP 404"):
            fetch_agent_status(agent.url.replace("/status", "/nope"), timeout=1)


def test_status_url_brackets_ipv6() -> None:
    assert status_url("10.0.0.7", 9464) == "http://10.0.0.7:9464/status"
    assert status_url("fd00::7", 9464) == "http://[fd00::7]:9464/status"


def test_pod_selection_filters_labels_and_prefers_the_live_newest_pod() -> None:
    old = agent_pod("llama", "node-a", 1)
    old["metadata"].update(name="old", deletionTimestamp="2025-01-01T00:01:00Z")
    new = agent_pod("llama", "node-a", 2)
    new["metadata"].update(name="new", creationTimestamp="2025-01-01T00:02:00Z")
    other = agent_pod("mistral", "node-a", 3)
    other["metadata"]["labels"]["weightcache.io/cache"] = "mistral"
    unscheduled = agent_pod("llama", "node-z", 4)
    unscheduled["metadata"]["name"] = "unscheduled"
    del unscheduled["spec"]["nodeName"]
    pods = select_agent_pods([new, other, old, unscheduled], SELECTOR, 9464)
    assert [(p.name, p.node, p.port) for p in pods] == [("new", "node-a", 2), ("unscheduled", None, 4)]


def test_fetch_all_asks_only_running_pods_concurrently() -> None:
    with AgentServer(agent_status("node-a")) as a, AgentServer(agent_status("node-b")) as b:
        pending = agent_pod("llama", "node-c", b.port, phase="Pending")
        pods = select_agent_pods([agent_pod("llama", "node-a", a.port), agent_pod("llama", "node-b", b.port),
                                  pending], SELECTOR, 9464)
        answers = asyncio.run(fetch_all(pods, timeout=2))
    assert set(answers) == {"llama-agent-node-a", "llama-agent-node-b"}
    assert answers["llama-agent-node-a"]["node"] == "node-a"


# --- roll-up ------------------------------------------------------------------------------

def _pods(n: int, **kw: Any) -> list[Any]:
    return select_agent_pods([agent_pod("llama", f"node-{i:03d}", 9000 + i, **kw) for i in range(n)], SELECTOR, 9464)


def test_summary_is_bounded_and_lists_problems_first() -> None:
    pods = _pods(40)
    answers: dict[str, Any] = {p.name: agent_status(p.node, "Ready") for p in pods}
    answers[pods[39].name] = agent_status(pods[39].node, "Failed", message="out of GPU memory: needs 141 GiB")
    answers[pods[38].name] = agent_status(pods[38].node, "Loading", progress=0.5)
    answers[pods[37].name] = AgentStatusError("agent not reachable: timed out")
    summary = summarize(pods, answers, desired_nodes=41, cap=32)
    assert len(summary["nodes"]) == 32 and summary["nodesOmitted"] == 8
    assert summary["nodeCounts"] == {"pending": 0, "loading": 1, "ready": 37, "failed": 1, "unknown": 1}
    assert [n["phase"] for n in summary["nodes"][:4]] == ["Failed", "Unknown", "Loading", "Ready"]
    assert summary["desiredNodes"] == 41 and summary["readyNodes"] == 37
    conditions = {c.type: c for c in agent_conditions(summary, OBSERVED)}
    assert conditions["Degraded"].status == "True" and conditions["Degraded"].reason == "AgentFailed"
    assert "node-039: out of GPU memory" in conditions["Degraded"].message
    assert "+8 more nodes" in conditions["Degraded"].message
    assert conditions["Ready"].status == "False" and conditions["Loading"].status == "True"
    # What the operator would write fits the CRD's status schema.
    status = {**summary, "observedGeneration": 3, "daemonSet": "llama-agent", "model": "m",
              "socketDir": "/run/weightcache/default/llama",
              "conditions": merge(None, agent_conditions(summary, OBSERVED), 3)}
    jsonschema.validate(status, STATUS_SCHEMA)


def test_malformed_agent_documents_are_sanitized() -> None:
    (pod,) = _pods(1)
    bad = {"phase": "Ready", "bytes": -5, "clients": True, "loadSeconds": float("nan"),
           "gpuUUIDs": ["GPU-" + "x" * 200, 7, ""] + [f"GPU-{i}" for i in range(100)],
           "message": "m" * 5000, "fingerprint": {"not": "a string"}, "ranks": "nope"}
    (entry,) = summarize([pod], {pod.name: bad}, None, 32)["nodes"]
    assert entry["phase"] == "Ready" and "bytes" not in entry and "clients" not in entry
    assert "loadSeconds" not in entry and "fingerprint" not in entry
    assert len(entry["message"]) == 1024 and len(entry["gpuUUIDs"]) == 64
    assert all(len(u) <= 64 for u in entry["gpuUUIDs"])
    (weird,) = summarize([pod], {pod.name: {"phase": "Dancing"}}, None, 32)["nodes"]
    assert weird["phase"] == "Unknown" and "unknown phase" in weird["message"]
    jsonschema.validate({"nodes": [entry, weird]}, STATUS_SCHEMA)


def test_pods_not_running_are_pending_with_the_kubelet_reason() -> None:
    (pod,) = select_agent_pods([{
        **agent_pod("llama", "node-a", 1, phase="Pending"),
        "status": {"phase": "Pending", "containerStatuses": [
            {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}}]},
    }], SELECTOR, 9464)
    (entry,) = summarize([pod], {}, None, 32)["nodes"]
    assert entry == {"node": "node-a", "pod": "llama-agent-node-a", "phase": "Pending",
                     "message": "ImagePullBackOff: pull access denied"}


def test_rollout_state_gates_ready() -> None:
    summary = summarize(_pods(2), {p.name: agent_status(p.node) for p in _pods(2)}, 2, 32)
    ready = lambda r: {c.type: c for c in agent_conditions(summary, r)}["Ready"]  # noqa: E731
    ds = {"metadata": {"generation": 3}, "status": {"observedGeneration": 3, "desiredNumberScheduled": 2,
                                                    "updatedNumberScheduled": 2}}
    assert ready(daemonset_rollout(ds)).status == "True"
    ds["status"]["updatedNumberScheduled"] = 1
    assert (ready(daemonset_rollout(ds)).status, ready(daemonset_rollout(ds)).reason) == ("False", "Rolling")
    ds["status"].update(updatedNumberScheduled=2, observedGeneration=2)
    assert ready(daemonset_rollout(ds)).reason == "Starting"
    assert ready(daemonset_rollout(None)).reason == "Starting"
    empty = summarize([], {}, 0, 32)
    assert {c.type: c for c in agent_conditions(empty, OBSERVED)}["Ready"].reason == "NoNodes"


# --- conditions and status writes --------------------------------------------------------

def test_conditions_keep_transition_time_until_status_changes() -> None:
    first = merge(None, [Desired("Ready", "False", "Starting", "a")], 1, now="2025-01-01T00:00:00Z")
    same = merge(first, [Desired("Ready", "False", "NodesNotReady", "b")], 2, now="2025-01-01T00:05:00Z")
    assert same[0]["lastTransitionTime"] == "2025-01-01T00:00:00Z" and same[0]["observedGeneration"] == 2
    flipped = merge(same, [Desired("Ready", "True", "AllNodesReady", "c")], 2, now="2025-01-01T00:09:00Z")
    assert flipped[0]["lastTransitionTime"] == "2025-01-01T00:09:00Z"
    # Reason changes and status changes are events; message-only changes are not.
    assert [t.reason for t in transitions(first, same)] == ["NodesNotReady"]
    assert transitions(same, merge(same, [Desired("Ready", "False", "NodesNotReady", "other text")], 2)) == []
    (t,) = transitions(same, flipped)
    assert (t.old_status, t.status, t.warning) == ("False", "True", False)
    (t,) = transitions(flipped, merge(flipped, [Desired("Ready", "False", "NodesNotReady", "x")], 2))
    assert t.warning
    # Someone else's condition types survive.
    foreign = [{"type": "Example", "status": "True", "reason": "X", "message": "", "lastTransitionTime": "t"}]
    assert merge(foreign, [Desired("Ready", "True", "R", "")], 1)[-1]["type"] == "Example"


def test_status_patch_writes_only_what_changed() -> None:
    old = {"readyNodes": 1, "desiredNodes": 2, "daemonSet": "x-agent", "kopf": {"x": 1}}
    assert status_patch(old, {"readyNodes": 1, "desiredNodes": 2, "daemonSet": "x-agent"}) == {}
    assert status_patch(old, {"readyNodes": 2, "desiredNodes": 2}) == {"readyNodes": 2, "daemonSet": None}
    assert "kopf" not in STATUS_KEYS  # never touches keys it does not own


# --- CLI --------------------------------------------------------------------------------

def test_cli_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTCACHE_AGENT_IMAGE", "from-env:1")
    monkeypatch.setenv("WEIGHTCACHE_PRIORITY_CLASS", "high")
    args = parse_args(["--namespace", "ml", "-n", "research", "--agent-image", "from-flag:2"])
    config = config_from_args(args)
    assert args.namespaces == ["ml", "research"] and not args.all_namespaces
    assert (config.agent_image, config.priority_class) == ("from-flag:2", "high")
    with pytest.raises(SystemExit):
        parse_args(["--namespace", "ml", "--all-namespaces"])


def test_weightcache_operator_rejects_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    from weightcache_operator.cli import main
    assert main(["--model-root", "relative"]) == 2
    assert "model root must be an absolute host path" in capsys.readouterr().err
    assert main(["--kubeconfig", "/nonexistent/kubeconfig"]) == 2
    assert "cannot load Kubernetes credentials" in capsys.readouterr().err


def test_status_document_round_trips_through_json() -> None:
    """The contract document survives JSON and the roll-up keeps its fields."""
    doc = json.loads(json.dumps(agent_status("node-a", "Ready", clients=2)))
    (pod,) = _pods(1)
    (entry,) = summarize([pod], {pod.name: doc}, 1, 32)["nodes"]
    assert entry["clients"] == 2 and entry["gpuUUIDs"] == doc["gpuUUIDs"] and entry["socketDir"] == doc["socketDir"]
