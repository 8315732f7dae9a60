"""The status keys a reconcile owns: where a pass starts from, and how it writes back.

Both reconciles (``controller.weightcache`` and ``controller.engineset``) own a fixed
set of ``.status`` keys and leave every other key alone. One pass:

1. ``carried_status``: the old status is the object's, overlaid with what this
   operator last wrote (kept in kopf's memo), because a watch event may not have
   caught up with our own write yet; the new status starts as the owned keys of the
   old one plus ``observedGeneration``;
2. the reconcile fills in the new status;
3. ``publish_status``: the patch (``status_patch``: only the owned keys that
   differ) is written through the caller's status writer, remembered in the memo,
   and each condition that changed status or reason becomes an Event and a log line.
   Nothing changed: no write, no Event.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kopf

from .api.v1alpha1.weightcache_types import plain
from .conditions import transitions

# Writes a status patch to one object: (namespace, name, patch) -> the object as written.
StatusWriter = Callable[[str, str, Mapping[str, Any]], Any]


def _whole(old: Any, new: Any) -> Any:
    return new


def status_patch(
    old: Mapping[str, Any], new: Mapping[str, Any], keys: Sequence[str],
    changed: Callable[[Any, Any], Any] = _whole,
) -> dict[str, Any]:
    """Only the owned keys that differ, each as ``changed(old value, new value)``; keys no longer set become null."""
    patch: dict[str, Any] = {}
    for key in keys:
        if key in new:
            if old.get(key) != new[key]:
                patch[key] = changed(old.get(key), new[key])
        elif key in old:
            patch[key] = None
    return patch


def carried_status(
    body: Mapping[str, Any], memo: kopf.Memo, keys: Sequence[str],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(old, new): the status this pass starts from, and the owned part of it to build on."""
    # Our last successful status write wins over a watch event that has not caught up.
    old = {**plain(body.get("status") or {}), **memo.get("written", {})}
    new: dict[str, Any] = {k: old[k] for k in keys if k in old}
    generation = (body.get("metadata") or {}).get("generation")
    if generation is not None:
        new["observedGeneration"] = generation
    return old, new


async def publish_status(
    body: kopf.Body, memo: kopf.Memo, logger: Any, old: Mapping[str, Any], new: Mapping[str, Any],
    keys: Sequence[str], patch: Mapping[str, Any], write: StatusWriter,
) -> None:
    """Write `patch` (from ``status_patch``) and post an Event per condition change; nothing when it is empty."""
    if not patch:
        return
    meta = body["metadata"]
    await asyncio.to_thread(write, meta["namespace"], meta["name"], patch)
    memo["written"] = {k: v for k, v in new.items() if k in keys}
    for t in transitions(old.get("conditions"), new["conditions"]):
        kopf.event(body, type="Warning" if t.warning else "Normal", reason=t.reason,
                   message=f"{t.type}={t.status}: {t.message}"[:1024])
        logger.info(f"condition {t.type} {t.old_status} -> {t.status} ({t.reason}): {t.message}")
