"""Ready / Loading / Degraded conditions: merging and transitions.

Conditions follow the Kubernetes API conventions (metav1.Condition shape): one entry
per type with status, reason (CamelCase), message, observedGeneration, and a
lastTransitionTime that moves only when the status changes. ``merge`` computes the
new list from the old one and the desired states; ``transitions`` says what changed
in a way worth a Kubernetes Event (status or reason, never just the message, so
progress updates do not flood the event stream); a Warning one where something broke:
Degraded turning True, Ready leaving True, or Ready False for the very reason Degraded is
True (no node, no claim, an invalid spec), so that a failure is never only a Normal event.
"""
from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

READY = "Ready"
LOADING = "Loading"
DEGRADED = "Degraded"
PROGRESSING = "Progressing"  # an EngineSet's rollout
OURS = (READY, LOADING, DEGRADED, PROGRESSING)


@dataclasses.dataclass(frozen=True)
class Desired:
    type: str
    status: str  # "True" / "False" / "Unknown"
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Transition:
    type: str
    old_status: str | None
    status: str
    reason: str
    message: str
    failure: bool = False  # Ready is not True for the reason Degraded gives (NoNodes, ClaimNotFound, ...)

    @property
    def warning(self) -> bool:
        """Worth a Warning event: something broke, rather than progressed."""
        if self.type == DEGRADED:
            return self.status == "True"
        if self.type == READY:
            return self.status != "True" and (self.old_status == "True" or self.failure)
        if self.type == PROGRESSING:
            return self.status == "False"  # a rollout stalled
        return False


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _by_type(conditions: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("type")): c for c in conditions or [] if isinstance(c, Mapping)}


def merge(
    old: Sequence[Mapping[str, Any]] | None,
    desired: Sequence[Desired],
    generation: int | None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """New condition list: ours in a fixed order (then anyone else's, untouched)."""
    stamp = now or now_rfc3339()
    previous = _by_type(old)
    out: list[dict[str, Any]] = []
    for d in desired:
        prev = previous.get(d.type)
        unchanged = prev is not None and prev.get("status") == d.status and prev.get("lastTransitionTime")
        cond: dict[str, Any] = {
            "type": d.type,
            "status": d.status,
            "reason": d.reason,
            "message": d.message[:32768],
            "lastTransitionTime": prev["lastTransitionTime"] if unchanged else stamp,  # type: ignore[index]
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    mine = {d.type for d in desired}
    out.extend(dict(c) for t, c in previous.items() if t not in mine)
    return out


def holds(conditions: Sequence[Mapping[str, Any]] | None, ctype: str, status: str, reason: str) -> bool:
    """The condition `ctype` already has this status and reason: nothing new to say about it."""
    cond = _by_type(conditions).get(ctype)
    return cond is not None and cond.get("status") == status and cond.get("reason") == reason


def transitions(
    old: Sequence[Mapping[str, Any]] | None, new: Sequence[Mapping[str, Any]]
) -> list[Transition]:
    """Conditions whose status or reason differ between ``old`` and ``new``."""
    previous = _by_type(old)
    degraded = _by_type(new).get(DEGRADED) or {}
    failure = degraded.get("reason") if degraded.get("status") == "True" else None
    out = []
    for cond in new:
        if cond.get("type") not in OURS:
            continue
        prev = previous.get(cond["type"])
        if prev is None or prev.get("status") != cond["status"] or prev.get("reason") != cond["reason"]:
            out.append(Transition(
                type=cond["type"],
                old_status=None if prev is None else prev.get("status"),
                status=cond["status"],
                reason=cond["reason"],
                message=cond["message"],
                failure=cond["type"] == READY and cond["reason"] == failure,
            ))
    return out
