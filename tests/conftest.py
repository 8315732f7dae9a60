"""Fixtures shared across test modules: the real Kubernetes control plane (one per session)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from k8s_lab import Lab, unavailable_reason


@pytest.fixture(scope="session")
def k8s_lab() -> Iterator[Lab]:
    """A running control plane with nodes node-1 and node-2, the GPU DeviceClass and the CRDs.

    Skips where the control-plane scripts or etcd are absent. Started once per session and
    stopped (down.sh --wipe, nothing left running) at its end.
    """
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no Kubernetes control plane: {reason}")
    lab = Lab.start()
    try:
        yield lab
    finally:
        lab.stop()
    left = lab.leftover_pids()
    assert not left, f"control-plane processes left running: {left}"


@pytest.fixture(scope="session")
def k8s_chart(k8s_lab: Lab) -> Lab:
    """The lab with the project's Helm chart installed (release `weightcache` in namespace
    `weightcache-system`): the operator's RBAC, the agent's ClusterRole and the
    ValidatingAdmissionPolicy; its operator Deployment scaled to 0. Needs helm-sdkpy."""
    import os

    from k8s_lab import install_or_upgrade_chart

    try:
        import helm_sdkpy  # noqa: F401
    except Exception as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"helm-sdkpy not available: {e}")
    install_or_upgrade_chart(k8s_lab)
    # No pod for the chart's operator Deployment: a test that needs the operator runs it as a
    # local process against the lab, and a fake kubelet must not find an operator pod to run.
    k8s_lab.kubectl("-n", "weightcache-system", "scale", "deployment", "--all", "--replicas=0")
    return k8s_lab
