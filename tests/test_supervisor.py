"""The node supervisor as the DaemonSet runs it: real processes, real sockets, real HTTP.

`weightcache agent --socket-dir DIR --tp-size 2 --backend cpu --http-port 0` must run one
worker per rank, publish one node state on /status, /readyz and /metrics, restart a
killed worker, refuse to restart-storm a bad checkpoint, and leave nothing behind on
SIGTERM. The tests in this module share one supervisor and run in file order; the last
one stops it.
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from weightcache_agent import CacheSpec, agent_status
from weightcache_agent.serve.agent_http import AgentHTTPServer, AgentMetrics
from weightcache_agent.arena.devices import Device
from weightcache_agent.engine.server import load_model
from weightcache_agent.serve.supervisor import NodeConfig, NodeSupervisor, Worker, failure_message, node_phase
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

SHAPE = LlamaShape(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=1024)
STATUS_KEYS = {"node": str, "phase": str, "message": str, "fingerprint": str, "bytes": int, "loadSeconds": float,
               "clients": int, "gpuUUIDs": list, "socketDir": str, "ranks": list}
RANK_KEYS = {"rank": int, "device": str, "phase": str, "bytes": int, "progress": float, "clients": int, "socket": str}


class Node:
    """`weightcache agent --socket-dir ...` as a subprocess, asked over HTTP."""

    def __init__(self, model: str, workdir: str, *extra: str, tp_size: int = 2, backend: str = "cpu"):
        self.model = model
        self.socket_dir = os.path.join(workdir, "sockets")
        self.port_file = os.path.join(workdir, "port")
        self.log_path = os.path.join(workdir, "node.log")
        os.makedirs(workdir, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket-dir", self.socket_dir,
                 "--tp-size", str(tp_size), "--devices", "all", "--quantization", "none", "--dtype", "auto",
                 "--backend", backend,
                 "--http-port", "0", "--port-file", self.port_file, "--node-name", "node-a", *extra],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._port: int | None = None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    @property
    def port(self) -> int:
        deadline = time.monotonic() + 60
        while self._port is None:
            try:
                with open(self.port_file) as f:
                    self._port = int(f.read())
            except (FileNotFoundError, ValueError):
                assert self.proc.poll() is None, f"supervisor exited {self.proc.returncode}:\n{self.log()}"
                assert time.monotonic() < deadline, f"supervisor never listened:\n{self.log()}"
                time.sleep(0.05)
        return self._port

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read().decode()
        finally:
            conn.close()

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status")
        assert code == 200, body
        return json.loads(body)

    def metrics(self) -> dict[str, dict[tuple, float]]:
        """sample name -> {sorted label items: value}."""
        code, body = self.get("/metrics")
        assert code == 200
        out: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        return out

    def wait(self, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"supervisor exited {self.proc.returncode}:\n{self.log()}"
            status = self.status()
            if predicate(status):
                return status
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s: {status}\n{self.log()}"
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def rank_labels(rank: int) -> tuple:
    return (("device", f"cpu-{rank}"), ("rank", str(rank)))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent has not reaped it yet).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def workdir():
    # Short: Unix socket paths are limited to 107 bytes, pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="wc-node-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def model(workdir) -> str:
    return write_llama_checkpoint(os.path.join(workdir, "model"), SHAPE)


@pytest.fixture(scope="module")
def node(model, workdir):
    node = Node(model, os.path.join(workdir, "good"))
    yield node
    node.stop()


def test_two_ranks_ready_status_and_metrics(node, time_bar):
    status = node.wait(lambda s: s["phase"] == "Ready", "Ready node")
    assert node.get("/readyz")[0] == 200
    assert node.get("/healthz")[0] == 200
    for key, kind in STATUS_KEYS.items():
        assert isinstance(status[key], kind), (key, status[key])
    assert status["node"] == "node-a"
    assert status["socketDir"] == node.socket_dir
    assert status["gpuUUIDs"] == ["cpu-0", "cpu-1"]
    assert status["fingerprint"]
    assert [r["rank"] for r in status["ranks"]] == [0, 1]

    workers = []
    for r in status["ranks"]:
        for key, kind in RANK_KEYS.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert r["socket"] == os.path.join(node.socket_dir, f"{r['device']}.sock")
        assert (r["phase"], r["progress"], r["clients"]) == ("Ready", 1.0, 0)
        worker = agent_status(r["socket"])  # what the worker itself says
        assert worker["phase"] == "ready" and worker["spec"]["tp_rank"] == r["rank"]
        assert r["bytes"] == worker["bytes"] > 0
        assert r["loadSeconds"] == pytest.approx(worker["load_seconds"])
        workers.append(worker)
    assert workers[0]["fingerprint"] != workers[1]["fingerprint"]  # two shards, not one copy twice
    assert status["bytes"] == sum(w["bytes"] for w in workers)
    assert status["loadSeconds"] == pytest.approx(max(w["load_seconds"] for w in workers), abs=1e-5)
    # Room for a second copy (a model revision loading beside this one): the largest rank's arena
    # against the tightest device's free memory (host memory on the cpu backend).
    assert status["rankBytes"] == max(w["arena_bytes"] for w in workers) >= max(w["bytes"] for w in workers)
    assert 0 < status["freeBytes"] == min(r["freeBytes"] for r in status["ranks"])
    from weightcache_agent.arena.cpu import available_memory
    assert status["freeBytes"] <= available_memory() + 2**30  # what the host has (a GiB of slack: it moves)
    assert node.get("/nope")[0] == 404

    # An engine (the reference engine's load path, in this process) attaches to rank 0 and
    # holds its lease while the metrics are read.
    _, attachment = load_model(CacheSpec(model=node.model, tp_size=2, tp_rank=0), mode="client",
                               socket=status["ranks"][0]["socket"])
    try:
        assert attachment.source == "agent"
        status = node.wait(lambda s: s["clients"] == 1, "attached client", timeout=10)
        assert [r["clients"] for r in status["ranks"]] == [1, 0]
        deadline = time.monotonic() + 10
        while (m := node.metrics())["weightcache_attach_seconds_count"][rank_labels(0)] < 1:
            assert time.monotonic() < deadline, m["weightcache_attach_seconds_count"]
            time.sleep(0.1)
    finally:
        attachment.close()

    for rank, worker in enumerate(workers):
        labels = rank_labels(rank)
        assert m["weightcache_bytes_resident"][labels] == worker["bytes"]
        assert m["weightcache_load_seconds"][labels] == pytest.approx(worker["load_seconds"])
        assert m["weightcache_rank_ready"][labels] == 1
        assert m["weightcache_worker_restarts_total"][labels] == 0
    assert m["weightcache_clients"][rank_labels(0)] == 1
    assert m["weightcache_clients"][rank_labels(1)] == 0
    assert m["weightcache_attach_seconds_count"][rank_labels(0)] == 1
    assert m["weightcache_attach_seconds_count"][rank_labels(1)] == 0
    assert m["weightcache_attach_seconds_sum"][rank_labels(0)] > 0
    time_bar("an attach, as the agent's metric counts it", m["weightcache_attach_seconds_sum"][rank_labels(0)], 5.0)
    assert m["weightcache_attach_seconds_bucket"][rank_labels(0)[:1] + (("le", "+Inf"),) + rank_labels(0)[1:]] == 1


def test_a_cache_miss_is_counted_on_the_rank_that_refused(node, caplog):
    status = node.wait(lambda s: s["phase"] == "Ready", "Ready node")
    sock = status["ranks"][1]["socket"]
    with caplog.at_level(logging.WARNING, logger="weightcache_agent.client.session"):
        _, attachment = load_model(CacheSpec(model=node.model, tp_size=2, tp_rank=1, dtype="float16"), mode="client",
                                   socket=sock, fallback=True)
    attachment.close()
    assert attachment.source == "disk"
    assert "dtype: cache=bfloat16 engine=float16" in attachment.fallback_reason
    assert any(r.levelno == logging.WARNING and "cache miss" in r.getMessage() and "dtype: cache=bfloat16" in
               r.getMessage() for r in caplog.records), caplog.text
    assert agent_status(sock)["misses"] == 1
    deadline = time.monotonic() + 10
    while (m := node.metrics())["weightcache_attach_misses_total"][rank_labels(1)] < 1:
        assert time.monotonic() < deadline, m["weightcache_attach_misses_total"]
        time.sleep(0.1)
    assert m["weightcache_attach_misses_total"][rank_labels(0)] == 0


def test_killed_worker_is_restarted(node):
    before = node.wait(lambda s: s["phase"] == "Ready", "Ready node")
    victim = before["ranks"][1]
    os.kill(victim["pid"], signal.SIGKILL)

    # The restart takes a backoff plus a Python start-up: the node is seen not ready meanwhile.
    node.wait(lambda s: s["phase"] != "Ready", "not-ready node after the kill", timeout=10)
    assert node.get("/readyz")[0] == 503
    after = node.wait(lambda s: s["phase"] == "Ready" and s["ranks"][1]["restarts"] == 1, "restarted rank 1")
    assert after["ranks"][1]["pid"] != victim["pid"]
    assert after["ranks"][0]["pid"] == before["ranks"][0]["pid"] and after["ranks"][0]["restarts"] == 0
    assert after["ranks"][1]["bytes"] == victim["bytes"]
    assert after["restarts"] == 1
    assert after["fingerprint"] == before["fingerprint"]
    assert node.get("/readyz")[0] == 200
    m = node.metrics()
    assert m["weightcache_worker_restarts_total"][rank_labels(1)] == 1
    assert m["weightcache_worker_restarts_total"][rank_labels(0)] == 0
    assert m["weightcache_rank_ready"][rank_labels(1)] == 1
    # The histogram is cumulative across the restart: rank 0's attach is still counted.
    assert m["weightcache_attach_seconds_count"][rank_labels(0)] == 1


def test_bad_checkpoint_fails_without_restarts(model, workdir):
    bad = shutil.copytree(model, os.path.join(workdir, "bad-model"))
    weights = os.path.join(bad, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    node = Node(bad, os.path.join(workdir, "bad"))
    try:
        status = node.wait(lambda s: s["phase"] == "Failed" and all(r["phase"] == "Failed" for r in s["ranks"]),
                           "Failed node")
        assert "model.safetensors" in status["message"] and "truncated" in status["message"]
        assert all("truncated" in r["message"] and r["pid"] is None for r in status["ranks"])
        assert node.get("/readyz")[0] == 503
        assert node.get("/healthz")[0] == 200  # alive and saying why: no pod crash loop
        time.sleep(2.0)  # four poll intervals and twice the first crash backoff: a hot restart loop would show by now
        status = node.status()
        assert status["phase"] == "Failed"
        assert [r["restarts"] for r in status["ranks"]] == [0, 0]
        assert [r["pid"] for r in status["ranks"]] == [None, None]
        m = node.metrics()
        assert m["weightcache_rank_ready"][rank_labels(0)] == 0
        assert sum(m["weightcache_worker_restarts_total"].values()) == 0
    finally:
        assert node.stop() == 0


def test_sigterm_stops_workers_and_removes_sockets(node):
    status = node.wait(lambda s: s["phase"] == "Ready", "Ready node")
    pids = [r["pid"] for r in status["ranks"]]
    assert all(os.path.exists(r["socket"]) for r in status["ranks"])
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(30) == 0, node.log()
    assert not any(alive(pid) for pid in pids)
    leftovers = [name for name in os.listdir(node.socket_dir) if name.endswith((".sock", ".lock"))]
    assert leftovers == []
    assert "all workers stopped" in node.log()


# -- in-process pieces: no workers started -----------------------------------------------------


def test_failure_message_prefers_the_agents_own_words():
    tail = ["INFO listening", "weightcache agent: /m/x.safetensors: truncated", "Traceback noise"]
    assert failure_message(tail, 1) == "/m/x.safetensors: truncated"
    assert failure_message(["OSError: AF_UNIX path too long"], 1) == "exited with status 1: OSError: AF_UNIX path too long"
    assert failure_message([], -9) == "exited with status -9"


def rank(r: int, phase: str, message: str = "", progress: float = 0.0) -> dict[str, Any]:
    return {"rank": r, "device": f"cpu-{r}", "phase": phase, "message": message, "progress": progress}


def test_node_phase_from_ranks():
    assert node_phase([rank(0, "Ready"), rank(1, "Ready")], None) == ("Ready", "2/2 ranks ready")
    assert node_phase([rank(0, "Pending"), rank(1, "Pending")], None) == ("Pending", "starting 2 workers")
    phase, message = node_phase([rank(0, "Ready"), rank(1, "Loading", progress=0.5)], None)
    assert phase == "Loading" and "1/2 ranks ready" in message and "loading 50%" in message
    phase, message = node_phase([rank(0, "Ready"), rank(1, "Restarting", "worker killed by signal 9")], None)
    assert phase == "Loading" and "killed by signal 9" in message
    phase, message = node_phase([rank(0, "Loading"), rank(1, "Failed", "truncated")], None)
    assert (phase, message) == ("Failed", "rank 1 (cpu-1): truncated")
    assert node_phase([], "no devices to serve: 8 ranks need 8 GPUs") == ("Failed", "no devices to serve: 8 ranks need 8 GPUs")


def test_attach_latencies_are_counted_once_and_survive_a_restart():
    seen: list[tuple[int, str, float]] = []
    worker = Worker(1, Device("cpu", "cpu-1", 1), NodeConfig("/m", "/s", 2, "cpu"), on_attach=lambda *a: seen.append(a))
    worker._observe_attaches({"attaches": 2, "attach_seconds": [0.1, 0.2]})
    worker._observe_attaches({"attaches": 2, "attach_seconds": [0.1, 0.2]})  # nothing new
    worker._observe_attaches({"attaches": 3, "attach_seconds": [0.1, 0.2, 0.3]})
    assert [s for _, _, s in seen] == [0.1, 0.2, 0.3]
    worker._seen_attaches = 0  # what spawn() does for a new process
    worker._observe_attaches({"attaches": 1, "attach_seconds": [0.4]})
    assert seen[-1] == (1, "cpu-1", 0.4) and len(seen) == 4
    worker._observe_attaches({"attaches": 2})  # an agent that does not report latencies
    assert len(seen) == 4


class FakeSource:
    def __init__(self, doc: dict[str, Any], healthy: bool = True):
        self.doc, self.is_healthy = doc, healthy

    def snapshot(self) -> dict[str, Any]:
        return self.doc

    def ready(self) -> bool:
        return self.doc["phase"] == "Ready"

    def healthy(self) -> tuple[bool, str]:
        return self.is_healthy, "ok" if self.is_healthy else "supervisor loop has not run for 45s"


def test_http_endpoints_and_metrics_in_process():
    config = NodeConfig("/m", "/s", 2, "cpu", node_name="n")
    supervisor = NodeSupervisor(config, [], setup_error="no devices to serve: 2 ranks need 2 GPUs")
    source = FakeSource(supervisor.snapshot())
    metrics = AgentMetrics()
    ranks = [{"rank": 0, "device": "GPU-a", "phase": "Ready", "bytes": 10, "clients": 2, "loadSeconds": 1.5,
              "restarts": 3},
             {"rank": 1, "device": "GPU-b", "phase": "Loading", "bytes": 4, "clients": 0, "loadSeconds": None,
              "restarts": 0}]
    metrics.watch(lambda: {"ranks": ranks}, [(0, "GPU-a"), (1, "GPU-b")])
    metrics.observe_attach(0, "GPU-a", 0.002)
    server = AgentHTTPServer("127.0.0.1", 0, source, metrics.registry)
    server.start()
    try:
        def get(path: str, method: str = "GET") -> tuple[int, str]:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                conn.request(method, path)
                response = conn.getresponse()
                return response.status, response.read().decode()
            finally:
                conn.close()

        code, body = get("/status")
        assert code == 200 and json.loads(body)["phase"] == "Failed"
        assert "2 ranks need 2 GPUs" in json.loads(body)["message"]
        assert get("/readyz")[0] == 503
        assert get("/healthz") == (200, json.dumps({"ok": True, "message": "ok"}))
        source.is_healthy = False
        assert get("/healthz")[0] == 503
        source.doc = {**source.doc, "phase": "Ready", "message": ""}
        assert get("/readyz")[0] == 200
        assert get("/readyz", "HEAD") == (200, "")
        assert get("/status?x=1")[0] == 200 and get("/other")[0] == 404

        code, body = get("/metrics")
        assert code == 200
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(body) for s in family.samples}
        a, b = (("device", "GPU-a"), ("rank", "0")), (("device", "GPU-b"), ("rank", "1"))
        assert samples[("weightcache_bytes_resident", a)] == 10 and samples[("weightcache_bytes_resident", b)] == 4
        assert samples[("weightcache_clients", a)] == 2
        assert samples[("weightcache_load_seconds", a)] == 1.5 and ("weightcache_load_seconds", b) not in samples
        assert samples[("weightcache_rank_ready", a)] == 1 and samples[("weightcache_rank_ready", b)] == 0
        assert samples[("weightcache_worker_restarts_total", a)] == 3
        assert samples[("weightcache_attach_seconds_count", a)] == 1
        assert samples[("weightcache_attach_seconds_count", b)] == 0  # present before any attach
        assert samples[("weightcache_attach_seconds_bucket", (a[0], ("le", "0.0025"), a[1]))] == 1
        assert samples[("weightcache_attach_seconds_bucket", (a[0], ("le", "0.001"), a[1]))] == 0
    finally:
        server.close()


def _cuda_ready() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA GPU and cuda-bindings")
def test_cuda_node_sockets_named_by_gpu_uuid(model, workdir):
    """What the DaemonSet runs (`--backend auto --devices all`), on every GPU this machine has."""
    import torch

    from weightcache_agent.arena.devices import cuda_devices

    gpus = len(cuda_devices())
    uuids = [d.uuid for d in cuda_devices()]
    node = Node(model, os.path.join(workdir, "cuda"), tp_size=gpus, backend="auto")
    try:
        status = node.wait(lambda s: s["phase"] in ("Ready", "Failed"), "Ready node", timeout=120)
        assert status["phase"] == "Ready", status
        assert status["backend"] == "cuda" and status["gpuUUIDs"] == uuids
        for r, uuid in zip(status["ranks"], uuids):
            assert r["device"] == uuid and r["socket"] == os.path.join(node.socket_dir, f"{uuid}.sock")
            worker = agent_status(r["socket"])
            assert worker["backend"] == "cuda" and worker.get("device", uuid) == uuid
            assert r["bytes"] == worker["bytes"] > 0
        assert torch.cuda.device_count() == gpus
        m = node.metrics()
        assert m["weightcache_rank_ready"][(("device", uuids[0]), ("rank", "0"))] == 1
    finally:
        assert node.stop() == 0, node.log()
    assert [n for n in os.listdir(node.socket_dir) if n.endswith((".sock", ".lock"))] == []
