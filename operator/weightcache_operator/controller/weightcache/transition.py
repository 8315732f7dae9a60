"""Model revision transitions: which model an agent runs, and whether a second copy fits.

A new model path or revision in a WeightCache rolls its agent DaemonSet: on each node the
new agent loads the new weights while the engines still map the old arena (it stays valid
while they hold it), so for a while every GPU holds two copies of a rank. Before the
operator lets the DaemonSet roll, `memory_shortfalls` compares, node by node, the largest
rank the agent holds with the free memory of its tightest device, both as the agent
reports them in `/status`. Where a node is short, the WeightCache holds the change (the
agents keep serving the old revision), says so in its Degraded condition
(`InsufficientMemory`, with an Event), and the EngineSets on the cache stop their standbys
(`holds_for_memory`): the memory-safe order, since a standby's own memory (its KV cache)
is what the new arena can take; the primaries keep serving. The check repeats on every
poll and the change proceeds once every node has room; the rollout then restores the
standbys on the new revision. The new revision is assumed no larger than the old one
(the operator never reads checkpoints): a larger one that does not fit fails its agent's
load by name, and the old engines keep serving.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...conditions import DEGRADED

HELD_FOR_MEMORY = "InsufficientMemory"  # the Degraded reason while a transition is held


def _flag(argv: Sequence[str], flag: str) -> str | None:
    """A flag's value, written "--flag=VALUE" (as the operator renders free-form values) or "--flag VALUE"."""
    argv = list(argv)
    for arg in argv:
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def model_of(pod_spec: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(model directory, revision) an agent pod spec runs, from its first container's argv."""
    containers = pod_spec.get("containers") or [{}]
    argv = [str(a) for a in (containers[0].get("command") or []) + (containers[0].get("args") or [])]
    return _flag(argv, "--model"), _flag(argv, "--revision")


def daemonset_model(ds: Mapping[str, Any] | None) -> tuple[str | None, str | None] | None:
    """What a live agent DaemonSet's pods run; None without a DaemonSet."""
    if ds is None:
        return None
    return model_of(((ds.get("spec") or {}).get("template") or {}).get("spec") or {})


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def memory_shortfalls(nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per node whose tightest device has less free memory than its largest rank.

    `nodes` are `.status.nodes` entries (`rollup.node_entry`): `rankBytes` and `freeBytes`.
    A node that has not reported both (loading, unreachable, an older agent) is no shortfall:
    its load of the new revision fails by name if it does not fit.
    """
    short = []
    for entry in nodes:
        need, free = entry.get("rankBytes"), entry.get("freeBytes")
        if isinstance(need, int) and isinstance(free, int) and need > free:
            short.append(f"{entry.get('node') or '?'} has {_gib(free)} free on its tightest device, "
                         f"a second copy of a rank needs {_gib(need)}")
    return short


def hold_message(old: tuple[str | None, str | None], new: tuple[str, str | None], short: list[str]) -> str:
    def label(m: tuple[str | None, str | None]) -> str:
        return f"{m[0]}@{m[1]}" if m[1] else str(m[0])

    more = f" (and {len(short) - 3} more nodes)" if len(short) > 3 else ""
    return (f"model change {label(old)} -> {label(new)} held: {'; '.join(short[:3])}{more}. The agents keep "
            f"serving {label(old)}; EngineSets on this cache stop their standbys to free memory, and the change "
            f"proceeds once every node has room")


def holds_for_memory(cache: Mapping[str, Any]) -> bool:
    """Whether a WeightCache holds a model change for memory (its EngineSets then stop their standbys)."""
    for c in ((cache.get("status") or {}).get("conditions") or []):
        if isinstance(c, Mapping) and c.get("type") == DEGRADED and c.get("status") == "True" \
                and c.get("reason") == HELD_FOR_MEMORY:
            return True
    return False
