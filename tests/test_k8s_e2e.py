"""The failover end to end on a real control plane: operator, agent, engines, API server.

Nothing is stood in for but the kubelet and the container runtime: the operator runs in
this process as the chart's service account, the node agent is the pod its DaemonSet
makes (a local process, cpu backend, its label writer on the token bound to that pod and
through the chart's admission policy), the engines are the EngineSet's pods (reference
engine processes attaching from the environment the operator injects), and the Service's
EndpointSlice is the real controller's. `bench/failover_e2e_k8s.py` holds the setup and
the trial loop; this test runs fewer trials than the benchmark (for CI time) and asserts:

- placement: four engine pods in two groups, each group on one node and one device, the
  devices distinct, the environment the engines attached with matching the placement;
- a SIGKILLed primary's standby is promoted by the agent and then listed ready by the
  EndpointSlice (the benchmark's bar: p99 <= 200 ms, kill to the EndpointSlice event; here,
  beside other workers, the promotion's p99 and the whole path's median are bounded with
  `SHARED_MACHINE_SLACK`), and
  the killed pod comes back as the group's standby after its container restarts;
- a group never lacks a ready serving endpoint for longer than the kubelet race allows
  (see `test_no_group_is_left_without_a_serving_endpoint`);
- a template change rolls every group through the agents' planned switchover, each
  group's EndpointSlice entry moving from an old pod to a new one with no gap at all, and
  every pod ends on the new template hash.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import sys
from collections.abc import Iterator

import pytest

from k8s_lab import REPO, SHARED_MACHINE_SLACK, Lab, wait_for
from weightcache_agent.protocol import agent_status

pytestmark = [pytest.mark.timeout(420)]

spec = importlib.util.spec_from_file_location("failover_e2e_k8s", REPO / "bench" / "failover_e2e_k8s.py")
assert spec and spec.loader
e2e_bench = importlib.util.module_from_spec(spec)
sys.modules["failover_e2e_k8s"] = e2e_bench
spec.loader.exec_module(e2e_bench)

TRIALS = 10


@pytest.fixture(scope="module")
def e2e(k8s_chart: Lab) -> Iterator[e2e_bench.EndToEnd]:
    with e2e_bench.EndToEnd(k8s_chart) as setup:
        yield setup


def env_of(pod: dict, name: str) -> str | None:
    for var in pod["spec"]["containers"][0].get("env") or []:
        if var["name"] == name:
            return var.get("value")
    return None


def test_four_engines_in_two_groups_each_on_one_node_and_device(e2e: e2e_bench.EndToEnd) -> None:
    pods = {p["metadata"]["name"]: p for p in e2e.pods()}
    assert sorted(pods) == ["chat-0-0", "chat-0-1", "chat-1-0", "chat-1-1"]
    placement = {}
    for group in (0, 1):
        members = [pods[f"chat-{group}-{slot}"] for slot in (0, 1)]
        nodes = {p["spec"]["nodeName"] for p in members} | {p["metadata"]["annotations"]["weightcache.io/node"]
                                                             for p in members}
        devices = {p["metadata"]["annotations"]["weightcache.io/gpus"] for p in members}
        env_devices = {env_of(p, "WEIGHTCACHE_DEVICES") for p in members} | {env_of(p, "NVIDIA_VISIBLE_DEVICES")
                                                                             for p in members}
        assert nodes == {e2e_bench.NODE} and len(devices) == 1 and env_devices == devices, (nodes, devices)
        assert {env_of(p, "WEIGHTCACHE_GROUP") for p in members} == {f"{e2e.ns}/chat-{group}"}
        placement[group] = devices.pop()
    assert placement[0] != placement[1]
    # The agent holds each group's engines on that group's device: one primary, one standby.
    for group, device in placement.items():
        roles = e2e.leases(device)
        assert sorted(roles.values()) == ["primary", "standby"], roles
        assert {e2e_bench.group_of(n) for n in roles} == {group}
    # The Service routes to one engine per group: the primary, labelled by the operator.
    serving = set(e2e.watch.current())
    assert {e2e_bench.group_of(n) for n in serving} == {0, 1} and len(serving) == 2


BOUND_S = SHARED_MACHINE_SLACK * e2e_bench.BAR_P99_S


@pytest.fixture(scope="module")
def results(e2e: e2e_bench.EndToEnd) -> e2e_bench.Results:
    r = e2e.measure(TRIALS, warmup=2)
    e2e.report = e2e_bench.table(r)  # printed after the operator's runner gives stdout back
    return r


def test_kill_of_a_primary_moves_the_endpoint_within_the_bar(e2e: e2e_bench.EndToEnd,
                                                            results: e2e_bench.Results, time_bar) -> None:
    assert len(results.trials) == TRIALS
    assert {t.group for t in results.trials} == {0, 1}
    for t in results.trials:
        assert t.killed != t.promoted and e2e_bench.group_of(t.promoted) == t.group
        assert t.promotion_s > 0 and t.endpoint_s > 0, t
    # the agent promotes before the API can follow (its write comes after the promotion): in every trial
    # the last poll that still found the standby not primary was sent before the EndpointSlice listed it
    # (when a poll saw the promotion depends on how fast a loaded machine answers it, not on the order)
    for t in results.trials:
        assert t.not_promoted_s < t.endpoint_s, t
    # The agent's part (kill -> promoted) at p99; the whole path (through the EndpointSlice
    # controller, which a busy machine delays by a second at times) at its median: the p99 of
    # ten trials is one trial, and the benchmark holds the bar on it, alone.
    time_bar("kill -> the agent's promotion, p99", e2e_bench.percentile(results.promotion, 99), BOUND_S,
             inclusive=True, detail=e2e.report)
    time_bar("kill -> the EndpointSlice lists the standby, median", statistics.median(results.endpoint), BOUND_S,
             inclusive=True, detail=e2e.report)
    # every killed pod came back, restarted in place, as its group's standby
    final = e2e.wait_settled((0, 1))
    killed = {t.killed for t in results.trials}
    assert killed <= {name for p, s, _ in final.values() for name in (p, s)}
    restarts = {n: e2e.kubelet.run_of(e2e.ns, n).restarts for n in killed}
    assert all(r >= 1 for r in restarts.values()), restarts


def test_no_group_is_left_without_a_serving_endpoint(e2e: e2e_bench.EndToEnd,
                                                     results: e2e_bench.Results) -> None:
    """Every EndpointSlice state during the trials lists a ready serving engine of each group.

    One race is outside the product's reach: a kubelet that marks the killed pod not ready
    before the agent's write lands leaves the group empty until the write arrives (the fake
    kubelet looks at its pods every second, as a kubelet's relist does, so this is rare).
    Such a window must be closed by the promoted standby within the bar (`BOUND_S` here); anything longer
    (the operator taking the label back from a fresh primary, say) fails.
    """
    assert results.slice_changes > 2 * TRIALS
    too_long = [w for w in results.empty_windows if w[2] > BOUND_S]
    assert not too_long, f"groups without a ready serving endpoint (start s, group, seconds): {too_long}"


def test_report(e2e: e2e_bench.EndToEnd, results: e2e_bench.Results, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():  # the operator's runner holds sys.stdout: write to the descriptor
        os.write(1, ("\n" + e2e.report + "\n").encode())


def test_template_rollout_moves_each_groups_endpoint_to_a_new_pod_without_a_gap(
        e2e: e2e_bench.EndToEnd, results: e2e_bench.Results) -> None:
    """A changed template rolls every group, make before break: each group's EndpointSlice entry
    goes from its old pod to a new one, no EndpointSlice state lacks a ready serving engine of a
    group, and every pod ends on the new template hash."""
    before = {p["metadata"]["name"]: p["metadata"]["labels"]["weightcache.io/template-hash"] for p in e2e.pods()}
    r = e2e_bench.roll_template(e2e, ("--max-new-tokens", "128"))
    assert r.template_hash not in set(before.values())
    assert set(r.hashes.values()) == {r.template_hash}
    for group in (0, 1):
        assert e2e_bench.group_of(r.new_serving[group]) == group
        # the pod serving now is one the rollout made; the one serving before is gone or renewed
        assert r.new_serving[group] not in before or r.hashes[r.new_serving[group]] != before[r.new_serving[group]]
    assert r.slice_changes >= 4, r
    assert r.empty_windows == [], f"groups without a ready serving endpoint during the rollout: {r.empty_windows}"
    # the new engines really run the new template's arguments
    for name in r.hashes:
        run = e2e.kubelet.run_of(e2e.ns, name)
        assert run is not None and run.proc is not None and "128" in run.proc.args


def test_after_the_rollout_each_group_has_one_primary_and_its_standbys(e2e: e2e_bench.EndToEnd) -> None:
    """The surged pod may keep its slot: a group still ends with 1 + standbys pods, not one more."""
    def live() -> list[str]:
        return sorted(p["metadata"]["name"] for p in e2e.pods() if not p["metadata"].get("deletionTimestamp"))
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: len(live()) == e2e.replicas * (1 + e2e.standbys), timeout=20, what="four pods")
    assert len(live()) == e2e.replicas * (1 + e2e.standbys), live()
    settled = e2e.wait_settled((0, 1))
    assert {e2e_bench.group_of(n) for n in live()} == set(settled)


def events(e2e: e2e_bench.EndToEnd, reason: str) -> list[str]:
    items = e2e.api.get(f"/api/v1/namespaces/{e2e.ns}/events")["items"]
    return [ev.get("message", "") for ev in items
            if ev.get("reason") == reason and ev.get("involvedObject", {}).get("name") == e2e_bench.ENGINESET]


def engineset(e2e: e2e_bench.EndToEnd) -> dict:
    return e2e.api.get(f"{e2e_bench.WC}/namespaces/{e2e.ns}/enginesets/{e2e_bench.ENGINESET}")


def progressing(e2e: e2e_bench.EndToEnd) -> dict:
    return next((c for c in (engineset(e2e).get("status") or {}).get("conditions") or []
                 if c["type"] == "Progressing"), {})


def test_a_bad_template_stalls_after_the_first_group_and_the_old_primaries_keep_serving(
        e2e: e2e_bench.EndToEnd) -> None:
    """A template whose engines exit at start (a bad flag): the rollout stops at group 0 with a
    condition and a Warning Event, no group loses its primary or its endpoint, group 1 is not
    touched; putting the template back rolls the failed pod away."""
    settled = e2e.wait_settled((0, 1))
    before = {p["metadata"]["name"] for p in e2e.pods()}
    path = f"{e2e_bench.WC}/namespaces/{e2e.ns}/enginesets/{e2e_bench.ENGINESET}"
    good = engineset(e2e)["spec"]["template"]
    e2e.api.patch(path, {"spec": {"template": e2e_bench.engine_template(("--max-new-tokens", "0"))}})
    try:
        stalled = wait_for(lambda: (c := progressing(e2e)).get("reason") == "RolloutStalled" and c, timeout=90,
                           interval=0.5, what="the rollout stalled")
        assert stalled["status"] == "False" and stalled["message"].startswith("group 0: new pod"), stalled
        assert "CrashLoopBackOff" in stalled["message"] or "failed" in stalled["message"], stalled
        wait_for(lambda: [m for m in events(e2e, "RolloutStalled")], timeout=10, what="a RolloutStalled Event")
        warnings = [ev for ev in e2e.api.get(f"/api/v1/namespaces/{e2e.ns}/events")["items"]
                    if ev.get("reason") == "RolloutStalled"]
        assert all(ev["type"] == "Warning" for ev in warnings), warnings
        # The old primaries serve on (the EndpointSlice lists them and the agent holds them as
        # primaries, beside group 0's failing pod); group 1 has its old pods only.
        assert sorted(e2e.watch.current()) == sorted(v[0] for v in settled.values())
        for primary, _, device in settled.values():
            assert e2e.leases(device).get(primary) == "primary", (primary, e2e.leases(device))
        group1 = {p["metadata"]["name"] for p in e2e.pods() if e2e_bench.group_of(p["metadata"]["name"]) == 1}
        assert group1 <= before, f"group 1 was touched by a stalled rollout: {group1 - before}"
        assert (engineset(e2e)["status"]["rollout"]["phase"], engineset(e2e)["status"]["rollout"]["group"]) \
            == ("Stalled", 0)
    finally:
        e2e.api.patch(path, {"spec": {"template": good}})
    wait_for(lambda: progressing(e2e).get("reason") == "RolloutComplete", timeout=90, interval=0.5,
             what="the rollout complete again")
    assert e2e.wait_settled((0, 1)) == settled


def test_each_group_reports_what_it_serves_against_the_rollouts_target(e2e: e2e_bench.EndToEnd) -> None:
    e2e.wait_settled((0, 1))
    status = wait_for(lambda: (s := engineset(e2e).get("status") or {}) and all(
        g.get("rollout") == "Updated" for g in s.get("groups") or [{}]) and s, timeout=20, what="groups Updated")
    target = status["rollout"]["templateHash"]
    for g in status["groups"]:
        assert g["templateHash"] == target and g["updatedPods"] == g["pods"] == 1 + e2e.standbys, g
        assert g["model"] == f"/models/{e2e_bench.MODEL}", g


def test_a_switchover_requested_by_annotation_moves_the_endpoint_to_the_standby(e2e: e2e_bench.EndToEnd,
                                                                                  time_bar) -> None:
    old, new, seconds = e2e_bench.switchover_by_annotation(e2e, 0)
    # the operator's poll (1 s), the agent's switchover, the EndpointSlice controller: a few seconds
    # alone, more on a machine busy with other workers
    time_bar("annotation -> EndpointSlice", seconds, 15.0)
    assert e2e.wait_settled([0])[0][0] == new
    wait_for(lambda: "weightcache.io/switchover-to" not in (engineset(e2e)["metadata"].get("annotations") or {}),
             timeout=10, what="the annotation removed")
    assert any(new in m and "annotation" in m for m in events(e2e, "Switched")), events(e2e, "Switched")


def test_a_switchover_to_a_pod_that_is_no_standby_is_refused_by_an_event(e2e: e2e_bench.EndToEnd) -> None:
    primary = e2e.wait_settled([1])[1][0]
    e2e.lab.kubectl("annotate", "-n", e2e.ns, f"engineset/{e2e_bench.ENGINESET}",
                    f"weightcache.io/switchover-to={primary}")
    refused = wait_for(lambda: [m for m in events(e2e, "SwitchoverRefused") if primary in m], timeout=15,
                       what="a SwitchoverRefused event")
    assert "already the primary" in refused[0], refused
    wait_for(lambda: "weightcache.io/switchover-to" not in (engineset(e2e)["metadata"].get("annotations") or {}),
             timeout=10, what="the annotation removed")
    assert e2e.wait_settled([1])[1][0] == primary


def test_a_new_model_revision_rolls_every_group_to_the_new_weights_without_a_gap(
        e2e: e2e_bench.EndToEnd, capsys: pytest.CaptureFixture[str]) -> None:
    """The WeightCache moves to other weights: the agent's DaemonSet pod is replaced and loads them
    while the old engines keep serving from the arena they map; then each group gets pods attached
    to the new weights and its EndpointSlice entry moves to one of them with no gap."""
    r = e2e_bench.roll_model(e2e, e2e_bench.MODEL_V2, "r2")
    assert r.empty_windows == [], f"groups without a ready serving endpoint during the rollout: {r.empty_windows}"
    status = engineset(e2e)["status"]
    for g in status["groups"]:
        assert g["model"] == f"/models/{e2e_bench.MODEL_V2}@r2" and g["rollout"] == "Updated", g
    for group in (0, 1):
        assert r.new_serving[group] != r.old_serving[group]
    device = e2e.wait_settled([0])[0][2]
    assert agent_status(e2e.socket_path(device), timeout=2).get("revision") == "r2"
    with capsys.disabled():
        os.write(1, (f"\nmodel rollout {e2e_bench.MODEL} -> {e2e_bench.MODEL_V2}@r2, 2 groups: {r.seconds:.1f} s "
                     f"(agent reload included), {r.slice_changes} EndpointSlice changes, "
                     f"{len(r.empty_windows)} spans without a serving endpoint\n").encode())
