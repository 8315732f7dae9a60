"""What an engine pod's object says about it: readiness, failure, age, owner, slot.

The EngineSet reconcile decides from these facts (replace a failed pod, stall a rollout on
one, count a ready standby, say why a group does not serve), and the rollout planner gets
them through ``EnginePod``. Pods arrive as the API server's JSON; every reader tolerates a
missing field (a pod just created has no status yet), and none of them does I/O.
"""
from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from .manifests import LABEL_SERVING, LABEL_TEMPLATE_HASH

# A pod in one of these states will not become ready by waiting: a rollout stops on it.
FAILING_REASONS = ("CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                   "CreateContainerConfigError", "CreateContainerError", "RunContainerError")
RESTARTS_FAILED = 3


def meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """An object's metadata, empty when it has none."""
    return obj.get("metadata") or {}


def labels(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return meta(obj).get("labels") or {}


def template_hash_of(pod: Mapping[str, Any]) -> str | None:
    """The template hash a pod was rendered from (None for a pod without the label)."""
    return labels(pod).get(LABEL_TEMPLATE_HASH)


def labelled_serving(pod: Mapping[str, Any]) -> bool:
    return labels(pod).get(LABEL_SERVING) == "true"


def pod_failure(pod: Mapping[str, Any]) -> str | None:
    """Why a pod cannot become ready (failed, crash-looping, image or config errors), or None."""
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return f"pod Failed: {status.get('reason') or status.get('message') or 'its container exited'}"
    for c in status.get("containerStatuses") or []:
        waiting = ((c.get("state") or {}).get("waiting") or {})
        if waiting.get("reason") in FAILING_REASONS:
            return f"container {c.get('name')}: {waiting['reason']}: {waiting.get('message') or ''}".strip(": ")
        if (c.get("restartCount") or 0) >= RESTARTS_FAILED:
            return f"container {c.get('name')} restarted {c['restartCount']} times"
    return None


def pod_age(pod: Mapping[str, Any], now: datetime.datetime) -> float:
    """Seconds since the pod was created; 0 when that is unknown, so it is never "too old"."""
    created = meta(pod).get("creationTimestamp")
    try:
        return (now - datetime.datetime.fromisoformat(str(created).replace("Z", "+00:00"))).total_seconds()
    except ValueError:
        return 0.0


def pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def controlled_by(obj: Mapping[str, Any], owner_uid: str | None) -> bool:
    """Whether `obj`'s controller reference is the owner with this uid (never when the uid is unknown)."""
    for ref in meta(obj).get("ownerReferences") or []:
        if ref.get("controller"):
            return owner_uid is not None and ref.get("uid") == owner_uid
    return False


def slot_of(pod_name: str, name: str, group: int) -> int | None:
    """The slot in a pod name ``<name>-<group>-<slot>``; None for a name of another shape."""
    prefix = f"{name}-{group}-"
    rest = pod_name[len(prefix):] if pod_name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None
