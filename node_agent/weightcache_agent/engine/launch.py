"""One tensor-parallel engine in one container: start a process per rank and keep them together.

`weightcache engine --tp-size N ...` without `--tp-rank` runs here (an EngineSet pod's
command, one pod per engine). It picks the ranks' meeting point (`--dist-init`, else two
free loopback ports: the pod has its own network namespace) and starts
`weightcache engine ... --tp-rank R --dist-init tcp://127.0.0.1:PORT` for R = 0..N-1, each
with the pod's environment unchanged: every rank finds its own GPU's agent socket in
`$WEIGHTCACHE_SOCKET_DIR`/`$WEIGHTCACHE_DEVICES`, and all ranks name the same engine (the
pod's uid, else the meeting point), so the ranks' agents give the whole engine one role.
Rank 0 serves HTTP on the flags' port; the others follow it.

The ranks live and die together: SIGTERM/SIGINT is passed to every rank (rank 0 drains its
requests); a rank that exits on its own -- its engine is broken without it -- stops the
others, and the launcher exits 1 with one line naming the rank, so the kubelet restarts
the pod. A rank never outlives the launcher (parent-death signal).
"""
from __future__ import annotations

import logging
import random
import signal
import socket
import subprocess
import sys
import time

from ..serve.process_group import die_with_parent
from ..serve.stop import StopFlag

log = logging.getLogger("weightcache.engine")

STOP_GRACE = 15.0  # seconds past the drain a rank may take after SIGTERM before SIGKILL
RENDEZVOUS_FLOOR = 10000  # TP rendezvous ports start above the ones well-known services listen on


def free_rendezvous(host: str = "127.0.0.1") -> str:
    """tcp://HOST:PORT with PORT and PORT+1 both free (the collectives and the rank link).

    Chosen below the kernel's ephemeral range: a port from that range (what binding port 0 hands
    out) may be taken by any process's outgoing connection between this check and the ranks' own
    binds, seconds later on a busy node."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        if low > RENDEZVOUS_FLOOR + 2:
            port = rng.randrange(RENDEZVOUS_FLOOR, low - 1)
        else:  # no room below the ephemeral range: the kernel's choice, checked
            with socket.socket() as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
            if port >= 65535:
                continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((host, port))
                b.bind((host, port + 1))
        except OSError:
            continue
        return f"tcp://{host}:{port}"
    raise OSError("no two adjacent free ports on the loopback interface")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def launch(argv: list[str], tp_size: int, dist_init: str | None, drain_seconds: float) -> int:
    """Run `tp_size` ranks of `weightcache engine argv`, until a signal or a rank's exit."""
    init = dist_init or free_rendezvous()
    stop = StopFlag().on_signals()
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(tp_size):
            ranks.append(subprocess.Popen(
                [sys.executable, "-m", "weightcache_agent", "engine", *argv, "--tp-rank", str(rank),
                 "--dist-init", init], stdin=subprocess.DEVNULL, preexec_fn=die_with_parent))
    except OSError as e:
        _stop(ranks, drain_seconds)
        print(f"weightcache engine: cannot start rank {len(ranks)}: {e.strerror or e}", file=sys.stderr)
        return 1
    log.info("tensor-parallel engine: %d ranks (pids %s) meet at %s; rank 0 serves HTTP", tp_size,
             ", ".join(str(p.pid) for p in ranks), init)
    exited = None
    while not stop.wait(0.2):
        exited = next(((rank, p.returncode) for rank, p in enumerate(ranks) if p.poll() is not None), None)
        if exited is not None:
            break
    _stop(ranks, drain_seconds)
    if exited is None:  # stopped by a signal: the ranks drained and left
        codes = [p.returncode for p in ranks]
        return next((c for c in codes if c not in (0, -signal.SIGTERM)), 0)
    rank, code = exited
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    print(f"weightcache engine: rank {rank} {how}; the engine cannot serve without it, its other ranks were stopped",
          file=sys.stderr)
    return 1


def _stop(ranks: list[subprocess.Popen[bytes]], drain_seconds: float) -> None:
    for p in ranks:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + drain_seconds + STOP_GRACE
    for p in ranks:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
