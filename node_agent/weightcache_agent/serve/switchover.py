"""Planned switchover: hand a group's primary role to a named standby, on every rank.

A rolling upgrade (or an operator by hand) starts a standby on the new template or
revision, then asks each rank's agent, in rank order, to promote that standby and
demote the current primary in one step (`switchover` on the agent socket; the agent
accepts it from privileged peers only). For a tensor-parallel group every rank's agent
must switch, or the group would serve with ranks of two engines: `switch_group` stops at
the first rank that refuses and says which.

Entry points: `weightcache switchover` (on the node, e.g. `kubectl exec` into the agent
pod) and the node supervisor's `POST /switchover` (the operator, with the control token).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from .. import protocol
from ..errors import WeightCacheError
from ..usage import parser as usage_parser


def switch_rank(socket_path: str, group: str, to_pod: str | None = None, to_pid: int | None = None,
                timeout: float = 5.0, to_engine: str | None = None, owner: int | None = None) -> dict[str, Any]:
    """One rank's switchover; the agent's reply (`switched`, or an error document). `owner`: off
    Kubernetes, the uid whose group of that name is meant."""
    message: dict[str, Any] = {"type": "switchover", "group": group}
    if owner is not None:
        message["owner"] = owner
    if to_pod is not None:
        message["to_pod"] = to_pod
    if to_pid is not None:
        message["to_pid"] = to_pid
    if to_engine is not None:
        message["to_engine"] = to_engine
    conn = protocol.connect(socket_path)
    try:
        conn.settimeout(timeout)
        protocol.send_message(conn, message)
        reply, _ = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES)
        return reply
    except (OSError, EOFError) as e:
        raise WeightCacheError(f"agent at {socket_path} did not answer the switchover: {e}") from None
    finally:
        conn.close()


def switch_group(sockets: list[str], group: str, to_pod: str | None = None, to_pid: int | None = None,
                 timeout: float = 5.0) -> dict[str, Any]:
    """Switch every rank (sockets in rank order); stop at the first refusal."""
    started = time.perf_counter()
    ranks = []
    for socket_path in sockets:
        reply = switch_rank(socket_path, group, to_pod, to_pid, timeout)
        ranks.append({"socket": socket_path, **reply})
        if reply.get("type") != "switched" or not reply.get("ok"):
            return {"ok": False, "group": group, "ranks": ranks, "seconds": time.perf_counter() - started,
                    "message": f"{socket_path}: {reply.get('message') or 'the promoted engine did not answer'}"}
    return {"ok": True, "group": group, "ranks": ranks, "seconds": time.perf_counter() - started}


def sockets_in(socket_dir: str, devices: list[str] | None = None) -> list[str]:
    """The agent sockets in `socket_dir` (devices: only those, in this order)."""
    if devices:
        return [os.path.join(socket_dir, f"{d}.sock") for d in devices]
    return sorted(os.path.join(socket_dir, f) for f in os.listdir(socket_dir) if f.endswith(".sock"))


def main(argv: list[str]) -> int:
    p = usage_parser("weightcache switchover", "Hand a group's primary role to one of its standbys, on every rank.",
                     examples=["weightcache switchover --socket /run/weightcache/llama.sock --group ml/chat-0 "
                               "--to-pod chat-0-b",
                               "weightcache switchover --socket-dir /run/weightcache/c-1a2b --devices GPU-aa,GPU-bb "
                               "--group ml/chat-0 --to-pid 4242 --json"])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", action="append", help="an agent socket (repeat in rank order for TP > 1)")
    where.add_argument("--socket-dir", help="every socket in this directory (or those of --devices, in order)")
    p.add_argument("--devices", help="comma list of device UUIDs, rank order (with --socket-dir; default: every "
                                     "socket in the directory, sorted)")
    p.add_argument("--group", required=True, help="the lease group (an EngineSet group: NAMESPACE/ENGINESET-INDEX)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-pod", help="the standby's pod name")
    target.add_argument("--to-pid", type=int, help="the standby engine's pid")
    target.add_argument("--demote-only", action="store_true",
                        help="demote the primary, promote none here (another agent's engine took over)")
    p.add_argument("--json", action="store_true", help="print the agents' replies as JSON")
    args = p.parse_args(argv)
    try:
        sockets = args.socket or sockets_in(args.socket_dir, [d for d in (args.devices or "").split(",") if d])
        if not sockets:
            raise WeightCacheError(f"no agent sockets in {args.socket_dir}")
        result = switch_group(sockets, args.group, args.to_pod, args.to_pid)
    except (WeightCacheError, OSError) as e:
        print(f"weightcache switchover: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    elif result["ok"]:
        print(f"group {args.group}: {args.to_pod or args.to_pid or 'no engine here'} is primary on {len(sockets)} "
              f"rank(s) in {result['seconds'] * 1e3:.1f} ms")
    else:
        print(f"weightcache switchover: group {args.group}: {result['message']}", file=sys.stderr)
    return 0 if result["ok"] else 1
