"""The EngineSet reconcile's steps one at a time: inventory, cache view, per-group decisions, status.

Each step's decision is a pure function of the objects a pass reads; here they get real
objects (engine pods as ``render_pod`` renders them, agent pods as ``render_daemonset``
renders them, agents' ``/status`` documents as the contract shapes them) with the
fields the API server and kubelet would add, and their answers are checked one by one.
The whole pass against an API server: tests/test_engineset_kmock.py.
"""
from __future__ import annotations

import copy
import datetime
from typing import Any

import pytest
from weightcache_operator.api.v1alpha1.engineset_types import parse_engineset
from weightcache_operator.api.v1alpha1.weightcache_types import parse_spec
from weightcache_operator.config import OperatorConfig
from weightcache_operator.controller.engineset.cache_view import (
    CacheState,
    CacheView,
    still_not_primary,
    view_from_agents,
)
from weightcache_operator.controller.engineset.groups import (
    engine_pods,
    excess_standbys,
    group_roles,
    pods_to_replace,
    slot_budget,
    slots_to_fill,
)
from weightcache_operator.controller.engineset.inventory import (
    GroupPods,
    recorded_placements,
    rolling_group,
    running_groups,
    take_inventory,
    unwanted_groups,
)
from weightcache_operator.controller.engineset.leases import PodRef
from weightcache_operator.controller.engineset.manifests import lease_group, render_claim, render_pod, template_hash
from weightcache_operator.controller.engineset.placement import Placement, Replica
from weightcache_operator.controller.engineset.status import (
    MAX_REASONS,
    Tally,
    conditions,
    group_entry,
    record_failover,
    tally_group,
)
from weightcache_operator.controller.engineset.switchover import requested_group, switchover_refusal
from weightcache_operator.controller.weightcache.agents import AgentPod, AgentStatusError
from weightcache_operator.controller.weightcache.manifests import render_daemonset

CONFIG = OperatorConfig()
CACHE = parse_spec({"model": {"path": "qwen"}, "parallelism": {"tensor": 2}})
NEW_MODEL = parse_spec({"model": {"path": "qwen", "revision": "v2"}, "parallelism": {"tensor": 2}})
TEMPLATE = {"spec": {"containers": [{"name": "engine", "image": "engine:1"}]}}
ES = parse_engineset("chat", {"cacheRef": {"name": "qwen"}, "template": TEMPLATE, "replicas": 2, "standbys": 1})
A = Placement(0, "node-a", ("GPU-a0", "GPU-a1"))
B = Placement(1, "node-b", ("GPU-b0", "GPU-b1"))
THASH = template_hash(ES, CACHE, CONFIG)


def engine(p: Placement, slot: int, *, cache: Any = CACHE, phase: str = "Running", ready: bool = True,
           serving: bool = False, deleting: bool = False) -> dict[str, Any]:
    """An engine pod as the reconcile would have created it, with what the API server and kubelet add."""
    pod = render_pod(ES, cache, CONFIG, "ml", "chat", p, slot, serving=serving)
    pod["metadata"]["uid"] = f"uid-{pod['metadata']['name']}"
    pod["metadata"]["ownerReferences"] = [{"controller": True, "uid": "uid-es"}]
    if deleting:
        pod["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    pod["spec"]["nodeName"] = p.node
    pod["status"] = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return pod


def view(**change: Any) -> CacheView:
    v = CacheView(CACHE, True, "", [], {}, {}, {"node-a", "node-b"}, current={"node-a", "node-b"})
    for key, value in change.items():
        setattr(v, key, value)
    return v


def lease_doc(*leases: tuple[dict[str, Any], str]) -> dict[str, Any]:
    """An agent's /status with these (pod, role) leases of group 0 on rank 0."""
    return {"phase": "Ready", "replicas": [{"index": 0, "gpus": ["GPU-a0", "GPU-a1"], "phase": "Ready"}],
            "ranks": [{"rank": 0, "phase": "Ready", "misses": 0, "leases": [
                {"role": role, "group": lease_group("ml", "chat", 0),
                 "pod": {"namespace": "ml", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}}
                for pod, role in leases]}]}


# --- inventory ------------------------------------------------------------------------

def test_inventory_sorts_pods_by_group_and_slot_and_sets_aside_what_is_going() -> None:
    stray = engine(A, 0)
    stray["metadata"]["name"] = "chat-0-x"  # not a slot
    unlabelled = engine(A, 2)
    unlabelled["metadata"]["labels"]["weightcache.io/group"] = "zero"
    going_claim = render_claim(ES, "ml", "chat", B)
    going_claim["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    inv = take_inventory("chat", [engine(A, 0), engine(A, 1, deleting=True), stray, unlabelled],
                         [render_claim(ES, "ml", "chat", A), going_claim])
    assert set(inv.pods) == {0}
    assert list(inv.pods[0].live) == [0] and inv.pods[0].terminating == {1}
    assert set(inv.claims) == {0}
    assert inv.waiting == {1}  # its claim still holds the name: nothing new for group 1 yet
    assert inv.group(5).live == {} and 5 not in inv.pods


def test_recorded_placement_prefers_the_claim_and_voids_one_of_another_size() -> None:
    claim = render_claim(ES, "ml", "chat", A)
    pod_elsewhere = engine(Placement(0, "node-c", ("GPU-c0", "GPU-c1")), 0)
    old_size = engine(Placement(1, "node-b", ("GPU-b0",)), 0)  # from before the cache's tp grew
    inv = take_inventory("chat", [pod_elsewhere, old_size], [claim])
    assert recorded_placements(inv, 2) == {0: A}
    assert running_groups(inv) == {0, 1}


def test_unwanted_groups_are_the_ones_no_longer_placed_there() -> None:
    moved = Placement(1, "node-c", ("GPU-c0", "GPU-c1"))
    inv = take_inventory("chat", [engine(A, 0), engine(B, 0), engine(Placement(2, "node-a", ("GPU-a2", "GPU-a3")), 0),
                                  engine(Placement(3, "node-a", ("GPU-x", "GPU-y")), 0, deleting=True)], [])
    existing = recorded_placements(inv, 2)
    # group 1 is placed elsewhere now, group 2 is beyond replicas, group 3 only has a pod going away
    assert unwanted_groups(inv, {0: A, 1: moved}, existing) == [1, 2]


def test_the_rollout_works_on_the_lowest_outdated_group_that_is_not_waiting() -> None:
    inv = take_inventory("chat", [engine(A, 0), engine(B, 0, cache=NEW_MODEL)], [])
    placed = {0: A, 1: B}
    assert rolling_group(placed, inv, THASH) == 1
    inv.waiting.add(1)
    assert rolling_group(placed, inv, THASH) is None
    assert rolling_group(placed, take_inventory("chat", [engine(A, 0), engine(B, 0)], []), THASH) is None


# --- the cache view ---------------------------------------------------------------------

def agent(name: str, node: str) -> AgentPod:
    return AgentPod(name, node, "10.0.0.1", 9464, "Running", True, False, "", None)


def test_the_view_of_the_agents_places_only_ready_replicas_of_nodes_that_answer() -> None:
    agent_spec = render_daemonset(CACHE, "ml", "qwen", CONFIG)["spec"]["template"]["spec"]
    old_spec = render_daemonset(NEW_MODEL, "ml", "qwen", CONFIG)["spec"]["template"]["spec"]
    raw = [{"metadata": {"name": "qwen-a"}, "spec": agent_spec}, {"metadata": {"name": "qwen-c"}, "spec": old_spec}]
    primary = engine(A, 0)
    doc_a = lease_doc((primary, "primary"))
    doc_a["replicas"].append({"index": 1, "gpus": ["GPU-a2", "GPU-a3"], "phase": "Loading"})
    doc_a["ranks"][0]["misses"] = 2
    doc_c = {"phase": "Ready", "replicas": [{"index": 0, "gpus": ["GPU-c0"], "phase": "Ready"}]}  # one GPU: not tp
    state = CacheState(CACHE, True, "ok", False)
    v = view_from_agents(state, raw, [agent("qwen-a", "node-a"), agent("qwen-b", "node-b"), agent("qwen-c", "node-c")],
                         {"qwen-a": doc_a, "qwen-b": AgentStatusError("timed out"), "qwen-c": doc_c})
    assert v.replicas == [Replica("node-a", 0, ("GPU-a0", "GPU-a1"))]
    assert v.unreachable == {"node-b": "timed out"}
    assert v.agent_nodes == {"node-a", "node-b", "node-c"}
    assert v.primaries["node-a"][lease_group("ml", "chat", 0)].name == "chat-0-0"
    assert v.roles["node-a"] == {"chat-0-0": "primary"}
    assert v.misses == {"node-a": 2, "node-c": 0}
    assert v.current == {"node-a"}  # node-c's agent runs another revision
    assert v.agent_urls["node-a"] == "http://10.0.0.1:9464"


def test_a_serving_label_stays_where_a_fresh_read_shows_a_primary_or_no_answer() -> None:
    promoted, demoted, unknown = engine(A, 0, serving=True), engine(A, 1, serving=True), engine(B, 0, serving=True)
    ref = PodRef("ml", "chat-0-0", "uid-chat-0-0")
    # node-b answered before (its leases are known) but not now: its pod keeps the label
    fresh = view(primaries={"node-a": {lease_group("ml", "chat", 0): ref}, "node-b": {}},
                 unreachable={"node-b": "timed out"})
    assert still_not_primary(fresh, [promoted, demoted, unknown]) == [demoted]
    # the same name with another uid is a replacement pod, not the primary
    fresh.primaries["node-a"][lease_group("ml", "chat", 0)] = PodRef("ml", "chat-0-0", "uid-older")
    assert still_not_primary(fresh, [promoted]) == [promoted]


# --- one group ----------------------------------------------------------------------------

def group(*pods: dict[str, Any], terminating: tuple[int, ...] = ()) -> GroupPods:
    gp = GroupPods()
    for pod in pods:
        gp.live[int(pod["metadata"]["name"].rsplit("-", 1)[1])] = pod
    gp.terminating = set(terminating)
    return gp


def test_failed_finished_and_misplaced_pods_are_replaced_but_a_failed_new_one_stays_in_a_rollout() -> None:
    failed, done = engine(A, 0, phase="Failed"), engine(A, 1, phase="Succeeded")
    misplaced = engine(Placement(0, "node-a", ("GPU-a2", "GPU-a3")), 2)
    assert [(s, why) for s, _, why in pods_to_replace(group(failed, done, misplaced, engine(A, 3)), 0, A, None)] == [
        (0, "pod Failed"), (1, "pod Succeeded"), (2, "placement changed")]
    new_failed = engine(A, 4, cache=NEW_MODEL, phase="Failed")
    new_hash = template_hash(ES, NEW_MODEL, CONFIG)
    assert pods_to_replace(group(new_failed), 0, A, new_hash) == []  # the stalled rollout shows it
    assert [s for s, _, _ in pods_to_replace(group(new_failed, failed), 0, A, new_hash)] == [0]


def test_missing_pods_go_to_the_lowest_free_slots_around_terminating_ones() -> None:
    gp = group(engine(A, 2), terminating=(0,))
    assert slots_to_fill(gp, 3, rolling=False, node_current=True) == [1]
    assert slots_to_fill(group(), 2, rolling=False, node_current=True) == [0, 1]
    assert slots_to_fill(group(), 2, rolling=True, node_current=True) == []  # the planner's
    # pods on a node whose agent has not loaded the model yet could not attach: none added
    assert slots_to_fill(gp, 3, rolling=False, node_current=False) == []
    assert slots_to_fill(group(), 2, rolling=False, node_current=False) == [0, 1]
    assert slot_budget(view(memory_hold=True), 3) == 1 and slot_budget(view(), 3) == 3


def test_roles_follow_the_agent_by_name_and_uid_and_give_the_label_changes() -> None:
    primary, standby, old = engine(A, 0), engine(A, 1), engine(A, 2, serving=True)
    v = view(primaries={"node-a": {lease_group("ml", "chat", 0): PodRef("ml", "chat-0-0", "uid-chat-0-0")}})
    roles = group_roles(v, "node-a", lease_group("ml", "chat", 0), group(primary, standby, old))
    assert roles.primary is primary and roles.serving_pod is primary
    assert roles.label_changes() == ([primary], [old])  # "true" on the primary, "false" on the old one
    # a replacement under the primary's name is not the primary: labels stay until the agent says
    v.primaries["node-a"][lease_group("ml", "chat", 0)] = PodRef("ml", "chat-0-0", "uid-older")
    roles = group_roles(v, "node-a", lease_group("ml", "chat", 0), group(primary, standby, old))
    assert roles.primary is None and roles.serving_pod is old
    assert roles.label_changes() == ([], [])


def test_excess_standbys_go_highest_slot_first_never_the_primary_or_a_pod_still_serving() -> None:
    pods = [engine(A, 0), engine(A, 1), engine(A, 2, serving=True), engine(A, 3)]
    v = view(primaries={"node-a": {lease_group("ml", "chat", 0): PodRef("ml", "chat-0-3", None)}})
    roles = group_roles(v, "node-a", lease_group("ml", "chat", 0), group(*pods))
    assert [s for s, _ in excess_standbys(group(*pods), 2, roles, keep_all=False)] == [1, 0]
    assert [s for s, _ in excess_standbys(group(*pods), 3, roles, keep_all=False)] == [1]
    assert excess_standbys(group(*pods), 1, roles, keep_all=True) == []


def test_the_planner_sees_each_pod_with_its_role_and_template() -> None:
    failing = engine(A, 1, cache=NEW_MODEL, ready=False)
    failing["status"]["containerStatuses"] = [{"name": "engine", "restartCount": 5}]
    pods = engine_pods(group(engine(A, 0, serving=True), failing), {"chat-0-0": "primary"},
                       datetime.datetime.now(datetime.timezone.utc))
    assert [(p.name, p.slot, p.role, p.ready, p.serving) for p in pods] == [
        ("chat-0-0", 0, "primary", True, True), ("chat-0-1", 1, None, False, False)]
    assert pods[0].template_hash == THASH and pods[1].template_hash != THASH
    assert pods[1].failed == "container engine restarted 5 times"


def test_a_switchover_request_is_refused_with_the_reason() -> None:
    primary, standby, loose = engine(A, 0), engine(A, 1), engine(A, 2)
    inv = take_inventory("chat", [primary, standby, loose], [])
    v = view(roles={"node-a": {"chat-0-0": "primary", "chat-0-1": "standby"}})
    assert requested_group(inv, {0: A}, "chat-0-1") == (0, A)
    assert requested_group(inv, {}, "chat-0-1") == (0, None)

    def why(pod: str, key: bool = True, placed: dict[int, Placement] | None = None) -> str:
        g, p = requested_group(inv, {0: A} if placed is None else placed, pod)
        return switchover_refusal(v, "chat", pod, g, p, key)

    assert why("chat-0-1") == ""
    assert why("chat-0-0") == "chat-0-0 is already the primary of group 0"
    assert "reports nothing for it" in why("chat-0-2")
    assert why("chat-9-9") == "chat-9-9 is not a live engine pod of EngineSet chat"
    assert "not a live engine pod" in why("chat-0-1", placed={})
    assert "no control key" in why("chat-0-1", key=False)


# --- status ----------------------------------------------------------------------------

def test_a_failover_is_timed_from_the_last_pass_that_saw_the_old_primary() -> None:
    seen: dict[int, tuple[str, float]] = {}
    entry: dict[str, Any] = {"index": 0}
    assert record_failover(entry, {}, "chat-0-0", seen, 100.0, clock=lambda: "T1") is None
    assert seen == {0: ("chat-0-0", 100.0)} and "lastFailoverTime" not in entry

    entry = {"index": 0}
    old = {"primary": "chat-0-0", "lastFailoverSeconds": 9.0}
    assert record_failover(entry, old, "chat-0-1", seen, 101.25, clock=lambda: "T2") == "chat-0-0"
    assert entry == {"index": 0, "lastFailoverTime": "T2", "lastFailoverSeconds": 1.25}
    assert seen[0] == ("chat-0-1", 101.25)

    # the last pass saw another primary than the status names: no duration to measure from
    entry = {"index": 0, "lastFailoverSeconds": 1.25}
    assert record_failover(entry, {"primary": "chat-0-0"}, "chat-0-2", seen, 102.0, clock=lambda: "T3") == "chat-0-0"
    assert entry == {"index": 0, "lastFailoverTime": "T3"}

    # an operator restarted in between never saw the old primary: the time, no duration
    entry = {"index": 0, "lastFailoverSeconds": 1.25}
    assert record_failover(entry, {"primary": "chat-0-1"}, "chat-0-2", {}, 5.0, clock=lambda: "T3") == "chat-0-1"
    assert entry == {"index": 0, "lastFailoverTime": "T3"}


def test_a_group_entry_counts_a_ready_labelled_primary_as_serving() -> None:
    primary, standby = engine(A, 0, serving=True), engine(A, 1)
    v = view(primaries={"node-a": {lease_group("ml", "chat", 0): PodRef("ml", "chat-0-0", "uid-chat-0-0")}},
             roles={"node-a": {"chat-0-0": "primary", "chat-0-1": "standby"}})
    gp = group(primary, standby)
    roles = group_roles(v, "node-a", lease_group("ml", "chat", 0), gp)
    tally = Tally()
    entry = group_entry("chat", ES.mode, A, gp, roles, {"lastFailoverTime": "T0", "primary": "chat-0-0"})
    tally_group(tally, v, A, gp, roles, entry, [], THASH, None)
    assert tally.counts == {"replicas": 1, "ready": 1, "serving": 1, "standbys": 1, "pods": 2, "updated": 2}
    assert tally.groups == [{"index": 0, "node": "node-a", "gpus": ["GPU-a0", "GPU-a1"], "claim": "chat-0",
                             "primary": "chat-0-0", "standbys": ["chat-0-1"], "lastFailoverTime": "T0",
                             "phase": "Serving", "templateHash": THASH, "model": "/models/qwen",
                             "updatedPods": 2, "pods": 2, "rollout": "Updated"}]
    assert tally.not_serving == {}


def test_a_group_that_does_not_serve_says_why_in_the_ready_condition() -> None:
    v = view(roles={"node-a": {}}, misses={"node-a": 3})
    tally = Tally()
    for g in range(MAX_REASONS + 2):
        p = Placement(g, "node-a", (f"GPU-{g}",))
        gp = group(engine(A, 0, ready=False))
        roles = group_roles(v, "node-a", lease_group("ml", "chat", g), gp)
        tally_group(tally, v, p, gp, roles, group_entry("chat", ES.mode, p, gp, roles, {}), [], THASH, None)
    assert tally.counts["serving"] == 0 and tally.groups[0]["phase"] == "Starting"
    assert "refused 3 attach(es)" in tally.not_serving[0]
    es = parse_engineset("chat", {"cacheRef": {"name": "qwen"}, "template": TEMPLATE, "replicas": MAX_REASONS + 2})
    ready, degraded = conditions(es, v, tally, [], {})
    assert (ready.status, ready.reason) == ("False", "GroupsNotServing")
    assert ready.message.startswith(f"0/{MAX_REASONS + 2} groups serving; group 0: ")
    assert ready.message.endswith("; and 2 more")
    assert (degraded.status, degraded.reason) == ("False", "AsExpected")


@pytest.mark.parametrize("change, reason", [
    ({"rejected": ["Pod chat-0-0: forbidden"]}, "Rejected"),
    ({"conflicts": ["Service chat"]}, "OwnershipConflict"),
])
def test_what_the_api_server_refused_comes_before_other_trouble(change: dict[str, Any], reason: str) -> None:
    tally = Tally(**copy.deepcopy(change))
    _, degraded = conditions(ES, view(ready=False, ready_message="loading"), tally, [1], {0: A})
    assert (degraded.status, degraded.reason) == ("True", reason)
    _, degraded = conditions(ES, view(ready=False, ready_message="loading"), Tally(), [1], {0: A})
    assert degraded.reason == "CacheNotReady" and "(loading)" in degraded.message
    _, degraded = conditions(ES, view(unreachable={"node-a": "timed out"}), Tally(), [], {0: A})
    assert degraded.reason == "AgentUnreachable" and "node-a (timed out)" in degraded.message
