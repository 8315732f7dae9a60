"""End-to-end failover on a real control plane: from the kill of a primary engine to its Service.

What meets here, all real: the operator (kopf, in this process, with the chart's settings
and its service account's token), the API server, scheduler and controllers (DaemonSet,
EndpointSlice, garbage collector), a node agent (the DaemonSet's pod, run as a local
process, cpu backend, with the token bound to its pod) and the reference engines (the
EngineSet's pods, local processes that attach to the agent). The fake kubelet
(`tests/fake_kubelet.py`) plays node-1: it runs the pods, mirrors their readiness into the
API, restarts a dead container (restartPolicy Always), gives every hostPath volume a
directory of node-1's own and every engine its own loopback port.

How data flows in one trial: SIGKILL of a group's primary engine -> the kernel closes its
lease socket -> the agent promotes the group's standby (socket message, acknowledged) ->
rank 0 makes its one API write, the standby's `weightcache.io/serving=true` -> the
EndpointSlice controller lists the standby as a ready endpoint of the Service. Timed:
kill -> the EndpointSlice event that lists the standby ready (watched; the time is taken
as the event arrives), and kill -> the agent reporting the standby's lease as `primary`
(its socket's `status`, polled every 2 ms). The killed container then restarts, attaches
as the group's standby, and the operator's reconcile moves its stale `serving=true` to
`false`; the next trial on that group waits for all of that. Trials alternate between the
two groups, so one group's restart overlaps the other's trial. Every EndpointSlice change
during the trials is kept: a group must never be left with no ready serving endpoint.

    python bench/failover_e2e_k8s.py --trials 50

starts a control plane with `../shared/k8s` (or reuses WEIGHTCACHE_K8S_LAB), installs the
chart (helm-sdkpy), prints the table and stops everything it started.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for p in (REPO / "tests", REPO / "node_agent", REPO / "operator"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import yaml  # noqa: E402

from fake_kubelet import FakeKubelet  # noqa: E402
from k8s_lab import Lab, free_ports, pods_path, wait_for  # noqa: E402


def _sibling(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


failover_k8s = _sibling("failover_k8s")
SliceWatch = failover_k8s.SliceWatch
percentile = failover_k8s.percentile

NODE = "node-1"
CACHE = "wc"
ENGINESET = "chat"
MODEL_ROOT = "/srv/models"  # the operator's model root: node-1's host path, under the kubelet's root
MODEL = "small"
MODEL_V2 = "small-v2"  # other weights: what a revision rollout moves the cache to
# How often the fake kubelet looks at its pods (process exits, readiness probes). A kubelet
# notices a dead container at its PLEG relist, every second by default, and probes readiness
# every periodSeconds (1 in the template): 1 s models it. A much faster kubelet marks the
# killed pod not ready before the agent's write lands (see bench/RESULTS.md).
KUBELET_PERIOD_S = 1.0
BAR_P99_S = failover_k8s.BAR_P99_S  # the same bar as the write alone, measured from the kill
WC = "/apis/weightcache.io/v1alpha1"
SERVING = "weightcache.io/serving"
AGENT_LABELS = {"app.kubernetes.io/name": "weightcache-agent"}
SMALL_LLAMA = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)


def engine_template(extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """The EngineSet's pod template: the reference engine, attaching from the injected environment.

    The model is the cache's ($WEIGHTCACHE_MODEL, set by the operator): a new revision reaches the
    engines without a template change. The engine listens on the loopback port the kubelet gives the pod (`$(HOST_PORT_HTTP)`):
    every pod of the node shares one loopback here. Readiness is `/readyz?role=any`: a warm
    standby is Ready, so the serving label alone decides what the Service routes to.
    """
    return {"metadata": {"labels": {"app": ENGINESET}}, "spec": {
        "terminationGracePeriodSeconds": 2,
        "containers": [{
            "name": "engine", "image": "ghcr.io/weightcache/agent:0.1.0",
            "command": [sys.executable, "-m", "weightcache_agent", "engine"],
            "args": ["--mode", "client", "--role", "auto", "--host", "127.0.0.1",
                     "--port", "$(HOST_PORT_HTTP)", "--threads", "1", "--drain-seconds", "1", *extra_args],
            "ports": [{"name": "http", "containerPort": 8000}],
            "readinessProbe": {"httpGet": {"path": "/readyz?role=any", "port": "http"}, "periodSeconds": 1},
        }]}}


@dataclass
class Trial:
    group: int
    killed: str
    promoted: str
    endpoint_s: float   # kill -> the EndpointSlice lists the promoted standby as ready
    promotion_s: float  # kill -> the agent holds the standby's lease as primary (when a poll saw it)
    killed_at: float = 0.0  # perf_counter time of the kill
    closed_s: float | None = None  # kill -> the killed engine's lease is gone (the kernel closed its socket)
    # kill -> the last poll that found the standby not yet primary was sent: the promotion came after it.
    # A loaded machine delays the poll's answer (promotion_s), never this bound.
    not_promoted_s: float = 0.0


@dataclass
class Results:
    trials: list[Trial] = field(default_factory=list)
    slice_changes: int = 0  # EndpointSlice states seen during the trials
    # spans in which a group had no ready serving endpoint: (s from the first trial, group, seconds)
    empty_windows: list[tuple[float, int, float]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def endpoint(self) -> list[float]:
        return [t.endpoint_s for t in self.trials]

    @property
    def promotion(self) -> list[float]:
        return [t.promotion_s for t in self.trials]


def group_of(pod: str) -> int:
    """`<engineset>-<group>-<slot>` -> group."""
    return int(pod.rsplit("-", 2)[1])


def operator_runner(lab: Lab, namespace: str, root: Path, config: Any) -> Any:
    """kopf's runner of the operator watching `namespace`, authenticated as the chart's service
    account (every call goes through its RBAC); a context manager, not started yet."""
    from kopf.testing import KopfRunner

    from weightcache_operator.registry import build_registry, build_settings

    token = lab.bound_token("weightcache-system", "weightcache")
    kubeconfig = root / "operator.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "lab", "cluster": {"server": lab.server, "certificate-authority": str(lab.ca_path)}}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "lab", "user": "operator"}}]}))
    registry, _ = build_registry(config, kubeconfig=str(kubeconfig))
    return KopfRunner(["run", "--standalone", "--namespace", namespace], registry=registry, settings=build_settings(),
                      timeout=60)


def sweep(root: Path) -> None:
    """Kill, by pid, any process still running with an argument under `root`: the kubelet kills a
    pod's process group, and an agent's workers run in groups of their own."""
    here = str(root)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if any(a.startswith(here + "/") for a in args):
                os.kill(int(entry.name), signal.SIGKILL)


class EndToEnd:
    """The operator, the fake kubelet of node-1 (agent + engines), a WeightCache and an EngineSet.

    A context manager: on entry everything is created and running (four engine pods, the
    Service's EndpointSlice listing one primary per group); on exit the processes are
    stopped, the resources deleted while the operator still runs (its finalizer), and the
    namespace removed.
    """

    def __init__(self, lab: Lab, *, replicas: int = 2, standbys: int = 1, poll_interval: float = 1.0,
                 probe_interval: float = KUBELET_PERIOD_S) -> None:
        self.lab = lab
        self.api = lab.api
        self.replicas, self.standbys = replicas, standbys
        self.poll_interval = poll_interval
        self.probe_interval = probe_interval
        self.stack = contextlib.ExitStack()
        self.ns = ""
        self.engineset, self.cache, self.node = ENGINESET, CACHE, NODE  # what a subclass may name otherwise
        self.settle_timeout = 60.0  # a killed engine's restart, until its group is whole again

    # -- setup ---------------------------------------------------------------------------

    def __enter__(self) -> EndToEnd:
        try:
            self._start()
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def _start(self) -> None:
        from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

        lab, api = self.lab, self.api
        self.ns = ns = lab.namespace("e2e")
        self.stack.callback(lab.delete_namespace, ns)
        self.root = Path(tempfile.mkdtemp(prefix="wc-e2e-"))  # short: socket paths stay < 108 bytes
        self.stack.callback(shutil.rmtree, self.root, True)
        write_llama_checkpoint(str(self.root / NODE / MODEL_ROOT.lstrip("/") / MODEL), LlamaShape(**SMALL_LLAMA),
                               seed=3)
        write_llama_checkpoint(str(self.root / NODE / MODEL_ROOT.lstrip("/") / MODEL_V2), LlamaShape(**SMALL_LLAMA),
                               seed=4)

        # node-1 alone runs this cache's agent; the engines' runtime class exists.
        lab.kubectl("label", "node", NODE, f"weightcache.io/e2e={ns}", "--overwrite")
        self.stack.callback(lab.kubectl, "label", "node", NODE, "weightcache.io/e2e-", check=False)
        lab.apply({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
                   "handler": "nvidia"})

        # A control key, as the chart gives the operator one: rollouts switch groups over through the agents.
        self._run_node_and_operator(b"end-to-end-control-key-0123456789", self._agent_argv)

        api.create(f"{WC}/namespaces/{ns}/weightcaches", {
            "apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": CACHE},
            "spec": {"model": {"path": MODEL}, "parallelism": {"tensor": 1},
                     "nodeSelector": {"weightcache.io/e2e": ns}}})
        self.create_engineset()
        self.watch = SliceWatch(lab, ns, self.engineset).start()
        self.stack.callback(self.watch.close)
        self.wait_settled(range(self.replicas), timeout=120)

    def create_engineset(self) -> None:
        self.api.create(f"{WC}/namespaces/{self.ns}/enginesets", {
            "apiVersion": "weightcache.io/v1alpha1", "kind": "EngineSet", "metadata": {"name": ENGINESET},
            "spec": {"cacheRef": {"name": CACHE}, "replicas": self.replicas, "standbys": self.standbys,
                     "service": {"port": 8000}, "gpuBinding": {"mode": "visibleDevices"},
                     "template": engine_template()}})

    @staticmethod
    def _agent_argv(pod: dict[str, Any], argv: list[str]) -> list[str]:
        # The cpu backend has no GPUs to count: this agent stands for a node with two, one
        # replica of the (TP 1) cache on each.
        labels = pod["metadata"].get("labels") or {}
        if all(labels.get(k) == v for k, v in AGENT_LABELS.items()):
            return [*argv, "--replicas", "2"]
        return argv

    def _run_node_and_operator(self, control_key: bytes,
                               argv_hook: Callable[[dict[str, Any], list[str]], list[str]]) -> None:
        """The fake kubelet of `self.node` (its agent on a free HTTP port: every fake node shares this
        machine's loopback) and the operator; on exit, in reverse: processes, resources, operator."""
        from weightcache_operator.config import OperatorConfig
        from weightcache_operator.controller.weightcache import manifests

        old_port = manifests.AGENT_HTTP_PORT
        manifests.AGENT_HTTP_PORT, = free_ports(1)
        self.stack.callback(setattr, manifests, "AGENT_HTTP_PORT", old_port)
        (self.root / "logs").mkdir()
        self.kubelet = FakeKubelet(self.lab, [self.node], namespace=self.ns, host_root=self.root,
                                   loopback_labels=AGENT_LABELS, argv_hook=argv_hook,
                                   probe_interval=self.probe_interval, log_dir=self.root / "logs", kill_timeout=3.0)
        config = OperatorConfig(model_root=MODEL_ROOT, poll_interval=self.poll_interval, agent_http_timeout=1.0,
                                control_key=control_key)
        self.runner = operator_runner(self.lab, self.ns, self.root, config)
        self.runner.__enter__()
        self.stack.callback(self._stop_operator)
        self.stack.callback(self._delete_resources)  # runs before the operator stops
        self.stack.callback(sweep, self.root)         # what outlived its pod (an agent's workers)
        self.kubelet.start()
        self.stack.callback(self.kubelet.stop)        # and first of all: the processes

    def _delete_resources(self) -> None:
        for plural, name in (("enginesets", self.engineset), ("weightcaches", self.cache)):
            self.api.delete(f"{WC}/namespaces/{self.ns}/{plural}/{name}")
        for plural, name in (("enginesets", self.engineset), ("weightcaches", self.cache)):
            with contextlib.suppress(TimeoutError):
                wait_for(lambda p=plural, n=name: self.api.get_or_none(f"{WC}/namespaces/{self.ns}/{p}/{n}") is None,
                         timeout=20, what=f"{plural}/{name} gone")

    def _stop_operator(self) -> None:
        self.runner.__exit__(None, None, None)

    # -- what the trials read ------------------------------------------------------------

    def pods(self) -> list[dict[str, Any]]:
        return self.api.get(pods_path(self.ns), labelSelector=f"weightcache.io/engineset={self.engineset}")["items"]

    def socket_path(self, device: str) -> str:
        from weightcache_operator.controller.weightcache.manifests import socket_dir

        return str(self.kubelet.host_path(self.node, socket_dir(self.ns, self.cache)) / f"{device}.sock")

    def leases(self, device: str) -> dict[str, str]:
        """pod name -> role, as the agent's worker for `device` holds them."""
        from weightcache_agent.protocol import agent_status

        try:
            status = agent_status(self.socket_path(device), timeout=2)
        except (OSError, ValueError):
            return {}
        return {c["pod"]["name"]: c["role"] for c in status.get("clients") or [] if c.get("pod")}

    def settled(self, group: int) -> tuple[str, str, str] | None:
        """(primary, standby, device) once the group is whole: both pods Ready, the agent holds one as
        primary and one as standby, the labels say so, and the EndpointSlice lists the primary only."""
        pods = [p for p in self.pods() if p["metadata"]["labels"].get("weightcache.io/group") == str(group)
                and not p["metadata"].get("deletionTimestamp")]
        if len(pods) < 1 + self.standbys:
            return None
        if not all(any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions") or [])
                   for p in pods):
            return None
        device = pods[0]["metadata"].get("annotations", {}).get("weightcache.io/gpus", "")
        roles = self.leases(device)
        primary = [p["metadata"]["name"] for p in pods if roles.get(p["metadata"]["name"]) == "primary"]
        standby = [p["metadata"]["name"] for p in pods if roles.get(p["metadata"]["name"]) == "standby"]
        if len(primary) != 1 or len(standby) + 1 != len(pods):
            return None
        labels = {p["metadata"]["name"]: p["metadata"]["labels"].get(SERVING) for p in pods}
        if labels[primary[0]] != "true" or any(labels[s] != "false" for s in standby):
            return None
        ready = {n for n in self.watch.current() if group_of(n) == group}
        if ready != {primary[0]}:
            return None
        return primary[0], standby[0], device

    def wait_settled(self, groups: Any, timeout: float = 60) -> dict[int, tuple[str, str, str]]:
        return {g: wait_for(lambda g=g: self.settled(g), timeout=timeout, interval=0.05, what=f"group {g} settled")
                for g in groups}

    # -- the trials ----------------------------------------------------------------------

    def kill_and_time(self, group: int) -> Trial:
        """SIGKILL the group's primary; time the agent's promotion and the EndpointSlice."""
        from weightcache_agent.protocol import agent_status

        primary, standby, device = self.wait_settled([group], timeout=self.settle_timeout)[group]
        sock = self.socket_path(device)
        seen: list[float] = []
        closed: list[float] = []
        not_yet = [0.0]  # when the last poll that found the standby not primary was sent
        go = threading.Event()
        t0 = [0.0]

        def poll() -> None:
            go.set()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                sent = time.perf_counter()
                try:
                    clients = [c for c in agent_status(sock, timeout=1).get("clients") or [] if c.get("pod")]
                except (OSError, ValueError):
                    clients = []
                now = time.perf_counter()
                if t0[0] and clients:
                    if any(c["pod"].get("name") == standby and c.get("role") == "primary" for c in clients):
                        seen.append(now)
                        closed.append(now)  # the killed lease went at the latest now (also when unseen)
                        return
                    not_yet[0] = sent
                    if not closed and all(c["pod"].get("name") != primary for c in clients):
                        closed.append(now)
                time.sleep(0.002)

        poller = threading.Thread(target=poll, name="promotion-poll", daemon=True)
        poller.start()
        go.wait()
        t0[0] = time.perf_counter()
        self.kubelet.kill(self.ns, primary)
        t_ep = self.watch.wait_until(lambda eps: standby in eps, since=t0[0], timeout=10)
        poller.join(timeout=10)
        if not seen:
            raise TimeoutError(f"the agent never reported {standby} primary")
        return Trial(group, primary, standby, t_ep - t0[0], seen[0] - t0[0], t0[0], closed[0] - t0[0],
                     max(not_yet[0] - t0[0], 0.0))

    def measure(self, trials: int, *, warmup: int = 2, progress: bool = False) -> Results:
        """`warmup` + `trials` failovers, alternating between the groups; the EndpointSlice checked
        for groups without a ready serving endpoint over the counted trials."""
        results = Results()
        start = 0.0
        for i in range(-warmup, trials):
            if i == 0:
                start = time.perf_counter()
                results = Results()
            trial = self.kill_and_time(i % self.replicas)
            if i >= 0:
                results.trials.append(trial)
            if progress and i >= 0 and (i + 1) % 10 == 0:
                print(f"  {i + 1}/{trials} trials", file=sys.stderr)
        self.wait_settled(range(self.replicas), timeout=self.settle_timeout)
        results.wall_s = time.perf_counter() - start
        results.slice_changes, results.empty_windows = self.empty_windows(start)
        return results

    def empty_windows(self, since: float) -> tuple[int, list[tuple[float, int, float]]]:
        """The EndpointSlice states from `since` on (the one in force then included), and the spans
        in which a group had no ready serving endpoint: (start s after `since`, group, seconds)."""
        history = list(self.watch.history)
        before = [h for h in history if h[0] < since]
        states = ([(since, before[-1][1])] if before else []) + [h for h in history if h[0] >= since]
        windows = []
        for g in range(self.replicas):
            empty_since = None
            for t, eps in states:
                has = any(group_of(n) == g for n in eps)
                if not has and empty_since is None:
                    empty_since = t
                elif has and empty_since is not None:
                    windows.append((empty_since - since, g, t - empty_since))
                    empty_since = None
            if empty_since is not None:
                windows.append((empty_since - since, g, time.perf_counter() - empty_since))
        return len(states), sorted(windows)


@dataclass
class Rollout:
    seconds: float
    old_serving: dict[int, str]   # group -> pod serving before
    new_serving: dict[int, str]   # group -> pod serving after
    hashes: dict[str, str]        # pod -> template hash, at the end
    template_hash: str            # the EngineSet's current one
    slice_changes: int
    empty_windows: list[tuple[float, int, float]]


def _wait_rollout(e2e: EndToEnd, complete: Any, timeout: float) -> dict[str, Any]:
    try:
        return wait_for(complete, timeout=timeout, interval=0.2, what="the rollout complete")
    except TimeoutError as e:
        status = e2e.api.get(f"{WC}/namespaces/{e2e.ns}/enginesets/{e2e.engineset}").get("status") or {}
        pods = {p["metadata"]["name"]: p["metadata"]["labels"].get("weightcache.io/template-hash") for p in e2e.pods()}
        raise TimeoutError(f"{e}; rollout status {status.get('rollout')}; pods {pods}") from None


def _roll(e2e: EndToEnd, change: Callable[[], Callable[[dict[str, Any]], bool]], timeout: float) -> Rollout:
    """Make `change` (it returns what says the EngineSet's status saw it) and wait for the rollout
    to complete: phase Complete, every live pod on its template hash, every group settled."""
    settled = e2e.wait_settled(range(e2e.replicas), timeout=60)
    old_serving = {g: v[0] for g, v in settled.items()}
    path = f"{WC}/namespaces/{e2e.ns}/enginesets/{e2e.engineset}"
    start = time.perf_counter()
    seen = change()

    def complete() -> dict[str, Any] | None:
        status = e2e.api.get(path).get("status") or {}
        rollout = status.get("rollout") or {}
        if rollout.get("phase") != "Complete" or not seen(status):
            return None
        pods = [p for p in e2e.pods() if not p["metadata"].get("deletionTimestamp")]
        hashes = {p["metadata"]["name"]: p["metadata"]["labels"].get("weightcache.io/template-hash") for p in pods}
        if set(hashes.values()) != {rollout.get("templateHash")}:
            return None
        return {"hashes": hashes, "hash": rollout["templateHash"]}

    done = _wait_rollout(e2e, complete, timeout)
    after = e2e.wait_settled(range(e2e.replicas), timeout=60)
    seconds = time.perf_counter() - start
    changes, windows = e2e.empty_windows(start)
    return Rollout(seconds, old_serving, {g: v[0] for g, v in after.items()}, done["hashes"], done["hash"],
                   changes, windows)


def roll_template(e2e: EndToEnd, extra_args: tuple[str, ...], timeout: float = 240) -> Rollout:
    """Change the EngineSet's template and wait for the rollout to complete with every group settled."""
    def change() -> Callable[[dict[str, Any]], bool]:
        es = e2e.api.patch(f"{WC}/namespaces/{e2e.ns}/enginesets/{e2e.engineset}",
                           {"spec": {"template": engine_template(extra_args)}})
        return lambda status: status.get("observedGeneration") == es["metadata"]["generation"]

    return _roll(e2e, change, timeout)


def roll_model(e2e: EndToEnd, path: str, revision: str, timeout: float = 240) -> Rollout:
    """Move the WeightCache to another model directory and revision, and wait for the EngineSet's
    rollout to complete: the agent DaemonSet rolls (its new pod loads the new weights while the old
    engines keep serving the old ones they map), then every group switches to pods attached to it."""
    def change() -> Callable[[dict[str, Any]], bool]:
        es = e2e.api.get(f"{WC}/namespaces/{e2e.ns}/enginesets/{e2e.engineset}")
        old_hash = ((es.get("status") or {}).get("rollout") or {}).get("templateHash")
        e2e.api.patch(f"{WC}/namespaces/{e2e.ns}/weightcaches/{e2e.cache}",
                      {"spec": {"model": {"path": path, "revision": revision}}})
        return lambda status: status["rollout"].get("templateHash") not in (None, old_hash)

    return _roll(e2e, change, timeout)


def switchover_by_annotation(e2e: EndToEnd, group: int, timeout: float = 30) -> tuple[str, str, float]:
    """`kubectl annotate engineset ... weightcache.io/switchover-to=<standby>`: (old, new, seconds
    from the annotation to the EndpointSlice listing the standby alone)."""
    primary, standby, _ = e2e.wait_settled([group], timeout=60)[group]
    start = time.perf_counter()
    e2e.lab.kubectl("annotate", "-n", e2e.ns, f"engineset/{e2e.engineset}", f"weightcache.io/switchover-to={standby}")
    wait_for(lambda: {n for n in e2e.watch.current() if group_of(n) == group} == {standby},
             timeout=timeout, interval=0.01, what=f"the EndpointSlice listing {standby} alone")
    return primary, standby, time.perf_counter() - start


def table(r: Results) -> str:
    def ms(x: float) -> str:
        return f"{x * 1000:7.1f}"
    lines = [f"{'kill of a primary ->':<44} {'trials':>6} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'mean ms':>7}"]
    for name, v in (("EndpointSlice lists the standby ready", r.endpoint),
                    ("agent holds the standby as primary", r.promotion),
                    ("(difference: label write -> EndpointSlice)",
                     [t.endpoint_s - t.promotion_s for t in r.trials])):
        lines.append(f"{name:<44} {len(v):>6} {ms(statistics.median(v))} {ms(percentile(v, 99))} "
                     f"{ms(max(v))} {ms(statistics.fmean(v))}")
    slowest = max(r.trials, key=lambda t: t.endpoint_s)
    lines.append(f"slowest: group {slowest.group}, {slowest.killed} -> {slowest.promoted}, "
                 f"{slowest.endpoint_s * 1000:.1f} ms (promotion {slowest.promotion_s * 1000:.1f} ms)")
    longest = max((w[2] for w in r.empty_windows), default=0.0)
    lines.append(f"EndpointSlice states during the trials: {r.slice_changes}; spans with a group lacking a ready "
                 f"serving endpoint: {len(r.empty_windows)} (longest {longest * 1000:.1f} ms); "
                 f"trials took {r.wall_s:.0f} s")
    lines.append(failover_k8s.verdict("kill -> EndpointSlice", percentile(r.endpoint, 99)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=2, help="failovers run first and not counted")
    ap.add_argument("--kubelet-period", type=float, default=KUBELET_PERIOD_S,
                    help="seconds between the fake kubelet's looks at its pods (exits, readiness)")
    args = ap.parse_args(argv)
    from k8s_lab import install_or_upgrade_chart, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"no Kubernetes control plane: {reason}", file=sys.stderr)
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "node_agent"), str(REPO / "operator")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    t = time.monotonic()
    lab = Lab.start(("node-1",))
    try:
        print(f"control plane up in {time.monotonic() - t:.0f}s ({lab.server})", file=sys.stderr)
        install_or_upgrade_chart(lab)
        lab.kubectl("-n", "weightcache-system", "scale", "deployment", "--all", "--replicas=0")
        with EndToEnd(lab, probe_interval=args.kubelet_period) as e2e:
            print(f"four engine pods, two groups, settled after {time.monotonic() - t:.0f}s", file=sys.stderr)
            results = e2e.measure(args.trials, warmup=args.warmup, progress=True)
        print(f"fake kubelet period {args.kubelet_period:g} s")
        print(table(results))
    finally:
        lab.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
