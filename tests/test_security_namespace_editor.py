"""What a namespace editor can do with the objects the operator reconciles, tried as an attacker.

A namespace editor (the `edit` role: WeightCache, EngineSet and pod create) writes specs that
the operator turns into privileged agent DaemonSets and engine pods. Each test here is one
attack, run as described: on the real API server with the CRDs and the chart's admission
policies where those decide, with the operator's pure builders where they do, and with real
agent processes where the agent must refuse.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from k8s_lab import REPO, Lab, ns_path, pods_path, wait_for
from operator_fixtures import LLAMA_SPEC
from weightcache_agent import agent_status
from weightcache_agent.serve.agent_main import build_parser
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint
from weightcache_operator.api.v1alpha1.engineset_types import parse_engineset
from weightcache_operator.api.v1alpha1.weightcache_types import SpecError, parse_spec
from weightcache_operator.config import OperatorConfig, control_plane_taint_tolerated
from weightcache_operator.controller.engineset.manifests import SOCKET_VOLUME, render_pod
from weightcache_operator.controller.engineset.placement import Placement
from weightcache_operator.controller.weightcache.manifests import (
    MAX_SOCKET_NAME,
    MAX_SOCKET_PATH,
    agent_args,
    render_daemonset,
    socket_dir,
)

WC = "/apis/weightcache.io/v1alpha1"


def weightcache(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": name}, "spec": spec}


def with_revision(revision: str) -> dict[str, Any]:
    return {**LLAMA_SPEC, "model": {**LLAMA_SPEC["model"], "revision": revision}}


# --- a revision that the agent would read as one of its own flags ---------------------------

FLAG_REVISIONS = ("--help", "-h", "--model=/etc", "--socket-dir=/tmp")


@pytest.mark.parametrize("revision", FLAG_REVISIONS)
def test_a_revision_read_as_a_flag_is_refused_by_the_operator(revision: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_spec(with_revision(revision))
    assert refused.value.reason == "InvalidSpec"
    assert refused.value.message.startswith(f"model.revision {revision!r} may hold only letters, digits")
    assert "must not start with '-'" in refused.value.message
    # Revisions people use pass.
    for fine in ("main", "v1.0", "2024-05-01", "1605565", "refs/pr/1", "a1b2c3d"):
        assert parse_spec(with_revision(fine)).revision == fine


@pytest.mark.parametrize("revision", FLAG_REVISIONS)
def test_the_agent_reads_a_rendered_revision_as_a_value_whatever_it_is(revision: str) -> None:
    # Past every check (an object stored before the CRD had its rule): the agent's own parser still
    # reads the value as the revision, never as a flag of its own (with "--revision VALUE", "--help"
    # printed the help and exited: a crash loop).
    cs = dataclasses.replace(parse_spec(LLAMA_SPEC), revision=revision)
    args = agent_args(cs, "ml", "llama")
    parsed = build_parser().parse_args(args[1:])
    assert parsed.revision == revision
    assert parsed.model == "/models/meta-llama/Llama-3.1-70B-Instruct"
    ds = render_daemonset(cs, "ml", "llama", OperatorConfig())
    assert f"--revision={revision}" in ds["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_revision_read_as_a_flag_is_refused_at_apply(k8s_lab: Lab) -> None:
    lab = k8s_lab
    lab.apply_crds()
    ns = lab.namespace("rev")
    try:
        caches = f"{WC}/namespaces/{ns}/weightcaches"
        for i, revision in enumerate(FLAG_REVISIONS):
            status, body = lab.api.request("POST", caches, weightcache(f"flag-{i}", with_revision(revision)))
            assert status == 422, (revision, body)
            assert "model.revision may hold only letters, digits" in body["message"], body["message"]
            assert "must not start with '-'" in body["message"]
        status, body = lab.api.request("POST", caches, weightcache("tagged", with_revision("v1.0")))
        assert status == 201, body
        assert lab.api.get(ns_path(ns, "weightcaches", "tagged", group="weightcache.io",
                                   version="v1alpha1"))["spec"]["model"]["revision"] == "v1.0"
    finally:
        lab.delete_namespace(ns)


# --- two caches in one socket directory ----------------------------------------------------

def old_socket_dir(namespace: str, name: str, hex_digits: int = 10) -> str:
    """The directory scheme before: names cut to 12 and 16 characters, 10 hex digits (40 bits) of the hash."""
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:hex_digits]
    return f"/run/weightcache/{namespace[:12]}.{name[:16]}.{digest}"


def search_collision(victim: tuple[str, str], attacker_ns: str, hex_digits: int) -> str:
    """A cache name in `attacker_ns` whose old-scheme directory (hash cut to `hex_digits`) is the victim's."""
    want = old_socket_dir(*victim, hex_digits=hex_digits)
    for i in range(1 << (4 * hex_digits + 4)):
        name = f"{victim[1][:16]}-{i:x}"
        if old_socket_dir(attacker_ns, name, hex_digits=hex_digits) == want:
            return name
    raise AssertionError("no collision found")


def test_a_searched_name_shares_no_socket_directory() -> None:
    assert old_socket_dir("ml", "llama") == "/run/weightcache/ml.llama.94fdbd1837"  # what the operator rendered
    # The attack: another namespace sharing the victim's first 12 characters, a cache name sharing its
    # first 16, and a search over the rest until the hash's kept digits agree. With the hash cut to
    # 4 hex digits this takes ~65 000 tries; each further digit multiplies the work by 16, and the old
    # scheme kept 10 (2^40 tries: hours on a GPU). Only the kept digits matter:
    victim = ("ml-production", "llama-3-70b-instruct")
    attacker_ns = "ml-production-sandbox"
    name = search_collision(victim, attacker_ns, hex_digits=4)
    assert old_socket_dir(attacker_ns, name, hex_digits=4) == old_socket_dir(*victim, hex_digits=4)
    # Now the directory keeps 120 bits of the hash: a search of 2^120. The found pair lands apart.
    assert socket_dir(attacker_ns, name) != socket_dir(*victim)
    leaf = socket_dir(*victim).rsplit("/", 1)[1]
    digest = leaf.rsplit(".", 1)[1]
    assert len(digest) * 5 >= 120 and set(digest) <= set("abcdefghijklmnopqrstuvwxyz234567"), leaf
    # ... and every device socket still fits a Unix socket address, whatever the names' lengths.
    longest = socket_dir("n" * 63, "x" * 253)
    assert len(longest.encode()) + 1 + MAX_SOCKET_NAME <= MAX_SOCKET_PATH
    assert len(longest + "/GPU-00000000-0000-0000-0000-000000000000.sock") == MAX_SOCKET_PATH


SHAPE = LlamaShape(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256)


class NodeAgent:
    """`weightcache agent --socket-dir DIR --cache ...` (tp 1, cpu backend) as a subprocess."""

    def __init__(self, model: str, sockets: str, workdir: str, cache: str):
        os.makedirs(workdir, exist_ok=True)
        self.port_file = os.path.join(workdir, "port")
        self.log_path = os.path.join(workdir, "agent.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket-dir", sockets,
                 f"--cache={cache}", "--tp-size", "1", "--devices", "all", "--backend", "cpu",
                 "--http-host", "127.0.0.1", "--http-port", "0", "--port-file", self.port_file,
                 "--node-name", "node-a"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_serving(self, socket_path: str, timeout: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"agent exited {self.proc.returncode}:\n{self.log()}"
            if os.path.exists(socket_path):
                try:
                    status = agent_status(socket_path)
                    if status.get("phase") == "ready" or status.get("resident"):
                        return status
                except Exception:  # still binding or loading
                    pass
            assert time.monotonic() < deadline, f"not serving after {timeout:.0f}s:\n{self.log()}"
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


@pytest.fixture(scope="module")
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="wc-ned-", dir="/tmp")  # short: socket paths hold at most 107 bytes
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def model(workdir: str) -> str:
    return write_llama_checkpoint(os.path.join(workdir, "model"), SHAPE)


def test_an_agent_of_another_cache_refuses_a_claimed_socket_directory(model: str, workdir: str) -> None:
    sockets = os.path.join(workdir, "sockets")
    sock = os.path.join(sockets, "cpu-0.sock")
    victim = NodeAgent(model, sockets, os.path.join(workdir, "victim"), "ml-production/llama/uid-victim")
    try:
        served_by = victim.wait_serving(sock)["pid"]
        claim = os.path.join(sockets, ".weightcache-cache")
        st = os.lstat(claim)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        with open(claim) as f:
            assert json.load(f) == {"namespace": "ml-production", "name": "llama", "uid": "uid-victim"}

        # The colliding cache's agent lands in the same directory: it refuses at once, naming both,
        # and binds nothing; the victim's engines keep their agent.
        attacker = NodeAgent(model, sockets, os.path.join(workdir, "attacker"), "ml-sandbox/llama-x/uid-attacker")
        assert attacker.proc.wait(60) == 1, attacker.log()
        assert ("socket directory " + sockets + " belongs to WeightCache ml-production/llama (uid uid-victim), "
                "not ml-sandbox/llama-x (uid uid-attacker)") in attacker.log(), attacker.log()
        assert agent_status(sock)["pid"] == served_by
    finally:
        assert victim.stop() == 0, victim.log()

    # With the victim's agent gone (a restart, a node drain), the directory is still the victim's.
    attacker = NodeAgent(model, sockets, os.path.join(workdir, "attacker2"), "ml-sandbox/llama-x/uid-attacker")
    assert attacker.proc.wait(60) == 1, attacker.log()
    assert "belongs to WeightCache ml-production/llama" in attacker.log()
    assert not os.path.lexists(sock), os.listdir(sockets)

    # The same cache deleted and created again (a new uid) takes its directory back.
    again = NodeAgent(model, sockets, os.path.join(workdir, "again"), "ml-production/llama/uid-new")
    try:
        again.wait_serving(sock)
        with open(os.path.join(sockets, ".weightcache-cache")) as f:
            assert json.load(f)["uid"] == "uid-new"
    finally:
        assert again.stop() == 0, again.log()


def test_a_bad_cache_identity_is_one_line(model: str, workdir: str) -> None:
    agent = NodeAgent(model, os.path.join(workdir, "bad"), os.path.join(workdir, "bad-agent"), "ml/Not_A_Name")
    assert agent.proc.wait(60) == 2, agent.log()
    assert "--cache 'ml/Not_A_Name': 'Not_A_Name' is not a Kubernetes object name" in agent.log(), agent.log()


# --- a read-write socket directory in an engine pod ------------------------------------------

def rw(name: str, **extra: Any) -> dict[str, Any]:
    """A container that mounts the operator's socket volume read-write (no readOnly)."""
    return {"name": name, "image": "busybox:1", **extra,
            "volumeMounts": [{"name": SOCKET_VOLUME, "mountPath": "/sockets"}]}


HOSTILE_TEMPLATE: dict[str, Any] = {"spec": {
    "containers": [{"name": "engine", "image": "engine:1"}],
    "initContainers": [
        rw("init", command=["sh", "-c", "rm -f /sockets/*.sock /sockets/.*.lock"]),
        rw("sidecar", restartPolicy="Always"),  # a native sidecar: runs beside the engine all along
    ],
    # Not accepted by the API server on create, but rendered read-only all the same.
    "ephemeralContainers": [rw("debug")],
}}
ENGINE_CACHE = parse_spec({"model": {"path": "qwen"}, "parallelism": {"tensor": 1}})


def socket_mounts(pod: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    spec = pod["spec"]
    return {c["name"]: [m for m in c.get("volumeMounts") or [] if m["name"] == SOCKET_VOLUME]
            for kind in ("containers", "initContainers", "ephemeralContainers") for c in spec.get(kind) or []}


def test_every_container_of_an_engine_pod_gets_the_socket_directory_read_only() -> None:
    es = parse_engineset("chat", {"cacheRef": {"name": "qwen"}, "template": HOSTILE_TEMPLATE})
    pod = render_pod(es, ENGINE_CACHE, OperatorConfig(), "ml", "chat", Placement(0, "node-a", ("GPU-a",)), 0)
    mounts = socket_mounts(pod)
    assert set(mounts) == {"engine", "init", "sidecar", "debug"}
    for name, found in mounts.items():
        assert found and all(m.get("readOnly") is True for m in found), (name, found)
    assert mounts["init"][0]["mountPath"] == "/sockets"  # the template's mount stays, read-only


@pytest.mark.parametrize("path", ["/run/weightcache", "/run/weightcache/ml.qwen.x", "/run//weightcache/",
                                  "/run/./weightcache/a/..", "/run", "/"])
def test_a_template_may_not_bring_its_own_host_path_to_the_sockets(path: str) -> None:
    template = {"spec": {"containers": [rw("engine")],
                         "volumes": [{"name": "mine", "hostPath": {"path": path}}]}}
    with pytest.raises(SpecError) as refused:
        parse_engineset("chat", {"cacheRef": {"name": "qwen"}, "template": template})
    assert refused.value.reason == "InvalidTemplate"
    assert refused.value.message.startswith(f"spec.template.spec.volumes[0] (mine) is the host path {path!r}, "
                                            "which holds the agents' socket directories (/run/weightcache)")
    for fine in ("/run/other", "/var/run", "/run/weightcache-other"):
        template["spec"]["volumes"][0]["hostPath"]["path"] = fine
        parse_engineset("chat", {"cacheRef": {"name": "qwen"}, "template": template})


ENGINE_POLICY = "weightcache-engine-sockets"


def engine_pod(name: str, **spec: Any) -> dict[str, Any]:
    """A pod as an EngineSet's (its label), with the operator's socket volume."""
    return {"metadata": {"name": name, "labels": {"weightcache.io/engineset": "chat"}},
            "spec": {"nodeName": "node-1",
                     "volumes": [{"name": SOCKET_VOLUME,
                                  "hostPath": {"path": "/run/weightcache/ml.chat.x", "type": "Directory"}}],
                     **spec}}


def refused_by_policy(answer: tuple[int, Any], *containers: str) -> bool:
    status, body = answer
    message = body.get("message", "") if isinstance(body, dict) else ""
    return (status in (403, 422) and ENGINE_POLICY in message and "read-write in: " + ", ".join(containers) in message)


def test_the_admission_policy_refuses_a_writable_socket_mount_in_any_container(k8s_chart: Lab) -> None:
    lab = k8s_chart
    ns = lab.namespace("rwsock")
    try:
        policy = lab.api.get(f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{ENGINE_POLICY}")
        assert not policy.get("status", {}).get("typeChecking", {}).get("expressionWarnings"), policy["status"]
        ro = {"name": "engine", "image": "engine:1",
              "volumeMounts": [{"name": SOCKET_VOLUME, "mountPath": "/sockets", "readOnly": True}]}
        # A new policy takes effect once the API server has loaded it: wait for its first denial.
        wait_for(lambda: refused_by_policy(lab.api.request("POST", pods_path(ns), engine_pod(
            "probe", containers=[rw("engine")])), "engine"), timeout=30, what="the engine policy to take effect")
        for name, spec, culprits in (
                ("init", {"containers": [ro], "initContainers": [rw("init")]}, ["init"]),
                ("sidecar", {"containers": [ro], "initContainers": [rw("sidecar", restartPolicy="Always")]},
                 ["sidecar"]),
                ("both", {"containers": [rw("engine")], "initContainers": [rw("init")]}, ["engine", "init"]),
                ("hostpath", {"containers": [{**ro, "volumeMounts": [{"name": "own", "mountPath": "/s"}]}],
                              "volumes": [{"name": "own", "hostPath": {"path": "/run/weightcache"}}]}, ["engine"])):
            answer = lab.api.request("POST", pods_path(ns), engine_pod(name, **spec))
            assert refused_by_policy(answer, *culprits), (name, answer)
        # Every container read-only: admitted.
        sidecar_ro = {**rw("sidecar", restartPolicy="Always")}
        sidecar_ro["volumeMounts"] = [{**sidecar_ro["volumeMounts"][0], "readOnly": True}]
        status, body = lab.api.request("POST", pods_path(ns), engine_pod("good", containers=[ro],
                                                                         initContainers=[sidecar_ro]))
        assert status == 201, body
        # `kubectl debug` by a namespace editor: an ephemeral container with the socket volume read-write.
        pod = lab.api.get(pods_path(ns, "good"))
        pod["spec"]["ephemeralContainers"] = [{**rw("debug"), "targetContainerName": "engine"}]
        answer = lab.api.request("PUT", pods_path(ns, "good") + "/ephemeralcontainers", pod)
        assert refused_by_policy(answer, "debug"), answer
        pod["spec"]["ephemeralContainers"][0]["volumeMounts"][0]["readOnly"] = True
        status, body = lab.api.request("PUT", pods_path(ns, "good") + "/ephemeralcontainers", pod)
        assert status == 200, body
    finally:
        lab.delete_namespace(ns)


# --- another team's model, and privileged agents on the control plane -----------------------

def test_model_paths_scoped_per_namespace_or_by_an_allow_list() -> None:
    open_root = OperatorConfig()
    per_ns = OperatorConfig.from_env({"WEIGHTCACHE_MODEL_PATHS_PER_NAMESPACE": "true",
                                      "WEIGHTCACHE_MODEL_PATHS_SHARED": "public/, base-models"})
    allow_list = OperatorConfig.from_env({"WEIGHTCACHE_MODEL_PATHS_SHARED": "public"})

    def refusal(config: OperatorConfig, namespace: str, path: str) -> str | None:
        try:
            config.admit_cache(parse_spec({"model": {"path": path}}), namespace)
        except SpecError as e:
            assert e.reason == "ModelPathNotAllowed"
            return e.message
        return None

    assert refusal(open_root, "team-a", "team-b/secret-model") is None  # the default: the root is shared
    assert refusal(per_ns, "team-a", "team-a/llama") is None
    assert refusal(per_ns, "team-a", "public/llama") is None
    assert refusal(per_ns, "team-a", "base-models") is None
    assert refusal(per_ns, "team-a", "team-b/secret-model") == (
        "model.path 'team-b/secret-model' is outside what namespace team-a may load (under the model root: team-a/, "
        "public/, base-models/; the chart's agent.modelPaths); agents left unchanged")
    assert refusal(per_ns, "team-a", "team-a-evil/llama") is not None  # a prefix of characters is not a directory
    assert refusal(per_ns, "team", "team-a/llama") is not None
    with pytest.raises(SpecError, match="must not contain '..'"):  # no way out of the namespace's root
        parse_spec({"model": {"path": "team-a/../team-b/x"}})
    assert refusal(allow_list, "team-a", "public/llama") is None
    assert refusal(allow_list, "team-a", "team-a/llama") is not None
    # A PVC is the namespace's own: not scoped further.
    per_ns.admit_cache(parse_spec({"model": {"pvc": "weights"}}), "team-a")
    with pytest.raises(ValueError, match="must be a path relative to the model root"):
        OperatorConfig.from_env({"WEIGHTCACHE_MODEL_PATHS_SHARED": "../etc"})


@pytest.mark.parametrize("toleration, tolerated", [
    ({"operator": "Exists"}, "node-role.kubernetes.io/control-plane:NoSchedule"),
    ({"operator": "Exists", "effect": "NoSchedule"}, "node-role.kubernetes.io/control-plane:NoSchedule"),
    ({"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"},
     "node-role.kubernetes.io/control-plane:NoSchedule"),
    ({"key": "node-role.kubernetes.io/master", "operator": "Equal", "value": "", "effect": "NoSchedule"},
     "node-role.kubernetes.io/master:NoSchedule"),
    ({"operator": "Exists", "effect": "NoExecute"}, None),
    ({"key": "nvidia.com/gpu", "operator": "Exists"}, None),
    ({"key": "node-role.kubernetes.io/control-plane", "operator": "Equal", "value": "x"}, None),
])
def test_tolerations_of_the_control_planes_taint_are_refused(toleration: dict[str, str], tolerated: str | None) -> None:
    assert control_plane_taint_tolerated(toleration) == tolerated
    cs = parse_spec({"model": {"path": "m"}, "tolerations": [{"key": "pool", "operator": "Exists"}, toleration]})
    if tolerated is None:
        OperatorConfig().admit_cache(cs, "ml")
        return
    with pytest.raises(SpecError) as refused:
        OperatorConfig().admit_cache(cs, "ml")
    assert refused.value.reason == "TolerationNotAllowed"
    assert refused.value.message.startswith(f"tolerations[1] {toleration} tolerates the control plane's taint "
                                            f"{tolerated}: privileged agents would run on control-plane nodes")
    OperatorConfig(allow_control_plane_tolerations=True).admit_cache(cs, "ml")  # the admin's choice


def test_the_operator_refuses_another_teams_model_and_the_control_plane(k8s_lab: Lab, tmp_path: Any) -> None:
    """The real operator, configured as the chart's agent.modelPaths.perNamespace sets it, against a
    namespace editor's WeightCaches: its own model is served, another team's and one whose agents would
    tolerate the control plane's taint are refused with a condition and an Event, and get no DaemonSet."""
    lab = k8s_lab
    lab.apply_crds()
    ns = lab.namespace("scope")
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'node_agent'}:{REPO / 'operator'}",
           "WEIGHTCACHE_MODEL_PATHS_PER_NAMESPACE": "true", "WEIGHTCACHE_MODEL_PATHS_SHARED": "",
           "WEIGHTCACHE_AGENT_ALLOW_CONTROL_PLANE": "false", "WEIGHTCACHE_POLL_INTERVAL": "1"}
    log = open(tmp_path / "operator.log", "w+")
    operator = subprocess.Popen([sys.executable, "-m", "weightcache_agent.cli", "operator", "-n", ns,
                                 "--kubeconfig", str(lab.kubeconfig)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        caches = f"{WC}/namespaces/{ns}/weightcaches"
        own = {**LLAMA_SPEC, "model": {"path": f"{ns}/llama"}}
        lab.api.create(caches, weightcache("own", own))
        lab.api.create(caches, weightcache("theirs", {**LLAMA_SPEC, "model": {"path": "team-b/secret-model"}}))
        lab.api.create(caches, weightcache("control-plane", {**own, "tolerations": [{"operator": "Exists"}]}))
        wait_for(lambda: lab.api.get_or_none(ns_path(ns, "daemonsets", "own-agent", group="apps")),
                 timeout=60, what="the DaemonSet of the cache on the namespace's own model")

        def degraded(name: str, reason: str) -> dict[str, Any] | None:
            conditions = (lab.api.get(f"{caches}/{name}").get("status") or {}).get("conditions") or []
            return next((c for c in conditions if c["type"] == "Degraded" and c["status"] == "True"
                         and c.get("reason") == reason), None)
        theirs = wait_for(lambda: degraded("theirs", "ModelPathNotAllowed"), timeout=60, what="the model refusal")
        assert theirs["message"].startswith(f"model.path 'team-b/secret-model' is outside what namespace {ns} may "
                                            f"load (under the model root: {ns}/;")
        cp = wait_for(lambda: degraded("control-plane", "TolerationNotAllowed"), timeout=60,
                      what="the toleration refusal")
        assert "tolerates the control plane's taint node-role.kubernetes.io/control-plane:NoSchedule" in cp["message"]
        for name in ("theirs", "control-plane"):
            assert lab.api.get_or_none(ns_path(ns, "daemonsets", f"{name}-agent", group="apps")) is None, name
        events = wait_for(lambda: [e for e in lab.api.get(ns_path(ns, "events"))["items"]
                                   if e.get("reason") in ("ModelPathNotAllowed", "TolerationNotAllowed")
                                   and e.get("type") == "Warning"] or None, timeout=30, what="Warning Events")
        assert {e["involvedObject"]["name"] for e in events} >= {"theirs", "control-plane"}, events
        log.seek(0)
        assert "Traceback" not in log.read()
    finally:
        operator.terminate()
        try:
            operator.wait(60)  # kopf's graceful stop, which beside the run's other workers can take a while
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait()
        log.close()
        lab.delete_namespace(ns)
