"""The objects an EngineSet owns, at the API server: listed back, created, kept, relabelled.

Every object the reconcile writes carries the EngineSet's controller reference, and only
objects that carry it are ever listed back (``list_owned``) or changed, so a name taken
by someone else is a conflict to report, never an object to adopt. A creation the API
server refuses as wrong (``Rejected``) is the user's input to report, not a transient
failure to retry. Blocking calls: the reconcile runs them in a thread.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from ...kube import KubeApi, merge_patch_for
from .manifests import LABEL_ENGINESET, LABEL_SERVING, selector_labels
from .pods import controlled_by, meta


class Rejected(Exception):
    """The API server refused to create an object as rendered (message says which and why)."""


def api_message(e: ApiException) -> str:
    """The API server's own words for a refusal (its Status message), else the HTTP reason."""
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)[:512]
    except (ValueError, AttributeError):
        return str(e.reason)


def list_owned(api: KubeApi, kind: str, namespace: str, name: str, uid: str | None) -> list[dict[str, Any]]:
    """The objects of `kind` that carry the EngineSet's label and that it controls."""
    try:
        items = api.list(kind, namespace, selector_labels(name))
    except ApiException as e:
        if kind == "ResourceClaim" and e.status == 404:
            return []  # no resource.k8s.io/v1 on this cluster: nothing of ours can exist
        raise
    # Repeat the label filter (servers that ignore selectors) and keep only what we control.
    return [o for o in items
            if (meta(o).get("labels") or {}).get(LABEL_ENGINESET) == name and controlled_by(o, uid)]


def create_owned(api: KubeApi, obj: dict[str, Any], owner: kopf.Body) -> dict[str, Any] | None:
    """Create an owned object; None when the name is taken (by a previous pass or by someone else).

    A refusal that says the object itself is wrong or not allowed (400, 403, 422:
    an invalid template, a quota, a Pod Security level) is the user's input, not a
    transient failure: it becomes ``Rejected`` for a condition, never a retry storm.
    """
    kopf.append_owner_reference(obj, owner=owner)
    try:
        return api.create(obj)
    except ApiException as e:
        if e.status == 409:
            return None
        if e.status in (400, 403, 422):
            raise Rejected(f"{obj['kind']} {obj['metadata']['name']}: {api_message(e)}") from None
        raise


def ensure_service(api: KubeApi, desired: dict[str, Any], owner: kopf.Body, uid: str | None) -> str:
    """Create or patch the Service to `desired`: created | patched | unchanged | conflict (not ours)."""
    ns, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    current = api.get("Service", ns, name)
    if current is None:
        return "created" if create_owned(api, desired, owner) is not None else "conflict"
    if not controlled_by(current, uid):
        return "conflict"
    spec = current.get("spec") or {}
    want = {"selector": desired["spec"]["selector"], "ports": desired["spec"]["ports"]}
    have = {"selector": spec.get("selector"),
            "ports": [{k: p.get(k) for k in ("name", "port", "targetPort", "protocol")}
                      for p in spec.get("ports") or []]}
    if have == want:
        return "unchanged"
    patch: dict[str, Any] = {"spec": merge_patch_for(have, want)}
    if meta(current).get("resourceVersion"):
        patch["metadata"] = {"resourceVersion": meta(current)["resourceVersion"]}
    api.patch("Service", ns, name, patch)
    return "patched"


def set_serving(api: KubeApi, pod: Mapping[str, Any], value: str) -> None:
    """Set a pod's serving label ("true" or "false")."""
    m = meta(pod)
    patch: dict[str, Any] = {"metadata": {"labels": {LABEL_SERVING: value}}}
    if m.get("uid"):
        patch["metadata"]["uid"] = m["uid"]  # precondition: never a replacement of that name
    api.patch("Pod", m["namespace"], m["name"], patch)
