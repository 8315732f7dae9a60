"""`weightcache status`: ask an agent what it holds and who is attached.

Imports the base modules only, never torch: a status call takes a fraction of a second.
The socket comes from --socket, else $WEIGHTCACHE_SOCKET, as for `weightcache engine`.
"""
from __future__ import annotations

import datetime
import json
import os
import stat
import sys
import time

from ..load.progress import size_text
from ..protocol import agent_request, agent_status
from ..errors import WeightCacheError
from ..usage import EXIT_FAILED, EXIT_USAGE, parser as usage_parser, refuse

ENV_SOCKET = "WEIGHTCACHE_SOCKET"


def main(argv: list[str]) -> int:
    p = usage_parser("weightcache status", "Show an agent's cache and its clients.",
                     examples=["weightcache status --socket /run/weightcache/llama.sock",
                               "weightcache status --socket /run/weightcache/llama.sock --wait 300  # until ready",
                               "weightcache status --socket /run/weightcache/default.llama.1a2b3c  # each GPU's",
                               "WEIGHTCACHE_SOCKET=/run/weightcache/llama.sock weightcache status --json"],
                     env={ENV_SOCKET: "the agent's socket, when --socket is not given"})
    p.add_argument("--socket", default=os.environ.get(ENV_SOCKET) or None,
                   help=f"the agent's Unix socket, or a node agent's socket directory: every socket in it "
                        f"(default: ${ENV_SOCKET})")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--wait", type=float, metavar="SECONDS", default=0.0,
                   help="wait up to SECONDS for the agent to start and hold its weights (phase ready); exit 1 "
                        "when it fails or the time runs out")
    p.add_argument("--verify", action="store_true",
                   help="check the arena's bytes against the digest the agent made when it filled it, now "
                        "(root or the agent's uid; a whole pass of the arena); exit 1 when they differ")
    args = p.parse_args(argv)
    if not args.socket:
        return refuse("weightcache status", f"which agent? pass --socket PATH or set ${ENV_SOCKET}", EXIT_USAGE)
    if args.verify:
        return _verify(args.socket, args.json)
    directory = os.path.isdir(args.socket)
    if directory:  # a node agent's --socket-dir: one socket per GPU
        sockets = sockets_in(args.socket)
        if not sockets:
            return refuse("weightcache status", f"{args.socket} is a directory with no agent socket in it: pass "
                                                "one socket with --socket (a node agent's are <dir>/<GPU-UUID>.sock)",
                          EXIT_USAGE)
    else:
        sockets = [args.socket]
    if args.wait < 0:
        return refuse("weightcache status", f"--wait {args.wait:g}: seconds to wait cannot be negative", EXIT_USAGE)
    statuses, failures = [], []
    for path in sockets:
        try:
            status = wait_ready(path, args.wait) if args.wait else agent_status(path)
        except WeightCacheError as e:
            failures.append(f"{e} (is the agent running? start one with weightcache agent)")
            continue
        status.pop("type", None)
        statuses.append(status)
        if args.wait and status.get("phase") != "ready":
            failures.append(f"the agent at {path} is {status.get('phase')}, not ready"
                            + ("" if status.get("phase") == "failed" else f", after {args.wait:g}s"))
    for failure in failures:
        refuse("weightcache status", failure)
    if not statuses:
        return EXIT_FAILED
    try:
        if args.json:  # one socket: its document; a directory: a list of them
            json.dump(statuses if directory else statuses[0], sys.stdout, indent=2)
            print()
        else:
            print("\n\n".join(render(status) for status in statuses))
        sys.stdout.flush()  # a reader that stopped early (`| head`) is met here, not at exit
    except BrokenPipeError:
        # The reader has what it wanted: no traceback, and stdout pointed at /dev/null so that
        # the interpreter's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_FAILED if failures else 0


def sockets_in(directory: str) -> list[str]:
    """The Unix sockets directly in `directory`, by name (a node agent's, one per GPU)."""
    found = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        try:
            if entry.name.endswith(".sock") and stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                found.append(entry.path)
        except OSError:
            continue
    return found


def wait_ready(path: str, seconds: float) -> dict:
    """The agent's status once its phase is ready or failed, or the last one read when `seconds` run
    out; the socket may not exist yet (the agent still starting) until then."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            status = agent_status(path)
        except WeightCacheError:
            if time.monotonic() >= deadline:
                raise
        else:
            if status.get("phase") in ("ready", "failed") or time.monotonic() >= deadline:
                return status
        time.sleep(0.2)


def _verify(socket: str, as_json: bool) -> int:
    try:
        result = agent_request(socket, {"type": "verify"}, timeout=600.0)
    except WeightCacheError as e:
        return refuse("weightcache status --verify", str(e), EXIT_FAILED)
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        print()
    elif result["ok"]:
        print(f"verified {size_text(result['bytes'])} in {result['seconds'] * 1e3:.1f} ms: the arena holds what the "
              "agent loaded")
    else:
        print("the arena's bytes differ from what the agent loaded: the agent stopped handing it out and is "
              "filling a fresh one", file=sys.stderr)
    return 0 if result["ok"] else EXIT_FAILED


def render(status: dict) -> str:
    progress = status["progress"]
    rows = [
        ("socket", status["socket"]),
        ("phase", status["phase"] + (f" ({status['error']})" if status.get("error") else "")),
        ("model", status["model"]),
        ("revision", status.get("revision") or (status.get("fields") or {}).get("revision") or "-"),
        ("fingerprint", status.get("fingerprint") or "-"),
        ("backend", status["backend"]),
        ("resident", _resident(status)),
    ]
    integrity = status.get("integrity") or {}
    if integrity:
        rows.append(("integrity", integrity.get("state", "-") + (
            f" ({integrity['tampered']} arena(s) found changed, {integrity.get('refills', 0)} refilled)"
            if integrity.get("tampered") else "")))
    if status["phase"] == "loading" and progress["bytes_total"]:
        # read from disk (source tensors) is counted apart from what ends resident
        eta = progress.get("eta_seconds")
        rows.append(("progress", f"{progress['fraction']:.0%}  read {size_text(progress['bytes_done'])}/"
                                 f"{size_text(progress['bytes_total'])}, {progress['tensors_done']}/"
                                 f"{progress['tensors_total']} source tensors"
                                 + (f"  {size_text(progress['bytes_per_second'])}/s  ETA {eta:.0f}s" if eta else "")))
    if status.get("load_seconds") is not None:
        rows.append(("load time", f"{status['load_seconds']:.2f}s"))
    rows.append(("clients", str(len(status["clients"]))))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.upper():<{width}}  {v}" for k, v in rows]
    if status["clients"]:
        lines.append("")
        lines.append(f"  {'PID':>8}  {'ROLE':<8}  {'GROUP':<12}  ATTACHED")
        for c in status["clients"]:
            since = datetime.datetime.fromtimestamp(c["attached_at"]).strftime("%Y-%m-%d %H:%M:%S")
            lines.append(f"  {c['pid'] or '-':>8}  {c['role']:<8}  {c['group'] or '-':<12}  {since}")
    return "\n".join(lines)


def _resident(status: dict) -> str:
    """What the arena holds, or will hold once the load in progress ends; with the quantization."""
    progress, quant = status["progress"], (status.get("spec") or {}).get("quantization") or "none"
    if status["phase"] in ("starting", "preparing", "adopting", "loading"):
        if not progress.get("tensors_resident"):  # the plan is not known yet
            return "-"
        text = f"{size_text(progress['bytes_resident'])} in {progress['tensors_resident']} tensors, once loaded"
    else:
        text = f"{size_text(status['bytes'])} in {status['tensors']} tensors"
    return text if quant == "none" else f"{text} ({quant})"
