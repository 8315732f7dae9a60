#!/usr/bin/env python3
"""Render deploy/static/weightcache.yaml from the Helm chart, for clusters without Helm.

    python deploy/static/render.py            # write deploy/static/weightcache.yaml
    python deploy/static/render.py --check    # exit 1 when the committed file differs from a fresh render

The file is what `helm install weightcache charts/weightcache -n weightcache
--create-namespace` creates with the chart's default values: the namespace, the CRDs, then
the release's objects as Helm renders them, less one: the operator's control key, a Secret
the chart fills with a random key at install, which each cluster must make for itself
(docs/upgrade.md says how). Helm renders against a live API server (the kinds it serves
decide whether the admission policies render), so this starts a throwaway control plane
the way the tests do (tests/k8s_lab.py: the binaries from $KUBEBUILDER_ASSETS, or
../shared/k8s with etcd and kubectl on PATH), installs the chart there through Helm's Go
library (helm-sdkpy), and reads the release's manifest back. Kubernetes v1.36 renders it,
so the file carries the admission policies: it needs Kubernetes >= 1.30.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "weightcache"
OUTPUT = Path(__file__).resolve().parent / "weightcache.yaml"
RELEASE = NAMESPACE = "weightcache"
HEADER = f"""\
# weightcache: static manifests for clusters without Helm (Kubernetes >= 1.30).
# Rendered from charts/weightcache with its default values, as `helm install {RELEASE}
# charts/weightcache -n {NAMESPACE} --create-namespace` would create them, less the operator's
# control key (a random Secret each cluster makes: docs/upgrade.md). Do not edit: regenerate
# with `python deploy/static/render.py`. Install, upgrade, uninstall: docs/upgrade.md.
"""


def is_control_key(doc: dict) -> bool:
    return doc.get("kind") == "Secret" and doc["metadata"]["name"].endswith("-control-key")


def compose(release_manifest: str) -> str:
    """The file's text from the release's manifest: namespace, CRDs, then the release less its key."""
    namespace = yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
                               sort_keys=False)
    parts = [HEADER + "---\n" + namespace]
    for crd in sorted((CHART / "crds").glob("*.yaml")):
        parts.append(f"---\n# Source: weightcache/crds/{crd.name}\n" + crd.read_text().removeprefix("---\n"))
    for text in release_manifest.split("\n---\n"):
        text = text.strip("\n").removeprefix("---\n")
        doc = yaml.safe_load(text)
        if doc and not is_control_key(doc):
            parts.append("---\n" + text + "\n")
    return "".join(parts)


def render(kubeconfig: str) -> str:
    """Install the chart into the throwaway cluster `kubeconfig` names, read the release back,
    and uninstall it again (its namespace stays)."""
    import helm_sdkpy

    config = helm_sdkpy.Configuration(namespace=NAMESPACE, kubeconfig=kubeconfig)
    release = asyncio.run(helm_sdkpy.Install(config).run(RELEASE, str(CHART), create_namespace=True, wait=False))
    try:
        return compose(release["manifest"])
    finally:
        asyncio.run(helm_sdkpy.Uninstall(config).run(RELEASE, wait=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file differs")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from k8s_lab import Lab, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"render.py: no Kubernetes control plane to render against: {reason}", file=sys.stderr)
        return 2
    lab = Lab.start(nodes=())
    try:
        text = render(str(lab.kubeconfig))
    finally:
        lab.stop()
    if args.check:
        if OUTPUT.read_text() != text:
            print(f"render.py: {OUTPUT.relative_to(REPO)} differs from the chart: run python deploy/static/render.py",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
