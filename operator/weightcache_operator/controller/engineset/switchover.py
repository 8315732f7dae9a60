"""A switchover on request: ``kubectl annotate engineset NAME weightcache.io/switchover-to=POD``.

A one-shot request, read from the annotation by each pass: the pass finds the pod's group
(``requested_group``), checks that the agent can make that pod primary
(``switchover_refusal``: a live warm standby, and a control key to ask with), asks the
node's agent, and removes the annotation whatever the answer, with an Event that says
which. The checks are here, the asking is the reconcile's; no I/O here.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .cache_view import CacheView
from .inventory import Inventory
from .placement import Placement
from .pods import meta

ANNOTATION_SWITCHOVER = "weightcache.io/switchover-to"


def requested_switchover(body: Mapping[str, Any]) -> str | None:
    """The pod the EngineSet's annotation asks to make primary, if it asks."""
    wanted = (meta(body).get("annotations") or {}).get(ANNOTATION_SWITCHOVER)
    return None if wanted is None else str(wanted)


def requested_group(inv: Inventory, placed: Mapping[int, Placement],
                    to_pod: str) -> tuple[int | None, Placement | None]:
    """(group, placement) of the live pod named `to_pod`; a placement only while the group is placed."""
    group = next((g for g, gp in inv.pods.items()
                  if any(meta(x).get("name") == to_pod for x in gp.live.values())), None)
    return group, (placed.get(group) if group is not None else None)


def switchover_refusal(view: CacheView, name: str, to_pod: str, group: int | None, p: Placement | None,
                       has_control_key: bool) -> str:
    """Why the agent cannot be asked to make `to_pod` primary; empty when it can."""
    if p is None:
        return f"{to_pod} is not a live engine pod of EngineSet {name}"
    role = view.roles.get(p.node, {}).get(to_pod)
    if role == "primary":
        return f"{to_pod} is already the primary of group {group}"
    if role != "standby":
        return f"{to_pod} is not attached as a standby (the agent on {p.node} reports {role or 'nothing'} for it)"
    if not has_control_key:
        return "the operator has no control key (install with the chart, or set WEIGHTCACHE_CONTROL_KEY_FILE)"
    return ""
