"""Every manifest under examples/ applied as shipped, on a real control plane, until it serves.

The files are applied with `kubectl apply -f` into the namespace they name (`default`). The
operator runs in this process with the chart's service account; the fake kubelet plays a
node of its own (`node-examples`, so that its label, ResourceSlice and pods touch no other
test) and runs each pod's container command as a local process (the image is never
pulled), cpu backend. What differs from a GPU cluster, and why each change is unavoidable:

- the claim `qwen2-7b-instruct` of qwen-pvc-tp2.yaml (model-pvc.yaml, applied as shipped) is
  bound to a PersistentVolume made here, and its content (what the kubelet mounts) is a small
  synthetic Llama-shaped checkpoint: no 7B download in CI;
- the node's GPUs are published as a DRA driver would, named as the cpu backend's devices
  (`cpu-0`..`cpu-3`), and the agent is given `--replicas 2` (the cpu backend has no GPUs to
  count): two TP=2 replicas, one per serving group of engineset-chat.yaml;
- the engine's `--port 8000` becomes a free loopback port (`$(HOST_PORT_HTTP)`): pods here
  share one loopback, where a cluster gives each pod its own network namespace.

examples/engineset-chat.yaml (on the cache of qwen-pvc-tp2.yaml, as the README's Kubernetes
quick start applies them) must reach serving: the cache Ready, the Service's EndpointSlice
listing one ready serving engine per group, each a TP=2 reference engine started by the
one-command launcher (its ranks attaching with the cache's sharding rules, which the operator
injects), answering /generate; no pod restarted. Then a serving pod is SIGKILLed: its group's
standby pod is promoted on both ranks and listed by the EndpointSlice. examples/llama-70b-tp8-fp8.yaml
needs eight H200s and a 70B FP8 checkpoint: here it is applied, accepted by the API server's
schema and CEL rules, and rendered into its agent DaemonSet (TP 8, fp8-block), which runs
no pod because no node has that GPU product -- so nothing crash-loops. examples/engineset-vllm.yaml
runs vLLM's CPU build in its pods, on a node of its own (`node-vllm`, labelled with eight GPUs
as GPU feature discovery would): its four vLLM engines serve, the standbys without their KV
cache, and one survives its primary's SIGKILL under OpenAI traffic (the harness, and what it
changes for CPU, is bench/vllm_failover_k8s.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from fake_kubelet import FakeKubelet
from k8s_lab import REPO, Lab, free_ports, pods_path, wait_for

pytestmark = [pytest.mark.timeout(600)]

spec = importlib.util.spec_from_file_location("failover_e2e_k8s", REPO / "bench" / "failover_e2e_k8s.py")
assert spec and spec.loader
e2e_bench = sys.modules.get("failover_e2e_k8s") or importlib.util.module_from_spec(spec)
if "failover_e2e_k8s" not in sys.modules:
    sys.modules["failover_e2e_k8s"] = e2e_bench
    spec.loader.exec_module(e2e_bench)
vllm_bench = e2e_bench._sibling("vllm_failover_k8s")  # loaded as failover_e2e_k8s loads its siblings
VLLM_PYTHON = os.environ.get("WEIGHTCACHE_VLLM_PYTHON")

NODE = "node-examples"
NS = "default"  # what the examples name
EXAMPLES = REPO / "examples"
WC = "/apis/weightcache.io/v1alpha1"
CPU_DEVICES = [f"cpu-{i}" for i in range(4)]
CLAIM = "qwen2-7b-instruct"


def example(name: str) -> str:
    return (EXAMPLES / name).read_text()


def test_every_example_and_the_readme_quick_start_have_a_test_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == [
        "engineset-chat.yaml", "engineset-sglang.yaml", "engineset-vllm.yaml", "llama-70b-tp8-fp8.yaml", "model-pvc.yaml", "qwen-pvc-tp2.yaml"]
    # The README's Kubernetes quick start applies what the serving test below applies, in that order.
    applied = re.findall(r"^kubectl apply -f (\S+)", (REPO / "README.md").read_text(), re.MULTILINE)
    assert applied == ["examples/qwen-pvc-tp2.yaml", "examples/engineset-chat.yaml"]


@contextlib.contextmanager
def operator(lab: Lab, root: Path):
    from weightcache_operator.config import OperatorConfig

    # A control key, as the chart gives the operator one: the agents name the pods that hold their
    # leases only to its token, and without those names no primary is ever labelled serving.
    config = OperatorConfig(poll_interval=1.0, agent_http_timeout=1.0, control_key=b"examples-control-key-0123456789")
    with e2e_bench.operator_runner(lab, NS, root, config) as runner:
        yield runner
    assert runner.exception is None


def test_llama_70b_is_accepted_and_rendered(k8s_chart: Lab, tmp_path: Path) -> None:
    lab = k8s_chart
    with operator(lab, tmp_path):
        lab.kubectl("apply", "-f", str(EXAMPLES / "llama-70b-tp8-fp8.yaml"))
        try:
            ds = wait_for(lambda: lab.api.get_or_none(f"/apis/apps/v1/namespaces/{NS}/daemonsets/llama-70b-agent"),
                          timeout=60, what="the llama-70b agent DaemonSet")
            args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
            assert args[args.index("--tp-size") + 1] == "8" and args[args.index("--quantization") + 1] == "fp8-block"
            assert ds["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
            time.sleep(2)  # two reconciles: no node has that GPU, so no agent pod, nothing to crash-loop
            pods = lab.api.get(pods_path(NS), labelSelector="weightcache.io/cache=llama-70b")["items"]
            assert pods == []
        finally:
            lab.api.delete(f"{WC}/namespaces/{NS}/weightcaches/llama-70b")
            wait_for(lambda: lab.api.get_or_none(f"{WC}/namespaces/{NS}/weightcaches/llama-70b") is None,
                     timeout=30, what="llama-70b gone")


def test_sglang_engineset_is_accepted_and_rendered(k8s_chart: Lab, tmp_path: Path) -> None:
    """examples/engineset-sglang.yaml as shipped, applied with kubectl: the API server admits both
    objects (CRD schema, CEL rules, the admission policy on engine pods), the operator renders the
    cache's agents and takes the EngineSet without a spec error. SGLang's server itself needs a GPU
    (docs/sglang.md says what runs where); it serves on the H200 in bench/sglang_gpu.py."""
    lab = k8s_chart
    with operator(lab, tmp_path):
        lab.kubectl("apply", "-f", str(EXAMPLES / "engineset-sglang.yaml"))
        try:
            ds = wait_for(lambda: lab.api.get_or_none(f"/apis/apps/v1/namespaces/{NS}/daemonsets/qwen-7b-sglang-agent"),
                          timeout=60, what="the qwen-7b-sglang agent DaemonSet")
            args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
            assert "--layout" not in args and args[args.index("--dtype") + 1] == "bfloat16"
            es = wait_for(lambda: (lambda o: o if (o or {}).get("status", {}).get("conditions") else None)(
                lab.api.get_or_none(f"{WC}/namespaces/{NS}/enginesets/chat-sglang")), timeout=60,
                what="the chat-sglang EngineSet's first status")
            reasons = {c.get("reason") for c in es["status"]["conditions"]}
            assert not any("Invalid" in (r or "") for r in reasons), es["status"]
            container = es["spec"]["template"]["spec"]["containers"][0]
            assert container["command"] == ["python3", "-m", "sglang.launch_server"]
            assert container["args"][container["args"].index("--load-format") + 1] == "weightcache"
        finally:
            lab.kubectl("delete", "-f", str(EXAMPLES / "engineset-sglang.yaml"), "--wait=true")


@pytest.mark.skipif(not VLLM_PYTHON and not os.environ.get("CI"),
                    reason="no vLLM environment ($WEIGHTCACHE_VLLM_PYTHON; tests/vllm_venv.sh makes one)")
@pytest.mark.timeout(1500)  # four vLLM engines starting at once: ~4 min alone on two cores, far more beside other workers
def test_vllm_engineset_serves_and_fails_over_as_shipped(own_k8s_chart: Lab) -> None:
    """examples/engineset-vllm.yaml as shipped, vLLM's CPU build in its pods (what differs from a GPU
    node: bench/vllm_failover_k8s.py): its agents run with default flags; two groups of a vLLM
    primary and a standby reach serving, none restarted; each standby has given its KV cache back
    (its engine's anonymous memory at least 90% of the KV cache below its primary's); an OpenAI
    client sends completions through the EndpointSlice; SIGKILL of a primary: the
    standby takes its KV cache back, the EndpointSlice lists it, it answers, and no request failed
    (one retry allowed); the killed engine restarts and is its group's sleeping standby again (the
    time from the kill printed). Twenty trials and a rollout: bench/vllm_failover_k8s.py."""
    assert VLLM_PYTHON, "CI must provide $WEIGHTCACHE_VLLM_PYTHON (tests/vllm_venv.sh)"
    with vllm_bench.VllmExample(own_k8s_chart, VLLM_PYTHON, settle_timeout=1200) as example:
        ds = example.api.get(f"/apis/apps/v1/namespaces/{NS}/daemonsets/qwen-7b-vllm-agent")
        args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--layout" not in args and args[args.index("--dtype") + 1] == "bfloat16"
        settled = example.wait_settled(range(2), timeout=60)
        for pod in example.pods():  # none crash-loops: every container runs its first start
            statuses = pod["status"].get("containerStatuses") or [{}]
            assert statuses[0].get("restartCount", 0) == 0, (pod["metadata"]["name"], statuses)
        kv = vllm_bench.KV_CACHE_GIB * 2**30
        for primary, standby, _ in settled.values():
            assert "released its KV cache" in example.log_of(standby), example.log_of(standby)[-3000:]
            assert "released its KV cache" not in example.log_of(primary)
            held, released = example.worker_memory(primary), example.worker_memory(standby)
            assert held["RssAnon"] - released["RssAnon"] >= 0.9 * kv, (held, released)

        # The client waits up to 15 s for the Service to move before its one retry: what this test asserts is
        # that no request is lost, not how fast the EndpointSlice moves. That latency is printed below and is
        # the bench's bar (bench/vllm_failover_k8s.py, p99 of 20 trials alone); on two cores shared with the
        # rest of the suite one trial took 3.8 s (the agent's status answers and the standby's KV cache
        # allocation starved), past the bench's 2 s patience.
        with vllm_bench.Client(example, retry_wait_s=15.0) as client:
            wait_for(lambda: {r.group for r in client.records if r.ok} == {0, 1}, timeout=120, interval=0.1,
                     what="a completion answered by each group")
            trial, = vllm_bench.failovers(example, client, 1)
        assert not client.failed(), client.failed()[:3]
        assert trial.first_token_s is not None, "the promoted engine answered no completion"
        assert "promoted to primary: KV cache back" in example.log_of(trial.trial.promoted)
        # The group is not left without a standby: the killed pod's engine starts again at once and comes
        # back as its group's standby, KV cache released (its log, appended to, had no such line as primary).
        killed = trial.trial.killed
        wait_for(lambda: "released its KV cache" in example.log_of(killed), timeout=600, interval=0.1,
                 what=f"{killed} back as a sleeping standby")
        replaced_s = time.perf_counter() - trial.trial.killed_at
        roles = {pod: role for leases in example.all_leases().values() for pod, role in leases.items()}
        assert roles.get(killed) == "standby" and roles.get(trial.trial.promoted) == "primary", roles
        os.write(1, f"\nvLLM pod failover: SIGKILL of {trial.trial.killed} -> EndpointSlice lists "
                    f"{trial.trial.promoted} in {trial.trial.endpoint_s * 1e3:.0f} ms, its first completion "
                    f"{trial.first_token_s * 1e3:.0f} ms; {len(client.records)} completions, 0 failed; "
                    f"a standby again (the killed engine restarted, attached, KV cache released) "
                    f"{replaced_s:.1f} s after the kill\n".encode())


def test_qwen_cache_and_chat_engineset_serve_as_shipped(k8s_chart: Lab) -> None:
    from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint
    from weightcache_operator.controller.weightcache import manifests

    lab = k8s_chart
    root = Path(tempfile.mkdtemp(prefix="wc-ex-"))  # short: socket paths stay < 108 bytes
    stack = contextlib.ExitStack()
    with stack:
        stack.callback(shutil.rmtree, root, True)
        # The claim's content: a synthetic checkpoint that splits over TP 2 by the example's own rules.
        write_llama_checkpoint(str(root / NODE / "pvc" / CLAIM), LlamaShape(**e2e_bench.SMALL_LLAMA), seed=5)
        lab.add_node(NODE)
        lab.kubectl("label", "node", NODE, "weightcache=enabled", "--overwrite")
        stack.callback(lab.kubectl, "label", "node", NODE, "weightcache-", check=False)
        lab.ensure_device_class()
        stack.callback(lab.kubectl, "delete", "resourceslice", lab.publish_gpus(NODE, CPU_DEVICES),
                       "--ignore-not-found", check=False)
        # The claim as shipped, bound to a volume made for it (what an administrator or a provisioner does).
        lab.kubectl("apply", "-f", str(EXAMPLES / "model-pvc.yaml"))
        lab.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"examples-{CLAIM}"},
                   "spec": {"capacity": {"storage": "20Gi"}, "accessModes": ["ReadOnlyMany"],
                            "storageClassName": "", "hostPath": {"path": f"/pvc/{CLAIM}"},
                            "claimRef": {"namespace": NS, "name": CLAIM}}})
        wait_for(lambda: lab.api.get(f"/api/v1/namespaces/{NS}/persistentvolumeclaims/{CLAIM}")["status"].get(
            "phase") == "Bound", timeout=60, interval=0.5, what="the shipped claim bound")
        stack.callback(lab.kubectl, "delete", "pv", f"examples-{CLAIM}", "--ignore-not-found", "--wait=false",
                       check=False)
        stack.callback(lab.kubectl, "delete", "pvc", CLAIM, "-n", NS, "--ignore-not-found", "--wait=false",
                       check=False)

        old_port = manifests.AGENT_HTTP_PORT
        manifests.AGENT_HTTP_PORT, = free_ports(1)  # every fake node shares this machine's loopback
        stack.callback(setattr, manifests, "AGENT_HTTP_PORT", old_port)

        def agent_argv(pod: dict, argv: list[str]) -> list[str]:
            labels = pod["metadata"].get("labels") or {}
            agent = all(labels.get(k) == v for k, v in e2e_bench.AGENT_LABELS.items())
            return [*argv, "--replicas", "2"] if agent else argv

        (root / "logs").mkdir()
        kubelet = FakeKubelet(lab, [NODE], namespace=NS, host_root=root, loopback_labels=e2e_bench.AGENT_LABELS,
                              argv_hook=agent_argv, probe_interval=1.0, log_dir=root / "logs", kill_timeout=3.0)
        stack.enter_context(operator(lab, root))
        stack.callback(e2e_bench.sweep, root)
        stack.callback(delete_examples, lab)  # while the operator still runs: its finalizers
        kubelet.start()
        stack.callback(kubelet.stop)

        lab.kubectl("apply", "-f", str(EXAMPLES / "qwen-pvc-tp2.yaml"))
        chat = example("engineset-chat.yaml")
        assert chat.count('"--port", "8000"') == 1
        lab.kubectl("apply", "-f", "-", input=chat.replace('"--port", "8000"', '"--port", "$(HOST_PORT_HTTP)"'))

        def cache_ready() -> bool:
            wc = lab.api.get(f"{WC}/namespaces/{NS}/weightcaches/qwen-7b")
            return any(c["type"] == "Ready" and c["status"] == "True" for c in wc.get("status", {}).get("conditions", []))
        wait_for(cache_ready, timeout=180, interval=0.5, what="the qwen-7b cache Ready")

        def serving() -> dict[str, str] | None:
            slices = lab.api.get(f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices",
                                 labelSelector="kubernetes.io/service-name=chat")["items"]
            ready = {e["targetRef"]["name"]: e["addresses"][0] for s in slices for e in s.get("endpoints") or []
                     if e.get("conditions", {}).get("ready") and e.get("targetRef")}
            return ready if {e2e_bench.group_of(n) for n in ready} == {0, 1} else None
        try:
            endpoints = wait_for(serving, timeout=300, interval=0.5, what="a serving engine of each group")
        except TimeoutError:
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in (root / "logs").iterdir() if p.is_file())
            raise AssertionError(f"no serving engine of each group; logs:\n{logs}") from None
        assert len(endpoints) == 2, endpoints
        pods = {p["metadata"]["name"]: p for p in lab.api.get(pods_path(NS), labelSelector="weightcache.io/engineset=chat")["items"]}
        assert sorted(pods) == ["chat-0-0", "chat-0-1", "chat-1-0", "chat-1-1"]
        for name, pod in pods.items():  # none crash-loops: every container runs its first start
            statuses = pod["status"].get("containerStatuses") or [{}]
            log = root / "logs" / f"{NS}_{name}.log"
            assert statuses[0].get("restartCount", 0) == 0, (name, statuses, log.read_text(errors="replace")[-4000:])
        for name in endpoints:
            run = kubelet.run_of(NS, name)
            assert run is not None and run.proc is not None and run.proc.poll() is None
            port = run.host_ports[8000]
            body = json.dumps({"tokens": [1, 17, 42, 3], "max_tokens": 4}).encode()
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body),
                                        timeout=60) as response:
                answer = json.load(response)
            assert answer["role"] == "primary" and len(answer["tokens"]) == 4, answer

        # A TP=2 failover in pods: SIGKILL of a serving pod (its launcher and both ranks); both ranks of
        # the group's standby pod are promoted together, and the Service lists it.
        victim = min(endpoints)
        killed = time.monotonic()
        kubelet.kill(NS, victim)

        def successor() -> str | None:
            now = serving()
            return next((n for n in now or {} if e2e_bench.group_of(n) == e2e_bench.group_of(victim)
                         and n != victim), None)
        promoted = wait_for(successor, timeout=30, interval=0.01, what="the standby pod serving")
        # The operator's runner holds sys.stdout: write to the descriptor.
        os.write(1, f"\nTP=2 pod failover: SIGKILL of {victim} -> EndpointSlice lists {promoted} in "
                    f"{(time.monotonic() - killed) * 1e3:.0f} ms\n".encode())


def delete_examples(lab: Lab) -> None:
    for plural, name in (("enginesets", "chat"), ("weightcaches", "qwen-7b")):
        lab.api.delete(f"{WC}/namespaces/{NS}/{plural}/{name}")
    for plural, name in (("enginesets", "chat"), ("weightcaches", "qwen-7b")):
        with contextlib.suppress(TimeoutError):
            wait_for(lambda p=plural, n=name: lab.api.get_or_none(f"{WC}/namespaces/{NS}/{p}/{n}") is None,
                     timeout=30, what=f"{plural}/{name} gone")
