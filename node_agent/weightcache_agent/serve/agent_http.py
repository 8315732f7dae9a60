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
"""
from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger("weightcache.http")

# Attach is milliseconds when things are right; the upper buckets catch an agent that
# makes engines wait (still loading, contention).
ATTACH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RANK_LABELS = ("rank", "device")
REQUEST_TIMEOUT = 10.0  # seconds a client may take to send its request
MAX_POST_BYTES = 4096
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
        for r in ranks:
            labels = [str(r["rank"]), r["device"]]
            changed.add_metric(labels, r.get("integrityFailures", 0))
            verified.add_metric(labels, 1.0 if r.get("integrity") == "verified" else 0.0)
            misses.add_metric(labels, r.get("misses", 0))
            resident.add_metric(labels, r["bytes"])
            clients.add_metric(labels, r["clients"])
            if r.get("loadSeconds") is not None:
                load.add_metric(labels, r["loadSeconds"])
            ready.add_metric(labels, 1.0 if r["phase"] == "Ready" else 0.0)
            restarts.add_metric(labels, r["restarts"])
        return [resident, clients, load, ready, restarts, misses, changed, verified]


class _Server(ThreadingHTTPServer):
    dual_stack = False  # with AF_INET6 on "::": IPv4 too (pod IPs may be either)
    daemon_threads = True
    request_queue_size = 128  # probes, scrapes and the operator may arrive together

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up mid-reply is routine, not a traceback.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("client %s went away: %s", client_address, exc)
            return
        log.exception("HTTP request from %s failed", client_address)

    def server_bind(self) -> None:
        if self.dual_stack:
            with contextlib.suppress(OSError, AttributeError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # HTTPServer.server_bind resolves its own name with getfqdn(): a reverse DNS lookup
        # that can hang for seconds in a pod without working DNS. Nothing here needs it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "weightcache-agent", self.server_address[1]


class _Ipv6Server(_Server):
    address_family = socket.AF_INET6


class _DualStackServer(_Ipv6Server):
    dual_stack = True


class AgentHTTPServer:
    """The endpoints above on `host:port` (port 0: any free port, see `.port`), served from threads."""

    def __init__(self, host: str, port: int, source: StatusSource, registry: CollectorRegistry,
                 control_token: Callable[[], str | None] | None = None):
        # staticmethod: a plain function as a class attribute would be bound to the handler.
        handler = type("Handler", (_Handler,), {"source": source, "registry": registry,
                                                "control_token": staticmethod(control_token) if control_token else None})
        self._server = _make_server(host, port, handler)
        self.port: int = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="http", daemon=True)
        self._thread.start()
        host = self._server.server_address[0]
        log.info("http listening on %s:%d (/healthz /readyz /status /metrics)",
                 f"[{host}]" if ":" in host else host, self.port)

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5.0)
        self._server.server_close()


def _make_server(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    if host in ("", "::"):
        try:
            return _DualStackServer(("::", port), handler)
        except OSError as e:
            if host == "::":
                raise
            log.info("no IPv6 here (%s); listening on IPv4 only", e)
        return _Server(("0.0.0.0", port), handler)
    return (_Ipv6Server if ":" in host else _Server)((host, port), handler)


class _Handler(BaseHTTPRequestHandler):
    source: StatusSource
    registry: CollectorRegistry
    control_token: Callable[[], str | None] | None = None  # reads the current token (None: off)
    timeout = REQUEST_TIMEOUT
    server_version = "weightcache-agent"

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
                self._json(200, self.source.snapshot(), send_body)
            elif path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(self.registry), send_body)
            else:
                self._json(404, {"error": f"no such endpoint {path!r}; try /healthz /readyz /status /metrics"},
                           send_body)
        except Exception:  # one bad request must not look like a dead agent
            log.exception("GET %s failed", path)
            self._json(500, {"error": "internal error; see the agent's log"}, send_body)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        token = self.control_token() if self.control_token is not None else None
        if path != "/switchover" or token is None:
            self._json(404, {"error": f"no POST endpoint {path!r}" if path != "/switchover" else
                             "switchover over HTTP is off on this agent (no control token)"}, True)
            return
        offered = self.headers.get("Authorization", "")
        if not hmac.compare_digest(offered.encode(), f"Bearer {token}".encode()):
            self._json(401, {"error": "a valid bearer token is required"}, True)
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
            if not 0 < length <= MAX_POST_BYTES:
                raise ValueError(f"Content-Length must be 1..{MAX_POST_BYTES}")
            body = json.loads(self.rfile.read(length))
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
