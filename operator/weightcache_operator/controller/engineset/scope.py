"""One pass of the EngineSet reconcile: the object it works on and what it has done so far.

Built by the reconcile once the spec is parsed and the cache is read, handed to every
step in turn, and dropped at the end of the pass (nothing in it outlives the pass except
the memo it points at). Steps read the object and the cache view from it, and leave in
it what later steps and the status need: the group being rolled and its step, the
serving labels to change once every group is done, and the ``Tally`` for the status.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import kopf

from ...api.v1alpha1.engineset_types import EngineSetSpec
from .cache_view import CacheView
from .rollout import Step
from .status import Tally


@dataclasses.dataclass
class EngineSetScope:
    """An EngineSet in the middle of a pass."""

    body: kopf.Body
    memo: kopf.Memo
    logger: Any
    namespace: str
    name: str
    uid: str | None
    es: EngineSetSpec
    view: CacheView
    old_status: Mapping[str, Any]
    new_status: dict[str, Any]
    pods: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # as listed, terminating ones too
    thash: str = ""  # the template hash every pod should run
    rolling: int | None = None  # the group the rollout works on
    step: Step | None = None  # that group's step in this pass
    now_mono: float = 0.0  # one reading of the monotonic clock for every group's failover timing
    tally: Tally = dataclasses.field(default_factory=Tally)
    # Serving labels to change after every group is done: all "true" ones before any "false" one.
    serving_true: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    serving_false: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def note(self, action: str, kind: str, obj_name: str, why: str = "") -> None:
        """A write this pass made, as a log line and an Event on the EngineSet."""
        message = f"{action} {kind} {obj_name}" + (f": {why}" if why else "")
        self.logger.info(message)
        kopf.event(self.body, type="Normal", reason=f"{kind}{action.capitalize()}", message=message[:1024])

    def old_group(self, group: int) -> Mapping[str, Any]:
        """The group's entry in the status this pass started from (empty when it had none)."""
        entries = {g.get("index"): g for g in self.old_status.get("groups") or [] if isinstance(g, Mapping)}
        return entries.get(group) or {}
