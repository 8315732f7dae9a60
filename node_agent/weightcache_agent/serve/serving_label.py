"""The agent's one API write: label a promoted engine pod `weightcache.io/serving: "true"`.

Why: when a primary engine dies, the Service of its EngineSet must route to the standby
the agent just promoted. Doing it from the node, in one write, is what makes failover
take milliseconds instead of an operator's reconcile; the EndpointSlice controller then
lists the new primary. The chart's ValidatingAdmissionPolicy lets an agent's token make
exactly this change, to pods on its own node.

How: in a pod, the API server is `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`,
authenticated with the pod's bound service-account token and verified against the
cluster CA, both under `/var/run/secrets/kubernetes.io/serviceaccount/` (each
overridable: constructor arguments, or `WEIGHTCACHE_KUBE_API`, `WEIGHTCACHE_KUBE_TOKEN`,
`WEIGHTCACHE_KUBE_CA`). No Kubernetes library: the agent image stays small. The TLS
connection is opened ahead of time (`connect()`) and kept open (a `GET /version` every
`keepalive` seconds, as the API server closes idle connections), so a promotion costs one
round trip: `mark_serving` sends the merge patch
`{"metadata": {"uid": <uid>, "labels": {"weightcache.io/serving": "true"}}}` (the uid
makes a replacement pod of the same name refuse it) and returns the seconds it took.
The token is read again when its file changes (the kubelet rotates it) and after a 401.
A connection the server closed while idle is noticed before sending and reopened. Every
call ends within `timeout` seconds; a failure raises `ServingLabelError` with one line
and logs that line (no traceback): the agent goes on serving, and the operator's
reconcile labels the pod later.

A promotion storm (an engine that drops and retakes its lease in a loop, promoting its
peer each time) must not become a storm of API writes: `PromotionLabels` sits between
the agent's promotion hook and the writer. Per group it keeps only the latest promoted
pod; a group's first promotion is written at once (failover pays nothing), and later
ones at most once per `MIN_WRITE_INTERVAL`, each only if that engine is still the
group's primary when its turn comes: one write per promotion that lasted.
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import select
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path

from ..errors import WeightCacheError

log = logging.getLogger(__name__)

SERVING_LABEL = "weightcache.io/serving"
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MIN_WRITE_INTERVAL = 0.5  # seconds between two label writes for one group


class ServingLabelError(WeightCacheError):
    """The serving label could not be written (refused, unreachable, or too slow)."""


def in_cluster_api_url() -> str | None:
    """The API server's URL from the environment, or None outside a cluster."""
    if os.environ.get("WEIGHTCACHE_KUBE_API"):
        return os.environ["WEIGHTCACHE_KUBE_API"]
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return None
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"https://{host}:{port}"


def api_endpoint(api_url: str | None, token_path: str | os.PathLike[str] | None,
                 ca_path: str | os.PathLike[str] | None, error: type[Exception],
                 missing: str) -> tuple[str, int, Path, ssl.SSLContext]:
    """The API server's host and port, this process's token file, and TLS trusting the cluster CA:
    from the arguments, else $WEIGHTCACHE_KUBE_API / _TOKEN / _CA, else the pod's own (in-cluster).
    Raises `error` naming what is missing (`missing` says why the server was wanted) or unreadable."""
    url = api_url or in_cluster_api_url()
    if not url:
        raise error(f"{missing}: KUBERNETES_SERVICE_HOST is not set and no URL was given")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise error(f"API server URL must be https://host[:port], not {url!r}")
    token = Path(token_path or os.environ.get("WEIGHTCACHE_KUBE_TOKEN") or SA_DIR / "token")
    ca = Path(ca_path or os.environ.get("WEIGHTCACHE_KUBE_CA") or SA_DIR / "ca.crt")
    try:
        tls = ssl.create_default_context(cafile=str(ca))
    except (OSError, ssl.SSLError) as e:
        raise error(f"cluster CA {ca}: {_one_line(e)}") from None
    return parts.hostname, parts.port or 443, token, tls


class ServingLabelWriter:
    """A kept-alive, authenticated connection to the API server that flips one pod label."""

    def __init__(self, api_url: str | None = None, *, token_path: str | os.PathLike[str] | None = None,
                 ca_path: str | os.PathLike[str] | None = None, timeout: float = 2.0,
                 keepalive: float = 30.0) -> None:
        self.host, self.port, self.token_path, self._ctx = api_endpoint(api_url, token_path, ca_path,
                                                                        ServingLabelError, "no API server")
        self.timeout = timeout
        self._lock = threading.Lock()
        self._conn: http.client.HTTPSConnection | None = None
        self._token = ""
        self._token_stamp: tuple[int, int, int] | None = None
        self.connections_opened = 0
        # The API server closes connections idle for long (90 s in kube-apiserver): a cheap
        # request every `keepalive` seconds keeps the one a promotion will use open.
        self.keepalive = keepalive
        self.keepalives_sent = 0
        self._closed = threading.Event()
        self._keeper: threading.Thread | None = None

    @classmethod
    def from_environment(cls, timeout: float = 2.0) -> ServingLabelWriter | None:
        """A connected writer when running in a cluster (or pointed at one), else None.

        A failed first connection is logged; the first write tries again.
        """
        if not in_cluster_api_url():
            return None
        try:
            writer = cls(timeout=timeout)
        except ServingLabelError as e:
            log.warning("no serving-label writer: %s", e)
            return None
        try:
            writer.connect()
        except ServingLabelError as e:
            log.warning("API server not reachable yet (%s); the first promotion will connect", e)
        return writer

    # -- connection and token ----------------------------------------------------------

    def connect(self) -> None:
        """Open the TLS connection now, so that the first promotion pays no handshake, and
        start keeping it open."""
        try:
            with self._lock:
                self._read_token(force=False)
                self._open(time.monotonic() + self.timeout)
        finally:  # when the server is not there yet, the keeper goes on trying
            if self.keepalive > 0 and self._keeper is None:
                self._keeper = threading.Thread(target=self._keep_open, name="serving-label-keepalive",
                                                daemon=True)
                self._keeper.start()

    def _keep_open(self) -> None:
        while not self._closed.wait(self.keepalive):
            with self._lock:
                try:
                    if not self._usable():
                        self._open(time.monotonic() + self.timeout)
                    conn = self._conn
                    assert conn is not None and conn.sock is not None
                    conn.sock.settimeout(self.timeout)
                    conn.request("GET", "/version", headers={"Accept": "application/json"})
                    resp = conn.getresponse()
                    resp.read()
                    if resp.will_close:
                        self._drop()
                    self.keepalives_sent += 1
                except (ServingLabelError, http.client.HTTPException, OSError) as e:
                    self._drop()
                    log.debug("keeping the API connection open: %s", _one_line(e))

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _open(self, deadline: float) -> http.client.HTTPSConnection:
        if self._conn is not None:
            self._conn.close()
        conn = http.client.HTTPSConnection(self.host, self.port, context=self._ctx,
                                           timeout=max(deadline - time.monotonic(), 0.001))
        try:
            conn.connect()
        except (OSError, ssl.SSLError) as e:
            conn.close()
            self._conn = None
            raise ServingLabelError(f"connect to {self.host}:{self.port}: {_one_line(e)}") from None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._conn = conn
        self.connections_opened += 1
        return conn

    def _usable(self) -> bool:
        """The kept connection is open and the server has not closed it while idle."""
        conn = self._conn
        if conn is None or conn.sock is None:
            return False
        sock = conn.sock
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return True
            # Readable while idle: TLS records the server sends after the handshake (session
            # tickets) read as no data; an end of stream or stray bytes mean it is unusable.
            sock.setblocking(False)
            try:
                sock.recv(1)
                return False
            except ssl.SSLWantReadError:
                return True
            finally:
                sock.setblocking(True)
        except (OSError, ValueError):
            return False

    def _read_token(self, force: bool) -> None:
        try:
            st = os.stat(self.token_path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if force or stamp != self._token_stamp:
                self._token = self.token_path.read_text().strip()
                self._token_stamp = stamp
        except OSError as e:
            raise ServingLabelError(f"service-account token {self.token_path}: {_one_line(e)}") from None

    # -- the write ---------------------------------------------------------------------

    def mark_serving(self, namespace: str, name: str, uid: str) -> float:
        """Label pod namespace/name (only if its uid is `uid`) serving; the seconds it took."""
        start = time.perf_counter()
        try:
            with self._lock:
                self._mark(namespace, name, uid, time.monotonic() + self.timeout)
        except ServingLabelError as e:
            log.warning("serving label for pod %s/%s not written: %s", namespace, name, e)
            raise
        return time.perf_counter() - start

    def label_promoted(self, pod: Mapping[str, str] | None) -> float | None:
        """For a promotion hook: label the pod a lease names ({namespace, name, uid}).

        The seconds it took, or None when the lease names no pod or the write failed (logged).
        """
        if not pod or not all(pod.get(k) for k in ("namespace", "name", "uid")):
            log.info("promoted engine names no pod; its serving label is left to the operator")
            return None
        try:
            return self.mark_serving(pod["namespace"], pod["name"], pod["uid"])
        except ServingLabelError:
            return None

    def _mark(self, namespace: str, name: str, uid: str, deadline: float) -> None:
        body = json.dumps({"metadata": {"uid": uid, "labels": {SERVING_LABEL: "true"}}}).encode()
        path = f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods/{urllib.parse.quote(name)}"
        self._read_token(force=False)
        retried_auth = retried_conn = False
        while True:
            if not self._usable():
                self._open(deadline)
            conn = self._conn
            assert conn is not None and conn.sock is not None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServingLabelError(f"timed out after {self.timeout:g}s")
            conn.sock.settimeout(remaining)
            try:
                conn.request("PATCH", path, body=body, headers={
                    "Authorization": f"Bearer {self._token}",
                    "Content-Type": "application/merge-patch+json",
                    "Accept": "application/json",
                })
                resp = conn.getresponse()
                raw = resp.read()
            except TimeoutError:
                self._drop()
                raise ServingLabelError(f"timed out after {self.timeout:g}s") from None
            except (http.client.HTTPException, OSError) as e:
                self._drop()
                if retried_conn:
                    raise ServingLabelError(f"PATCH {path}: {_one_line(e)}") from None
                retried_conn = True  # the kept connection went away under us: once more on a new one
                continue
            if resp.will_close:
                self._drop()
            if resp.status == 401 and not retried_auth:
                retried_auth = True
                self._read_token(force=True)
                continue
            if resp.status >= 300:
                raise ServingLabelError(f"PATCH {path}: {resp.status} {_status_message(raw)}")
            return

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _status_message(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
        return _one_line(f"{doc.get('reason', '')}: {doc.get('message', '')}".strip(": "))
    except (ValueError, AttributeError):
        return _one_line(raw.decode(errors="replace")[:300])


def _one_line(e: object) -> str:
    text = str(e) or type(e).__name__
    return " ".join(text.split())


class PromotionLabels:
    """Promotions in, label writes out: the latest per group, at most one per group every
    `interval` seconds, and none for a promotion that no longer holds when its turn comes.

    `promoted(group, pod, current)` never blocks the agent; `current()` says whether that
    engine is still its group's primary. One thread does the writes, in order.
    """

    def __init__(self, writer: ServingLabelWriter, interval: float = MIN_WRITE_INTERVAL) -> None:
        self.writer, self.interval = writer, interval
        self._pending: dict[str, tuple[Mapping[str, str] | None, Callable[[], bool]]] = {}
        self._next: dict[str, float] = {}  # group -> when its next write may go
        self._cond = threading.Condition()
        self.written = self.superseded = self.lapsed = 0
        threading.Thread(target=self._run, name="serving-labels", daemon=True).start()

    def promoted(self, group: str, pod: Mapping[str, str] | None, current: Callable[[], bool]) -> None:
        with self._cond:
            if group in self._pending:
                self.superseded += 1
            self._pending[group] = (pod, current)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [g for g in self._pending if self._next.get(g, 0.0) <= now]
                if not due:
                    waits = [self._next[g] - now for g in self._pending]
                    self._cond.wait(min(waits) if waits else None)
                    continue
                batch = [(g, self._pending.pop(g)) for g in due]
            for group, (pod, current) in batch:
                if not current():
                    self.lapsed += 1  # promoted and gone again before its write: nothing to route to
                    continue
                self.writer.label_promoted(pod)
                self.written += 1
                with self._cond:
                    now = time.monotonic()
                    self._next[group] = now + self.interval
                    if len(self._next) > 4096:  # bounded: forget groups whose interval has passed
                        self._next = {g: t for g, t in self._next.items() if t > now}
