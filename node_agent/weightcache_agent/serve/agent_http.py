"""The node agent's HTTP face: probes for the kubelet, metrics for Prometheus, status for the operator.

    GET /healthz  200 while the supervisor loop runs (liveness), else 503
    GET /readyz   200 once every rank on the node is loaded (readiness), else 503
    GET /status   the node status document (supervisor.NodeSupervisor.snapshot) as JSON
    GET /metrics  Prometheus text exposition from a registry of our own
    POST /switchover  {"group", "toPod"}: a planned switchover on every rank of the group (toPod
                  null: demote only, the new primary is another agent's engine);
                  only with `Authorization: Bearer <control token>`, and only when a token is set

Every handler reads the supervisor's last published document; none waits on a worker,
so a probe answers in microseconds even while a rank is wedged. Gauges are produced at
scrape time from that document (a custom collector); the attach latency histogram is a
real cumulative `Histogram` the supervisor feeds with each new attach it sees, so it
survives worker restarts the way Prometheus expects counters to.

Connections cost no thread until their request is whole: one thread accepts them and
reads every request head (and a switchover's small body) with a selector, at most
`MAX_CONNECTIONS` at once (past that the oldest unfinished one is closed, so a flood of
slow clients cannot keep a kubelet probe out) and each within `REQUEST_TIMEOUT` in all,
however slowly its bytes come. Whole requests go to `HANDLER_THREADS` threads through a
queue of `MAX_QUEUED`; past that a request is closed unanswered. The agent's thread count
therefore does not grow with its clients.

Who sees what: `/status` lists each rank's leases. The pods, groups and pids in them go
only to a request that carries the control token (the operator, which derives it);
everyone else gets the same document with each lease reduced to its role. Fail closed:
while there is no usable token (no file given, the file absent -- it comes from an
optional Secret volume -- or shorter than 16 characters) nobody gets them over HTTP;
`weightcache status` on the node's socket still shows them to whoever may use it.
"""
from __future__ import annotations

import collections
import contextlib
import hmac
import io
import json
import logging
import queue
import re
import selectors
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Iterable, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger("weightcache.http")

# Attach is milliseconds when things are right; the upper buckets catch an agent that
# makes engines wait (still loading, contention).
ATTACH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RANK_LABELS = ("rank", "device")
REQUEST_TIMEOUT = 10.0  # seconds a client may take to send its whole request
WRITE_TIMEOUT = 10.0  # seconds a reply may wait on a client that does not read
MAX_POST_BYTES = 4096
MAX_HEAD_BYTES = 16384  # request line and headers
MAX_CONNECTIONS = 256  # connections still sending their request
HANDLER_THREADS = 4
MAX_QUEUED = 64  # whole requests waiting for a handler thread
_CONTENT_LENGTH = re.compile(rb"^content-length:[ \t]*([0-9]{1,9})[ \t]*\r?$", re.I | re.M)
MAX_NAME = 253  # a Kubernetes name; groups are "namespace/name"


class StatusSource(Protocol):
    def snapshot(self) -> dict[str, Any]: ...

    def ready(self) -> bool: ...

    def healthy(self) -> tuple[bool, str]: ...

    def switchover(self, group: str, to_pod: str | None) -> dict[str, Any]: ...


class AgentMetrics:
    """The agent's Prometheus registry: per-rank gauges from the status, plus the attach histogram."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.attach_seconds = Histogram("weightcache_attach_seconds", "Time from an engine's attach request to the "
                                        "manifest and arena fd sent, per rank", RANK_LABELS, buckets=ATTACH_BUCKETS,
                                        registry=self.registry)
        self._snapshot: Callable[[], dict[str, Any]] = lambda: {"ranks": []}
        self.registry.register(_StatusCollector(lambda: self._snapshot()))

    def watch(self, snapshot: Callable[[], dict[str, Any]], ranks: Iterable[tuple[int, str]] = ()) -> None:
        """Read gauges from `snapshot`; `ranks` get an empty histogram now, so they show before any attach."""
        self._snapshot = snapshot
        for rank, device in ranks:
            self.attach_seconds.labels(str(rank), device)

    def observe_attach(self, rank: int, device: str, seconds: float) -> None:
        self.attach_seconds.labels(str(rank), device).observe(seconds)


class _StatusCollector:
    """Gauges and counters built at scrape time from the supervisor's last status document."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return list(self._families([]))

    def collect(self) -> Iterable[Metric]:
        return self._families(self._snapshot().get("ranks", []))

    @staticmethod
    def _families(ranks: list[dict[str, Any]]) -> list[Metric]:
        resident = GaugeMetricFamily("weightcache_bytes_resident", "Bytes of weights this rank holds resident",
                                     labels=RANK_LABELS)
        clients = GaugeMetricFamily("weightcache_clients", "Engines attached to this rank", labels=RANK_LABELS)
        load = GaugeMetricFamily("weightcache_load_seconds", "Seconds the rank's last load took (absent until loaded)",
                                 labels=RANK_LABELS)
        ready = GaugeMetricFamily("weightcache_rank_ready", "1 when the rank is loaded and serving, else 0",
                                  labels=RANK_LABELS)
        restarts = CounterMetricFamily("weightcache_worker_restarts", "Times the supervisor restarted this rank's "
                                       "worker", labels=RANK_LABELS)
        misses = CounterMetricFamily("weightcache_attach_misses", "Attaches this rank refused because it holds other "
                                     "weights than asked (fingerprint) or failed to load: each one an engine's disk "
                                     "load when it falls back", labels=RANK_LABELS)
        changed = CounterMetricFamily("weightcache_arena_integrity_failures", "Arenas this rank found changed "
                                      "since it filled them (keyed digest mismatch; each one refilled)",
                                      labels=RANK_LABELS)
        verified = GaugeMetricFamily("weightcache_arena_verified", "1 while the rank's arena last checked equal to "
                                     "its keyed digest, else 0", labels=RANK_LABELS)
        refused = CounterMetricFamily("weightcache_refused_connections", "Connections this rank's socket refused at "
                                      "accept, by reason: forbidden (a uid the socket policy does not admit) or "
                                      "too_many_connections (a uid at its cap); logged at most once a second",
                                      labels=("rank", "device", "reason"))
        for r in ranks:
            labels = [str(r["rank"]), r["device"]]
            for reason in ("forbidden", "too_many_connections"):
                refused.add_metric(labels + [reason], (r.get("refusedConnections") or {}).get(reason, 0))
            changed.add_metric(labels, r.get("integrityFailures", 0))
            verified.add_metric(labels, 1.0 if r.get("integrity") == "verified" else 0.0)
            misses.add_metric(labels, r.get("misses", 0))
            resident.add_metric(labels, r["bytes"])
            clients.add_metric(labels, r["clients"])
            if r.get("loadSeconds") is not None:
                load.add_metric(labels, r["loadSeconds"])
            ready.add_metric(labels, 1.0 if r["phase"] == "Ready" else 0.0)
            restarts.add_metric(labels, r["restarts"])
        return [resident, clients, load, ready, restarts, misses, changed, verified, refused]


class AgentHTTPServer:
    """The endpoints above on `host:port` (port 0: any free port, see `.port`): one thread reads
    requests, `HANDLER_THREADS` answer them."""

    def __init__(self, host: str, port: int, source: StatusSource, registry: CollectorRegistry,
                 control_token: Callable[[], str | None] | None = None):
        # staticmethod: a plain function as a class attribute would be bound to the handler.
        self._handler = type("Handler", (_Handler,), {"source": source, "registry": registry,
                                                      "control_token": staticmethod(control_token)
                                                      if control_token else None})
        self._listener = _listen(host, port)
        self.port: int = self._listener.getsockname()[1]
        self._requests: queue.Queue[tuple[socket.socket, Any, bytes] | None] = queue.Queue(MAX_QUEUED)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._threads: list[threading.Thread] = []
        self._dropped = 0  # connections closed for want of room, logged at most once a second
        self._dropped_logged = 0.0

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._read_requests, name="http", daemon=True)]
        self._threads += [threading.Thread(target=self._answer, name=f"http-{i}", daemon=True)
                          for i in range(HANDLER_THREADS)]
        for t in self._threads:
            t.start()
        host = self._listener.getsockname()[0]
        log.info("http listening on %s:%d (/healthz /readyz /status /metrics)",
                 f"[{host}]" if ":" in host else host, self.port)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        for _ in range(HANDLER_THREADS):
            with contextlib.suppress(queue.Full):
                self._requests.put(None, timeout=1.0)
        for t in self._threads:
            t.join(5.0)
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- reading requests: one thread, no thread per connection -------------------------

    def _read_requests(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        # connection -> (peer, bytes so far, deadline); insertion order is age
        pending: collections.OrderedDict[socket.socket, list[Any]] = collections.OrderedDict()

        def drop(conn: socket.socket, why: str) -> None:
            sel.unregister(conn)
            peer = pending.pop(conn)[0]
            log.debug("http client %s dropped: %s", _peer_name(peer), why)
            conn.close()

        try:
            while not self._stop.is_set():
                timeout = max(0.0, next(iter(pending.values()))[2] - time.monotonic()) if pending else None
                for key, _ in sel.select(timeout):
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj is self._listener:
                        self._accept(sel, pending, drop)
                        continue
                    conn = key.fileobj
                    state = pending[conn]
                    try:
                        chunk = conn.recv(65536)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as e:
                        drop(conn, str(e))
                        continue
                    if not chunk:
                        drop(conn, "hung up before its request was whole")
                        continue
                    state[1] += chunk
                    whole = _request_complete(state[1])
                    if whole is None:
                        drop(conn, "request too large")
                    elif whole:
                        sel.unregister(conn)
                        peer, data, _ = pending.pop(conn)
                        self._hand_over(conn, peer, data)
                now = time.monotonic()
                while pending and next(iter(pending.values()))[2] <= now:
                    drop(next(iter(pending)), f"request not whole within {REQUEST_TIMEOUT:g} s")
        finally:
            for conn in list(pending):
                conn.close()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, pending: collections.OrderedDict,
                drop: Callable[[socket.socket, str], None]) -> None:
        for _ in range(64):  # a burst at a time, then back to the clients already here
            try:
                conn, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: the backlog keeps them until we have room
                log.warning("http accept failed: %s", e)
                return
            if len(pending) >= MAX_CONNECTIONS:
                drop(next(iter(pending)), "too many connections still sending their request")
                self._count_drop()
            conn.setblocking(False)
            pending[conn] = [peer, b"", time.monotonic() + REQUEST_TIMEOUT]
            sel.register(conn, selectors.EVENT_READ)

    def _hand_over(self, conn: socket.socket, peer: Any, data: bytes) -> None:
        try:
            self._requests.put_nowait((conn, peer, data))
        except queue.Full:
            conn.close()
            self._count_drop()

    def _count_drop(self) -> None:
        self._dropped += 1
        now = time.monotonic()
        if now - self._dropped_logged >= 1.0:
            log.warning("http: %d connection(s) closed for want of room (%d at once at most)",
                        self._dropped, MAX_CONNECTIONS)
            self._dropped, self._dropped_logged = 0, now

    # -- answering: a fixed pool ---------------------------------------------------------

    def _answer(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            conn, peer, data = item
            try:
                conn.setblocking(True)
                conn.settimeout(WRITE_TIMEOUT)
                # Room for any reply here (status is tens of KiB), so one that is never read
                # leaves the kernel with it instead of holding this thread.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
                self._handler((conn, data), peer, self)
            except (ConnectionError, TimeoutError) as e:  # a client that hung up mid-reply is routine
                log.debug("http client %s went away: %s", _peer_name(peer), e)
            except Exception:
                log.exception("HTTP request from %s failed", _peer_name(peer))
            finally:
                with contextlib.suppress(OSError):
                    conn.close()


def _peer_name(peer: Any) -> str:
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


def _request_complete(data: bytes) -> bool | None:
    """True once `data` holds a whole request (head, and the body its Content-Length says), False
    while more is to come, None when it is larger than any request served here."""
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return None if len(data) > MAX_HEAD_BYTES else False
    if head_end > MAX_HEAD_BYTES:
        return None
    match = _CONTENT_LENGTH.search(data, 0, head_end + 2)
    length = int(match.group(1)) if match else 0
    if length > MAX_POST_BYTES:
        return True  # the handler answers 400 from the head alone
    return len(data) - head_end - 4 >= length


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket: `""` or `"::"` for every address (both families where there is IPv6)."""
    if host in ("", "::"):
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError as e:
            if host == "::":
                raise
            log.info("no IPv6 here (%s); listening on IPv4 only", e)
            return _bound(socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port))
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too (pod IPs may be either)
        return _bound(sock, ("::", port))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return _bound(socket.socket(family, socket.SOCK_STREAM), (host, port))


def _bound(sock: socket.socket, address: tuple[str, int]) -> socket.socket:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)  # probes, scrapes and the operator may arrive together
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Handler(BaseHTTPRequestHandler):
    source: StatusSource
    registry: CollectorRegistry
    control_token: Callable[[], str | None] | None = None  # reads the current token (None: off)
    server_version = "weightcache-agent"

    def setup(self) -> None:
        # The request was read whole before this handler ran: parse it from memory.
        self.connection, data = self.request
        self.rfile = io.BytesIO(data)
        self.wfile = socketserver._SocketWriter(self.connection)

    def finish(self) -> None:
        self.wfile.flush()

    def _token(self) -> str | None:
        return self.control_token() if self.control_token is not None else None

    def _authorized(self, token: str) -> bool:
        offered = self.headers.get("Authorization", "")
        return hmac.compare_digest(offered.encode(), f"Bearer {token}".encode())

    def do_GET(self) -> None:
        self._route(send_body=True)

    def do_HEAD(self) -> None:
        self._route(send_body=False)

    def _route(self, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path == "/healthz":
                ok, why = self.source.healthy()
                self._json(200 if ok else 503, {"ok": ok, "message": why}, send_body)
            elif path == "/readyz":
                doc = self.source.snapshot()
                ready = self.source.ready()
                self._json(200 if ready else 503, {"ready": ready, "phase": doc["phase"], "message": doc["message"]},
                           send_body)
            elif path == "/status":
                token = self._token()
                doc = self.source.snapshot()
                # No token is no proof: without one, nobody is shown who holds the leases.
                self._json(200, doc if token is not None and self._authorized(token) else _without_identities(doc),
                           send_body)
            elif path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.registry), send_body)
            else:
                self._json(404, {"error": f"no such endpoint {path!r}; try /healthz /readyz /status /metrics"},
                           send_body)
        except (ConnectionError, TimeoutError):
            raise  # the client went away: nobody to answer
        except Exception:  # one bad request must not look like a dead agent
            log.exception("GET %s failed", path)
            self._json(500, {"error": "internal error; see the agent's log"}, send_body)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        token = self._token()
        if path != "/switchover" or token is None:
            self._json(404, {"error": f"no POST endpoint {path!r}" if path != "/switchover" else
                             "switchover over HTTP is off on this agent (no control token)"}, True)
            return
        if not self._authorized(token):
            self._json(401, {"error": "a valid bearer token is required"}, True)
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
            if not 0 < length <= MAX_POST_BYTES:
                raise ValueError(f"Content-Length must be 1..{MAX_POST_BYTES}")
            body = json.loads(self.rfile.read(length))  # from memory: the body was read with the head
            group, to_pod = body.get("group"), body.get("toPod")
            if not all(isinstance(v, str) and 0 < len(v) <= 2 * MAX_NAME + 1 for v in (group, to_pod or "-")):
                raise ValueError("body must be {\"group\": string, \"toPod\": string or null (demote only)}")
        except (ValueError, AttributeError) as e:
            self._json(400, {"error": f"bad switchover request: {e}"}, True)
            return
        try:
            result = self.source.switchover(group, to_pod)
        except Exception as e:  # an agent that does not answer is the caller's news, not a crash
            log.warning("switchover of %s to %s failed: %s", group, to_pod, e)
            self._json(502, {"ok": False, "error": str(e)}, True)
            return
        self._json(200 if result["ok"] else 409, result, True)

    def _json(self, code: int, doc: Any, send_body: bool) -> None:
        self._send(code, "application/json", json.dumps(doc).encode(), send_body)

    def _send(self, code: int, content_type: str, body: bytes, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # Probes arrive every few seconds: access lines only at debug level.
        log.debug("%s %s", self.address_string(), format % args)


def _without_identities(doc: dict[str, Any]) -> dict[str, Any]:
    """The status document for a reader without the control token: each lease's role only."""
    ranks = [{**r, "leases": [{"role": lease.get("role")} for lease in r.get("leases") or []]}
             for r in doc.get("ranks") or []]
    return {**doc, "ranks": ranks}
