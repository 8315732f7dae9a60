"""Install, upgrade and uninstall as docs/upgrade.md says, on a real control plane, and the
static manifests: a fresh render equals the committed file, and they apply and go away.

The docs' shell blocks run literally in bash, with `kubectl` against a control plane of this
module's own (the chart's cluster-wide objects and the CRDs come and go here, which the
session's shared control plane must keep) and a `helm` on PATH that does what the helm CLI
does through Helm's own Go library (helm-sdkpy: install, upgrade, uninstall, get values).
After each uninstall nothing of weightcache is left: no namespace, no CRD, no object of any
kind that names it. One control plane start (~15 s) and ~40 s of commands in all.
"""
from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from k8s_lab import Lab, tool_env, unavailable_reason, wait_for

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "weightcache"
STATIC = REPO / "deploy" / "static"
UPGRADE = (REPO / "docs" / "upgrade.md").read_text()
REGISTRY = "registry.example.com/platform"
CRDS = ("enginesets.weightcache.io", "weightcaches.weightcache.io")

HELM = r'''#!PYTHON
"""`helm` for the docs' commands: install, upgrade, uninstall, get values, through helm-sdkpy."""
import argparse, asyncio, os, sys
import yaml
import helm_sdkpy

def typed(text):
    return {"true": True, "false": False}.get(text, int(text) if text.isdigit() else text)

p = argparse.ArgumentParser(prog="helm")
p.add_argument("command"); p.add_argument("args", nargs="*")
p.add_argument("-n", "--namespace", default="default"); p.add_argument("--create-namespace", action="store_true")
p.add_argument("--set", action="append", default=[]); p.add_argument("-f", "--values", action="append", default=[])
p.add_argument("--wait", action="store_true"); p.add_argument("-o", "--output", default="yaml")
a = p.parse_args()
config = helm_sdkpy.Configuration(namespace=a.namespace, kubeconfig=os.environ["KUBECONFIG"])
values = {}
for path in a.values:
    values.update(yaml.safe_load(open(path)) or {})
for item in a.set:
    key, value = item.split("=", 1)
    node = values
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = typed(value)
if a.command == "install":
    name, chart = a.args
    asyncio.run(helm_sdkpy.Install(config).run(name, chart, values=values, create_namespace=a.create_namespace,
                                               wait=a.wait))
elif a.command == "upgrade":
    name, chart = a.args
    asyncio.run(helm_sdkpy.Upgrade(config).run(name, chart, values=values, wait=a.wait))
elif a.command == "uninstall":
    (name,) = a.args
    asyncio.run(helm_sdkpy.Uninstall(config).run(name, wait=a.wait))
elif a.command == "get" and a.args[0] == "values":
    sys.stdout.write(yaml.safe_dump(asyncio.run(helm_sdkpy.GetValues(config).run(a.args[1]))))
else:
    sys.exit(f"helm: {a.command} is not one of the docs' commands")
'''


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no Kubernetes control plane: {reason}")
    try:
        import helm_sdkpy  # noqa: F401
    except Exception as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"helm-sdkpy not available: {e}")
    lab = Lab.start(nodes=())  # no node: the operator's Deployment stays Pending and goes at once
    try:
        yield lab
    finally:
        lab.stop()
    assert not lab.leftover_pids()


@pytest.fixture
def shell(lab: Lab, tmp_path: Path):
    """run(block, cwd): a docs block in `bash -euo pipefail`, kubectl and helm pointed at the lab."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "helm").write_text(HELM.replace("PYTHON", sys.executable, 1))
    (bindir / "helm").chmod(0o755)
    kubectl = shutil.which(tool_env().get("KUBECTL", "kubectl"), path=tool_env().get("PATH"))
    os.symlink(kubectl, bindir / "kubectl")
    env = {**lab.env, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "REGISTRY": REGISTRY}

    def run(block: str, cwd: Path, **extra: str) -> str:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env={**env, **extra},
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, (block, done.stdout[-2000:], done.stderr[-3000:])
        return done.stdout

    return run


def blocks(after: str, text: str = UPGRADE) -> list[str]:
    """The ```bash blocks of the section whose heading is `after`."""
    body = text.split(f"\n## {after}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", body, re.DOTALL)


def leftovers(lab: Lab) -> list[str]:
    """Every object of any kind (events aside) whose name, namespace or labels name weightcache."""
    kinds = [k for k in lab.kubectl("api-resources", "--verbs=list", "-o", "name").split()
             if not k.startswith("events")]
    items = json.loads(lab.kubectl("get", ",".join(kinds), "-A", "-o", "json", timeout=120))["items"]
    found = []
    for item in items:
        meta = item["metadata"]
        if "weightcache" in json.dumps([meta.get("name"), meta.get("namespace"), meta.get("labels")]):
            found.append(f"{item['kind']} {meta.get('namespace', '')}/{meta['name']}")
    return found


def without_crds(lab: Lab) -> None:
    lab.kubectl("delete", "crd", *CRDS, "--ignore-not-found", "--wait")


def nothing_left(lab: Lab) -> None:
    """No object names weightcache; the API group's APIService follows its CRDs within seconds."""
    assert [x for x in leftovers(lab) if not x.startswith("APIService ")] == []
    wait_for(lambda: leftovers(lab) == [], timeout=30, interval=0.5, what=f"the APIService gone: {leftovers(lab)}")


def render_module():
    spec = importlib.util.spec_from_file_location("render_static", STATIC / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the static manifests: equal to a fresh render --------------------------------------------------

def test_the_static_manifests_equal_a_fresh_render_of_the_chart(lab: Lab) -> None:
    fresh = render_module().render(str(lab.kubeconfig))
    committed = (STATIC / "weightcache.yaml").read_text()
    if committed != fresh:
        diff = difflib.unified_diff(committed.splitlines(), fresh.splitlines(), "committed", "rendered", lineterm="")
        pytest.fail("deploy/static/weightcache.yaml differs from the chart: run python deploy/static/render.py\n"
                    + "\n".join(list(diff)[:60]))


# -- Helm: install as the README says, upgrade and uninstall as docs/upgrade.md says ---------------

def previous_release(root: Path) -> Path:
    """The chart as a previous release shipped it: CRDs without their printer columns."""
    chart = root / "charts" / "weightcache"
    shutil.copytree(CHART, chart)
    for path in (chart / "crds").glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            version.pop("additionalPrinterColumns", None)
        path.write_text(yaml.safe_dump(crd))
    return chart


def printer_columns(lab: Lab, crd: str) -> list[str]:
    live = lab.api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
    return [c["name"] for c in live["spec"]["versions"][0].get("additionalPrinterColumns", [])]


def operator_container(lab: Lab) -> dict:
    deployment = lab.api.get("/apis/apps/v1/namespaces/weightcache/deployments/weightcache")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_helm_install_upgrade_and_uninstall_as_documented_leave_nothing(lab: Lab, shell, tmp_path: Path) -> None:
    without_crds(lab)
    readme = (REPO / "README.md").read_text()
    install = re.search(r"^helm install .*?[^\\]\n", blocks("On Kubernetes", readme)[0], re.DOTALL | re.MULTILINE)
    shell(install.group(0), cwd=previous_release(tmp_path / "old").parents[1])  # the README's install, an older chart
    assert operator_container(lab)["image"] == f"{REGISTRY}/weightcache-operator:0.1.0"
    assert printer_columns(lab, "weightcaches.weightcache.io") == []

    # the operator runs (here as a process: no kubelet) and the examples give it work
    operator = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "operator", "--all-namespaces"],
                                env=lab.env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "operator.log", "w"),
                                start_new_session=True)
    try:
        lab.kubectl("apply", "-f", str(REPO / "examples" / "llama-70b-tp8-fp8.yaml"),
                    "-f", str(REPO / "examples" / "engineset-chat.yaml"))
        wait_for(lambda: lab.api.get_or_none("/apis/apps/v1/namespaces/default/daemonsets/llama-70b-agent"),
                 timeout=60, what="the operator's agent DaemonSet")
        wait_for(lambda: lab.api.get_or_none("/api/v1/namespaces/default/serviceaccounts/weightcache-agent"),
                 timeout=30, what="the agents' ServiceAccount")

        new = tmp_path / "new"  # this checkout's chart, in a directory the commands may write to
        (new / "charts").mkdir(parents=True)
        (new / "charts" / "weightcache").symlink_to(CHART)
        (upgrade,) = blocks("Upgrade with Helm")
        shell(upgrade, cwd=new, VERSION="0.2.0")
        assert operator_container(lab)["image"] == f"{REGISTRY}/weightcache-operator:0.2.0"
        env = {e["name"]: e.get("value") for e in operator_container(lab)["env"]}
        assert env["WEIGHTCACHE_AGENT_IMAGE"] == f"{REGISTRY}/weightcache-agent:0.2.0"
        for crd in CRDS:  # the CRDs moved too, which helm upgrade alone does not do
            wanted = yaml.safe_load((CHART / "crds" / f"weightcache.io_{crd.split('.')[0]}.yaml").read_text())
            assert printer_columns(lab, crd) == [c["name"] for c in
                                                 wanted["spec"]["versions"][0].get("additionalPrinterColumns", [])]
        assert printer_columns(lab, "weightcaches.weightcache.io")

        (uninstall,) = blocks("Uninstall with Helm")
        shell(uninstall, cwd=new)
    finally:
        os.killpg(operator.pid, signal.SIGTERM)
        operator.wait(timeout=30)
    nothing_left(lab)
    assert lab.api.get_or_none("/api/v1/namespaces/weightcache") is None


# -- the static manifests: install and uninstall as docs/upgrade.md says ---------------------------

def test_the_static_manifests_install_and_uninstall_as_documented(lab: Lab, shell, tmp_path: Path) -> None:
    without_crds(lab)
    (tmp_path / "deploy" / "static").mkdir(parents=True)
    shutil.copy(STATIC / "weightcache.yaml", tmp_path / "deploy" / "static")
    install, uninstall = blocks("Without Helm: the static manifests")
    shell(install, cwd=tmp_path)

    container = operator_container(lab)
    assert container["image"] == f"{REGISTRY}/weightcache-operator:0.1.0"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["WEIGHTCACHE_AGENT_IMAGE"] == f"{REGISTRY}/weightcache-agent:0.1.0"
    policy = lab.api.get("/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/weightcache-operator-writes")
    assert f"{REGISTRY}/weightcache-agent:0.1.0" in json.dumps(policy) and "ghcr.io" not in json.dumps(policy)
    key = lab.api.get("/api/v1/namespaces/weightcache/secrets/weightcache-control-key")
    assert len(key["data"]["key"]) >= 32
    for crd in CRDS:
        live = lab.api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
        assert any(c["type"] == "Established" and c["status"] == "True" for c in live["status"]["conditions"])

    shell(uninstall, cwd=tmp_path)
    nothing_left(lab)


# -- the chart's monitoring objects, installed and read back ---------------------------------------

MONITORING_CRDS = [{
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{plural}.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
} for kind, plural in (("PodMonitor", "podmonitors"), ("PrometheusRule", "prometheusrules"))]


def test_the_monitoring_objects_install_as_the_chart_ships_them(lab: Lab) -> None:
    """The Prometheus Operator's kinds stand in as bare CRDs: what is checked is what the chart writes."""
    import asyncio

    import helm_sdkpy

    from weightcache_operator.controller.weightcache.manifests import agent_labels

    lab.apply(*MONITORING_CRDS)
    for crd in MONITORING_CRDS:
        lab.kubectl("wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=60s")
    lab.kubectl("create", "namespace", "grafana")
    config = helm_sdkpy.Configuration(namespace="wc-monitoring", kubeconfig=str(lab.kubeconfig))
    on = {"enabled": True}
    asyncio.run(helm_sdkpy.Install(config).run("weightcache", str(CHART), create_namespace=True, wait=False, values={
        "monitoring": {"podMonitor": on, "prometheusRule": on, "dashboard": {**on, "namespace": "grafana"}}}))
    try:
        base = "/apis/monitoring.coreos.com/v1/namespaces/wc-monitoring"
        rule = lab.api.get(f"{base}/prometheusrules/weightcache")
        assert rule["spec"] == yaml.safe_load((CHART / "monitoring" / "alerts.yaml").read_text())
        dashboard = lab.api.get("/api/v1/namespaces/grafana/configmaps/weightcache-dashboard")
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard["data"]["weightcache.json"]) == \
            json.loads((CHART / "monitoring" / "dashboard.json").read_text())
        monitor = lab.api.get(f"{base}/podmonitors/weightcache-agents")["spec"]
        pods = agent_labels("llama")  # the labels the operator gives agent pods
        assert monitor["selector"]["matchLabels"].items() <= pods.items()
        assert pods[monitor["jobLabel"]] == "weightcache-agent"  # the job the agent-down alert selects
        assert monitor["namespaceSelector"] == {"any": True}
        assert monitor["podMetricsEndpoints"][0]["port"] == "http"  # the agent container's port name
    finally:
        asyncio.run(helm_sdkpy.Uninstall(config).run("weightcache", wait=False))
        lab.kubectl("delete", "namespace", "wc-monitoring", "grafana", "--wait")
        lab.kubectl("delete", "crd", *(c["metadata"]["name"] for c in MONITORING_CRDS), "--wait=false")
