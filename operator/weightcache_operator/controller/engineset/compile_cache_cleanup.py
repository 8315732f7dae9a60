"""An EngineSet's compile caches removed from its nodes: old keys after a change, all of them at deletion.

Why: ``compile_cache.py`` gives an EngineSet's engine pods host directories
``<root>/<namespace>/<engineset>/<key>`` (33 MiB for an 8.4 GiB bf16 Llama under vLLM, more with
DeepGEMM's JIT); the kubelet creates them and nothing of Kubernetes removes them. A new image
or model revision starts a new key, and a deleted EngineSet leaves all of its own. The
operator removes them as Kubernetes' local-path provisioners remove a volume's directory:
one short-lived pod per node, pinned there by ``nodeName``, that mounts the namespace's
directory and runs ``weightcache compile-cache-prune /cache <engineset> [--keep <key>]`` from
the agent's image (``compile_cache_prune.py``: never follows a link).

How data flows:

- every EngineSet pass calls ``after_pass`` with its pods and its current cache directory:
  the nodes its engine pods mount a cache on are added to the annotation
  ``weightcache.io/compile-cache-nodes`` (so a node the EngineSet left is still cleaned);
  once every pod mounts the current key's directory (no rollout in progress) and
  ``weightcache.io/compile-cache-key`` names another key, cleaners with ``--keep <key>`` run on
  every recorded node; when they are done the annotation names the current key. So a node
  keeps one key per EngineSet, two during a rollout.
- kopf calls ``on_delete`` while the EngineSet is held by the operator's finalizer (its
  pods still exist: the garbage collector takes them once it is gone): cleaners without
  ``--keep`` on the recorded nodes and those of its pods, retried every 2 s until done.

``run_cleaners`` is one try of either: it creates the missing cleaners and reads the others.
All ``Succeeded`` -> they are deleted: done. One ``Failed``, one not done ``CLEANUP_SECONDS``
after it was created (a node gone, an image that cannot be pulled), or one the API refused (a
namespace being deleted) -> done too, with a Warning Event ``CompileCacheLeft`` naming the
nodes and the command to run on each: a leftover directory must not hold a deletion, or
retry a prune, forever.

A cleaner runs as root (the kubelet made the directories root-owned) with every capability
dropped, no service-account token and a read-only root filesystem.
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
LABEL_KEEP = f"{API_GROUP}/compile-cache-keep"
ANNOTATION_NODES = f"{API_GROUP}/compile-cache-nodes"
ANNOTATION_KEY = f"{API_GROUP}/compile-cache-key"
CLEANUP_SECONDS = 120.0
RETRY_SECONDS = 2.0
CLEANER_MOUNT = "/cache"
ALL = "none"  # LABEL_KEEP of a cleaner that keeps nothing


def cleaner_name(engineset: str, node: str, keep: str | None = None) -> str:
    """A pod name per EngineSet, node and kept key, at most 63 characters, the same on every try."""
    digest = hashlib.sha256(f"{node}\0{keep or ''}".encode()).hexdigest()[:10]
    return f"{engineset[:35].rstrip('-')}-compile-cache-{digest}"


def cleaner_pod(engineset: str, namespace: str, uid: str, node: str, config: OperatorConfig,
                keep: str | None = None) -> dict[str, Any]:
    """The pod that removes `engineset`'s compile caches on `node` (those other than `keep`, if given)."""
    root = f"{config.compile_cache_root.rstrip('/')}/{namespace}"
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": cleaner_name(engineset, node, keep), "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "weightcache-operator",
                       "app.kubernetes.io/name": "weightcache-compile-cache-cleaner",
                       LABEL_CLEANER: engineset, LABEL_KEEP: keep or ALL},
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
                "command": ["weightcache", "compile-cache-prune", CLEANER_MOUNT, engineset,
                            *(["--keep", keep] if keep else [])],
                "volumeMounts": [{"name": COMPILE_CACHE_VOLUME, "mountPath": CLEANER_MOUNT}],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}},
                "securityContext": {"runAsUser": 0, "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
            }],
            "volumes": [{"name": COMPILE_CACHE_VOLUME, "hostPath": {"path": root, "type": "DirectoryOrCreate"}}],
        },
    }


def cache_dirs(pods: list[Mapping[str, Any]]) -> dict[str, set[str]]:
    """node -> the compile-cache host directories its pods mount."""
    out: dict[str, set[str]] = {}
    for p in pods:
        spec = p.get("spec") or {}
        for v in spec.get("volumes") or []:
            if v.get("name") == COMPILE_CACHE_VOLUME and v.get("hostPath") and spec.get("nodeName"):
                out.setdefault(spec["nodeName"], set()).add(v["hostPath"]["path"])
    return out


def recorded_nodes(meta: Mapping[str, Any]) -> set[str]:
    return {n for n in ((meta.get("annotations") or {}).get(ANNOTATION_NODES) or "").split(",") if n}


def _age(pod: Mapping[str, Any]) -> float:
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    if not created:
        return 0.0
    since = dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
    return (dt.datetime.now(dt.timezone.utc) - since).total_seconds()


class CompileCacheCleanup:
    """Both jobs, with the operator's config; each call is given the API client."""

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config

    def on_delete(self, api: KubeApi, body: Mapping[str, Any]) -> None:
        """kopf's deletion handler: every directory of the EngineSet, on every node it ran on."""
        meta = body.get("metadata") or {}
        pods = api.list_pods(meta["namespace"], {LABEL_ENGINESET: meta["name"]})
        if not self.run_cleaners(api, body, set(cache_dirs(pods)) | recorded_nodes(meta), None):
            raise kopf.TemporaryError("removing the compile caches on its nodes", delay=RETRY_SECONDS)

    def after_pass(self, api: KubeApi, body: Mapping[str, Any], pods: list[Mapping[str, Any]],
                   directory: str | None) -> None:
        """Record the nodes of the EngineSet's caches; once all its pods use `directory`, prune the other keys."""
        if directory is None:
            return
        meta = body.get("metadata") or {}
        ns, name = meta["namespace"], meta["name"]
        dirs = cache_dirs(pods)
        nodes = recorded_nodes(meta)
        if set(dirs) - nodes:
            nodes |= set(dirs)
            api.annotate_engineset(ns, name, {ANNOTATION_NODES: ",".join(sorted(nodes))})
        key = directory.rsplit("/", 1)[1]
        annotations = meta.get("annotations") or {}
        settled = bool(dirs) and all(d == {directory} for d in dirs.values())
        if not settled or annotations.get(ANNOTATION_KEY) == key:
            return
        if ANNOTATION_KEY not in annotations and all(len(d) == 1 for d in dirs.values()) and nodes == set(dirs):
            done = True  # the EngineSet's first key on its nodes: nothing older to remove
        else:
            done = self.run_cleaners(api, body, nodes, key)
        if done:
            api.annotate_engineset(ns, name, {ANNOTATION_KEY: key})

    def run_cleaners(self, api: KubeApi, body: Mapping[str, Any], nodes: set[str], keep: str | None) -> bool:
        """One try: create the missing cleaners, read the others; True once all are done (and deleted)."""
        meta = body.get("metadata") or {}
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        cleaners = {p["spec"]["nodeName"]: p for p in api.list_pods(ns, {LABEL_CLEANER: name,
                                                                               LABEL_KEEP: keep or ALL})}
        nodes = nodes | set(cleaners)
        if not nodes:
            return True
        refused = []
        for node in sorted(nodes - set(cleaners)):
            try:
                cleaners[node] = api.create(cleaner_pod(name, ns, uid, node, self.config, keep))
            except ApiException as e:
                if e.status != 409:
                    refused.append(f"{node} (API error {e.status}: {e.reason})")
        phases = {node: (p.get("status") or {}).get("phase", "Pending") for node, p in cleaners.items()}
        left = refused + [f"{n} (cleaner {ph})" for n, ph in sorted(phases.items()) if ph == "Failed"] + [
            f"{n} (cleaner {ph} after {CLEANUP_SECONDS:.0f} s)" for n, ph in sorted(phases.items())
            if ph not in ("Succeeded", "Failed") and _age(cleaners[n]) > CLEANUP_SECONDS]
        if not left and not all(ph == "Succeeded" for ph in phases.values()):
            return False
        if left:
            command = f"weightcache compile-cache-prune {self.config.compile_cache_root.rstrip('/')}/{ns} {name}"
            kopf.event(body, type="Warning", reason="CompileCacheLeft", message=(
                f"the compile caches of EngineSet {name} were not removed on {', '.join(left)}; on each such node "
                f"run `{command}{' --keep ' + keep if keep else ''}`")[:1024])
        for pod in cleaners.values():
            api.delete("Pod", ns, pod["metadata"]["name"])
        return True
