"""`kubectl get wc,wces` as a new user reads it, on a real control plane: counts print 0, never
blank; a STATUS column says why each object is not Ready; a cache that no node runs and a cache
whose PersistentVolumeClaim does not exist are Warning events naming what is wrong.

The operator runs in this process with the chart's service account, as in the other tests on
a real control plane; no kubelet is needed: nothing here gets as far as running a pod. The
claim's absence is what the real kube-scheduler says on the agent pod.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from k8s_lab import DEFAULT_NODES, REPO, Lab, wait_for

pytestmark = [pytest.mark.timeout(300)]

spec = importlib.util.spec_from_file_location("failover_e2e_k8s", REPO / "bench" / "failover_e2e_k8s.py")
assert spec and spec.loader
e2e_bench = sys.modules.get("failover_e2e_k8s") or importlib.util.module_from_spec(spec)
if "failover_e2e_k8s" not in sys.modules:
    sys.modules["failover_e2e_k8s"] = e2e_bench
    spec.loader.exec_module(e2e_bench)

NODE_LABEL = "weightcache.io/newcomer-test"  # the one node the claim-less cache selects
CLAIM = "model-not-created"
RULES = [{"pattern": ".*", "mode": "replicated"}]


def table(output: str) -> dict[str, dict[str, str]]:
    """`kubectl get` tables (several kinds: one table each) -> {NAME: {COLUMN: cell}}, cells cut at the
    header's column starts, as a person reads them (an empty cell stays '')."""
    rows: dict[str, dict[str, str]] = {}
    for block in output.strip().split("\n\n"):
        header, *lines = block.splitlines()
        starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
        names = header.split()
        for line in lines:
            cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
            rows[cells[0]] = dict(zip(names, cells))
    return rows


def warnings(lab: Lab, namespace: str, name: str) -> list[dict]:
    events = json.loads(lab.kubectl("get", "events", "-n", namespace, "-o", "json", "--field-selector",
                                    f"involvedObject.name={name},type=Warning"))["items"]
    return events


def test_kubectl_get_shows_0_and_why_and_failures_are_warning_events(k8s_chart: Lab) -> None:
    from weightcache_operator.config import OperatorConfig

    lab = k8s_chart
    ns = lab.namespace("newcomer")
    node = DEFAULT_NODES[-1]
    root = Path(tempfile.mkdtemp(prefix="wc-newcomer-"))
    atexit.register(shutil.rmtree, root, True)
    docs = [
        {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": "nowhere", "namespace": ns},
         "spec": {"model": {"path": "m"}, "nodeSelector": {NODE_LABEL: "no-such-node"}}},
        {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": "noclaim", "namespace": ns},
         "spec": {"model": {"pvc": CLAIM}, "nodeSelector": {NODE_LABEL: "yes"},
                  "sharding": {"preset": "none", "rules": RULES}}},
        {"apiVersion": "weightcache.io/v1alpha1", "kind": "EngineSet", "metadata": {"name": "orphan", "namespace": ns},
         "spec": {"cacheRef": {"name": "no-such-cache"}, "replicas": 1,
                  "template": {"spec": {"containers": [{"name": "engine", "image": "registry.local/engine:1"}]}}}},
    ]
    with contextlib.ExitStack() as stack:
        lab.kubectl("label", "node", node, f"{NODE_LABEL}=yes", "--overwrite")
        stack.callback(lab.kubectl, "label", "node", node, f"{NODE_LABEL}-", check=False)
        stack.callback(lab.delete_namespace, ns)
        runner = stack.enter_context(e2e_bench.operator_runner(
            lab, ns, root, OperatorConfig(poll_interval=1.0, agent_http_timeout=1.0)))
        stack.callback(delete_all, lab, ns)  # while the operator runs: its finalizers
        lab.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

        def settled() -> dict[str, dict[str, str]] | None:
            rows = table(lab.kubectl("get", "wc,wces", "-n", ns))
            statuses = {name.split("/")[-1]: row.get("STATUS") for name, row in rows.items()}
            # NODES is the DaemonSet's desired count, which its controller sets after the operator's
            # first status: the row has settled once that count has reached the status too
            nodes = next((r.get("NODES") for n, r in rows.items() if n.startswith("weightcache.")
                          and n.endswith("/noclaim")), None)
            return rows if statuses == {"nowhere": "NoNodes", "noclaim": "ClaimNotFound",
                                        "orphan": "CacheNotFound"} and nodes not in (None, "", "0", "<none>") else None

        try:
            rows = wait_for(settled, timeout=90, interval=0.5, what="the STATUS column of each object")
        except TimeoutError:
            raise AssertionError(lab.kubectl("get", "wc,wces,pods", "-n", ns, "-o", "wide")) from None
        caches = {n.split("/")[-1]: r for n, r in rows.items() if n.startswith("weightcache.")}
        sets = {n.split("/")[-1]: r for n, r in rows.items() if n.startswith("engineset.")}
        assert (caches["nowhere"]["READY"], caches["nowhere"]["NODES"]) == ("0", "0")
        assert (caches["noclaim"]["READY"], caches["noclaim"]["NODES"]) == ("0", "1")
        assert caches["noclaim"]["MODEL"] == f"pvc/{CLAIM}"
        assert (sets["orphan"]["READY"], sets["orphan"]["SERVING"], sets["orphan"]["STANDBYS"]) == ("0", "0", "0")

        # The kube-scheduler's own words put the claim's name on the agent pod.
        pod, = json.loads(lab.kubectl("get", "pods", "-n", ns, "-l", "weightcache.io/cache=noclaim",
                                      "-o", "json"))["items"]
        scheduled, = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
        assert f'persistentvolumeclaim "{CLAIM}" not found' in scheduled["message"], scheduled

        for name, reason, words in (("nowhere", "NoNodes", ["no node runs an agent"]),
                                    ("noclaim", "ClaimNotFound", [CLAIM, f"namespace {ns}"]),
                                    ("orphan", "CacheNotFound", ["no-such-cache"])):
            events = wait_for(lambda n=name, r=reason: [e for e in warnings(lab, ns, n) if e["reason"] == r],
                              timeout=30, what=f"a Warning event {reason} on {name}")
            assert any(all(w in e["message"] for w in words) for e in events), events
    assert runner.exception is None


def delete_all(lab: Lab, ns: str) -> None:
    lab.kubectl("delete", "wc,wces", "--all", "-n", ns, "--wait=false", check=False)
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not json.loads(lab.kubectl("get", "wc,wces", "-n", ns, "-o", "json"))["items"],
                 timeout=30, what="the objects gone")
