"""The fake kubelet runs pods as local processes and mirrors them into pod status."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fake_kubelet import FakeKubelet
from k8s_lab import ApiClient, Lab, free_ports, pods_path, wait_for

# Serves GET /ready: 200 once the file named by READY_FILE exists, 503 before. Writes its
# environment to ENV_OUT first.
ENGINE = r"""
import http.server, json, os, sys
port, out = int(sys.argv[1]), sys.argv[2]
json.dump(dict(os.environ), open(out, "w"))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/ready" and os.path.exists(os.environ["READY_FILE"])
        self.send_response(200 if ok else 503); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def ns(k8s_lab: Lab) -> Iterator[str]:
    name = k8s_lab.namespace("kubelet")
    yield name
    k8s_lab.delete_namespace(name)


@pytest.fixture
def kubelet(k8s_lab: Lab, ns: str, tmp_path: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(k8s_lab, ["node-1"], namespace=ns, log_dir=tmp_path) as k:
        yield k
    assert not k.errors, k.errors


def pod_status(lab: Lab, ns: str, name: str) -> dict[str, Any]:
    return lab.api.get(pods_path(ns, name)).get("status", {})


def ready(status: dict[str, Any]) -> bool | None:
    for c in status.get("conditions", []):
        if c["type"] == "Ready":
            return c["status"] == "True"
    return None


def test_runs_the_command_with_the_pods_env_and_probes_readiness(k8s_lab: Lab, ns: str, kubelet: FakeKubelet,
                                                                 tmp_path: Path) -> None:
    port = free_ports(1)[0]
    env_out, ready_file = tmp_path / "env.json", tmp_path / "ready"
    k8s_lab.api.create(pods_path(ns), {
        "metadata": {"name": "engine", "labels": {"weightcache.io/group": "3"}},
        "spec": {"nodeName": "node-1", "restartPolicy": "Never", "containers": [{
            "name": "engine", "image": "engine:1",
            "command": [sys.executable, "-c", ENGINE], "args": ["$(PORT)", str(env_out)],
            "env": [
                {"name": "PORT", "value": str(port)},
                {"name": "READY_FILE", "value": str(ready_file)},
                {"name": "WEIGHTCACHE_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "WEIGHTCACHE_POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "WEIGHTCACHE_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                {"name": "GROUP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['weightcache.io/group']"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ],
            "ports": [{"name": "http", "containerPort": port}],
            "readinessProbe": {"httpGet": {"port": "http", "path": "/ready"}, "periodSeconds": 1},
        }]},
    })
    env = wait_for(lambda: env_out.exists() and env_out.stat().st_size and json.loads(env_out.read_text()),
                   timeout=20, what="the engine process to start")
    meta = k8s_lab.api.get(pods_path(ns, "engine"))["metadata"]
    assert (env["WEIGHTCACHE_POD_NAME"], env["WEIGHTCACHE_POD_NAMESPACE"], env["WEIGHTCACHE_POD_UID"]) == \
        ("engine", ns, meta["uid"])
    assert (env["GROUP"], env["NODE"], env["PORT"]) == ("3", "node-1", str(port))
    # the API server's address and a token bound to this pod, as a kubelet mounts it
    assert f"https://{env['KUBERNETES_SERVICE_HOST']}:{env['KUBERNETES_SERVICE_PORT']}" == k8s_lab.server
    as_pod = ApiClient(k8s_lab.server, Path(env["WEIGHTCACHE_KUBE_CA"]),
                       token=Path(env["WEIGHTCACHE_KUBE_TOKEN"]).read_text())
    me = as_pod.create("/apis/authentication.k8s.io/v1/selfsubjectreviews", {})["status"]["userInfo"]
    assert me["username"] == f"system:serviceaccount:{ns}:default"
    assert me["extra"]["authentication.kubernetes.io/pod-name"] == ["engine"]
    assert me["extra"]["authentication.kubernetes.io/node-name"] == ["node-1"]
    # minted again once 80% of its lifetime has passed (as the kubelet rotates it): made due now
    token_file = Path(env["WEIGHTCACHE_KUBE_TOKEN"])
    first, run = token_file.read_text(), kubelet.run_of(ns, "engine")
    assert run is not None and token_file in run.tokens
    audiences, ttl, _ = run.tokens[token_file]
    run.tokens[token_file] = (audiences, ttl, 0.0)
    second = wait_for(lambda: (t := token_file.read_text()) != first and t, timeout=10, what="the token minted again")
    me = ApiClient(k8s_lab.server, Path(env["WEIGHTCACHE_KUBE_CA"]), token=second).create(
        "/apis/authentication.k8s.io/v1/selfsubjectreviews", {})["status"]["userInfo"]
    assert me["extra"]["authentication.kubernetes.io/pod-name"] == ["engine"]
    # running, but the probe says not ready yet
    status = wait_for(lambda: (s := pod_status(k8s_lab, ns, "engine")).get("phase") == "Running" and s,
                      timeout=10, what="phase Running")
    assert ready(status) is False
    assert not status["podIP"].startswith("127.")  # EndpointSlices refuse loopback addresses
    ready_file.touch()
    wait_for(lambda: ready(pod_status(k8s_lab, ns, "engine")), timeout=10, what="Ready=True")
    # the process dies: not ready, Failed
    proc = kubelet.process(ns, "engine")
    assert proc is not None and proc.poll() is None
    kubelet.kill(ns, "engine")
    status = wait_for(lambda: (s := pod_status(k8s_lab, ns, "engine")).get("phase") == "Failed" and s,
                      timeout=10, what="phase Failed")
    assert ready(status) is False
    assert status["containerStatuses"][0]["state"]["terminated"]["exitCode"] == -9


def test_a_container_that_exits_is_restarted_under_restart_policy_always(k8s_lab: Lab, ns: str,
                                                                        kubelet: FakeKubelet, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    k8s_lab.api.create(pods_path(ns), {
        "metadata": {"name": "crashy"},
        "spec": {"nodeName": "node-1", "containers": [{  # restartPolicy: Always, the default
            # "$$" is the kubelet's escape of "$": the shell sees "echo $$"
            "name": "c", "image": "x", "command": ["sh", "-c", f"echo $$$$ >> {runs}; sleep 0.5; exit 3"]}]},
    })
    def restarted_twice() -> dict[str, Any] | None:
        s = pod_status(k8s_lab, ns, "crashy")
        return s if s.get("containerStatuses", [{}])[0].get("restartCount", 0) >= 2 else None
    status = wait_for(restarted_twice, timeout=15, what="two restarts")
    assert status["phase"] == "Running"
    assert status["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 3
    assert len(set(runs.read_text().split())) >= 3  # a new process each time


def test_deleting_a_pod_stops_its_process_and_confirms_the_deletion(k8s_lab: Lab, ns: str,
                                                                    kubelet: FakeKubelet) -> None:
    k8s_lab.api.create(pods_path(ns), {
        "metadata": {"name": "sleeper"},
        "spec": {"nodeName": "node-1", "terminationGracePeriodSeconds": 30,
                 "containers": [{"name": "c", "image": "x", "command": ["sleep", "600"]}]},
    })
    wait_for(lambda: ready(pod_status(k8s_lab, ns, "sleeper")), timeout=10, what="Ready")
    proc = kubelet.process(ns, "sleeper")
    assert proc is not None and proc.poll() is None
    k8s_lab.api.delete(pods_path(ns, "sleeper"))  # graceful: the kubelet must confirm
    wait_for(lambda: k8s_lab.api.get_or_none(pods_path(ns, "sleeper")) is None, timeout=15, what="pod gone")
    assert proc.poll() is not None  # SIGTERM ended it


def test_pods_without_a_local_command_are_only_marked_running(k8s_lab: Lab, ns: str, kubelet: FakeKubelet) -> None:
    k8s_lab.api.create(pods_path(ns), {
        "metadata": {"name": "image-only"},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]},
    })
    k8s_lab.api.create(pods_path(ns), {  # another node: not this kubelet's
        "metadata": {"name": "elsewhere"},
        "spec": {"nodeName": "node-2", "containers": [{"name": "c", "image": "x", "command": ["sleep", "600"]}]},
    })
    status = wait_for(lambda: (s := pod_status(k8s_lab, ns, "image-only")).get("phase") == "Running" and s,
                      timeout=10, what="Running")
    assert ready(status) is True and kubelet.process(ns, "image-only") is None
    assert pod_status(k8s_lab, ns, "elsewhere").get("phase") == "Pending"
    assert kubelet.run_of(ns, "elsewhere") is None
