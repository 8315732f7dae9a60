"""A deleted EngineSet's compile caches removed from every node its engines ran on.

Why: ``compile_cache.py`` gives an EngineSet's engine pods host directories
``<root>/<namespace>/<engineset>/<key>`` (33 MiB for an 8B bf16 model under vLLM, more with
DeepGEMM's JIT); the kubelet creates them and nothing of Kubernetes removes them. The
EngineSet's deletion handler does, as Kubernetes' local-path provisioners remove a volume's
directory: one short-lived pod per node, pinned there by ``nodeName``, that mounts the
namespace's directory and runs ``weightcache compile-cache-prune /cache <engineset>`` from the
agent's image.

How data flows: kopf calls ``CompileCacheCleanup.on_delete`` while the EngineSet is held by
the operator's finalizer (its engine pods still exist: the garbage collector takes them only
once the EngineSet is gone). The nodes are those of its engine pods that mount a compile
cache, plus those of cleaner pods made by an earlier try. Each try creates the missing
cleaners and reads the others: every cleaner ``Succeeded`` -> they are deleted and the
EngineSet goes; one ``Failed``, or the cleaners not done ``CLEANUP_SECONDS`` after the
deletion began (a node gone or unreachable, an image that cannot be pulled), or the API
refusing a cleaner (a namespace being deleted) -> a Warning Event ``CompileCacheLeft``
naming the nodes and the command to run there, and the EngineSet goes anyway: a node's
leftover directory must not hold a deletion forever. Otherwise the handler retries in 2 s.

A cleaner runs as root (the kubelet made the directories root-owned) with every capability
dropped, no service-account token, a read-only root filesystem; the command removes only
the EngineSet's own directory, never following a link (``compile_cache_prune.py``).
"""
from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from ...api.v1alpha1 import API_GROUP, API_VERSION, ENGINESET_KIND
from ...config import OperatorConfig
from ...kube import KubeApi
from .compile_cache import COMPILE_CACHE_VOLUME
from .manifests import LABEL_ENGINESET

LABEL_CLEANER = f"{API_GROUP}/compile-cache-of"
CLEANUP_SECONDS = 120.0
RETRY_SECONDS = 2.0
CLEANER_MOUNT = "/cache"


def cleaner_name(engineset: str, node: str) -> str:
    """A pod name per EngineSet and node, at most 63 characters, the same on every try."""
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return f"{engineset[:35].rstrip('-')}-compile-cache-{digest}"


def cleaner_pod(engineset: str, namespace: str, uid: str, node: str, config: OperatorConfig) -> dict[str, Any]:
    """The pod that removes `engineset`'s compile caches on `node`."""
    root = f"{config.compile_cache_root.rstrip('/')}/{namespace}"
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": cleaner_name(engineset, node), "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "weightcache-operator",
                       "app.kubernetes.io/name": "weightcache-compile-cache-cleaner", LABEL_CLEANER: engineset},
            "ownerReferences": [{"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": ENGINESET_KIND,
                                 "name": engineset, "uid": uid}],
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "tolerations": [{"operator": "Exists"}],  # the GPU nodes' taints, whatever they are
            "imagePullSecrets": [{"name": s} for s in config.agent_image_pull_secrets],
            "containers": [{
                "name": "prune", "image": config.agent_image, "imagePullPolicy": config.agent_image_pull_policy,
                "command": ["weightcache", "compile-cache-prune", CLEANER_MOUNT, engineset],
                "volumeMounts": [{"name": COMPILE_CACHE_VOLUME, "mountPath": CLEANER_MOUNT}],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}},
                "securityContext": {"runAsUser": 0, "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
            }],
            "volumes": [{"name": COMPILE_CACHE_VOLUME, "hostPath": {"path": root, "type": "DirectoryOrCreate"}}],
        },
    }


def cache_nodes(pods: list[Mapping[str, Any]]) -> set[str]:
    """The nodes of the pods that mount a compile cache."""
    return {p["spec"]["nodeName"] for p in pods if p.get("spec", {}).get("nodeName") and any(
        v.get("name") == COMPILE_CACHE_VOLUME and v.get("hostPath") for v in p["spec"].get("volumes") or [])}


def _age(meta: Mapping[str, Any]) -> float:
    since = meta.get("deletionTimestamp")
    if not since:
        return 0.0
    started = dt.datetime.fromisoformat(since.replace("Z", "+00:00"))
    return (dt.datetime.now(dt.timezone.utc) - started).total_seconds()


class CompileCacheCleanup:
    """The EngineSet deletion handler's work, with the operator's API client and config."""

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.api: KubeApi | None = None

    def on_delete(self, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        api = self.api
        assert api is not None
        cleaners = {p["spec"]["nodeName"]: p for p in api.list_pods(ns, {LABEL_CLEANER: name})}
        nodes = cache_nodes(api.list_pods(ns, {LABEL_ENGINESET: name})) | set(cleaners)
        if not nodes:
            return
        refused = []
        for node in sorted(nodes - set(cleaners)):
            try:
                cleaners[node] = api.create(cleaner_pod(name, ns, uid, node, self.config))
            except ApiException as e:
                if e.status != 409:
                    refused.append(f"{node} (API error {e.status}: {e.reason})")
        phases = {node: (p.get("status") or {}).get("phase", "Pending") for node, p in cleaners.items()}
        if not refused and all(ph == "Succeeded" for ph in phases.values()) and len(phases) == len(nodes):
            self._delete(api, ns, cleaners)
            return
        failed = refused + [f"{node} (cleaner {phases[node]})" for node in sorted(phases)
                            if phases[node] == "Failed"]
        late = _age(meta) > CLEANUP_SECONDS
        if not failed and not late:
            waiting = sorted(n for n, ph in phases.items() if ph != "Succeeded")
            raise kopf.TemporaryError(f"removing the compile caches on {', '.join(waiting)}", delay=RETRY_SECONDS)
        left = failed + ([] if not late else [f"{n} (cleaner {ph} after {CLEANUP_SECONDS:.0f} s)"
                                             for n, ph in sorted(phases.items()) if ph not in ("Succeeded", "Failed")])
        kopf.event(body, type="Warning", reason="CompileCacheLeft", message=(
            f"the compile caches of EngineSet {name} were not removed on {', '.join(left)}; on each such node run "
            f"`weightcache compile-cache-prune {self.config.compile_cache_root.rstrip('/')}/{ns} {name}`")[:1024])
        self._delete(api, ns, cleaners)

    @staticmethod
    def _delete(api: KubeApi, ns: str, cleaners: Mapping[str, Mapping[str, Any]]) -> None:
        for pod in cleaners.values():
            api.delete("Pod", ns, pod["metadata"]["name"])
