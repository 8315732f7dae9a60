"""The control-plane harness itself: it skips with a reason where it cannot run, and it
brings up what the other tests rely on."""
from __future__ import annotations

from pathlib import Path

from fake_kubelet import _expand
from k8s_lab import ASSETS_ENV, GPU_DRIVER, Lab, unavailable_reason


def test_a_clone_without_the_binaries_is_told_the_envtest_convention(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(ASSETS_ENV, raising=False)
    reason = unavailable_reason(tmp_path / "shared" / "k8s")
    assert reason and "set $KUBEBUILDER_ASSETS to a directory holding kube-apiserver, etcd, kubectl" in reason
    # a directory with only envtest's three: the two components the tests also need are named
    assets = tmp_path / "assets"
    assets.mkdir()
    for name in ("kube-apiserver", "etcd", "kubectl"):
        (assets / name).write_text("#!/bin/sh\n")
        (assets / name).chmod(0o755)
    monkeypatch.setenv(ASSETS_ENV, str(assets))
    reason = unavailable_reason(tmp_path / "shared" / "k8s")
    assert reason and f"$KUBEBUILDER_ASSETS={assets} lacks kube-controller-manager, kube-scheduler" in reason


def test_the_lab_has_ready_nodes_the_gpu_class_and_the_crds(k8s_lab: Lab) -> None:
    nodes = {n["metadata"]["name"]: n for n in k8s_lab.api.get("/api/v1/nodes")["items"]}
    assert set(k8s_lab.nodes) <= set(nodes)
    for name in k8s_lab.nodes:
        ready = [c for c in nodes[name]["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"
    assert k8s_lab.api.get(f"/apis/resource.k8s.io/v1/deviceclasses/{GPU_DRIVER}")
    crds = k8s_lab.api.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions")["items"]
    assert "weightcaches.weightcache.io" in {c["metadata"]["name"] for c in crds}
    assert "system:masters" in k8s_lab.kubectl("auth", "whoami")  # the kubeconfig is the admin's
    assert k8s_lab.leftover_pids()  # its processes are found by their lab directory


def test_command_arguments_expand_like_the_kubelet() -> None:
    env = {"PORT": "8000"}
    assert _expand("--port=$(PORT)", env) == "--port=8000"
    assert _expand("$$(PORT) $(MISSING)", env) == "$(PORT) $(MISSING)"
