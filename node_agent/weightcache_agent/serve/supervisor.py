"""The node supervisor: one agent pod serves every rank that lives on its node.

`weightcache agent --socket-dir DIR --tp-size N --devices all ...` runs here. Each rank
gets its own worker process -- a plain single-socket agent (`weightcache agent --socket
DIR/<GPU-UUID>.sock --tp-rank R ...`) with its own arena -- so a crash in one rank's
loader or CUDA context cannot take the others' memory with it. With `--tp-size` > 1 each
worker is also given its replica's rank sockets (`--rank-sockets`): rank 0's worker decides
roles and failovers for the whole replica, so every rank promotes the same engine
(rank_group.py).

Data flow, all on the main thread (the only thread that ever starts a worker, because
a worker's parent-death signal fires when the *thread* that forked it exits):

    every POLL_INTERVAL:  for each worker
        process exited?  -> classify the exit status: crash -> restart with backoff;
                            1 (checkpoint/memory said no) -> Failed, slow retry;
                            2 (refused spec) -> Failed for good
        alive?           -> ask its socket for status (`protocol.agent_status`), keep it,
                            hand new attach latencies to the metrics; a worker that
                            stops answering is Unresponsive, then killed and restarted
    -> build one node status document (`snapshot()`), swapped in atomically

The HTTP endpoints (agent_http.py) only ever read the last document, so a slow or hung
worker can never block a probe. Worker output goes to this process's stderr, tagged with
rank and device (so `kubectl logs` shows all ranks), and its tail is kept to explain a
failure.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from .sockets import remove_socket_files
from ..protocol import agent_status
from .stop import StopFlag
from ..arena.devices import Device
from ..errors import WeightCacheError
from .process_group import die_with_parent
from .switchover import switch_group

log = logging.getLogger("weightcache.supervisor")

POLL_INTERVAL = 0.5  # seconds between status polls of every worker
POLL_TIMEOUT = 2.0  # a worker's status answer slower than this counts as no answer
STALE_AFTER = 10.0  # a live worker silent this long is Unresponsive (not ready)
KILL_AFTER = 60.0  # ... and silent this long is wedged: killed, then restarted like a crash
CRASH_BACKOFF = (1.0, 60.0)  # first delay and cap before restarting a crashed worker
FAILED_RETRY = (300.0, 3600.0)  # exit 1: the input may get fixed (a mount appears, memory frees)
HEARTBEAT_LIMIT = 30.0  # /healthz fails when the main loop has not ticked for this long
STOP_TIMEOUT = 20.0  # SIGTERM -> SIGKILL; below the DaemonSet's 30 s grace period
TAIL_LINES = 40

# The node's /status lists each rank's leases (engine pods and their roles), bounded.
MAX_LEASES_IN_STATUS = 64

# Exit statuses of `weightcache agent --socket` (agent_main.py).
EXIT_LOAD_FAILED = 1
EXIT_REFUSED_SPEC = 2

# Worker phases as the agent reports them -> the node-level vocabulary.
_WORKER_PHASES = {
    "starting": "Pending",
    "preparing": "Loading",
    "adopting": "Loading",
    "loading": "Loading",
    "ready": "Ready",
    "failed": "Failed",
}

@dataclass(frozen=True)
class NodeConfig:
    """What every worker on this node serves; one rank differs only in its device."""

    model: str
    socket_dir: str
    tp_size: int
    backend: str  # resolved: "cpu" or "cuda"
    quantization: str = "none"
    dtype: str = "auto"
    revision: str | None = None
    sharding: str | None = None
    expert_parallel: bool = False
    handshake_timeout: float = 10.0
    log_format: str = "text"
    node_name: str = ""
    socket_group: str | None = None
    max_leases: int = 256
    # The socket's other bounds, as each worker's own flags (None: the worker's default).
    max_pending: int | None = None
    max_leases_per_uid: int | None = None
    max_pending_per_uid: int | None = None
    max_connections_per_uid: int | None = None
    scrub_interval: float | None = None
    label_pods: str = "auto"
    pod_identity: str = "auto"
    identity_audience: str = "weightcache.io"
    peer_copy: bool = True  # replicas after the first fill from it instead of reading the disk

    def worker_argv(self, rank: int, device: Device, socket_path: str, peer: str | None = None,
                    rank_sockets: list[str] | None = None) -> list[str]:
        argv = [sys.executable, "-m", "weightcache_agent", "agent",
                "--model", self.model, "--socket", socket_path,
                "--tp-size", str(self.tp_size), "--tp-rank", str(rank),
                "--backend", self.backend, "--quantization", self.quantization, "--dtype", self.dtype,
                "--handshake-timeout", str(self.handshake_timeout), "--max-leases", str(self.max_leases),
                "--log-format", self.log_format, "--progress", "never", "--label-pods", self.label_pods,
                "--pod-identity", self.pod_identity, "--identity-audience", self.identity_audience]
        if device.backend == "cuda":
            argv += ["--device", device.uuid]
        # Free-form values as one "--flag=VALUE" token: a worker never reads a value as a flag.
        if self.revision:
            argv.append(f"--revision={self.revision}")
        if self.sharding:
            argv.append(f"--sharding={self.sharding}")
        if self.expert_parallel:
            argv.append("--expert-parallel")
        if self.socket_group is not None:
            argv += ["--socket-group", str(self.socket_group)]
        for flag, value in (("--max-pending", self.max_pending), ("--max-leases-per-uid", self.max_leases_per_uid),
                            ("--max-pending-per-uid", self.max_pending_per_uid),
                            ("--max-connections-per-uid", self.max_connections_per_uid),
                            ("--scrub-interval", self.scrub_interval)):
            if value is not None:
                argv += [flag, str(value)]
        if peer is not None:
            argv += ["--peer-socket", peer]
        if rank_sockets:
            argv += ["--rank-sockets", ",".join(rank_sockets)]
        return argv


class _LogForwarder:
    """Copies one worker's output to our stderr, tagged, and keeps its tail."""

    _write_lock = threading.Lock()

    def __init__(self, stream: TextIO, rank: int, device: str, log_format: str, out: TextIO):
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._stream, self._rank, self._device, self._json, self._out = stream, rank, device, log_format == "json", out
        self._thread = threading.Thread(target=self._pump, name=f"log-rank{rank}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._stream:
            line = line.rstrip("\n")
            if not line:
                continue
            self.tail.append(line)
            with self._write_lock:
                self._out.write(self._tag(line) + "\n")
                self._out.flush()
        self._stream.close()

    def _tag(self, line: str) -> str:
        if self._json:
            try:
                entry = json.loads(line)
            except ValueError:
                entry = None
            if isinstance(entry, dict):
                entry.update(rank=self._rank, device=self._device)
                return json.dumps(entry)
            return json.dumps({"level": "info", "logger": "weightcache.worker", "msg": line,
                               "rank": self._rank, "device": self._device})
        return f"[rank {self._rank} {self._device}] {line}"

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def failure_message(tail: list[str], code: int) -> str:
    """The reason a worker gave for exiting, from the last lines it printed."""
    for line in reversed(tail):
        if line.startswith("weightcache agent: "):  # agent_main prints refusals this way
            return line.removeprefix("weightcache agent: ")
    for line in reversed(tail):
        if line.strip():
            return f"exited with status {code}: {line.strip()}"
    return f"exited with status {code}"


class Worker:
    """One rank: its process (across restarts), the last status it gave, and why it stopped."""

    def __init__(self, rank: int, device: Device, config: NodeConfig,
                 on_attach: Callable[[int, str, float], None] | None = None, out: TextIO | None = None):
        self.rank, self.device, self.config = rank, device, config
        self.socket = os.path.join(config.socket_dir, device.socket_name)
        self.peer: str | None = None  # the first replica's socket of this rank, for a replica after it
        self.rank_sockets: list[str] | None = None  # every rank's socket of this replica (TP > 1): group promotion
        self.on_attach = on_attach
        self.out = out or sys.stderr
        self.proc: subprocess.Popen[str] | None = None
        self.forwarder: _LogForwarder | None = None
        self.status: dict[str, Any] | None = None  # last answer of the current process
        self.last_answer = 0.0
        self.started = 0.0  # monotonic time the current process was spawned
        self.phase = "Pending"
        self.message = ""
        self.restarts = 0
        self.spawned = 0
        self.crashes = 0  # consecutive, for the backoff; reset once ready
        self.failures = 0  # consecutive exit-1 failures, for the retry delay
        self.next_start: float | None = 0.0  # monotonic time of the next spawn; None: never
        self._seen_attaches = 0
        # Whether a process of ours was seen serving the socket (its status carried our child's
        # pid). A worker that lost the path to another agent (exit 3) bound nothing, and what
        # that agent bound is not ours to remove.
        self.bound = False

    # -- process -----------------------------------------------------------------------------

    def spawn(self) -> None:
        argv = self.config.worker_argv(self.rank, self.device, self.socket, self.peer, self.rank_sockets)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace", start_new_session=True,
                                     preexec_fn=die_with_parent)
        assert self.proc.stdout is not None
        self.forwarder = _LogForwarder(self.proc.stdout, self.rank, self.device.uuid, self.config.log_format, self.out)
        if self.spawned:
            self.restarts += 1
        self.spawned += 1
        self.next_start = None
        self.status, self.last_answer, self._seen_attaches = None, 0.0, 0
        self.started = time.monotonic()
        self.phase, self.message = "Pending", ""
        log.info("rank %d (%s): worker pid=%d started%s", self.rank, self.device.uuid, self.proc.pid,
                 f" (restart {self.restarts})" if self.restarts else "")

    def tick(self, now: float) -> None:
        """Advance this rank by one poll: start, reap, or ask for status."""
        if self.proc is None:
            if self.next_start is not None and now >= self.next_start:
                try:
                    self.spawn()
                except OSError as e:  # fork/exec refused (memory, process limits): try again later
                    delay = min(CRASH_BACKOFF[0] * 2 ** self.crashes, CRASH_BACKOFF[1])
                    self.crashes += 1
                    self.phase, self.next_start = "Restarting", now + delay
                    self.message = f"could not start the worker: {e}; retrying in {delay:.0f}s"
                    log.error("rank %d (%s): %s", self.rank, self.device.uuid, self.message)
            return
        code = self.proc.poll()
        if code is not None:
            self._exited(code, now)
            return
        try:
            status = agent_status(self.socket, timeout=POLL_TIMEOUT)
            if status.get("pid") != self.proc.pid:  # another agent at the path: not our worker's answer
                raise WeightCacheError(f"{self.socket} is served by pid {status.get('pid')}, not this worker")
        except (WeightCacheError, OSError, ValueError) as e:
            # Silent since its last answer, or since it started when it never answered: a worker
            # stuck before it binds (a hung read of a hostile checkpoint) is killed all the same.
            silent = now - (self.last_answer or self.started)
            if silent > KILL_AFTER:
                # Engines keep their mappings; a restart gives the rank a working socket back.
                log.error("rank %d (%s): worker pid=%d silent for %.0fs%s, killing it", self.rank, self.device.uuid,
                          self.proc.pid, silent, "" if self.last_answer else " since it started")
                self.proc.kill()
            elif silent > STALE_AFTER and self.last_answer:
                self.phase, self.message = "Unresponsive", f"worker stopped answering on its socket: {e}"
            return
        self.last_answer = now
        self.bound = True  # our own worker answered on the socket: it bound it
        self._observe_attaches(status)
        self.status = status
        self.phase = _WORKER_PHASES.get(str(status.get("phase")), "Pending")
        self.message = str(status.get("error") or "") if self.phase == "Failed" else ""
        if self.phase == "Ready":
            self.crashes = self.failures = 0

    def _observe_attaches(self, status: dict[str, Any]) -> None:
        # `attaches` counts every attach; `attach_seconds` holds only recent ones, newest
        # last. The difference since the last poll says how many of those are new.
        attaches = status.get("attaches")
        samples = status.get("attach_seconds")
        if not isinstance(attaches, int):
            return
        new = attaches - self._seen_attaches
        self._seen_attaches = attaches
        if new <= 0 or not isinstance(samples, list) or self.on_attach is None:
            return
        for seconds in samples[-new:]:
            if isinstance(seconds, (int, float)):
                self.on_attach(self.rank, self.device.uuid, float(seconds))

    def _exited(self, code: int, now: float) -> None:
        assert self.proc is not None and self.forwarder is not None
        self.forwarder.join(2.0)  # its last lines carry the reason
        reason = failure_message(list(self.forwarder.tail), code)
        pid = self.proc.pid
        self.proc, self.forwarder, self.status = None, None, None
        where = f"rank {self.rank} ({self.device.uuid})"
        if code == EXIT_REFUSED_SPEC:
            # The same flags would be refused again: only a new spec (a rolled pod) helps.
            self.phase, self.message, self.next_start = "Failed", reason, None
            log.error("%s: worker pid=%d refused the spec, not restarting: %s", where, pid, reason)
        elif code == EXIT_LOAD_FAILED:
            delay = min(FAILED_RETRY[0] * 2 ** self.failures, FAILED_RETRY[1])
            self.failures += 1
            self.phase, self.message, self.next_start = "Failed", reason, now + delay
            log.error("%s: worker pid=%d failed to load, retrying in %.0fs: %s", where, pid, delay, reason)
        else:
            # Killed, crashed, or lost a race for its socket: transient, so restart, but
            # back off so a worker that dies at once cannot spin.
            delay = min(CRASH_BACKOFF[0] * 2 ** self.crashes, CRASH_BACKOFF[1])
            self.crashes += 1
            # A signal says it all; an exit status is explained by the worker's last words.
            how = f"worker killed by signal {-code}" if code < 0 else reason
            self.phase, self.next_start = "Restarting", now + delay
            self.message = f"{how}; restarting in {delay:.0f}s"
            log.warning("%s: worker pid=%d: %s, restarting in %.1fs", where, pid, how, delay)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def reap(self, deadline: float) -> None:
        """Wait for the process until `deadline` (monotonic), then SIGKILL it."""
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("rank %d: worker pid=%d ignored SIGTERM, killing it", self.rank, self.proc.pid)
            self.proc.kill()
            self.proc.wait()
        if self.forwarder is not None:
            self.forwarder.join(2.0)
        self.proc, self.forwarder = None, None

    def remove_socket(self) -> None:
        # A clean worker removes its own socket; a killed one leaves it and its lock file. Only what
        # our worker bound is removed, and even then not while another agent holds or serves the path.
        if self.bound:
            remove_socket_files(self.socket)
            self.bound = False

    # -- reporting ---------------------------------------------------------------------------

    def live_leases(self) -> list[dict[str, Any]]:
        """The leases as the worker has them now (the polled status may be a tick old)."""
        try:
            return agent_status(self.socket, timeout=POLL_TIMEOUT).get("clients") or []
        except WeightCacheError:
            return []

    def to_json(self) -> dict[str, Any]:
        status = self.status or {}
        progress = status.get("progress") or {}
        fraction = 1.0 if self.phase == "Ready" else float(progress.get("fraction") or 0.0)
        load_seconds = status.get("load_seconds")
        return {
            "rank": self.rank,
            "device": self.device.uuid,
            "phase": self.phase,
            "bytes": int(status.get("bytes") or 0),
            "arenaBytes": int(status.get("arena_bytes") or 0),
            "freeBytes": status.get("free_bytes") if isinstance(status.get("free_bytes"), int) else None,
            "progress": round(min(max(fraction, 0.0), 1.0), 4),
            "clients": len(status.get("clients") or []),
            "socket": self.socket,
            "message": self.message,
            "pid": self.proc.pid if self.proc is not None else None,
            "restarts": self.restarts,
            "loadSeconds": float(load_seconds) if isinstance(load_seconds, (int, float)) else None,
            "fingerprint": status.get("fingerprint") or "",
            "attaches": int(status.get("attaches") or 0),
            "misses": int(status.get("misses") or 0),
            # Connections the worker refused at accept, by reason (forbidden: the socket policy; too_many_connections: a uid's cap).
            "refusedConnections": {str(k): int(v) for k, v in (status.get("refused_connections") or {}).items()
                                   if isinstance(v, int)},
            "filledFrom": status.get("filled_from") or "",  # disk, peer (another replica's arena) or adopted
            # verified / tampered / unverified / unavailable / error, and arenas found changed (then refilled)
            "integrity": str((status.get("integrity") or {}).get("state") or ""),
            "integrityFailures": int((status.get("integrity") or {}).get("tampered") or 0),
            # Who holds this rank: the operator makes pod labels follow these roles.
            "leases": [_lease_summary(c) for c in (status.get("clients") or [])[:MAX_LEASES_IN_STATUS]],
        }


def _lease_summary(lease: dict[str, Any]) -> dict[str, Any]:
    return {k: lease.get(k) for k in ("pid", "role", "group", "pod")}


def node_phase(ranks: list[dict[str, Any]], setup_error: str | None) -> tuple[str, str]:
    """(phase, message) of the node from its ranks: any Failed wins, then all Ready."""
    if setup_error:
        return "Failed", setup_error
    if not ranks:
        return "Pending", "no ranks to serve"
    failed = [r for r in ranks if r["phase"] == "Failed"]
    if failed:
        return "Failed", "; ".join(f"rank {r['rank']} ({r['device']}): {r['message']}" for r in failed)
    waiting = [r for r in ranks if r["phase"] != "Ready"]
    if not waiting:
        return "Ready", f"{len(ranks)}/{len(ranks)} ranks ready"
    parts = []
    for r in waiting:
        if r["phase"] == "Loading":
            parts.append(f"rank {r['rank']} ({r['device']}): loading {r['progress']:.0%}")
        else:
            parts.append(f"rank {r['rank']} ({r['device']}): {r['message'] or r['phase'].lower()}")
    ready = len(ranks) - len(waiting)
    if all(r["phase"] == "Pending" for r in waiting) and not ready:
        return "Pending", f"starting {len(ranks)} workers"
    return "Loading", f"{ready}/{len(ranks)} ranks ready; " + "; ".join(parts)


def replicas_of(ranks: list[dict[str, Any]], tp_size: int) -> list[dict[str, Any]]:
    """The node's replicas of the cache: each a run of `tp_size` ranks, its GPUs in rank order."""
    out = []
    for index in range(len(ranks) // tp_size):
        members = ranks[index * tp_size:(index + 1) * tp_size]
        phase, _ = node_phase(members, None)
        out.append({"index": index, "gpus": [r["device"] for r in members], "phase": phase})
    return out


def node_fingerprint(ranks: list[dict[str, Any]]) -> str:
    """One identity for the node's whole shard set ("" until every rank has loaded)."""
    if not ranks or not all(r["fingerprint"] for r in ranks):
        return ""
    joined = "\n".join(f"{r['rank']}:{r['fingerprint']}" for r in ranks)
    return hashlib.sha256(joined.encode()).hexdigest()[:32]


class NodeSupervisor:
    """Runs the workers of one node and publishes their joint state."""

    def __init__(self, config: NodeConfig, devices: list[Device], setup_error: str | None = None,
                 on_attach: Callable[[int, str, float], None] | None = None, out: TextIO | None = None):
        self.config = config
        self.devices = devices
        self.setup_error = setup_error
        # Replica r of the cache is devices[r*tp : (r+1)*tp]; its workers are ranks 0..tp-1.
        self.workers = [Worker(i % config.tp_size, device, config, on_attach, out) for i, device in enumerate(devices)]
        if config.tp_size > 1:
            # The ranks of one replica promote engines together; rank 0's worker decides (serve/rank_group.py).
            for start in range(0, len(self.workers) - config.tp_size + 1, config.tp_size):
                replica = self.workers[start:start + config.tp_size]
                for worker in replica:
                    worker.rank_sockets = [w.socket for w in replica]
        if config.peer_copy:
            # Replicas after the first copy each rank's arena from the first replica's, GPU to GPU.
            for worker in self.workers[config.tp_size:]:
                worker.peer = self.workers[worker.rank].socket
        self._stopping = False
        self._heartbeat = time.monotonic()
        self._snapshot = self._build()

    # -- the loop ----------------------------------------------------------------------------

    def run(self, stop: "threading.Event | StopFlag") -> None:
        """Supervise until `stop` is set, then stop every worker. Call from the main thread."""
        os.makedirs(self.config.socket_dir, exist_ok=True)
        log.info("node %s: serving %d rank(s) of %s on %s backend, sockets in %s", self.config.node_name,
                 len(self.workers), self.config.model, self.config.backend, self.config.socket_dir)
        try:
            while not stop.is_set():
                for worker in self.workers:
                    if stop.is_set():
                        break
                    try:
                        worker.tick(time.monotonic())
                    except Exception:  # a bug in one rank's bookkeeping must not orphan the others
                        log.exception("rank %d: supervising the worker failed", worker.rank)
                self._publish()
                stop.wait(POLL_INTERVAL)
        finally:
            self.shutdown()

    def shutdown(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM every worker at once, SIGKILL what outlives `timeout`, remove the sockets."""
        self._stopping = True
        self._publish()  # not ready from now on
        for worker in self.workers:
            worker.terminate()
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.reap(deadline)
            worker.remove_socket()
            worker.phase, worker.message, worker.status = "Pending", "stopped", None
        self._publish()
        log.info("node %s: all workers stopped", self.config.node_name)

    # -- state -------------------------------------------------------------------------------

    def _publish(self) -> None:
        self._snapshot = self._build()  # one reference swap: readers never see half a document
        self._heartbeat = time.monotonic()

    def _build(self) -> dict[str, Any]:
        ranks = [w.to_json() for w in self.workers]
        phase, message = node_phase(ranks, self.setup_error)
        if self._stopping:
            phase, message = "Pending", "agent is shutting down"
        load = [r["loadSeconds"] for r in ranks if r["loadSeconds"] is not None]
        return {
            "node": self.config.node_name,
            "phase": phase,
            "message": message,
            "fingerprint": node_fingerprint(ranks),
            "bytes": sum(r["bytes"] for r in ranks),
            # A revision change loads a second copy of each rank beside the first: the largest rank
            # against the tightest device says whether it fits (None until every rank has said).
            "rankBytes": max((r["arenaBytes"] for r in ranks), default=0),
            "freeBytes": min(free) if (free := [r["freeBytes"] for r in ranks]) and None not in free else None,
            # Ranks load side by side: the node was ready when its slowest rank was.
            "loadSeconds": round(max(load), 6) if load else 0.0,
            "clients": sum(r["clients"] for r in ranks),
            "gpuUUIDs": [d.uuid for d in self.devices],
            "socketDir": self.config.socket_dir,
            "backend": self.config.backend,
            "model": self.config.model,
            "revision": self.config.revision,
            "tpSize": self.config.tp_size,
            "replicas": replicas_of(ranks, self.config.tp_size),
            "restarts": sum(r["restarts"] for r in ranks),
            "ranks": ranks,
        }

    def switchover(self, group: str, to_pod: str | None) -> dict[str, Any]:
        """A planned switchover of `group` on every rank whose engines hold its leases, in rank order."""
        holders = sorted((w for w in self.workers if any(
            lease.get("group") == group for lease in w.live_leases())), key=lambda w: w.rank)
        if not holders:
            return {"ok": False, "group": group, "ranks": [], "seconds": 0.0,
                    "message": f"no engine of group {group!r} is attached on this node"}
        return switch_group([w.socket for w in holders], group, to_pod=to_pod)

    def snapshot(self) -> dict[str, Any]:
        """The node status document (the `/status` body); never blocks on a worker."""
        return self._snapshot

    def ready(self) -> bool:
        return self._snapshot["phase"] == "Ready"

    def healthy(self) -> tuple[bool, str]:
        age = time.monotonic() - self._heartbeat
        if age > HEARTBEAT_LIMIT:
            return False, f"supervisor loop has not run for {age:.0f}s"
        return True, "ok"
