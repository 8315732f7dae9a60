"""A kubelet stand-in for the test control plane: pods bound to its nodes run as local processes.

Why: the control plane in ``k8s_lab`` has no kubelet, so a pod is stored, scheduled and
never runs. Tests of what follows a running pod (EndpointSlices, failover, the operator
reading agents) need something that plays the kubelet's part: start the container, say
in the pod's status that it runs and is ready, notice when it dies, and confirm a
deletion.

How data flows: one thread lists and watches pods (all namespaces, or one) and keeps
those bound to the given nodes. A newly seen pod whose first container has a command
that resolves on this machine (``shutil.which``) is started as a local process, in its
own session, with this process's environment plus the container's ``env``: plain
``value``s, and downward-API ``fieldRef``s for ``metadata.name``/``namespace``/``uid``,
labels, annotations, ``spec.nodeName``, ``spec.serviceAccountName``,
``status.podIP``/``hostIP``; ``$(VAR)`` in command and args is expanded as the kubelet
does. As a kubelet mounts a service-account token, the process gets
``KUBERNETES_SERVICE_HOST``/``PORT`` of the test API server and, in files named by
``WEIGHTCACHE_KUBE_TOKEN`` and ``WEIGHTCACHE_KUBE_CA``, a token of the pod's service account
bound to the pod (unless ``automountServiceAccountToken`` is false) and the cluster CA; a
``projected`` volume's ``serviceAccountToken`` sources are minted for their audience, bound
to the pod, and written where the volume is mounted (with ``host_root``). Like the kubelet,
it mints every such token again once 80% of its lifetime has passed.
Any other pod (no command, an image-only command, ``run_commands=False``) is only marked
Running: enough for pods that must merely look alive.

A second thread, the only one that writes pod status, probes every ``probe_interval``
seconds: Ready when the process is alive (or there is none) and the readiness probe
passes (``httpGet`` on 127.0.0.1 answering 2xx/3xx, ``tcpSocket`` connecting, ``exec``
exiting 0). A process that exits turns its pod Succeeded (status 0) or Failed, not
ready, unless its ``restartPolicy`` (``Always`` by default, or ``OnFailure`` after a
failure) asks for a restart: then the pod stays Running and not ready, and the command
runs again after ``restart_delay`` seconds (``restartCount``, ``lastState`` recorded);
it is Ready again once the probe passes. The status carries a pod IP from
10.244.0.0/16, unique in the test process: EndpointSlices refuse loopback addresses, so
a pod's IP is a name, while its process listens on 127.0.0.1. When a pod gets a deletion
timestamp, its process group gets SIGTERM, then SIGKILL after the grace period (capped
by ``kill_timeout``), and the pod
is force-deleted with its uid as precondition, as a kubelet confirms the end.

Several pods of several nodes share this machine's filesystem and loopback, where a
cluster gives each pod its own mounts and network namespace. Three options stand in
for that (all off by default): ``host_root`` gives each node a directory of its own,
and a ``hostPath`` volume of a pod is that node's ``<host_root>/<node><path>``
(created for ``DirectoryOrCreate``), a ``persistentVolumeClaim`` volume is that node's
``<host_root>/<node>/pvc/<claimName>`` (what the test puts there is the claim's content), a ``secret`` or ``configMap`` volume is written out
as files when the container starts, and the volume's ``mountPath`` is replaced by that
directory in command, args and env values, so a process finds at its host path what the
container would find at the mount; a container that names ``$(HOST_PORT_<NAME>)`` (its port
``<name>`` upper-cased, ``-`` as ``_``) gets a free loopback port in that variable, and
its probes on that port go there; pods matching ``loopback_labels`` get ``127.0.0.1``
as their pod IP (for pods reached by IP, such as a node agent, and selected by no
Service). ``argv_hook`` lets a test adjust a command for this machine.
"""
from __future__ import annotations

import contextlib
import http.client
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from k8s_lab import ApiClient, ApiError, Lab, free_ports, pods_path

log = logging.getLogger("fake_kubelet")

_ip_lock = threading.Lock()
_ip_next = [1]


def _next_pod_ip() -> str:
    with _ip_lock:
        n = _ip_next[0]
        _ip_next[0] += 1
    return f"10.244.{n // 250}.{n % 250 + 1}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class PodRun:
    """What the fake kubelet knows of one pod."""

    namespace: str
    name: str
    uid: str
    pod: dict[str, Any]
    ip: str
    started: str = field(default_factory=_now)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    reported: tuple[str, bool, int | None, int] | None = None  # (phase, ready, exit code, restarts) written
    container_started: str = field(default_factory=_now)
    finished: str | None = None
    exited: float | None = None  # monotonic time the process was seen gone (restart pending)
    restarts: int = 0
    last_exit: dict[str, Any] | None = None  # the previous container's end, for lastState
    deleting: bool = False
    host_ports: dict[int, int] = field(default_factory=dict)  # containerPort -> loopback port it listens on
    # service-account token files -> (audiences, lifetime s, monotonic time to mint it again)
    tokens: dict[Path, tuple[list[str] | None, int, float]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class FakeKubelet:
    """Plays the kubelet of `nodes` for pods of `namespace` (all when None) matching `label_selector`."""

    def __init__(self, lab: Lab, nodes: list[str] | None = None, *, namespace: str | None = None,
                 label_selector: str | None = None, run_commands: bool = True, probe_interval: float = 0.1,
                 kill_timeout: float = 5.0, log_dir: Path | None = None, inherit_env: bool = True,
                 restart_delay: float = 0.5, host_root: Path | None = None,
                 loopback_labels: dict[str, str] | None = None,
                 argv_hook: Callable[[dict[str, Any], list[str]], list[str]] | None = None) -> None:
        self.lab = lab
        self.api: ApiClient = lab.api
        self.nodes = set(nodes or lab.nodes)
        self.namespace = namespace
        self.label_selector = label_selector
        self.run_commands = run_commands
        self.probe_interval = probe_interval
        self.kill_timeout = kill_timeout
        self.inherit_env = inherit_env
        self.restart_delay = restart_delay
        self.host_root = host_root
        self.loopback_labels = loopback_labels
        self.argv_hook = argv_hook
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="fake-kubelet-"))
        self.pods: dict[str, PodRun] = {}  # by uid
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._synced = threading.Event()
        self.errors: list[str] = []

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> FakeKubelet:
        for target, name in ((self._watch_loop, "fake-kubelet-watch"), (self._probe_loop, "fake-kubelet-probe")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        if not self._synced.wait(30):
            raise TimeoutError("fake kubelet: first pod list did not complete")
        return self

    def stop(self) -> None:
        """Stop watching and kill every process it started (the pods stay as they are)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._lock:
            runs = list(self.pods.values())
        for run in runs:
            self._kill(run, grace=0)

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what tests use ------------------------------------------------------------------

    def run_of(self, namespace: str, name: str) -> PodRun | None:
        with self._lock:
            for run in self.pods.values():
                if run.namespace == namespace and run.name == name and not run.deleting:
                    return run
        return None

    def process(self, namespace: str, name: str) -> subprocess.Popen[bytes] | None:
        run = self.run_of(namespace, name)
        return run.proc if run else None

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a pod's process group, as when its container crashes."""
        proc = self.process(namespace, name)
        if proc is None:
            raise LookupError(f"no process for pod {namespace}/{name}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def log_text(self, namespace: str, name: str) -> str:
        run = self.run_of(namespace, name)
        return run.log_path.read_text(errors="replace") if run and run.log_path and run.log_path.exists() else ""

    # -- watch ---------------------------------------------------------------------------

    def _path(self) -> str:
        return pods_path(self.namespace) if self.namespace else "/api/v1/pods"

    def _params(self) -> dict[str, str]:
        params = {"fieldSelector": "spec.nodeName!="}
        if self.label_selector:
            params["labelSelector"] = self.label_selector
        return params

    def _watch_loop(self) -> None:
        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    listing = self.api.get(self._path(), **self._params())
                    rv = listing["metadata"]["resourceVersion"]
                    seen = set()
                    for pod in listing.get("items", []):
                        seen.add(pod["metadata"]["uid"])
                        self._on_pod("MODIFIED", pod)
                    with self._lock:
                        gone = [r for uid, r in self.pods.items() if uid not in seen]
                    for run in gone:
                        self._on_pod("DELETED", run.pod)
                    self._synced.set()
                for kind, obj in self.api.watch(self._path(), stop=self._stop,
                                                params={**self._params(), "resourceVersion": rv}):
                    if kind == "ERROR":
                        rv = None  # expired: list again
                        break
                    rv = obj["metadata"].get("resourceVersion", rv)
                    if kind != "BOOKMARK":
                        self._on_pod(kind, obj)
            except Exception as e:  # keep playing the kubelet; the test sees errors in self.errors
                if self._stop.is_set():
                    return
                self.errors.append(f"watch: {e}")
                rv = None
                time.sleep(0.2)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec", {})
        if spec.get("nodeName") not in self.nodes:
            return
        uid = meta["uid"]
        with self._lock:
            run = self.pods.get(uid)
            if kind == "DELETED":
                self.pods.pop(uid, None)
            elif run is None:
                phase = pod.get("status", {}).get("phase")
                run = PodRun(meta["namespace"], meta["name"], uid, pod, pod.get("status", {}).get("podIP")
                             or self._pod_ip(pod))
                self.pods[uid] = run
                if phase in ("Succeeded", "Failed"):
                    run.reported = (phase, False, None, 0)  # finished before we came: leave it
                elif not meta.get("deletionTimestamp"):
                    self._launch(run)
            else:
                run.pod = pod
        if kind == "DELETED":
            if run is not None:
                self._kill(run, grace=0)
            return
        if meta.get("deletionTimestamp") and run is not None and not run.deleting:
            run.deleting = True
            threading.Thread(target=self._finalize, args=(run,), name=f"finalize-{run.name}", daemon=True).start()

    # -- processes -----------------------------------------------------------------------

    def _pod_ip(self, pod: dict[str, Any]) -> str:
        labels = pod["metadata"].get("labels") or {}
        if self.loopback_labels and all(labels.get(k) == v for k, v in self.loopback_labels.items()):
            return "127.0.0.1"
        return _next_pod_ip()

    def host_path(self, node: str, path: str) -> Path:
        """Where node `node`'s host path `path` is on this machine (with `host_root`)."""
        if self.host_root is None:
            return Path(path)
        return self.host_root / node / path.lstrip("/")

    def _mounts(self, run: PodRun, container: dict[str, Any]) -> list[tuple[str, str]]:
        """(mountPath, host directory) of the container's hostPath volumes, longest mount first."""
        if self.host_root is None:
            return []
        spec = run.pod.get("spec", {})
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        out = []
        for m in container.get("volumeMounts") or []:
            volume = volumes.get(m["name"]) or {}
            host = volume.get("hostPath")
            if host:
                local = self.host_path(spec.get("nodeName", ""), host["path"])
                if host.get("type") == "DirectoryOrCreate":
                    local.mkdir(parents=True, exist_ok=True)
            elif "secret" in volume or "configMap" in volume:
                local = self._projected(run, m["name"], volume)
            elif "projected" in volume:
                local = self._projected_tokens(run, m["name"], volume["projected"])
            elif "persistentVolumeClaim" in volume:  # the claim's contents: a directory the test fills
                local = self.host_path(spec.get("nodeName", ""), f"/pvc/{volume['persistentVolumeClaim']['claimName']}")
            else:
                continue
            out.append((m["mountPath"].rstrip("/") or "/", str(local)))
        return sorted(out, key=lambda x: -len(x[0]))

    def _projected(self, run: PodRun, name: str, volume: dict[str, Any]) -> Path:
        """A secret or configMap volume written out as files, one per key (or per listed item)."""
        import base64

        local = self.log_dir / f"{run.namespace}_{run.name}.volumes" / name
        local.mkdir(parents=True, exist_ok=True)
        source = volume.get("secret") or volume.get("configMap") or {}
        kind = "secrets" if "secret" in volume else "configmaps"
        obj = self.api.get_or_none(f"/api/v1/namespaces/{run.namespace}/{kind}/"
                                   f"{source.get('secretName') or source.get('name')}") or {}
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()} if kind == "secrets" else \
            {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            if item["key"] in data:
                (local / item["path"]).write_bytes(data[item["key"]])
        return local

    def _projected_tokens(self, run: PodRun, name: str, projected: dict[str, Any]) -> Path:
        """A projected volume's service-account tokens, minted as the kubelet does: for the
        source's audience, bound to the pod (other kinds of source are left out)."""
        local = self.log_dir / f"{run.namespace}_{run.name}.volumes" / name
        local.mkdir(parents=True, exist_ok=True)
        for source in projected.get("sources") or []:
            token = source.get("serviceAccountToken")
            if not token:
                continue
            self._mint(run, local / token["path"], [token["audience"]] if token.get("audience") else None,
                       token.get("expirationSeconds", 3600))
        return local

    @staticmethod
    def _remap(value: str, mounts: list[tuple[str, str]]) -> str:
        """A container path (alone, or after `=` or `:`) under a mount, as its host path."""
        def one(text: str) -> str:
            for mount, local in mounts:
                if text == mount or text.startswith(mount + "/"):
                    return local + text[len(mount):]
            return text
        return re.sub(r"(^|[=:])(/[^=:]*)", lambda m: m.group(1) + one(m.group(2)), value)

    def _assign_ports(self, run: PodRun, container: dict[str, Any]) -> dict[str, str]:
        """HOST_PORT_<NAME> for each named port the container asks for; the same port across restarts."""
        text = " ".join((container.get("command") or []) + (container.get("args") or [])
                        + [str(v.get("value", "")) for v in container.get("env") or []])
        env = {}
        for p in container.get("ports") or []:
            if not p.get("name"):
                continue
            var = "HOST_PORT_" + p["name"].upper().replace("-", "_")
            if f"$({var})" not in text:
                continue
            if p["containerPort"] not in run.host_ports:
                run.host_ports[p["containerPort"]], = free_ports(1)
            env[var] = str(run.host_ports[p["containerPort"]])
        return env

    def _field(self, pod: dict[str, Any], run: PodRun, path: str) -> str | None:
        meta, spec = pod["metadata"], pod.get("spec", {})
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        return {
            "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
            "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
            "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
            "status.podIP": run.ip, "status.hostIP": "127.0.0.1",
        }.get(path)

    def service_account_env(self, run: PodRun) -> dict[str, str]:
        """What a kubelet gives a pod to reach the API: the service's address, and a token of the
        pod's service account bound to the pod, with the CA, in files (named by the variables
        `serve/serving_label.py` reads, since /var/run/secrets cannot be mounted here)."""
        spec = run.pod.get("spec", {})
        if spec.get("automountServiceAccountToken") is False:
            return {}
        secrets = self.log_dir / f"{run.namespace}_{run.name}.serviceaccount"
        secrets.mkdir(exist_ok=True)
        self._mint(run, secrets / "token", None, 3600)
        (secrets / "ca.crt").write_bytes(self.lab.ca_path.read_bytes())
        (secrets / "namespace").write_text(run.namespace)
        server = urllib.parse.urlsplit(self.lab.server)
        return {"KUBERNETES_SERVICE_HOST": server.hostname or "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": str(server.port or 443),
                "WEIGHTCACHE_KUBE_TOKEN": str(secrets / "token"), "WEIGHTCACHE_KUBE_CA": str(secrets / "ca.crt")}

    def _mint(self, run: PodRun, path: Path, audiences: list[str] | None, ttl: int) -> None:
        """A token of the pod's service account bound to the pod, written to `path` whole (a reader never
        sees half of one); minted again once 80% of its lifetime has passed, as the kubelet rotates it."""
        sa = run.pod.get("spec", {}).get("serviceAccountName") or "default"
        req = self.api.create(f"/api/v1/namespaces/{run.namespace}/serviceaccounts/{sa}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": audiences, "expirationSeconds": ttl,
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": run.name, "uid": run.uid}}})
        fresh = path.with_name(f".{path.name}.new")
        fresh.write_text(req["status"]["token"])
        os.replace(fresh, path)
        run.tokens[path] = (audiences, ttl, time.monotonic() + 0.8 * ttl)

    def _rotate_tokens(self, run: PodRun) -> None:
        for path, (audiences, ttl, due) in list(run.tokens.items()):
            if time.monotonic() >= due:
                self._mint(run, path, audiences, ttl)

    def container_env(self, pod: dict[str, Any], run: PodRun, container: dict[str, Any]) -> dict[str, str]:
        env = dict(os.environ) if self.inherit_env else {}
        env.update(self.service_account_env(run))
        env.update(self._assign_ports(run, container))
        mounts = self._mounts(run, container)
        for var in container.get("env", []):
            if "value" in var:
                value: str | None = self._remap(_expand(var["value"], env), mounts)
            else:
                ref = (var.get("valueFrom") or {}).get("fieldRef")
                value = self._field(pod, run, ref["fieldPath"]) if ref else None
            if value is None:
                log.warning("pod %s: env %s has a source the fake kubelet cannot resolve; left out",
                            run.key, var.get("name"))
                continue
            env[var["name"]] = value
        return env

    def _launch(self, run: PodRun) -> None:
        containers = run.pod.get("spec", {}).get("containers", [])
        if not containers or not self.run_commands or not containers[0].get("command"):
            return
        c = containers[0]
        env = self.container_env(run.pod, run, c)
        mounts = self._mounts(run, c)
        argv = [self._remap(_expand(a, env), mounts) for a in (c.get("command") or []) + (c.get("args") or [])]
        if self.argv_hook is not None:
            argv = self.argv_hook(run.pod, argv)
        if shutil.which(argv[0]) is None:  # an image-only command: the pod merely looks alive
            return
        run.log_path = self.log_dir / f"{run.namespace}_{run.name}.log"
        cwd = c.get("workingDir") if c.get("workingDir") and os.path.isdir(c["workingDir"]) else None
        run.container_started = _now()
        with open(run.log_path, "ab") as out:
            out.write(f"# {_now()} {shlex.join(argv)}\n".encode())
            out.flush()
            run.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        log.info("pod %s: started pid %d", run.key, run.proc.pid)

    def _kill(self, run: PodRun, grace: float) -> None:
        proc = run.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        try:
            proc.wait(timeout=grace if grace > 0 else 5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        # the group may hold children that outlived the leader
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def _finalize(self, run: PodRun) -> None:
        grace = run.pod["metadata"].get("deletionGracePeriodSeconds")
        grace = self.kill_timeout if grace is None else min(float(grace), self.kill_timeout)
        self._kill(run, grace=max(grace, 0.0))
        try:
            self.api.delete(pods_path(run.namespace, run.name), grace=0, uid=run.uid)
        except ApiError as e:
            self.errors.append(f"finalize {run.key}: {e}")

    # -- status --------------------------------------------------------------------------

    def _probe_ok(self, run: PodRun, container: dict[str, Any]) -> bool:
        probe = container.get("readinessProbe")
        if not probe:
            return True
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            get = probe["httpGet"]
            port = _port(get.get("port"), container)
            port = run.host_ports.get(port, port)
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
                conn.request("GET", get.get("path", "/"))
                status = conn.getresponse().status
                conn.close()
                return 200 <= status < 400
            except OSError:
                return False
        if "tcpSocket" in probe:
            try:
                port = _port(probe["tcpSocket"].get("port"), container)
                socket.create_connection(("127.0.0.1", run.host_ports.get(port, port)), timeout=timeout).close()
                return True
            except OSError:
                return False
        if "exec" in probe:
            try:
                return subprocess.run(probe["exec"]["command"], timeout=timeout, capture_output=True,
                                      check=False).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                return False
        return True

    def _restarts_after(self, run: PodRun, code: int) -> bool:
        policy = run.pod.get("spec", {}).get("restartPolicy") or "Always"
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def _desired(self, run: PodRun) -> tuple[str, bool, int | None, int]:
        containers = run.pod.get("spec", {}).get("containers", [])
        if run.proc is not None:
            code = run.proc.poll()
            if code is not None:
                run.finished = run.finished or _now()
                if not self._restarts_after(run, code):
                    return ("Succeeded" if code == 0 else "Failed"), False, code, run.restarts
                if run.exited is None:
                    run.exited = time.monotonic()
                if time.monotonic() - run.exited < self.restart_delay:
                    return "Running", False, code, run.restarts  # not ready, waiting to restart
                run.last_exit = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                                "startedAt": run.container_started, "finishedAt": run.finished}}
                run.restarts += 1
                run.exited = run.finished = None
                self._launch(run)
        return "Running", bool(containers) and self._probe_ok(run, containers[0]), None, run.restarts

    def _status(self, run: PodRun, phase: str, ready: bool, code: int | None, restarts: int) -> dict[str, Any]:
        now = _now()
        flag = "True" if ready else "False"
        statuses = []
        for i, c in enumerate(run.pod.get("spec", {}).get("containers", [])):
            last: dict[str, Any] = {}
            if i == 0 and code is not None and phase != "Running":
                state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                        "startedAt": run.container_started, "finishedAt": run.finished or now}}
            elif i == 0 and code is not None:
                state = {"waiting": {"reason": "CrashLoopBackOff"}}
                last = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                       "startedAt": run.container_started, "finishedAt": run.finished or now}}
            else:
                state = {"running": {"startedAt": run.container_started if i == 0 else run.started}}
                last = (run.last_exit or {}) if i == 0 else {}
            statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "",
                             "ready": ready if i == 0 else phase == "Running", "restartCount": restarts if i == 0 else 0,
                             "started": "running" in state, "state": state, "lastState": last})
        return {"status": {
            "phase": phase, "podIP": run.ip, "podIPs": [{"ip": run.ip}],
            "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "startTime": run.started,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": run.started},
                {"type": "Initialized", "status": "True", "lastTransitionTime": run.started},
                {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
                {"type": "Ready", "status": flag, "lastTransitionTime": now},
            ],
            "containerStatuses": statuses,
        }}

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.probe_interval):
            with self._lock:
                runs = [r for r in self.pods.values() if not r.deleting]
            for run in runs:
                if run.reported and run.reported[0] in ("Succeeded", "Failed"):
                    continue
                try:
                    self._rotate_tokens(run)
                except Exception as e:  # the API server busy: the next tick tries again
                    self.errors.append(f"token {run.key}: {e}")
                try:
                    desired = self._desired(run)
                except Exception as e:  # e.g. a restart's token for a pod deleted meanwhile: one pod's
                    self.errors.append(f"restart {run.key}: {e}")  # trouble must not stop every pod's probes
                    continue
                if desired == run.reported:
                    continue
                try:
                    self.api.patch(pods_path(run.namespace, run.name) + "/status", self._status(run, *desired))
                    run.reported = desired
                except ApiError as e:
                    if e.status != 404:
                        self.errors.append(f"status {run.key}: {e}")
                except Exception as e:  # a dropped connection: next tick retries
                    self.errors.append(f"status {run.key}: {e}")


def _port(port: Any, container: dict[str, Any]) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} not among the container's ports")


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined names replaced, $$ escapes, others left as written."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)
