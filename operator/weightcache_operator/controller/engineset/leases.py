"""An agent's ``/status`` leases -> which pod is primary in each lease group, and each pod's role.

The agent is the truth about roles: it promotes and demotes engines, and reports every
lease per rank (``ranks[].leases`` or ``ranks[].clients``). The EngineSet reconcile
reads them here to put the serving label on each group's primary, to plan switchovers
and to say why a group does not serve. Rank 0 writes the serving label itself at a
failover, so its view wins. The documents are another program's output: malformed
entries are skipped, never an error.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class PodRef:
    """An engine pod as an agent's lease names it."""

    namespace: str | None
    name: str
    uid: str | None
    promoted_at: float | None = None


def _ranks(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The well-formed entries of an agent's ``ranks``, rank 0 first (entries without a rank last)."""
    ranks = [r for r in doc.get("ranks") or [] if isinstance(r, Mapping)] if isinstance(doc.get("ranks"), list) else []
    ranks.sort(key=lambda r: r.get("rank") if isinstance(r.get("rank"), int) else 1 << 30)
    return ranks


def _lease_lists(rank: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    for key in ("leases", "clients"):
        leases = rank.get(key)
        if isinstance(leases, list):
            yield from (x for x in leases if isinstance(x, Mapping))


def primaries(doc: Mapping[str, Any]) -> dict[str, PodRef]:
    """Per lease group, the pod an agent's ``/status`` holds as primary.

    Leases are reported per rank (``ranks[].leases`` or ``ranks[].clients``), each
    with ``role``, ``group`` and ``pod: {namespace, name, uid}``. Rank 0 is the one
    that writes the serving label at a failover, so its view wins; other ranks fill
    in groups rank 0 does not list. Malformed entries are skipped.
    """
    out: dict[str, PodRef] = {}
    for rank in _ranks(doc):
        for lease in _lease_lists(rank):
            group, pod = lease.get("group"), lease.get("pod")
            if lease.get("role") != "primary" or not isinstance(group, str) or group in out:
                continue
            if not isinstance(pod, Mapping) or not isinstance(pod.get("name"), str) or not pod["name"]:
                continue
            promoted = lease.get("promotedAt", lease.get("promoted_at"))
            out[group] = PodRef(
                namespace=pod.get("namespace") if isinstance(pod.get("namespace"), str) else None,
                name=pod["name"],
                uid=pod.get("uid") if isinstance(pod.get("uid"), str) and pod.get("uid") else None,
                promoted_at=float(promoted) if isinstance(promoted, (int, float)) and not isinstance(promoted, bool) else None,
            )
    return out


def pod_roles(doc: Mapping[str, Any]) -> dict[str, str]:
    """Pod name -> the role an agent's leases give it (rank 0's view first, as in `primaries`)."""
    out: dict[str, str] = {}
    for rank in _ranks(doc):
        for lease in _lease_lists(rank):
            pod, role = lease.get("pod"), lease.get("role")
            if isinstance(pod, Mapping) and isinstance(pod.get("name"), str) and isinstance(role, str):
                out.setdefault(pod["name"], role)
    return out


def unnamed_leases(doc: Mapping[str, Any]) -> int:
    """Leases an agent's ``/status`` reduces to their role: what it shows a reader without its
    control token (no key given to the operator, or another key than the agents')."""
    return sum(1 for rank in _ranks(doc) for lease in _lease_lists(rank) if "role" in lease and "pod" not in lease)
