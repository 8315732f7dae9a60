"""Shared helpers for the operator tests (CRD, manifests, kmock, chart).

- ``REPO`` and loaders for the CRD and examples;
- ``AgentServer``: a real HTTP server on 127.0.0.1 playing a node agent's
  ``/status``, ``/healthz``, ``/readyz`` (the operator reads it over real sockets);
- kmock helpers: declare the resources kopf and the operator touch, write a
  kubeconfig pointing at the emulator, create/patch objects through its HTTP API
  (so watchers see the events), and wait for conditions without blocking the
  event loop the emulator runs in;
- ``emulated_cluster`` (the emulator, KUBECONFIG at it, a client) and
  ``running_operator`` (the real operator in kopf's ``KopfRunner`` thread against the
  emulator), each for as long as an ``async with`` block runs.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from kopf.testing import KopfRunner
    from weightcache_operator.config import OperatorConfig

REPO = Path(__file__).resolve().parent.parent
CRD_PATH = REPO / "crds" / "weightcache.io_weightcaches.yaml"
CHART = REPO / "charts" / "weightcache"
EXAMPLES = REPO / "examples"

WC_RESOURCE = "weightcache.io/v1alpha1/weightcaches"
DS_RESOURCE = "apps/v1/daemonsets"
CM_RESOURCE = "v1/configmaps"
POD_RESOURCE = "v1/pods"
EVENT_RESOURCE = "v1/events"
SA_RESOURCE = "v1/serviceaccounts"
RB_RESOURCE = "rbac.authorization.k8s.io/v1/rolebindings"

POLL = 0.5  # seconds between the operator's polls of the agents in kmock tests (the lowest the config allows)


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def crd_schema() -> dict[str, Any]:
    return load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def example_documents() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path, doc))
    return docs


def weightcache(name: str, spec: dict[str, Any], *, namespace: str = "default",
                uid: str | None = None, generation: int = 1) -> dict[str, Any]:
    """A WeightCache as the API server would hand it out (uid, generation, resourceVersion set).

    The emulator assigns none of these; kopf's finalizer patch tests resourceVersion
    and owner references need the uid, so the test supplies them as the server would.
    """
    return {
        "apiVersion": "weightcache.io/v1alpha1",
        "kind": "WeightCache",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{namespace}-{name}",
            "generation": generation,
            "resourceVersion": "1",
        },
        "spec": copy.deepcopy(spec),
    }


LLAMA_SPEC: dict[str, Any] = {
    "model": {"path": "meta-llama/Llama-3.1-70B-Instruct", "revision": "main"},
    "parallelism": {"tensor": 8},
    "quantization": "fp8-block",
    "dtype": "bfloat16",
    "sharding": {"preset": "llama"},
}


def agent_status(node: str, phase: str = "Ready", *, ranks: int = 2, message: str = "",
                 progress: float = 1.0, clients: int = 0) -> dict[str, Any]:
    """A /status document as the agent publishes it (the agreed contract)."""
    uuids = [f"GPU-{node}-{i:04d}" for i in range(ranks)]
    per_rank = 10 * 2**30
    return {
        "node": node,
        "phase": phase,
        "message": message,
        "fingerprint": "sha256:abc123",
        "bytes": per_rank * ranks if phase == "Ready" else int(per_rank * ranks * progress),
        "loadSeconds": 12.5 if phase == "Ready" else 0.0,
        "clients": clients,
        "gpuUUIDs": uuids,
        "socketDir": "/run/weightcache/default/llama",
        "ranks": [
            {"rank": i, "device": f"cuda:{i}", "phase": phase, "bytes": per_rank,
             "progress": progress, "clients": clients, "socket": f"/run/weightcache/default/llama/{u}.sock"}
            for i, u in enumerate(uuids)
        ],
    }


class AgentServer:
    """A real HTTP server answering like one node agent; ``doc`` can change at any time."""

    def __init__(self, doc: dict[str, Any] | None = None) -> None:
        self.doc: dict[str, Any] | None = doc
        self.raw: bytes | None = None  # when set, served verbatim on /status (bad agents)
        self.delay = 0.0  # seconds each /status answer takes (an agent under load)
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path == "/status":
                    outer.hits += 1
                    time.sleep(outer.delay)
                    body = outer.raw if outer.raw is not None else json.dumps(outer.doc).encode()
                    self._send(200, body, "application/json")
                elif self.path == "/healthz":
                    self._send(200, b"ok", "text/plain")
                elif self.path == "/readyz":
                    ready = (outer.doc or {}).get("phase") == "Ready"
                    self._send(200 if ready else 503, b"ready" if ready else b"loading", "text/plain")
                else:
                    self._send(404, b"not found", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        # A short poll interval: shutdown() waits for it.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/status"

    def __enter__(self) -> "AgentServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def agent_servers(n: int) -> Iterator[list[AgentServer]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(AgentServer()) for _ in range(n)]


def agent_pod(cache: str, node: str, port: int, *, namespace: str = "default",
              phase: str = "Running", ip: str = "127.0.0.1", model: str | None = None,
              revision: str | None = None) -> dict[str, Any]:
    """An agent pod as the DaemonSet controller and kubelet would leave it (`model`, `revision`: its
    agent's flags, which say whether it runs the cache's current model)."""
    args = ["agent", "--model", model] + (["--revision", revision] if revision else []) if model else []
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{cache}-agent-{node}",
            "namespace": namespace,
            "uid": f"pod-uid-{cache}-{node}",
            "creationTimestamp": "2025-01-01T00:00:00Z",
            "labels": {"app.kubernetes.io/name": "weightcache-agent", "weightcache.io/cache": cache},
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "agent", "image": "x", "command": ["weightcache"], "args": args,
                            "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]}],
        },
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


# --- kmock --------------------------------------------------------------------------

def declare_resources(kmock: Any) -> None:
    """Everything kopf and the operator touch must be declared (the emulator's discovery)."""
    info = kmock.ResourceInfo
    kmock.resources[WC_RESOURCE] = info(
        kind="WeightCache", singular="weightcache", namespaced=True, shortnames={"wc"},
        verbs={"get", "list", "watch", "create", "patch", "delete"}, subresources={"status"})
    kmock.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs={"get", "list", "watch"})
    kmock.resources[EVENT_RESOURCE] = info(kind="Event", namespaced=True, verbs={"create", "list"})
    kmock.resources[DS_RESOURCE] = info(
        kind="DaemonSet", namespaced=True, verbs={"get", "list", "watch", "create", "patch"}, subresources={"status"})
    kmock.resources[CM_RESOURCE] = info(kind="ConfigMap", namespaced=True, verbs={"get", "list", "watch", "create", "patch"})
    kmock.resources[POD_RESOURCE] = info(kind="Pod", namespaced=True, verbs={"get", "list", "watch"})
    kmock.resources[SA_RESOURCE] = info(kind="ServiceAccount", namespaced=True, verbs={"get", "create", "patch"})
    kmock.resources[RB_RESOURCE] = info(kind="RoleBinding", namespaced=True, verbs={"get", "create", "patch"})


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "kmock", "user": {"token": "test-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        "current-context": "kmock",
    }))
    return path


def collection_path(resource: str, namespace: str) -> str:
    group_version, plural = resource.rsplit("/", 1)
    prefix = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


class KubeClient:
    """Creates and patches objects in the emulator over HTTP, as kubectl would."""

    def __init__(self, base_url: str) -> None:
        import aiohttp
        self._session = aiohttp.ClientSession(base_url=str(base_url).rstrip("/"))

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def create(self, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        path = collection_path(resource, body["metadata"]["namespace"])
        async with self._session.post(path, json=body) as r:
            assert r.status < 300, await r.text()
            return await r.json()

    async def patch(self, resource: str, namespace: str, name: str, patch: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        path = f"{collection_path(resource, namespace)}/{name}" + (f"/{subresource}" if subresource else "")
        async with self._session.patch(path, json=patch,
                                       headers={"Content-Type": "application/merge-patch+json"}) as r:
            assert r.status < 300, await r.text()
            return await r.json()

    async def delete(self, resource: str, namespace: str, name: str) -> None:
        async with self._session.delete(f"{collection_path(resource, namespace)}/{name}") as r:
            assert r.status < 300, await r.text()


def get_object(kmock: Any, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        obj = kmock.objects[resource, namespace, name]
    except KeyError:
        return None
    if obj.deleted:
        return None
    return copy.deepcopy(dict(obj.raw))


async def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``predicate`` without blocking the loop (the emulator serves from it). The timeout is a
    deadline for a stuck test, not a bar: a loaded CI machine takes several times as long."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (KeyError, TypeError, IndexError, AssertionError) as e:
            last_error = e
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f" ({last_error!r})" if last_error else ""))


@contextlib.asynccontextmanager
async def emulated_cluster(kmock: Any, tmp_path: Path, monkeypatch: Any,
                           declare: Callable[[Any], None] = declare_resources) -> AsyncIterator[KubeClient]:
    """The emulator with the resources ``declare`` names, KUBECONFIG pointing kopf and the operator at
    it, and a client of its API (closed when the block ends)."""
    declare(kmock)
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", str(kmock.url))))
    async with KubeClient(kmock.url) as client:
        yield client


@contextlib.asynccontextmanager
async def running_operator(kmock: Any, watched: str, *, config: OperatorConfig | None = None,
                           timeout: float = 30.0) -> AsyncIterator[KopfRunner]:
    """Run the operator until the block ends, as ``weightcache operator`` runs it
    (``build_registry`` + ``build_settings``) in kopf's ``KopfRunner`` thread.

    The block starts only once kopf watches the ``watched`` collection (a plural such as
    ``weightcaches``), so objects the test creates from then on reach the handlers as events.
    ``config`` defaults to polling the agents every ``POLL`` seconds, 1 s per HTTP request.
    """
    # kopf only here: the CRD, chart and manifest tests share this module without running it.
    from kopf.testing import KopfRunner
    from weightcache_operator.config import OperatorConfig
    from weightcache_operator.registry import build_registry, build_settings

    registry, _ = build_registry(config or OperatorConfig(poll_interval=POLL, agent_http_timeout=1.0))
    before = len(requests_of(kmock, "GET", watched))
    runner = KopfRunner(["run", "--standalone", "--all-namespaces"], registry=registry,
                        settings=build_settings(), timeout=30)
    runner.__enter__()
    try:
        # The watch request is a GET with ?watch=true on the collection.
        await wait_for(lambda: any(r.params.get("watch") for r in requests_of(kmock, "GET", watched)[before:]),
                       timeout=timeout, what=f"kopf's watch on {watched}")
        yield runner
    finally:
        # KopfRunner joins its thread; do that off the loop so the emulator keeps serving.
        await asyncio.to_thread(runner.__exit__, None, None, None)


def requests_of(kmock: Any, method: str, plural: str, *, name: str | None = None,
                subresource: str | None = None) -> list[Any]:
    """Requests the emulator received, by HTTP method, resource plural and object name."""
    out = []
    for r in list(kmock):
        if str(getattr(r.method, "value", r.method)).upper() != method.upper():
            continue
        if r.resource is None or r.resource.plural != plural:
            continue
        if name is not None and r.name != name:
            continue
        if r.subresource != subresource:
            continue
        out.append(r)
    return out


def events_for(kmock: Any, name: str, namespace: str = "default") -> list[dict[str, Any]]:
    """Events posted about the object ``name`` (any kind), oldest first.

    Read from the POST requests, not the stored objects: events are created with
    ``generateName``, which the emulator does not implement (it would keep one).
    """
    out = []
    for r in requests_of(kmock, "POST", "events"):
        data = r.data or {}
        if r.namespace == namespace and (data.get("involvedObject") or {}).get("name") == name:
            out.append(data)
    return out


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return c
    return None
