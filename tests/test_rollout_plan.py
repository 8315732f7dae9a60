"""The rollout planner, step by step: a simulated group follows each step the way the
cluster would (a created pod attaches as a standby, a switchover swaps roles, the
operator's label write follows the agent), and the invariants hold at every step."""
from __future__ import annotations

import dataclasses

import pytest

from weightcache_operator.controller.engineset.rollout import EnginePod, Target, plan_group, plan_rollout

OLD, NEW = Target("t-old", "r1"), Target("t-new", "r1")


def group(standbys: int, target: Target = OLD) -> list[EnginePod]:
    return [EnginePod(f"g-{slot}", slot, target.template_hash, target.revision, role="primary" if slot == 0 else "standby",
                      ready=True, serving=slot == 0) for slot in range(standbys + 1)]


def apply(pods: list[EnginePod], step, target: Target) -> list[EnginePod]:
    """What the cluster does in answer to one step (pods attach at once, labels follow roles)."""
    if step.kind == "create":
        pods = pods + [EnginePod(f"g-{step.slot}", step.slot, target.template_hash, target.revision)]
    elif step.kind == "switchover":
        pods = [dataclasses.replace(p, role="primary" if p.name == step.pod else
                                    ("standby" if p.role == "primary" else p.role)) for p in pods]
    elif step.kind == "retire":
        pods = [p for p in pods if p.name != step.pod]
    # the next observation: new pods attached and warm, labels follow the agent's roles
    return [dataclasses.replace(p, role=p.role or "standby", ready=True, serving=p.role == "primary") for p in pods]


@pytest.mark.parametrize("standbys", [0, 1, 2])
def test_a_group_rolls_make_before_break(standbys):
    pods, steps = group(standbys), []
    for _ in range(50):
        step = plan_group(0, pods, NEW, standbys)
        steps.append(step.kind)
        if step.kind == "done":
            break
        assert step.kind in ("create", "switchover", "retire"), step
        pods = apply(pods, step, NEW)
        primaries = [p for p in pods if p.role == "primary"]
        assert len(primaries) == 1, "always exactly one primary"
        assert sum(p.role == "standby" for p in pods) >= min(standbys, len(pods) - 1)
        assert len(pods) <= standbys + 2, "surge of one pod at most"
    assert steps[-1] == "done"
    assert steps.count("switchover") == 1
    assert steps.index("create") < steps.index("switchover") < steps.index("retire")
    assert all(NEW.matches(p) for p in pods) and len(pods) == standbys + 1


def test_a_failed_new_pod_stalls_and_leaves_the_old_primary():
    pods = group(1) + [EnginePod("g-2", 2, "t-new", "r1", failed="CrashLoopBackOff: exit 2")]
    step = plan_group(0, pods, NEW, 1)
    assert step.kind == "stalled" and "CrashLoopBackOff" in step.reason and step.pod == "g-2"
    slow = group(1) + [EnginePod("g-2", 2, "t-new", "r1", age=301.0)]
    assert plan_group(0, slow, NEW, 1, progress_deadline=300).kind == "stalled"
    young = group(1) + [EnginePod("g-2", 2, "t-new", "r1", age=5.0)]
    assert plan_group(0, young, NEW, 1).kind == "wait"


def test_a_group_without_a_primary_gets_one_preferring_the_target():
    pods = [dataclasses.replace(p, role="standby") for p in group(1)]
    assert plan_group(0, pods, NEW, 1) == dataclasses.replace(plan_group(0, pods, NEW, 1), kind="switchover", pod="g-0")
    pods.append(EnginePod("g-2", 2, "t-new", "r1", role="standby", ready=True))
    assert plan_group(0, pods, NEW, 1).pod == "g-2"
    cold = [dataclasses.replace(p, role=None, ready=False) for p in group(1)]
    assert plan_group(0, cold, OLD, 1).kind == "wait"


def test_pods_made_while_a_primary_serves_attach_as_standbys():
    assert plan_group(0, group(1), NEW, 1).role == "standby"
    assert plan_group(0, [], NEW, 1).role == "auto"


def test_an_old_pod_still_routed_to_is_not_retired():
    pods = [EnginePod("g-0", 0, "t-old", "r1", role="standby", ready=True, serving=True),
            EnginePod("g-1", 1, "t-old", "r1", role="standby", ready=True),
            EnginePod("g-2", 2, "t-new", "r1", role="primary", ready=True, serving=True)]
    step = plan_group(0, pods, NEW, 1)
    assert step == dataclasses.replace(step, kind="retire", pod="g-1")


def test_groups_roll_one_at_a_time_and_a_stall_stops_the_rest():
    done = group(1, NEW)
    assert [s.kind for s in plan_rollout([done, group(1), group(1)], NEW, 1)] == ["done", "create"]
    failing = group(1) + [EnginePod("g-2", 2, "t-new", "r1", failed="attach refused")]
    steps = plan_rollout([done, failing, group(1)], NEW, 1)
    assert [s.kind for s in steps] == ["done", "stalled"]


def test_a_revision_is_part_of_the_target():
    pods = group(0, Target("t", "r1"))
    assert plan_group(0, pods, Target("t", "r2"), 0).kind == "create"
    assert plan_group(0, pods, Target("t", "r1"), 0).kind == "done"


def test_a_revision_the_restarted_agent_serves_alone_rolls_through_a_new_primary():
    """The agent came back on a new revision: it knows none of the old pods (they serve the old
    weights they still map). A new pod attaches as primary; the old ones go once it serves."""
    pods = [dataclasses.replace(p, role=None) for p in group(1, Target("t", "r1"))]
    target = Target("t", "r2")
    step = plan_group(0, pods, target, 1)
    assert (step.kind, step.role) == ("create", "auto")
    pods = pods + [EnginePod("g-2", 2, "t", "r2", role="primary", ready=True, serving=True)]
    pods = [dataclasses.replace(p, serving=False) if p.role is None else p for p in pods]  # labels follow
    kinds = []
    for _ in range(10):
        step = plan_group(0, pods, target, 1)
        kinds.append(step.kind)
        if step.kind == "done":
            break
        pods = apply(pods, step, target)
    assert kinds[-1] == "done" and "switchover" not in kinds
    assert all(target.matches(p) for p in pods) and len(pods) == 2
