"""The EngineSet reconcile on a real control plane, as the chart's operator account.

The operator runs in this process (kopf's ``KopfRunner``) with the bound token of the
ServiceAccount the chart gives it, so every call it makes goes through the chart's RBAC:
a missing verb fails the test. The real scheduler allocates the group's ResourceClaim
through DRA (GPUs published as a driver would), the garbage collector follows the owner
references. No kubelet runs: the test plays it (pod status, IPs), and a node agent is a
real HTTP server on 127.0.0.1 behind an agent pod whose status points at it. When the
EngineSet is deleted, the test plays the kubelet for the operator's compile-cache cleaner too:
it runs the cleaner's command as a process, the pod's host path a directory here.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner

from k8s_lab import Lab, ns_path, pods_path, wait_for
from operator_fixtures import AgentServer
from weightcache_operator.config import OperatorConfig
from weightcache_operator.registry import build_registry, build_settings

pytestmark = [pytest.mark.timeout(300)]

NODE = "node-1"
GPUS = [f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f'engineset-{NODE}-{i}')}" for i in range(4)]
WC = ("weightcache.io", "v1alpha1")


def wc_path(ns: str, plural: str, name: str = "") -> str:
    return f"/apis/{WC[0]}/{WC[1]}/namespaces/{ns}/{plural}" + (f"/{name}" if name else "")


def agent_doc(leases: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"node": NODE, "phase": "Ready", "message": "", "gpuUUIDs": GPUS, "tpSize": 2,
            "replicas": [{"index": 0, "gpus": GPUS[:2], "phase": "Ready"},
                         {"index": 1, "gpus": GPUS[2:], "phase": "Ready"}],
            "ranks": [{"rank": 0, "phase": "Ready", "leases": leases or []}]}


def operator_kubeconfig(lab: Lab, path: Path) -> Path:
    token = lab.bound_token("weightcache-system", "weightcache")
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "lab", "cluster": {"server": lab.server, "certificate-authority": str(lab.ca_path)}}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "lab", "user": "operator"}}],
    }))
    return path


@pytest.fixture
def ns(k8s_chart: Lab) -> Iterator[str]:
    k8s_chart.ensure_device_class()
    k8s_chart.publish_gpus(NODE, GPUS)
    name = k8s_chart.namespace("es")
    yield name
    k8s_chart.delete_namespace(name)


def kubelet(lab: Lab, ns: str, name: str, ip: str) -> dict[str, Any]:
    """What a kubelet reports for a started pod."""
    return lab.api.patch(pods_path(ns, name) + "/status", {"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}]}})


def test_engineset_on_a_real_api_server_with_the_charts_rbac(k8s_chart: Lab, ns: str, tmp_path: Path) -> None:
    lab = k8s_chart
    with AgentServer(agent_doc()) as agent:
        # The agent pod: controlled by another object, so the DaemonSet controller leaves it be.
        holder = lab.api.create(ns_path(ns, "configmaps"), {"metadata": {"name": "agent-holder"}})
        lab.api.create(pods_path(ns), {
            "metadata": {"name": "qwen-agent-x", "labels": {"app.kubernetes.io/name": "weightcache-agent",
                                                             "weightcache.io/cache": "qwen"},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "agent-holder",
                                              "uid": holder["metadata"]["uid"], "controller": True}]},
            "spec": {"nodeName": NODE, "containers": [{"name": "agent", "image": "agent:1", "ports": [
                {"name": "http", "containerPort": agent.port}]}]}})
        kubelet(lab, ns, "qwen-agent-x", "127.0.0.1")

        registry, _ = build_registry(OperatorConfig(poll_interval=1.0, agent_http_timeout=1.0),
                                     kubeconfig=str(operator_kubeconfig(lab, tmp_path / "kubeconfig")))
        with KopfRunner(["run", "--standalone", "--namespace", ns], registry=registry,
                        settings=build_settings(), timeout=60) as runner:
            # No node matches the cache's selector: the DaemonSet makes no pods of its own.
            lab.api.create(wc_path(ns, "weightcaches"), {
                "apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": "qwen"},
                "spec": {"model": {"path": "qwen"}, "parallelism": {"tensor": 2}, "gpusPerNode": 4,
                         "nodeSelector": {"weightcache.io/test": "none"}}})
            lab.api.create(wc_path(ns, "enginesets"), {
                "apiVersion": "weightcache.io/v1alpha1", "kind": "EngineSet", "metadata": {"name": "chat"},
                "spec": {"cacheRef": {"name": "qwen"}, "replicas": 1, "standbys": 1, "template": {
                    "spec": {"containers": [{"name": "engine", "image": "engine:1",
                                             "resources": {"limits": {"nvidia.com/gpu": 2}}}]}}}})

            # The agents' identity, made by the operator with nothing but `bind` on its role.
            wait_for(lambda: lab.api.get_or_none(ns_path(ns, "rolebindings", "weightcache-agent",
                                                         group="rbac.authorization.k8s.io")),
                     timeout=60, what="the agents' RoleBinding")
            ds = wait_for(lambda: lab.api.get_or_none(f"/apis/apps/v1/namespaces/{ns}/daemonsets/qwen-agent"),
                          timeout=60, what="the agent DaemonSet")
            assert ds["spec"]["template"]["spec"]["serviceAccountName"] == "weightcache-agent"

            # The scheduler allocates the group's claim (exactly the pinned GPUs) and places both pods.
            def scheduled() -> list[str] | None:
                pods = [lab.api.get_or_none(pods_path(ns, n)) for n in ("chat-0-0", "chat-0-1")]
                nodes = [p and p["spec"].get("nodeName") for p in pods]
                return nodes if all(nodes) else None
            assert wait_for(scheduled, timeout=90, what="both engine pods scheduled") == [NODE, NODE]
            claim = lab.api.get(ns_path(ns, "resourceclaims", "chat-0", group="resource.k8s.io"))
            results = claim["status"]["allocation"]["devices"]["results"]
            slices = lab.api.get("/apis/resource.k8s.io/v1/resourceslices")["items"]
            uuid_of = {(s["spec"]["pool"]["name"], d["name"]): d["attributes"]["uuid"]["string"]
                       for s in slices for d in s["spec"]["devices"]}
            assert sorted(uuid_of[(r["pool"], r["device"])] for r in results) == sorted(GPUS[:2])

            # The pods start; the agent holds chat-0-0 as primary: the operator labels it serving.
            pods = {n: kubelet(lab, ns, n, ip) for n, ip in (("chat-0-0", "10.0.0.10"), ("chat-0-1", "10.0.0.11"))}
            agent.doc = agent_doc([
                {"role": "primary", "group": f"{ns}/chat-0", "pod": {
                    "namespace": ns, "name": "chat-0-0", "uid": pods["chat-0-0"]["metadata"]["uid"]}},
                {"role": "standby", "group": f"{ns}/chat-0", "pod": {
                    "namespace": ns, "name": "chat-0-1", "uid": pods["chat-0-1"]["metadata"]["uid"]}}])
            wait_for(lambda: lab.api.get(pods_path(ns, "chat-0-0"))["metadata"]["labels"]
                     .get("weightcache.io/serving") == "true", timeout=60, what="chat-0-0 serving")
            es = wait_for(lambda: (e := lab.api.get(wc_path(ns, "enginesets", "chat")))
                          .get("status", {}).get("servingGroups") == 1 and e, timeout=60, what="status")
            assert es["status"]["groups"][0]["primary"] == "chat-0-0"
            ready = {c["type"]: c for c in es["status"]["conditions"]}["Ready"]
            assert ready["status"] == "True", ready
            # The Service's endpoints: the serving pod only.
            def endpoints() -> set[str] | None:
                slices = lab.api.get(f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
                                     labelSelector="kubernetes.io/service-name=chat")["items"]
                ips = {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}
                return ips or None
            assert wait_for(endpoints, timeout=60, what="the Service's endpoints") == {"10.0.0.10"}

            # Deleting the WeightCache while the EngineSet names it is held, as a PVC in use is, with
            # an Event saying which EngineSet; the agents and the engines' routes stay.
            lab.api.delete(wc_path(ns, "weightcaches", "qwen"))
            wait_for(lambda: any(e.get("reason") == "InUse" and "EngineSet chat uses this WeightCache"
                                 in e.get("message", "") for e in lab.api.get(
                                     ns_path(ns, "events"), fieldSelector="involvedObject.name=qwen")["items"]),
                     timeout=60, what="the InUse Event")
            time.sleep(3)  # three poll intervals: still held
            cache = lab.api.get(wc_path(ns, "weightcaches", "qwen"))
            assert cache["metadata"].get("deletionTimestamp") and "weightcache.io/operator" in \
                cache["metadata"]["finalizers"]
            assert lab.api.get_or_none(f"/apis/apps/v1/namespaces/{ns}/daemonsets/qwen-agent") is not None
            assert wait_for(endpoints, timeout=10, what="the Service's endpoints") == {"10.0.0.10"}

            # The engines' compile cache on the node, as they leave it; and a link an engine planted in it.
            volume, = [v for v in lab.api.get(pods_path(ns, "chat-0-0"))["spec"]["volumes"]
                       if v["name"] == "weightcache-compile-cache"]
            host = tmp_path / "node"  # the node's filesystem root
            cache_dir = host / volume["hostPath"]["path"].lstrip("/")
            key = cache_dir.name
            (cache_dir / "vllm").mkdir(parents=True)
            (cache_dir / "vllm" / "artifact").write_bytes(os.urandom(1 << 16))
            outside = tmp_path / "outside"
            outside.mkdir()
            (outside / "keep").write_text("not the cache's")
            (cache_dir / "escape").symlink_to(outside, target_is_directory=True)
            es_meta = lab.api.get(wc_path(ns, "enginesets", "chat"))["metadata"]
            assert es_meta["annotations"]["weightcache.io/compile-cache-key"] == key  # its first key: nothing to prune
            assert es_meta["annotations"]["weightcache.io/compile-cache-nodes"] == NODE

            def cleaners(keep: str) -> dict[str, dict[str, Any]] | None:
                pods = lab.api.get(pods_path(ns), labelSelector=(
                    f"weightcache.io/compile-cache-of=chat,weightcache.io/compile-cache-keep={keep}"))["items"]
                return {p["spec"]["nodeName"]: p for p in pods} or None

            def run_cleaner(pod: dict[str, Any]) -> subprocess.CompletedProcess:
                """The kubelet's part: the container's command as a process, its host path a directory here."""
                spec = pod["spec"]
                assert spec["restartPolicy"] == "Never" and spec["tolerations"] == [{"operator": "Exists"}]
                hostpath = spec["volumes"][0]["hostPath"]["path"]
                assert hostpath == os.path.dirname(os.path.dirname(volume["hostPath"]["path"]))  # <root>/<namespace>
                container, = spec["containers"]
                assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
                argv = [a.replace(container["volumeMounts"][0]["mountPath"], str(host / hostpath.lstrip("/")))
                        for a in container["command"]]
                assert argv[0] == "weightcache"
                entry = shutil.which("weightcache")
                command = [entry, *argv[1:]] if entry else [sys.executable, "-m", "weightcache_agent.cli", *argv[1:]]
                done = subprocess.run(command, capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stderr
                return done

            def finished(pod: dict[str, Any], code: int) -> None:
                lab.api.patch(pods_path(ns, pod["metadata"]["name"]) + "/status", {"status": {
                    "phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [{
                        "name": "prune", "ready": False, "restartCount": 0, "image": pod["spec"]["containers"][0]["image"],
                        "imageID": "", "state": {"terminated": {"exitCode": code}}}]}})

            def warned(text: str) -> bool:
                return any(e.get("reason") == "CompileCacheLeft" and text in e.get("message", "") for e in lab.api.get(
                    ns_path(ns, "events"), fieldSelector="involvedObject.name=chat")["items"])

            # A key that an image or model change left behind (the EngineSet's last settled key), on this node
            # and on a node the EngineSet has left: once every pod mounts the current key, cleaners remove the
            # other keys on both nodes; the one whose node is gone fails, and an Event says what was left.
            old = cache_dir.parent / "0123456789abcdef"
            (old / "triton").mkdir(parents=True)
            (old / "triton" / "kernel.cubin").write_bytes(os.urandom(1 << 16))
            lab.api.patch(wc_path(ns, "enginesets", "chat"), {"metadata": {"annotations": {
                "weightcache.io/compile-cache-key": old.name, "weightcache.io/compile-cache-nodes": f"{NODE},node-gone"}}})
            pruning = wait_for(lambda: (c := cleaners(key)) and len(c) == 2 and c, timeout=60,
                               what="a cleaner per recorded node")
            assert pruning[NODE]["spec"]["containers"][0]["command"][-2:] == ["--keep", key]
            assert run_cleaner(pruning[NODE]).stdout.strip() == "removed chat/0123456789abcdef: 0.1 MiB"
            assert not old.exists() and (cache_dir / "vllm" / "artifact").exists()
            finished(pruning[NODE], 0)
            finished(pruning["node-gone"], 1)
            wait_for(lambda: warned(f"node-gone (cleaner Failed); on each such node run `weightcache "
                                    f"compile-cache-prune /var/lib/weightcache/compile-cache/{ns} chat --keep {key}`"),
                     timeout=60, what="the CompileCacheLeft Event")
            wait_for(lambda: lab.api.get(wc_path(ns, "enginesets", "chat"))["metadata"]["annotations"][
                "weightcache.io/compile-cache-key"] == key and cleaners(key) is None, timeout=60,
                what="the current key recorded, the cleaners gone")

            # Deleting the EngineSet: its compile caches are removed on every node it ran on first (the
            # operator's cleaners, run here as the kubelet would), then kopf lets it go, the garbage collector
            # takes the children, and then the held WeightCache goes too.
            lab.api.delete(wc_path(ns, "enginesets", "chat"))
            deleting = wait_for(lambda: (c := cleaners("none")) and len(c) == 2 and c, timeout=60,
                                what="the deletion's cleaners")
            assert "removed chat/" in run_cleaner(deleting[NODE]).stdout
            assert not cache_dir.parent.exists()
            assert (outside / "keep").read_text() == "not the cache's"
            assert lab.api.get_or_none(wc_path(ns, "enginesets", "chat")) is not None  # held until they are done
            finished(deleting[NODE], 0)
            finished(deleting["node-gone"], 1)
            wait_for(lambda: cleaners("none") is None, timeout=60, what="the deletion's cleaners deleted")
            wait_for(lambda: lab.api.get_or_none(wc_path(ns, "enginesets", "chat")) is None, timeout=180,
                     what="the EngineSet gone")
            # The garbage collector, not the operator, takes the children. On a control plane shared with many
            # earlier tests, its pass has lagged beyond a minute: these waits are deadlines, not bars.
            wait_for(lambda: lab.api.get_or_none(ns_path(ns, "services", "chat")) is None, timeout=180,
                     what="the Service collected")
            for n in ("chat-0-0", "chat-0-1"):
                wait_for(lambda n=n: (p := lab.api.get_or_none(pods_path(ns, n))) is None
                         or p["metadata"].get("deletionTimestamp"), timeout=60, what=f"{n} collected")
            wait_for(lambda: lab.api.get_or_none(wc_path(ns, "weightcaches", "qwen")) is None, timeout=60,
                     what="the WeightCache gone once nothing uses it")
        assert runner.exception is None
