"""Rolling upgrades of an EngineSet, make-before-break: what to do next for each group.

A pure planner. The reconcile describes every group as it is -- its pods, each with the
template hash and cache revision it runs, the role the agent gives it, readiness and
failure -- and what is wanted; `plan_group` answers with the ONE next step for that
group, and `plan_rollout` picks the group to work on (one at a time, in index order, so
a bad template stops after the first group). Applying a step and observing again is the
reconcile's job; nothing here touches the API, which is what lets the operator and the
local end-to-end test run the same decisions.

Per group, with `standbys` S (maxUnavailable 0, maxSurge 1):
1. surge: create one pod on the new template/revision beside the old ones;
2. once it is attached as a warm standby: switchover (it becomes primary, the old primary
   is demoted and drains, still answering until traffic moves); pods created while the
   group has a primary attach as standbys (`Step.role`), also on a new revision's agent;
3. retire old pods once nothing routes to them (serving label off), creating a new
   standby before retiring each old one, so the group never has fewer than S standbys;
4. done when every pod runs the new template and revision and the count is S + 1.
A group without a primary (its primary died where no standby of the same agent was left)
gets one by a switchover to a warm standby: the level-based repair. A group the agent
knows nothing of -- the agent restarted on a new model revision, which the old engines
cannot rejoin, while they keep serving the old weights they map -- gets a new pod that
attaches as its primary; the old pods are retired once it serves.
A new pod that fails (crash loop, attach refused) or does not become ready within the
progress deadline stalls the rollout: the old primary keeps serving, and the reason
goes to a condition and an Event.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class EnginePod:
    name: str
    slot: int
    template_hash: str
    revision: str
    role: str | None = None  # what the agent says: "primary" | "promoting" | "standby" | None (not attached)
    ready: bool = False  # attached and warm (the pod's readiness as a standby or primary)
    serving: bool = False  # the label the Service selects
    failed: str | None = None  # why it cannot become ready (crash loop, attach refused), else None
    age: float = 0.0  # seconds since it was created
    deleting: bool = False


@dataclasses.dataclass(frozen=True)
class Target:
    template_hash: str
    revision: str

    def matches(self, pod: EnginePod) -> bool:
        return pod.template_hash == self.template_hash and pod.revision == self.revision


@dataclasses.dataclass(frozen=True)
class Step:
    """One next step: kind is create | switchover | retire | wait | stalled | done."""

    kind: str
    group: int
    slot: int | None = None  # create
    role: str = "auto"  # create: "standby" while the group has a primary (it may be another agent's)
    pod: str | None = None  # switchover (the new primary), retire
    reason: str = ""

    @property
    def changes(self) -> bool:
        return self.kind in ("create", "switchover", "retire")


def plan_group(group: int, pods: Sequence[EnginePod], target: Target, standbys: int,
               progress_deadline: float = 300.0) -> Step:
    live = [p for p in pods if not p.deleting]
    new = [p for p in live if target.matches(p)]
    old = [p for p in live if not target.matches(p)]
    want = standbys + 1

    for pod in new:
        if pod.failed:
            return Step("stalled", group, pod=pod.name, reason=f"new pod {pod.name} failed: {pod.failed}")
        if not pod.ready and pod.age > progress_deadline:
            return Step("stalled", group, pod=pod.name,
                        reason=f"new pod {pod.name} not ready after {progress_deadline:.0f}s")
    pending = [p for p in new if not p.ready]
    if pending:
        return Step("wait", group, pod=pending[0].name, reason=f"waiting for {pending[0].name} to attach")

    # A promotion in flight (told, not yet acknowledged) already has its primary.
    primary = next((p for p in live if p.role in ("primary", "promoting")), None)
    role = "standby" if primary is not None else "auto"
    if primary is None:
        # Standbys of another agent (a new revision's) are not promoted by the agent that lost
        # the primary: hand the role over ourselves, to a pod on the target if there is one.
        warm = sorted((p for p in live if p.role == "standby"), key=lambda p: not target.matches(p))
        if warm:
            return Step("switchover", group, pod=warm[0].name, reason=f"the group has no primary; {warm[0].name} takes over")
        if not new and len(live) < want + 1:
            # The agent knows none of the pods (it restarted on a new revision, which the old
            # engines cannot rejoin): the new pod attaches as the group's primary there, and the
            # old ones keep their serving label until it is ready.
            return Step("create", group, slot=free_slot(pods), reason="the agent holds no engine of the group")
        return Step("wait", group, reason="the group has no primary and no warm standby")
    if not old:
        if len(live) < want:
            return Step("create", group, slot=free_slot(pods), role=role, reason="restore the standby count")
        return Step("done", group)

    if not target.matches(primary):
        warm = [p for p in new if p.role == "standby"]
        if warm:
            return Step("switchover", group, pod=warm[0].name, reason=f"hand the primary role to {warm[0].name}")
        if len(live) < want + 1:
            return Step("create", group, slot=free_slot(pods), role=role, reason="surge a standby on the new template")
        return Step("wait", group, reason="waiting for a new standby to attach")

    # The new primary serves: retire the old pods, never dropping below the standby count.
    if len(live) <= want:
        return Step("create", group, slot=free_slot(pods), role=role, reason="a new standby before retiring an old one")
    quiet = [p for p in old if p.role != "primary" and not p.serving]
    if quiet:
        return Step("retire", group, pod=quiet[0].name, reason=f"retire {quiet[0].name}")
    return Step("wait", group, reason="waiting for old pods to stop receiving traffic")


def plan_rollout(groups: Sequence[Sequence[EnginePod]], target: Target, standbys: int,
                 progress_deadline: float = 300.0) -> list[Step]:
    """The next step of each group that may move now: the first unfinished group only.

    Groups before it are done; the ones after wait their turn, so that a bad template
    stops after one group while the old primaries keep serving.
    """
    steps = []
    for index, pods in enumerate(groups):
        step = plan_group(index, pods, target, standbys, progress_deadline)
        steps.append(step)
        if step.kind != "done":
            break
    return steps


def free_slot(pods: Sequence[EnginePod]) -> int:
    taken = {p.slot for p in pods}
    return next(i for i in range(len(taken) + 1) if i not in taken)
