"""Rolling upgrades end to end on one node, cpu backend: real node agents, real engines,
the operator's rollout planner driving them, and a client that never stops sending.

What the operator does through the Kubernetes API, a small executor does here with the
same decisions (`weightcache_operator.controller.engineset.rollout`) and the same node-side
calls: an engine "pod" is a `weightcache engine` process with the environment the operator
injects; a switchover is `POST /switchover` on the node supervisor with the control token;
retiring a pod is SIGTERM (the engine finishes what is in flight). The client routes each request
to the group's primary as the agents say it is (what the serving label tells the Service).

Two rollouts across three groups, one after the other:
(a) a new engine template (a different flag), standbys 1;
(b) a new model revision (other weights, served by a second agent beside the first).
Bars: no failed request, each group answered by the old weights until its switch and by
the new ones after, every group always has a primary, switch time p99 <= 1 s, and the
old revision's agent holds no engine once the rollout is done, and once it goes no process
holds the old arena (its memory is back).
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from agent_fixtures import wait_for
from engine_fixtures import SMALL_LLAMA, short_run_dir
from weightcache_agent import agent_status
from weightcache_agent.errors import WeightCacheError
from weightcache_agent.serve.process_group import EngineChild, http_json
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint
from weightcache_operator.controller.engineset.rollout import EnginePod, Target, plan_rollout

TOKEN = "rolling-upgrade-control-token"
GROUPS = 3
PROMPT = [1, 17, 42, 255, 3]


class Node:
    """One node supervisor (`weightcache agent --socket-dir`) serving one revision."""

    def __init__(self, run_dir: str, name: str, model: str, revision: str):
        self.revision, self.model = revision, model
        self.socket_dir = os.path.join(run_dir, name)
        port_file, token_file = os.path.join(run_dir, f"{name}.port"), os.path.join(run_dir, f"{name}.token")
        with open(token_file, "w") as f:
            f.write(TOKEN)
        self.log = open(os.path.join(run_dir, f"{name}.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket-dir", self.socket_dir,
             "--backend", "cpu", "--revision", revision, "--http-port", "0", "--http-host", "127.0.0.1",
             "--port-file", port_file, "--control-token-file", token_file],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(lambda: os.path.exists(port_file), 60, f"{name}'s HTTP port")
        self.port = int(open(port_file).read())
        wait_for(lambda: self.http("GET", "/status")[1].get("phase") == "Ready", 60, f"{name} ready")
        self.socket = os.path.join(self.socket_dir, "cpu-0.sock")

    def http(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        response = conn.getresponse()
        answer = response.status, json.loads(response.read())
        conn.close()
        return answer

    def leases(self) -> list[dict]:
        """The agent's live truth (its socket), not the supervisor's periodic snapshot."""
        try:
            return agent_status(self.socket)["clients"]
        except WeightCacheError:
            return []

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        self.log.close()


@dataclasses.dataclass
class Pod:
    name: str
    group: int
    slot: int
    target: Target
    node: Node
    engine: EngineChild
    created: float = dataclasses.field(default_factory=time.monotonic)


class LocalCluster:
    """Pods as engine processes, and the rollout executor acting on them."""

    def __init__(self, run_dir: str, templates: dict[str, list[str]]):
        self.run_dir, self.templates = run_dir, templates
        self.nodes: dict[str, Node] = {}
        self.pods: dict[str, Pod] = {}
        self.lock = threading.Lock()
        self.switches: list[tuple[int, float, float]] = []  # (group, ack time, seconds)
        self.counter = 0

    def create(self, group: int, slot: int, target: Target, role: str = "auto") -> Pod:
        self.counter += 1
        name = f"chat-{group}-{slot}-{self.counter}"  # unique: a retired pod's name is not reused here
        node = self.nodes[target.revision]
        env = {"WEIGHTCACHE_SOCKET_DIR": node.socket_dir, "WEIGHTCACHE_DEVICES": "cpu-0",
               "WEIGHTCACHE_GROUP": f"ns/chat-{group}", "WEIGHTCACHE_POD_NAMESPACE": "ns",
               "WEIGHTCACHE_POD_NAME": name, "WEIGHTCACHE_POD_UID": f"uid-{name}"}
        engine = EngineChild(node.model, self.run_dir, name, role=role, group=f"ns/chat-{group}",
                             extra=self.templates[target.template_hash], env=env)
        pod = Pod(name, group, slot, target, node, engine)
        with self.lock:
            self.pods[name] = pod
        return pod

    def roles(self) -> dict[str, str]:
        out = {}
        for node in list(self.nodes.values()):  # the client's thread reads while the test adds a revision's node
            for lease in node.leases():
                if lease.get("pod"):
                    out[lease["pod"]["name"]] = lease["role"]
        return out

    def observe(self) -> list[list[EnginePod]]:
        roles = self.roles()
        groups: list[list[EnginePod]] = [[] for _ in range(GROUPS)]
        now = time.monotonic()
        with self.lock:
            pods = list(self.pods.values())
        for pod in pods:
            failed = None if pod.engine.alive() else f"exited: {pod.engine.log_tail(3)}"
            role = roles.get(pod.name)
            groups[pod.group].append(EnginePod(pod.name, pod.slot, pod.target.template_hash, pod.target.revision,
                                               role=role, ready=role is not None and self.warm(pod),
                                               serving=role == "primary", failed=failed, age=now - pod.created))
        return groups

    @staticmethod
    def warm(pod: Pod) -> bool:
        """The pod's readiness: attached and warmed up (what its readiness probe tells the kubelet)."""
        if not os.path.exists(pod.engine.port_file):
            return False
        try:
            code, body = pod.engine.get("/healthz", timeout=5)
        except OSError:
            return False
        return code == 200 and body.get("state") == "serving"

    def primary(self, group: int, prefer_revision: str | None = None) -> Pod | None:
        roles = self.roles()
        with self.lock:
            candidates = [p for p in self.pods.values() if p.group == group and roles.get(p.name) == "primary"]
        candidates.sort(key=lambda p: p.target.revision != prefer_revision)
        return candidates[0] if candidates else None

    def switchover(self, group: int, to: Pod) -> None:
        started = time.perf_counter()
        code, body = to.node.http("POST", "/switchover", {"group": f"ns/chat-{group}", "toPod": to.name})
        assert code == 200 and body["ok"], body
        for node in list(self.nodes.values()):  # a new revision's agent took over: the old one only demotes
            if node is not to.node and any(l["group"] == f"ns/chat-{group}" and l["role"] == "primary"
                                           for l in node.leases()):
                code, body = node.http("POST", "/switchover", {"group": f"ns/chat-{group}", "toPod": None})
                assert code == 200 and body["ok"], body
        self.switches.append((group, time.monotonic(), time.perf_counter() - started))

    def retire(self, name: str) -> None:
        with self.lock:
            pod = self.pods.pop(name)
        pod.engine.kill(signal.SIGTERM)  # finishes what is in flight, then exits
        threading.Thread(target=pod.engine.stop, daemon=True).start()

    def roll(self, target: Target, standbys: int, deadline: float = 240.0) -> None:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            steps = plan_rollout(self.observe(), target, standbys, progress_deadline=120)
            if steps != getattr(self, "_last", None):
                print(f"{time.monotonic():.2f} {[(s.kind, s.group, s.pod or s.slot) for s in steps]}", flush=True)
                self._last = steps
            if all(s.kind == "done" for s in steps) and len(steps) == GROUPS:
                return
            for step in steps:
                assert step.kind != "stalled", step.reason
                if step.kind == "create":
                    self.create(step.group, step.slot, target, step.role)
                elif step.kind == "switchover":
                    self.switchover(step.group, self.pods[step.pod])
                elif step.kind == "retire":
                    self.retire(step.pod)
            time.sleep(0.05)
        raise AssertionError(f"rollout to {target} not done in {deadline:.0f}s: {steps}")


class Client:
    """Sends requests in a loop, each to its group's primary; records every answer."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.records: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            group = i % GROUPS
            i += 1
            started = time.monotonic()
            pod = self.cluster.primary(group, prefer_revision=self.prefer)
            if pod is None:
                self.records.append({"group": group, "ok": False, "why": "no primary", "start": started})
                continue
            try:
                code, body = http_json("POST", f"{pod.engine.url}/generate", {"tokens": PROMPT, "max_tokens": 2},
                                       timeout=30)
                ok = code == 200
            except OSError as e:
                code, body, ok = None, {"error": str(e)}, False
            self.records.append({"group": group, "ok": ok, "code": code, "start": started, "pod": pod.name,
                                 "fingerprint": body.get("fingerprint"), "error": body.get("error")})
            time.sleep(0.01)  # a steady stream, leaving the 2-core CI machine room to start engines

    prefer: str | None = None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("revisions")
    shape = LlamaShape(**SMALL_LLAMA)
    return {"r1": write_llama_checkpoint(str(root / "r1"), shape, seed=1),
            "r2": write_llama_checkpoint(str(root / "r2"), shape, seed=7)}


@pytest.fixture(scope="module")
def cluster(checkpoints):
    run_dir = short_run_dir()
    cluster = LocalCluster(run_dir, {"tA": ["--max-new-tokens", "64"], "tB": ["--max-new-tokens", "128"]})
    try:
        cluster.nodes["r1"] = Node(run_dir, "n1", checkpoints["r1"], "r1")
        yield cluster
    finally:
        for name in list(cluster.pods):
            cluster.retire(name)
        for node in cluster.nodes.values():
            node.stop()


def fingerprints(cluster: LocalCluster) -> dict[str, str]:
    return {rev: agent_status(node.socket)["fingerprint"] for rev, node in cluster.nodes.items()}


def check_traffic(records: list[dict], switches: list[tuple[int, float, float]], old: str, new: str) -> None:
    failed = [r for r in records if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(records)} requests failed, e.g. {failed[:3]}"
    for group in range(GROUPS):
        mine = [r for r in records if r["group"] == group]
        acked = [t for g, t, _ in switches if g == group]
        assert acked, f"group {group} never switched"
        before = [r for r in mine if r["start"] < acked[0] - 0.5]
        after = [r for r in mine if r["start"] > acked[-1]]
        assert before and after, f"group {group}: traffic on both sides of its switch"
        assert {r["fingerprint"] for r in before} == {old}
        assert {r["fingerprint"] for r in after} == {new}, f"group {group}: old weights after the switch"


def arena_inode(pid: int) -> tuple[int, int]:
    """(device, inode) of the memfd arena the agent process `pid` holds."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path).startswith("/memfd:weightcache:"):
                st = os.stat(path)
                return st.st_dev, st.st_ino
        except FileNotFoundError:  # a connection the agent closed meanwhile
            continue
    raise AssertionError(f"agent {pid} holds no arena")


def holders(arena: tuple[int, int]) -> list[int]:
    """Processes with the arena open or mapped (the kernel frees a memfd when this is empty)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = []
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    fds.append(os.stat(f"/proc/{pid}/fd/{fd}"))
                except FileNotFoundError:  # closed meanwhile: the process itself is still looked at
                    pass
            with open(f"/proc/{pid}/maps") as f:
                mapped = [line.split() for line in f if "memfd:weightcache" in line]
        except OSError:  # the process gone meanwhile, or not ours to read
            continue
        if any((st.st_dev, st.st_ino) == arena for st in fds) or any(int(m[4]) == arena[1] for m in mapped):
            found.append(int(pid))
    return found


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_template_then_revision_rollout_without_a_failed_request(cluster, checkpoints, capsys, time_bar):
    initial = Target("tA", "r1")
    for group in range(GROUPS):
        for slot in range(2):
            cluster.create(group, slot, initial)
    wait_for(lambda: all(len([p for p in g if p.ready]) == 2 for g in cluster.observe()), 120, "initial groups")
    client = Client(cluster)
    client.thread.start()
    try:
        time.sleep(1.0)
        # (a) a new template: same weights, so every answer has the same fingerprint; what
        # changes is which engine answers, and none may fail.
        cluster.roll(Target("tB", "r1"), standbys=1)
        template_switches = list(cluster.switches)
        time.sleep(0.5)
        assert all(p.target.template_hash == "tB" for p in cluster.pods.values())

        # (b) a new revision: its agent loads beside the old one, which keeps serving.
        cluster.nodes["r2"] = Node(cluster.run_dir, "n2", checkpoints["r2"], "r2")
        old_fp, new_fp = fingerprints(cluster)["r1"], fingerprints(cluster)["r2"]
        assert old_fp != new_fp
        mark = len(client.records)
        cluster.switches.clear()
        client.prefer = "r2"
        cluster.roll(Target("tB", "r2"), standbys=1)
        time.sleep(1.0)
    finally:
        client.stop.set()
        client.thread.join(60)
    revision_switches = list(cluster.switches)
    records = client.records
    assert not [r for r in records if not r["ok"]], [r for r in records if not r["ok"]][:3]
    check_traffic(records[mark:], revision_switches, old_fp, new_fp)
    wait_for(lambda: cluster.nodes["r1"].leases() == [], 30, "the old revision's agent without engines")
    # Its DaemonSet pod goes (here: SIGTERM, as the kubelet sends): then no process holds the old
    # arena any more, so the kernel has freed it -- the memory of a whole copy is back.
    old_arena = arena_inode(agent_status(cluster.nodes["r1"].socket)["pid"])
    cluster.nodes.pop("r1").stop()
    assert holders(old_arena) == [], "processes still map or hold the old revision's arena"

    seconds = [s for _, _, s in template_switches + revision_switches]
    time_bar("a rolling upgrade's engine switch, p99", p99(seconds), 1.0, inclusive=True)
    with capsys.disabled():
        print(f"\nrolling upgrades, {GROUPS} groups: {len(records)} requests, 0 failed; switch p50 "
              f"{sorted(seconds)[len(seconds) // 2] * 1e3:.1f} ms, p99 {p99(seconds) * 1e3:.1f} ms "
              f"({len(template_switches)} template + {len(revision_switches)} revision switches)")
