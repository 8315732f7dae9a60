"""A real Kubernetes control plane for the tests that the API emulator cannot express.

Why: EndpointSlices following pod labels and readiness, owner-reference garbage
collection, scheduling with Dynamic Resource Allocation, ValidatingAdmissionPolicies
and bound service-account tokens only behave as in a cluster when a real
kube-apiserver, kube-controller-manager and kube-scheduler run them.

How: the scripts in ``tests/k8s`` (``control-plane.sh``, ``fake-node.sh``, ``down.sh``)
start etcd and the three components on loopback, on free ports picked here, in a fresh
writable directory under the temp dir. The binaries come, as controller-runtime's envtest
finds them, from the directory ``$KUBEBUILDER_ASSETS`` names: ``kube-apiserver``, ``etcd``
and ``kubectl`` (envtest's set) plus ``kube-controller-manager`` and ``kube-scheduler``
(garbage collection, EndpointSlices, scheduling). Without it, from ``<repo>/../shared/k8s``
(its ``bin/*.xz``, with etcd and kubectl on PATH). ``Lab.start()`` brings it up
once (tests share it through the session fixture ``k8s_lab`` in ``conftest.py``), adds
fake nodes that heartbeat, publishes the ``DeviceClass`` for GPUs, applies the
project's CRDs, and hands back a ``Lab``: the kubeconfig path, node names, an admin
REST client (``ApiClient``, no Kubernetes library) and helpers to publish a node's
GPUs as a DRA ``ResourceSlice``, make namespaces and bound tokens, and wait.
``Lab.stop()`` runs ``down.sh --wipe`` and then makes sure no process that mentions
the lab directory is left.

A test that assembles more of the system uses it like this::

    def test_failover(k8s_lab, k8s_chart):          # k8s_chart: the Helm chart installed too
        ns = k8s_lab.namespace("e2e")
        k8s_lab.publish_gpus("node-1", ["GPU-a", "GPU-b"])
        operator = subprocess.Popen([...], env=k8s_lab.env)   # KUBECONFIG points at the lab
        with FakeKubelet(k8s_lab, ["node-1"], namespace=ns) as kubelet:   # runs the pods
            ...
        k8s_lab.delete_namespace(ns)

Where the binaries are missing, ``unavailable_reason()`` says which and the fixture
skips. ``WEIGHTCACHE_K8S_LAB=DIR`` reuses a control plane already started with
``tests/k8s/control-plane.sh DIR`` (it is then neither wiped nor stopped).
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import http.client
import json
import lzma
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.parse
import uuid as uuidlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "k8s"
SHARED_K8S = REPO.parent / "shared" / "k8s"
ASSETS_ENV = "KUBEBUILDER_ASSETS"  # controller-runtime envtest's name for the binaries' directory
CRDS = REPO / "crds"
GPU_DRIVER = "gpu.nvidia.com"
DEFAULT_NODES = ("node-1", "node-2")
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
ASSETS = ("kube-apiserver", "etcd", "kubectl", "kube-controller-manager", "kube-scheduler")

T = TypeVar("T")


# CPU seconds the control planes this process stopped spent (their components, heartbeats and what
# those reaped), for the suite's CPU table: they run detached, so no os.times() of ours holds them.
detached_cpu_s = [0.0]


def assets_dir() -> Path | None:
    """The directory $KUBEBUILDER_ASSETS names, or None (then the binaries come from ../shared/k8s)."""
    value = os.environ.get(ASSETS_ENV, "").strip()
    return Path(value) if value else None


def unavailable_reason(shared: Path = SHARED_K8S, assets: Path | None = None) -> str | None:
    """Why a control plane cannot be started here, or None when it can."""
    assets = assets if assets is not None else assets_dir()
    for tool in ("openssl", "curl"):
        if shutil.which(tool) is None:
            return f"{tool} not on PATH"
    if assets is not None:
        missing = [b for b in ASSETS if not os.access(assets / b, os.X_OK)]
        if missing:
            return (f"${ASSETS_ENV}={assets} lacks {', '.join(missing)} (it must hold envtest's kube-apiserver, "
                    "etcd and kubectl, and kube-controller-manager and kube-scheduler)")
        return None
    if not all((shared / "bin" / f"{name}.xz").is_file() for name in BINARIES):
        return (f"set ${ASSETS_ENV} to a directory holding kube-apiserver, etcd, kubectl, kube-controller-manager "
                f"and kube-scheduler (no binaries at {shared} either)")
    for tool, hint in (("etcd", "apt-get install -y etcd-server"), ("kubectl", "a kubectl binary")):
        if shutil.which(tool) is None:
            return f"{tool} not on PATH (needs {hint}), or set ${ASSETS_ENV}"
    return None


def tool_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the assets' etcd and kubectl first on PATH, for the scripts."""
    env = dict(os.environ if env is None else env)
    assets = assets_dir()
    if assets is not None:
        env.update(PATH=f"{assets}{os.pathsep}{env.get('PATH', '')}", ETCD_BIN=str(assets / "etcd"),
                   KUBECTL=str(assets / "kubectl"))
    return env


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports that nothing listens on right now."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            # the scripts also use port+1 for nothing, but etcd's peer port must differ from its client port
            if port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


# ----------------------------------------------------------------------------- REST client

class ApiError(Exception):
    """An API request answered with an error status."""

    def __init__(self, status: int, method: str, path: str, body: Any) -> None:
        self.status = status
        self.body = body
        self.reason = body.get("reason", "") if isinstance(body, dict) else ""
        message = body.get("message", "") if isinstance(body, dict) else str(body)[:300]
        self.message = message
        super().__init__(f"{method} {path}: {status} {self.reason}: {message}")


class ApiClient:
    """A small JSON client for the API server: admin client certificate or a bearer token.

    One kept-alive connection per thread; ``watch`` opens its own.
    """

    def __init__(self, server: str, ca_path: Path, *, cert: tuple[Path, Path] | None = None,
                 token: str | None = None, timeout: float = 30.0) -> None:
        url = urllib.parse.urlsplit(server)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.token = token
        self.timeout = timeout
        self.ctx = ssl.create_default_context(cafile=str(ca_path))
        if cert:
            self.ctx.load_cert_chain(str(cert[0]), str(cert[1]))
        self._local = threading.local()

    def _conn(self, fresh: bool = False) -> http.client.HTTPSConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _headers(self, content_type: str | None) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if content_type:
            h["Content-Type"] = content_type
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    def request(self, method: str, path: str, body: Any = None, *, params: dict[str, Any] | None = None,
                content_type: str = "application/json") -> tuple[int, Any]:
        """(status, decoded body); never raises for an HTTP error status."""
        if params:
            path = f"{path}?{urllib.parse.urlencode(params)}"
        data = None if body is None else json.dumps(body).encode()
        for attempt in (0, 1):
            conn = self._conn(fresh=attempt > 0)
            try:
                conn.request(method, path, body=data, headers=self._headers(content_type if data else None))
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, ConnectionError, http.client.CannotSendRequest,
                    http.client.BadStatusLine, ssl.SSLEOFError):  # a kept-alive connection the server closed
                if attempt:
                    raise
        try:
            decoded = json.loads(raw) if raw else None
        except ValueError:
            decoded = raw.decode(errors="replace")
        return resp.status, decoded

    def call(self, method: str, path: str, body: Any = None, *, ok: tuple[int, ...] = (),
             params: dict[str, Any] | None = None, content_type: str = "application/json") -> Any:
        status, decoded = self.request(method, path, body, params=params, content_type=content_type)
        if status >= 400 and status not in ok:
            raise ApiError(status, method, path, decoded)
        return decoded

    def get(self, path: str, **params: Any) -> Any:
        return self.call("GET", path, params=params or None)

    def get_or_none(self, path: str) -> Any:
        status, decoded = self.request("GET", path)
        if status == 404:
            return None
        if status >= 400:
            raise ApiError(status, "GET", path, decoded)
        return decoded

    def create(self, path: str, obj: dict[str, Any]) -> Any:
        return self.call("POST", path, obj)

    def patch(self, path: str, patch: dict[str, Any], *, kind: str = "merge") -> Any:
        ctype = {"merge": "application/merge-patch+json",
                 "strategic": "application/strategic-merge-patch+json",
                 "json": "application/json-patch+json"}[kind]
        return self.call("PATCH", path, patch, content_type=ctype)

    def delete(self, path: str, *, grace: int | None = None, uid: str | None = None,
               propagation: str | None = None) -> Any:
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        if uid:
            body["preconditions"] = {"uid": uid}
        if propagation:
            body["propagationPolicy"] = propagation
        return self.call("DELETE", path, body, ok=(404, 409))

    def watch(self, path: str, *, stop: threading.Event, params: dict[str, Any] | None = None,
              timeout_s: int = 300) -> Iterator[tuple[str, dict[str, Any]]]:
        """Events (type, object) of a watch; ends at `stop`, the server's timeout or a dropped line."""
        query = {"watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s), **(params or {})}
        conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=self.timeout)
        done = threading.Event()

        def interrupt() -> None:  # a blocked read ends when its socket is shut down
            while not done.is_set():
                if stop.wait(0.05):
                    with contextlib.suppress(OSError, AttributeError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
                    return

        try:
            conn.request("GET", f"{path}?{urllib.parse.urlencode(query)}", headers=self._headers(None))
            resp = conn.getresponse()
            if resp.status >= 400:
                raise ApiError(resp.status, "WATCH", path, resp.read()[:500])
            assert conn.sock is not None
            conn.sock.settimeout(None)
            threading.Thread(target=interrupt, name="watch-interrupt", daemon=True).start()
            buf = b""
            while not stop.is_set():
                try:
                    chunk = resp.read1(65536)
                except (OSError, http.client.HTTPException, ValueError):
                    if stop.is_set():
                        return
                    raise
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        event = json.loads(line)
                        yield event["type"], event["object"]
        finally:
            done.set()
            conn.close()


# The latency bars (p99 kill -> EndpointSlice) are the benchmarks', measured alone and recorded in
# bench/RESULTS.md. The tests share a 2-core machine with other workers, where one starved process
# decides a p99: they bound latency at this multiple of the bar, so a regression of an order of
# magnitude fails the suite and a busy machine does not.
SHARED_MACHINE_SLACK = 5


def wait_for(fn: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05,
             what: str = "condition") -> T:
    """Poll fn until it returns something truthy; its last value, or TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r:.300})")
        time.sleep(interval)


# ----------------------------------------------------------------------------- paths

def pods_path(namespace: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")


def ns_path(namespace: str, resource: str, name: str = "", *, group: str = "", version: str = "v1") -> str:
    base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    return f"{base}/namespaces/{namespace}/{resource}" + (f"/{name}" if name else "")


# ----------------------------------------------------------------------------- the lab

def _binary_cache() -> Path:
    """Unpacked control-plane binaries, shared between sessions (keyed by their checksums)."""
    sums = (SHARED_K8S / "bin" / "SHA256SUMS")
    key = hashlib.sha256(sums.read_bytes()).hexdigest()[:16] if sums.exists() else "unversioned"
    return Path(tempfile.gettempdir()) / f"wc-k8s-bin-{key}"


def _unpack_binaries(dest: Path) -> None:
    assets = assets_dir()
    if assets is not None:  # envtest's layout: the binaries as they are
        for name in BINARIES:
            if not (dest / name).exists():
                (dest / name).symlink_to(assets.resolve() / name)
        return
    cache = _binary_cache()
    cache.mkdir(parents=True, exist_ok=True)
    for name in BINARIES:
        target = cache / name
        if not target.exists():
            part = cache / f"{name}.{os.getpid()}.part"
            with lzma.open(SHARED_K8S / "bin" / f"{name}.xz") as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            part.chmod(0o755)
            part.replace(target)
        link = dest / name
        if not link.exists():
            link.symlink_to(target)


@dataclass
class Lab:
    """A running control plane and what tests need to use it."""

    dir: Path
    ports: dict[str, int] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    owned: bool = True  # started (and so stopped) by us

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def ca_path(self) -> Path:
        return self.dir / "pki" / "ca.crt"

    @property
    def server(self) -> str:
        cfg = yaml.safe_load(self.kubeconfig.read_text())
        return cfg["clusters"][0]["cluster"]["server"]

    @property
    def env(self) -> dict[str, str]:
        """Environment for a process that talks to this control plane (kubectl, an operator)."""
        return {**tool_env(), "KUBECONFIG": str(self.kubeconfig)}

    @property
    def api(self) -> ApiClient:
        if not hasattr(self, "_api"):
            pki = self.dir / "pki"
            self._api = ApiClient(self.server, self.ca_path, cert=(pki / "admin.crt", pki / "admin.key"))
        return self._api

    def client(self, token: str) -> ApiClient:
        """A client that authenticates with a bearer token (a service account's)."""
        return ApiClient(self.server, self.ca_path, token=token)

    # -- lifecycle ---------------------------------------------------------------------

    @classmethod
    def start(cls, nodes: tuple[str, ...] = DEFAULT_NODES, *, lab_dir: Path | None = None,
              settings: dict[str, str] | None = None) -> Lab:
        """`settings`: the control-plane scripts' variables (RUNTIME_CONFIG, APISERVER_EXTRA_ARGS, ...),
        for a cluster that lacks an API; such a lab is never a reused one."""
        reuse = None if settings else os.environ.get("WEIGHTCACHE_K8S_LAB")
        if reuse:
            lab = cls(Path(reuse), owned=False)
        else:
            d = lab_dir or Path(tempfile.mkdtemp(prefix="wc-k8s-"))
            (d / "bin").mkdir(parents=True, exist_ok=True)
            _unpack_binaries(d / "bin")
            for attempt in range(3):
                # a free port is free when looked at: another process (a connection's local port) may take
                # it before the control plane binds it, which the script reports; new ports then
                etcd, peer, api, kcm, sched = free_ports(5)
                lab = cls(d, ports={"ETCD_PORT": etcd, "ETCD_PEER_PORT": peer, "APISERVER_PORT": api,
                                    "KCM_PORT": kcm, "SCHED_PORT": sched})
                env = tool_env({**os.environ, **(settings or {}), **{k: str(v) for k, v in lab.ports.items()}})
                proc = subprocess.run([str(SCRIPTS / "control-plane.sh"), str(d)], env=env, capture_output=True,
                                      text=True, timeout=300, check=False)
                if "is in use by a process this script did not start" not in proc.stderr or attempt == 2:
                    break
                subprocess.run([str(SCRIPTS / "down.sh"), str(d), "--wipe"], capture_output=True, timeout=120, check=False,
                               env={**os.environ, "STOP_TIMEOUT_S": "10"})
            atexit.register(lab.stop)
            if proc.returncode != 0:
                logs = "\n".join(f"{p.name}: {p.read_text()[-1500:]}" for p in sorted((d / "logs").glob("*.log")))
                lab.stop()
                raise RuntimeError(f"control-plane.sh failed ({proc.returncode}): {proc.stderr[-2000:]}\n{logs}")
        try:
            for node in nodes:
                lab.add_node(node)
            lab.ensure_device_class()
            lab.apply_crds()
            lab.wait_for_service_account("default")
        except BaseException:
            lab.stop()
            raise
        return lab

    def stop(self) -> None:
        """Stop every process of the lab (down.sh --wipe), then anything left that names its dir."""
        if not self.owned or getattr(self, "_stopped", False):
            return
        self._stopped = True
        detached_cpu_s[0] += self.cpu_seconds()
        # The heartbeat loops' command lines end in the lab dir without a trailing '/', which
        # down.sh's ownership check looks for: stop them here, by their recorded pids.
        for pidfile in (self.dir / "run").glob("fake-node-*.pid"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(pidfile.read_text().strip())
                if pid in self.leftover_pids():
                    os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(Exception):
            subprocess.run([str(SCRIPTS / "down.sh"), str(self.dir), "--wipe"], capture_output=True,
                           timeout=120, env={**os.environ, "STOP_TIMEOUT_S": "10"}, check=False)
        deadline = time.monotonic() + 5
        while self.leftover_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.leftover_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not os.environ.get("WEIGHTCACHE_KEEP_LAB"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def cpu_seconds(self) -> float:
        """CPU seconds the lab's running processes spent so far, with the children they reaped."""
        total = 0
        for pid in self.leftover_pids():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        return total / os.sysconf("SC_CLK_TCK")

    def leftover_pids(self) -> list[int]:
        """Processes with an argument in the lab directory (none after stop())."""
        here = str(self.dir)
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                if any(a == here or a.startswith(here + "/") or a.endswith("=" + here) or
                       ("=" + here + "/") in a for a in args):
                    found.append(int(entry.name))
        return found

    # -- kubectl -----------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        kubectl = tool_env().get("KUBECTL", "kubectl")
        proc = subprocess.run([kubectl, "--kubeconfig", str(self.kubeconfig), *args], input=input,
                              capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def apply(self, *docs: dict[str, Any] | str) -> None:
        """Apply objects (dicts) or YAML text, server-side (field manager `k8s-lab`, taking over what
        another manager set), as `kubectl apply --server-side --force-conflicts` does: through the API,
        with no kubectl start. A namespaced object without a namespace goes to `default`."""
        for doc in docs:
            for obj in (yaml.safe_load_all(doc) if isinstance(doc, str) else [doc]):
                if obj:
                    self.api.call("PATCH", self.object_path(obj), obj, params={"fieldManager": "k8s-lab", "force": "true"},
                                  content_type="application/apply-patch+yaml")

    def object_path(self, obj: dict[str, Any]) -> str:
        """The API path of an object, from its apiVersion and kind (the API server's discovery, cached)."""
        version = obj["apiVersion"]
        base = f"/api/{version}" if "/" not in version else f"/apis/{version}"
        if obj["kind"] not in self._discovery.get(version, {}):  # unseen, or served since (a new CRD's)
            listing = self.api.get(base)
            self._discovery[version] = {r["kind"]: (r["name"], r["namespaced"]) for r in listing["resources"]
                                        if "/" not in r["name"]}
        plural, namespaced = self._discovery[version][obj["kind"]]
        if namespaced:
            base += f"/namespaces/{obj['metadata'].get('namespace') or 'default'}"
        return f"{base}/{plural}/{obj['metadata']['name']}"

    @property
    def _discovery(self) -> dict[str, dict[str, tuple[str, bool]]]:
        if not hasattr(self, "_discovered"):
            self._discovered: dict[str, dict[str, tuple[str, bool]]] = {}
        return self._discovered

    # -- nodes, GPUs, CRDs -------------------------------------------------------------

    def add_node(self, name: str) -> None:
        """A Node kept Ready by a heartbeat loop (stopped by down.sh)."""
        proc = subprocess.run([str(SCRIPTS / "fake-node.sh"), "start", name, str(self.dir)],
                              capture_output=True, text=True, timeout=60, env=tool_env())
        if proc.returncode != 0:
            raise RuntimeError(f"fake-node.sh start {name}: {proc.stderr.strip()}")
        if name not in self.nodes:
            self.nodes.append(name)

    def ensure_device_class(self, name: str = GPU_DRIVER, driver: str = GPU_DRIVER) -> None:
        self.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
                    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]}})

    def publish_gpus(self, node: str, uuids: list[str], *, driver: str = GPU_DRIVER) -> str:
        """Publish `node`'s GPUs as a driver would: one ResourceSlice, devices gpu-<i> with a `uuid`."""
        name = f"{node}-{driver}"
        existing = self.api.get_or_none(f"/apis/resource.k8s.io/v1/resourceslices/{name}")
        generation = existing["spec"]["pool"]["generation"] + 1 if existing else 1
        self.apply({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": [{"name": f"gpu-{i}", "attributes": {"uuid": {"string": u}}}
                                 for i, u in enumerate(uuids)]},
        })
        return name

    def apply_crds(self) -> list[str]:
        """Apply every CRD in crds/ and wait until each is Established; their names."""
        names = []
        for path in sorted(CRDS.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    self.apply(doc)
                    names.append(doc["metadata"]["name"])
        for name in names:
            def established(name: str = name) -> bool:
                crd = self.api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                return any(c["type"] == "Established" and c["status"] == "True"
                           for c in (crd.get("status") or {}).get("conditions") or [])
            wait_for(established, timeout=30, what=f"CRD {name} Established")
        return names

    # -- namespaces, accounts, tokens ----------------------------------------------------

    def namespace(self, prefix: str = "t") -> str:
        """A fresh namespace (its default ServiceAccount present); its name."""
        name = f"{prefix}-{uuidlib.uuid4().hex[:6]}"
        self.api.create("/api/v1/namespaces", {"metadata": {"name": name}})
        self.wait_for_service_account(name)
        return name

    def wait_for_service_account(self, namespace: str, name: str = "default") -> None:
        wait_for(lambda: self.api.get_or_none(ns_path(namespace, "serviceaccounts", name)),
                 timeout=30, what=f"serviceaccount {namespace}/{name}")

    def service_account(self, namespace: str, name: str, *, cluster_role: str | None = None) -> None:
        """A ServiceAccount, bound in its namespace to `cluster_role` when given."""
        self.api.call("POST", ns_path(namespace, "serviceaccounts"), {"metadata": {"name": name}}, ok=(409,))
        if cluster_role:
            self.api.call("POST", ns_path(namespace, "rolebindings", group="rbac.authorization.k8s.io"), {
                "metadata": {"name": f"{name}-{cluster_role}"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
            }, ok=(409,))

    def bound_token(self, namespace: str, service_account: str, pod: str | None = None,
                    *, seconds: int = 3600) -> str:
        """A token of the service account, bound to `pod` (as the kubelet would mount it) when given."""
        spec: dict[str, Any] = {"expirationSeconds": seconds}
        if pod:  # as `kubectl create token --bound-object-kind Pod --bound-object-name POD` asks
            uid = self.api.get(pods_path(namespace, pod))["metadata"]["uid"]
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod, "uid": uid}
        request = self.api.create(ns_path(namespace, "serviceaccounts", f"{service_account}/token"),
                                  {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        return request["status"]["token"]

    def delete_namespace(self, namespace: str) -> None:
        """Delete a namespace; pods in it are force-deleted (no kubelet confirms their end)."""
        pods = self.api.get(pods_path(namespace)).get("items", [])
        for pod in pods:
            self.api.delete(pods_path(namespace, pod["metadata"]["name"]), grace=0)
        self.api.delete(f"/api/v1/namespaces/{namespace}")


def install_chart(lab: Lab, *, release: str = "weightcache", namespace: str = "weightcache-system",
                  values: dict[str, Any] | None = None) -> dict[str, Any]:
    """Install the project's Helm chart for real (Helm's Go library); the release document.

    Raises ImportError where helm-sdkpy is missing.
    """
    import asyncio

    import helm_sdkpy  # optional: only the tests that install the chart need it

    chart = REPO / "charts" / "weightcache"
    config = helm_sdkpy.Configuration(namespace=namespace, kubeconfig=str(lab.kubeconfig))
    return asyncio.run(helm_sdkpy.Install(config).run(release, str(chart), values=values,
                                                       create_namespace=True, wait=False))


AGENT_SA = "weightcache-agent"


@dataclass
class AgentIdentity:
    """An agent pod on a node and the token the kubelet would mount into it."""

    namespace: str
    pod: str
    uid: str
    node: str
    token: str
    token_path: Path


def agent_identity(lab: Lab, namespace: str, node: str, *, name: str | None = None,
                   token_dir: Path | None = None) -> AgentIdentity:
    """The `weightcache-agent` ServiceAccount (bound to the chart's ClusterRole), an agent pod bound
    to `node` and a token bound to that pod, written to a file as the kubelet mounts it."""
    lab.service_account(namespace, AGENT_SA, cluster_role=AGENT_SA)
    name = name or f"agent-{node}"
    pod = lab.api.create(pods_path(namespace), {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "weightcache-agent"}},
        "spec": {"nodeName": node, "serviceAccountName": AGENT_SA, "automountServiceAccountToken": False,
                 "containers": [{"name": "agent", "image": "ghcr.io/weightcache/agent:0.1.0"}]},
    })
    token = lab.bound_token(namespace, AGENT_SA, name)
    if token_dir is None:
        token_dir = Path(tempfile.mkdtemp(prefix="wc-agent-token-"))
        atexit.register(shutil.rmtree, token_dir, True)
    token_path = token_dir / f"{name}.token"
    token_path.write_text(token)
    return AgentIdentity(namespace, name, pod["metadata"]["uid"], node, token, token_path)


def install_or_upgrade_chart(lab: Lab, **kwargs: Any) -> None:
    """install_chart, or an upgrade where the release is there already (a reused lab)."""
    try:
        install_chart(lab, **kwargs)
    except Exception as e:
        if "re-use a name" not in str(e) and "still in use" not in str(e):
            raise
        import asyncio

        import helm_sdkpy

        config = helm_sdkpy.Configuration(namespace=kwargs.get("namespace", "weightcache-system"),
                                          kubeconfig=str(lab.kubeconfig))
        asyncio.run(helm_sdkpy.Upgrade(config).run(kwargs.get("release", "weightcache"),
                                                   str(REPO / "charts" / "weightcache"),
                                                   values=kwargs.get("values"), wait=False))
