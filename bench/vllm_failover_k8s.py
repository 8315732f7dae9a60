"""vLLM engines in an EngineSet on a real control plane: failover and a rolling upgrade under OpenAI traffic.

What runs, all real: examples/engineset-vllm.yaml applied as shipped (a WeightCache with vLLM's
layout, an EngineSet of two groups, each a vLLM primary and a vLLM standby on one GPU), the
operator (kopf, in this process, as the chart's service account), the API server, scheduler
and controllers (DaemonSet, EndpointSlice, DRA allocation), the node agent and the vLLM
OpenAI servers (`--load-format weightcache`), run by the fake kubelet as local processes with
vLLM's CPU build. What differs from a GPU node, and why: the model is a small synthetic Qwen2
(with a word-level tokenizer) where the example names Qwen2-7B; the node's "GPUs" are the cpu
backend's devices, published as a DRA driver would; the engine's `--port 8000` is a free
loopback port (pods share one loopback here); vLLM's CPU build sizes its KV cache from
`VLLM_CPU_KVCACHE_SPACE` (set in the node's environment: the example's
`--gpu-memory-utilization 0.45` would be 45% of host memory per engine on CPU) and refuses
`--enable-sleep-mode`, a CUDA allocator's feature, which is dropped from the command: on CPU
a standby releases its KV cache without it; the engines run `--enforce-eager`: vLLM's CPU
build traces the model with torch.compile at every start (45 s of a core per engine here, its
saved artifact failing to load again in vLLM-CPU 0.32), which is not what this measures; and
the model runs in the engine-core process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), as vLLM runs a
one-GPU engine, where its CPU build would start a worker process of its own (one more vLLM
import per engine, some 10 s of a core here).

The client: one thread sends OpenAI completions, one every 200 ms, alternating between the
groups, each to the group's engine the Service's EndpointSlice lists (pod -> its loopback
port). A request that fails (connection refused or reset, a 5xx) is retried once on another
engine of its group, as soon as the EndpointSlice lists one (at most 2 s later); it counts as
failed only if the retry fails too.

A trial: SIGKILL of a group's primary pod (its API server, engine core and worker) -> the
agent promotes the standby (whose worker first takes its KV cache back) -> the serving label
moves -> the EndpointSlice lists it. Timed from the kill: the killed engine's lease ending
(the kernel closes a dying process's socket once it has unmapped its memory), the agent holding
the standby as primary, the EndpointSlice, and the first completion answered by the promoted
engine. The killed pod restarts (vLLM's own start, minutes on this machine beside three other
engines) and attaches as the group's standby; trials alternate between the groups. Then a
template change (a vLLM flag) rolls both groups, make before break, under the same traffic
(`--trials 0`: the rollout alone).

    WEIGHTCACHE_VLLM_PYTHON=$(tests/vllm_venv.sh) python bench/vllm_failover_k8s.py --trials 20

starts a control plane (../shared/k8s, or $KUBEBUILDER_ASSETS), installs the chart, prints
the tables and stops what it started.
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for p in (REPO / "bench", REPO / "tests", REPO / "node_agent", REPO / "operator"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import failover_e2e_k8s as e2e_bench  # noqa: E402
from k8s_lab import Lab  # noqa: E402

EXAMPLE = REPO / "examples" / "engineset-vllm.yaml"
NS, ENGINESET, CACHE = "default", "chat-vllm", "qwen-7b-vllm"  # what the example names
SERVED_MODEL = "qwen2-7b-instruct"
NODE = "node-vllm"
MODEL_ROOT = "/srv/models"
CPU_DEVICES = ["cpu-0", "cpu-1"]
KV_CACHE_GIB = 1
BAR_P99_S = 1.0  # kill -> the EndpointSlice lists the promoted standby, p99, on CPU
RETRY_WAIT_S = 2.0  # the longest a failed request waits for the Service to move before its one retry
PACE_S = 0.2  # between two completions: steady traffic that leaves this small machine's cores to the engines
PROMPT = [11, 12, 13, 14, 15]  # token ids, the OpenAI API's array form (transformers reads the synthetic
# word-level tokenizer of a Qwen2 checkpoint with Qwen2's own pre-tokenizer, which finds no words in text)


def vllm_environment(kv_cache_gib: int = KV_CACHE_GIB) -> dict[str, str]:
    """What a CPU node's environment gives vLLM's processes here (see the module docstring)."""
    # nobind: vLLM would pin every engine's threads to the same first core of this small machine
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


class VllmExample(e2e_bench.EndToEnd):
    """examples/engineset-vllm.yaml served on `NODE`, with the trials and rollouts of `EndToEnd`."""

    def __init__(self, lab: Lab, vllm_python: str, *, kv_cache_gib: int = KV_CACHE_GIB,
                 settle_timeout: float = 600.0) -> None:
        super().__init__(lab, replicas=2, standbys=1)
        self.vllm_python, self.kv_cache_gib = vllm_python, kv_cache_gib
        self.engineset, self.cache, self.node = ENGINESET, CACHE, NODE
        self.settle_timeout = settle_timeout

    def _start(self) -> None:
        from weightcache_agent.testing.synthetic import qwen2_shape, write_llama_checkpoint, write_word_tokenizer

        lab = self.lab
        self.ns = NS
        self.root = Path(tempfile.mkdtemp(prefix="wc-vl-"))  # short: socket paths stay < 108 bytes
        self.stack.callback(shutil.rmtree, self.root, True)
        model = self.root / NODE / MODEL_ROOT.lstrip("/") / "Qwen" / "Qwen2-7B-Instruct"
        shape = qwen2_shape(tie_word_embeddings=True)
        write_llama_checkpoint(str(model), shape)
        write_word_tokenizer(str(model), shape.vocab_size)

        lab.add_node(NODE)
        # what the chart's node selector and GPU feature discovery put on a node with eight GPUs
        lab.kubectl("label", "node", NODE, "weightcache=enabled", "nvidia.com/gpu.count=8", "--overwrite")
        self.stack.callback(lab.kubectl, "label", "node", NODE, "weightcache-", "nvidia.com/gpu.count-", check=False)
        lab.ensure_device_class()
        self.stack.callback(lab.kubectl, "delete", "resourceslice", lab.publish_gpus(NODE, CPU_DEVICES),
                            "--ignore-not-found", check=False)
        self._run_node_and_operator(b"vllm-example-control-key-0123456789", self._argv)

        text = EXAMPLE.read_text()
        assert text.count('"--port", "8000"') == 1
        lab.kubectl("apply", "-f", "-", input=text.replace('"--port", "8000"', '"--port", "$(HOST_PORT_HTTP)"'))
        self.watch = e2e_bench.SliceWatch(lab, NS, ENGINESET).start()
        self.stack.callback(self.watch.close)
        try:
            self.wait_settled(range(self.replicas), timeout=self.settle_timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; logs:\n{self.logs()}") from None

    def _argv(self, pod: dict[str, Any], argv: list[str]) -> list[str]:
        labels = pod["metadata"].get("labels") or {}
        if all(labels.get(k) == v for k, v in e2e_bench.AGENT_LABELS.items()):
            return [*argv, "--replicas", str(len(CPU_DEVICES))]  # the cpu backend has no GPUs to count
        if argv[:2] == ["vllm", "serve"]:
            # vLLM's own environment; its working directory outside the checkout, whose build metadata
            # would stand in for the installed package's entry points. vLLM's CPU build's `vllm` command
            # fails at start (it looks up the distribution `vllm`): its server module, the model as --model.
            env = [f"{k}={v}" for k, v in vllm_environment(self.kv_cache_gib).items()]
            args = ["-m", "vllm.entrypoints.openai.api_server", "--model",
                    *[a for a in argv[2:] if a != "--enable-sleep-mode"], "--enforce-eager"]
            return ["env", "-u", "PYTHONPATH", "-C", str(self.root), *env, self.vllm_python, *args]
        return argv

    def logs(self, chars: int = 2500) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}"
                         for p in sorted((self.root / "logs").iterdir()) if p.is_file())

    def pod_states(self) -> dict[str, str]:
        """pod -> `ready=<bool> serving=<label> restarts=<n>`, for a message."""
        out = {}
        for p in self.pods():
            ready = any(c["type"] == "Ready" and c["status"] == "True"
                        for c in p.get("status", {}).get("conditions") or [])
            restarts = ((p["status"].get("containerStatuses") or [{}])[0]).get("restartCount", 0)
            out[p["metadata"]["name"]] = (f"ready={ready} serving={p['metadata']['labels'].get(e2e_bench.SERVING)} "
                                          f"restarts={restarts}")
        return out

    def all_leases(self) -> dict[str, dict[str, str]]:
        return {device: self.leases(device) for device in CPU_DEVICES}

    def port_of(self, pod: str) -> int | None:
        run = self.kubelet.run_of(NS, pod)
        return run.host_ports.get(8000) if run is not None else None

    def worker_memory(self, pod: str) -> dict[str, int]:
        """RssAnon / RssShmem (bytes) of the pod's process holding the KV cache: vLLM's worker, or its
        engine core where the model runs there."""
        run = self.kubelet.run_of(NS, pod)
        if run is None or run.proc is None:
            return {}
        statuses = [_proc_status(pid) for pid in _descendants(run.proc.pid)]
        for name in ("VLLM::Worker", "VLLM::EngineCo"):  # /proc keeps 15 characters of a name
            for status in statuses:
                if status.get("Name", "").startswith(name):
                    return {k: int(status[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem") if k in status}
        return {}

    def log_of(self, pod: str) -> str:
        path = self.root / "logs" / f"{NS}_{pod}.log"
        return path.read_text(errors="replace") if path.is_file() else ""


def _proc_status(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if ":\t" in line)
    return {}


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            ppid = _proc_status(int(entry.name)).get("PPid")
            if ppid:
                children.setdefault(int(ppid), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


@dataclass
class Request:
    start: float
    end: float
    group: int
    pod: str | None  # who answered
    ok: bool
    retried: bool
    error: str = ""


@dataclass
class Client:
    """OpenAI completions, alternating groups, routed by the EndpointSlice (one retry)."""

    example: VllmExample
    retry_wait_s: float = RETRY_WAIT_S
    records: list[Request] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name="openai-client", daemon=True)

    def __enter__(self) -> Client:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)

    def _run(self) -> None:
        group = 0
        while not self.stop.is_set():
            start = time.perf_counter()
            pod, error = self._once(group)
            retried = pod is None
            if retried:
                failed = error.split(":", 1)[0]
                self._wait_for_another_endpoint(group, failed)
                pod, error2 = self._once(group, avoid=failed)
                error = f"{error}; retry: {error2}" if pod is None else error
            self.records.append(Request(start, time.perf_counter(), group, pod, pod is not None, retried, error))
            group = (group + 1) % self.example.replicas
            self.stop.wait(PACE_S)

    def _wait_for_another_endpoint(self, group: int, failed: str) -> None:
        """Before the one retry: until the EndpointSlice lists another engine of the group than the one
        that failed (a client behind a Service retries once the Service moved), at most `retry_wait_s`."""
        deadline = time.monotonic() + self.retry_wait_s
        while time.monotonic() < deadline and not self.stop.is_set():
            if any(e2e_bench.group_of(n) == group and n != failed for n in self.example.watch.current()):
                return
            time.sleep(0.01)

    def _once(self, group: int, avoid: str = "") -> tuple[str | None, str]:
        # a killed engine stays listed until the kubelet notices: a retry goes to another one
        serving = sorted(n for n in self.example.watch.current() if e2e_bench.group_of(n) == group and n != avoid)
        if not serving:
            return None, f"no endpoint of group {group}"
        pod = serving[0]
        port = self.example.port_of(pod)
        if port is None:
            return None, f"{pod}: not running here"
        body = json.dumps({"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            answer = response.read()
            if response.status != 200:
                return None, f"{pod}: HTTP {response.status} {answer[:200]!r}"
            if not json.loads(answer)["choices"][0]["text"]:
                return None, f"{pod}: empty completion"
            return pod, ""
        except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
            return None, f"{pod}: {type(e).__name__}: {e}"
        finally:
            conn.close()

    def first_answer(self, pod: str, since: float) -> Request | None:
        """The first completion `pod` answered that was sent after `since`."""
        return next((r for r in list(self.records) if r.pod == pod and r.start >= since), None)

    def failed(self, since: float = 0.0) -> list[Request]:
        return [r for r in list(self.records) if not r.ok and r.start >= since]


@dataclass
class FailoverTrial:
    trial: e2e_bench.Trial
    first_token_s: float | None  # kill -> the promoted engine's first answered completion
    first_request_s: float | None  # that completion's own time, sent to answered


def failovers(example: VllmExample, client: Client, trials: int) -> list[FailoverTrial]:
    out = []
    for i in range(trials):
        try:
            trial = example.kill_and_time(i % example.replicas)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; pods: {example.pod_states()}; agent: {example.all_leases()}") from None
        t0 = trial.killed_at
        deadline = time.monotonic() + 30
        while (first := client.first_answer(trial.promoted, t0)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        out.append(FailoverTrial(trial, None if first is None else first.end - t0,
                                 None if first is None else first.end - first.start))
        answered = ("-" if first is None else
                    f"{(first.end - t0) * 1e3:.0f} ms ({(first.end - first.start) * 1e3:.0f} ms)")
        print(f"  trial {i + 1}/{trials}: {trial.killed} -> {trial.promoted}: lease ended "
              f"{trial.closed_s * 1e3:.0f} ms, promoted {trial.promotion_s * 1e3:.0f} ms, "
              f"EndpointSlice {trial.endpoint_s * 1e3:.0f} ms, first completion {answered}",
              file=sys.__stderr__, flush=True)
    return out


def roll_flag(example: VllmExample, flag: tuple[str, ...], timeout: float = 2400) -> e2e_bench.Rollout:
    """Add a vLLM flag to the EngineSet's template and wait for the rollout over every group."""
    path = f"{e2e_bench.WC}/namespaces/{NS}/enginesets/{ENGINESET}"

    def change() -> Any:
        template = example.api.get(path)["spec"]["template"]
        template["spec"]["containers"][0]["args"] += list(flag)
        es = example.api.patch(path, {"spec": {"template": template}})
        return lambda status: status.get("observedGeneration") == es["metadata"]["generation"]

    return e2e_bench._roll(example, change, timeout)


def memory_table(example: VllmExample) -> str:
    """Each group's primary and standby: the worker's anonymous and shared resident memory."""
    lines = [f"{'engine':<22} {'role':<8} {'RssAnon MiB':>11} {'RssShmem MiB':>12}  KV cache (vLLM's log)"]
    for group, (primary, standby, _) in sorted(example.wait_settled(range(example.replicas), timeout=600).items()):
        for pod, role in ((primary, "primary"), (standby, "standby")):
            mem = example.worker_memory(pod)
            events = [line.split("weightcache: ", 1)[1] for line in example.log_of(pod).splitlines()
                      if "released its KV cache" in line or "KV cache back" in line]  # the last one says
            lines.append(f"{pod:<22} {role:<8} {mem.get('RssAnon', 0) / 2**20:>11.0f} "
                         f"{mem.get('RssShmem', 0) / 2**20:>12.1f}  {events[-1] if events else 'held'}")
    return "\n".join(lines)


def failover_table(trials: list[FailoverTrial], client: Client, since: float) -> str:
    def ms(v: list[float]) -> str:
        return (f"{statistics.median(v) * 1e3:7.0f} {e2e_bench.percentile(v, 99) * 1e3:7.0f} "
                f"{max(v) * 1e3:7.0f}")
    lines = [f"{'SIGKILL of a primary ->':<42} {'trials':>6} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}"]
    for name, values in (("the killed engine's lease ends (its exit)", [t.trial.closed_s for t in trials]),
                         ("agent holds the standby as primary", [t.trial.promotion_s for t in trials]),
                         ("EndpointSlice lists the standby ready", [t.trial.endpoint_s for t in trials]),
                         ("first completion from the new primary",
                          [t.first_token_s for t in trials if t.first_token_s is not None]),
                         ("(that completion, sent -> answered)",
                          [t.first_request_s for t in trials if t.first_request_s is not None])):
        if values:
            lines.append(f"{name:<42} {len(values):>6} {ms(values)}")
    records = [r for r in client.records if r.start >= since]
    failed = client.failed(since)
    lines.append(f"client: {len(records)} completions, {sum(r.retried and r.ok for r in records)} answered on the "
                 f"retry, {len(failed)} failed")
    if failed:
        lines.append("failed: " + " | ".join(sorted({r.error for r in failed})[:5]))
    p99 = e2e_bench.percentile([t.trial.endpoint_s for t in trials], 99)
    lines.append(f"kill -> EndpointSlice p99 {p99 * 1e3:.0f} ms: {'PASS' if p99 <= BAR_P99_S else 'BAR MISSED'} "
                 f"(bar {BAR_P99_S * 1e3:.0f} ms); failed requests: {len(failed)} (bar 0)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--no-rollout", action="store_true", help="skip the template rollout")
    args = ap.parse_args(argv)
    from k8s_lab import install_or_upgrade_chart, unavailable_reason

    vllm_python = os.environ.get("WEIGHTCACHE_VLLM_PYTHON")
    reason = unavailable_reason() or ("" if vllm_python else "no $WEIGHTCACHE_VLLM_PYTHON (tests/vllm_venv.sh)")
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    out = sys.__stdout__  # the operator's runner holds sys.stdout and sys.stderr while it runs
    started = time.monotonic()
    lab = Lab.start((NODE,))
    try:
        install_or_upgrade_chart(lab)
        lab.kubectl("-n", "weightcache-system", "scale", "deployment", "--all", "--replicas=0")
        with VllmExample(lab, vllm_python) as example:
            print(f"four vLLM engines, two groups, serving after {time.monotonic() - started:.0f} s", file=out)
            print(memory_table(example), file=out, flush=True)
            if args.trials:
                with Client(example) as client:
                    since = time.perf_counter()
                    trials = failovers(example, client, args.trials)
                    example.wait_settled(range(example.replicas), timeout=600)
                print(failover_table(trials, client, since), file=out)
                print(memory_table(example), file=out, flush=True)
            if not args.no_rollout:
                with Client(example) as client:
                    since = time.perf_counter()
                    rollout = roll_flag(example, ("--max-num-seqs", "64"))
                print(f"rollout over {example.replicas} groups: {rollout.seconds:.0f} s, serving "
                      f"{rollout.old_serving} -> {rollout.new_serving}; client: {len(client.records)} completions, "
                      f"{len(client.failed(since))} failed; spans without a ready serving endpoint: "
                      f"{len(rollout.empty_windows)}", file=out, flush=True)
    finally:
        lab.stop()
    print(f"wall {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
