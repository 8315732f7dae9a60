"""Pure builders: an ``EngineSetSpec`` and a group's placement -> the objects that serve it.

No I/O and no kopf: the same inputs give the same dicts, so tests validate every
object against the Kubernetes OpenAPI schemas and the reconcile can compare what it
would write with what is there. Names, labels and environment are the contract in
docs/engineset.md. What one EngineSet ``<ns>/<name>`` becomes:

- per group ``g`` (one replica of the cache: one node, ``tp`` GPUs):
  - ResourceClaim ``<name>-<g>`` (gpuBinding.mode dra; resource.k8s.io/v1, so
    Kubernetes >= 1.34): exactly ``tp`` devices of the DeviceClass, pinned to the
    group's GPU UUIDs by a CEL selector; every pod of the group references it;
  - Pods ``<name>-<g>-<slot>``, slot 0..standbys: the user's template plus the node
    (nodeSelector ``kubernetes.io/hostname``), the GPUs (the claim, or
    ``NVIDIA_VISIBLE_DEVICES`` with a RuntimeClass), the ``WEIGHTCACHE_*``
    environment, the cache's socket directory (read-only: connecting works, replacing
    the socket, lock or state files does not) and model root, the pod's identity token
    (a projected service-account token with audience ``weightcache.io``, which the
    agent verifies at attach), the EngineSet's compile cache on the node
    (compile_cache.py), and the labels the Service selects on. Names never
    encode a role: the agent decides who is primary;
- Service ``spec.service.name`` (default ``<name>``): the pods of this EngineSet
  labelled ``weightcache.io/serving=true``, one per group.

Owner references are added by the reconcile (they need the live owner's uid).
"""
from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from ...api.v1alpha1.engineset_types import GPU_RESOURCE, EngineSetSpec
from ...api.v1alpha1.weightcache_types import WeightCacheSpec
from ...config import OperatorConfig
from ..weightcache.manifests import (
    GPU_TOLERATION,
    LABEL_CACHE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    MODEL_MOUNT,
    SHARDING_FILE,
    configmap_name,
    content_hash,
    model_dir,
    socket_dir,
)
from .compile_cache import (
    COMPILE_CACHE_ENV_VALUES,
    COMPILE_CACHE_MOUNT,
    COMPILE_CACHE_VOLUME,
    compile_cache_dir,
    compile_cache_mount,
    compile_cache_volume,
    container_may_write,
)
from .placement import Placement

LABEL_ENGINESET = "weightcache.io/engineset"
LABEL_GROUP = "weightcache.io/group"
LABEL_SERVING = "weightcache.io/serving"
LABEL_TEMPLATE_HASH = "weightcache.io/template-hash"
ANNOTATION_NODE = "weightcache.io/node"
ANNOTATION_GPUS = "weightcache.io/gpus"
# The model an engine pod attaches, "<dir>@<revision>": what `status.groups[].model` reports.
ANNOTATION_MODEL = "weightcache.io/model"
HOSTNAME_LABEL = "kubernetes.io/hostname"

# Names the operator adds to the pod; a template's own entries of these names are replaced.
CLAIM_REF = "weightcache-gpus"
SOCKET_VOLUME = "weightcache-sockets"
MODEL_VOLUME = "weightcache-models"
IDENTITY_VOLUME = "weightcache-identity"
SHARDING_VOLUME = "weightcache-sharding"
SHARDING_MOUNT = "/etc/weightcache-sharding"
IDENTITY_MOUNT = "/var/run/secrets/weightcache.io"
IDENTITY_AUDIENCE = "weightcache.io"
IDENTITY_TOKEN_SECONDS = 3600  # the kubelet renews it at 80% of this
CLAIM_REQUEST = "gpus"
ENV_NAMES = (
    "WEIGHTCACHE_SOCKET_DIR", "WEIGHTCACHE_DEVICES", "WEIGHTCACHE_GROUP", "WEIGHTCACHE_ROLE", "WEIGHTCACHE_MODEL",
    "WEIGHTCACHE_POD_NAME", "WEIGHTCACHE_POD_NAMESPACE", "WEIGHTCACHE_POD_UID", "WEIGHTCACHE_IDENTITY_TOKEN",
    "WEIGHTCACHE_SHARDING", "NVIDIA_VISIBLE_DEVICES",
)

# vLLM's OpenAI server spawns its engine core unless this says otherwise, and a spawned process
# imports vLLM again: 24-28 s of a warm start on an H100 (bench/RESULTS.md). Forked, the engine core
# starts in under a second; vLLM still spawns where CUDA is already initialized in the parent. Other
# engines ignore it; a template's own value wins.
ENGINE_START_ENV: tuple[tuple[str, str], ...] = (("VLLM_WORKER_MULTIPROC_METHOD", "fork"),)


def pod_name(name: str, group: int, slot: int) -> str:
    return f"{name}-{group}-{slot}"


def claim_name(name: str, group: int) -> str:
    return f"{name}-{group}"


def lease_group(namespace: str, name: str, group: int) -> str:
    """The agent's lease group of a serving group (``WEIGHTCACHE_GROUP``)."""
    return f"{namespace}/{name}-{group}"


def selector_labels(name: str) -> dict[str, str]:
    """Every engine pod of the EngineSet (the scale subresource's selector)."""
    return {LABEL_ENGINESET: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def service_selector(name: str) -> dict[str, str]:
    return {LABEL_ENGINESET: name, LABEL_SERVING: "true"}


def template_hash(es: EngineSetSpec, cs: WeightCacheSpec, config: OperatorConfig) -> str:
    """Hash of everything that shapes an engine pod except its placement, slot and role."""
    return content_hash({
        "template": es.template,
        "binding": [es.mode, es.device_class if es.mode == "dra" else es.runtime_class],
        "cache": es.cache_name,
        "models": [cs.model_pvc, config.model_root if cs.model_pvc is None else None],
        # A new model (path or revision) is a new pod: rolled like a new template.
        "model": [model_dir(cs), cs.revision],
        # The compile cache's directory is not hashed: it only makes a start faster, so neither an
        # operator upgrade that adds it nor a new root moves running pods (new pods get it). Turning
        # it off for an EngineSet does roll it (pods that cannot write the cache are replaced, make
        # before break); the key is present only when off, so existing EngineSets keep their hash.
        **({"compileCache": False} if not es.compile_cache else {}),
    })


def model_label(cs: WeightCacheSpec) -> str:
    """What model an engine pod attaches, for people: the directory and the revision."""
    return f"{model_dir(cs)}@{cs.revision}" if cs.revision else model_dir(cs)


def _object_labels(name: str, group: int) -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_ENGINESET: name, LABEL_GROUP: str(group)}


def _placement_annotations(p: Placement) -> dict[str, str]:
    return {ANNOTATION_NODE: p.node, ANNOTATION_GPUS: ",".join(p.gpus)}


def placement_of(obj: Mapping[str, Any], group: int) -> Placement | None:
    """Read a group's placement back from a claim's or pod's annotations."""
    ann = (obj.get("metadata") or {}).get("annotations") or {}
    node, gpus = ann.get(ANNOTATION_NODE), ann.get(ANNOTATION_GPUS)
    if not isinstance(node, str) or not node or not isinstance(gpus, str) or not gpus:
        return None
    return Placement(group, node, tuple(g for g in gpus.split(",") if g))


def _strip_gpu_resource(resources: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in resources.items():
        if key in ("limits", "requests") and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k != GPU_RESOURCE}
            if not value:
                continue
        out[key] = value
    return out


def _read_only_mounts(container: Mapping[str, Any], volumes: tuple[str, ...], sockets: str) -> dict[str, Any]:
    """`container` with every mount of one of `volumes`, or at or under the socket directory, read-only."""
    c = dict(container)
    mounts = []
    for m in c.get("volumeMounts") or []:
        m = dict(m)
        path = str(m.get("mountPath") or "")
        if m.get("name") in volumes or path == sockets or path.startswith(sockets.rstrip("/") + "/"):
            m["readOnly"] = True
        mounts.append(m)
    if mounts:
        c["volumeMounts"] = mounts
    return c


def _env(es: EngineSetSpec, cs: WeightCacheSpec, namespace: str, name: str, p: Placement, model: str,
         role: str = "auto") -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    env: list[dict[str, Any]] = [
        {"name": "WEIGHTCACHE_SOCKET_DIR", "value": socket_dir(namespace, es.cache_name)},
        {"name": "WEIGHTCACHE_DEVICES", "value": ",".join(p.gpus)},
        {"name": "WEIGHTCACHE_GROUP", "value": lease_group(namespace, name, p.group)},
        {"name": "WEIGHTCACHE_ROLE", "value": role},
        {"name": "WEIGHTCACHE_MODEL", "value": model},
        {"name": "WEIGHTCACHE_POD_NAME", "valueFrom": field("metadata.name")},
        {"name": "WEIGHTCACHE_POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
        {"name": "WEIGHTCACHE_POD_UID", "valueFrom": field("metadata.uid")},
        {"name": "WEIGHTCACHE_IDENTITY_TOKEN", "value": f"{IDENTITY_MOUNT}/token"},
    ]
    # The cache's sharding, which an engine's attach must name to match its fingerprint: a preset by
    # name, explicit rules as the file the agent reads too (its ConfigMap, mounted).
    if cs.sharding_rules:
        env.append({"name": "WEIGHTCACHE_SHARDING", "value": f"{SHARDING_MOUNT}/{SHARDING_FILE}"})
    elif cs.sharding_preset:
        env.append({"name": "WEIGHTCACHE_SHARDING", "value": cs.sharding_preset})
    if es.mode == "visibleDevices":
        env.append({"name": "NVIDIA_VISIBLE_DEVICES", "value": ",".join(p.gpus)})
    return env


# The operator's own volumes in an engine pod: a template's entries of these names are replaced.
OUR_VOLUMES = (SOCKET_VOLUME, MODEL_VOLUME, IDENTITY_VOLUME, SHARDING_VOLUME, COMPILE_CACHE_VOLUME)
OUR_MOUNT_PATHS = (MODEL_MOUNT, IDENTITY_MOUNT, SHARDING_MOUNT, COMPILE_CACHE_MOUNT)


def _pod_metadata(es: EngineSetSpec, cs: WeightCacheSpec, config: OperatorConfig, template: Mapping[str, Any],
                  name: str, p: Placement, serving: bool) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) of an engine pod: the template's, with ours on top."""
    tmeta = template.get("metadata") or {}
    labels = {k: v for k, v in (tmeta.get("labels") or {}).items()}
    labels.update(_object_labels(name, p.group))
    labels[LABEL_SERVING] = "true" if serving else "false"
    labels[LABEL_TEMPLATE_HASH] = template_hash(es, cs, config)
    # Whose agents serve it: the admission policy lets only that cache's agents mark it serving.
    labels[LABEL_CACHE] = es.cache_name
    annotations = {**(tmeta.get("annotations") or {}), **_placement_annotations(p),
                   ANNOTATION_MODEL: model_label(cs)}
    return labels, annotations


def _our_mounts(cs: WeightCacheSpec, sockets: str) -> list[dict[str, Any]]:
    # The socket directory read-only: connect() works through a read-only mount, while
    # unlinking or renaming the socket, its lock or its state file does not.
    mounts = [{"name": SOCKET_VOLUME, "mountPath": sockets, "readOnly": True},
              {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT, "readOnly": True},
              {"name": IDENTITY_VOLUME, "mountPath": IDENTITY_MOUNT, "readOnly": True}]
    if cs.sharding_rules:
        mounts.append({"name": SHARDING_VOLUME, "mountPath": SHARDING_MOUNT, "readOnly": True})
    return mounts


def _engine_container(container: Mapping[str, Any], es: EngineSetSpec, env: list[dict[str, Any]],
                      mounts: list[dict[str, Any]], sockets: str, compile_cache: bool) -> dict[str, Any]:
    """One of the template's containers with our environment and mounts, vLLM's engine core forked
    (``ENGINE_START_ENV``, unless the template says otherwise) and the GPUs bound our way;
    with the compile cache's mount and the variables of it the template does not set (``compile_cache``)."""
    c = dict(container)
    own = {e.get("name") for e in c.get("env") or [] if isinstance(e, Mapping)}
    defaults = ENGINE_START_ENV + (COMPILE_CACHE_ENV_VALUES if compile_cache else ())
    c["env"] = [e for e in c.get("env") or [] if e.get("name") not in ENV_NAMES] + env
    c["env"] += [{"name": var, "value": value} for var, value in defaults if var not in own]
    c["volumeMounts"] = [m for m in c.get("volumeMounts") or []
                         if m.get("name") not in OUR_VOLUMES
                         and m.get("mountPath") not in (sockets, *OUR_MOUNT_PATHS)] + mounts
    if compile_cache:
        c["volumeMounts"].append(compile_cache_mount())
    resources = _strip_gpu_resource(c.get("resources") or {})
    if es.mode == "dra":
        claims = [x for x in resources.get("claims") or [] if x.get("name") != CLAIM_REF]
        resources["claims"] = claims + [{"name": CLAIM_REF}]
    if resources:
        c["resources"] = resources
    else:
        c.pop("resources", None)
    return c


def _pod_volumes(spec: Mapping[str, Any], es: EngineSetSpec, cs: WeightCacheSpec, config: OperatorConfig,
                 sockets: str, compile_dir: str | None) -> list[dict[str, Any]]:
    """The template's volumes, ours replacing any of the same names."""
    if cs.model_pvc is not None:
        models: dict[str, Any] = {"name": MODEL_VOLUME,
                                  "persistentVolumeClaim": {"claimName": cs.model_pvc, "readOnly": True}}
    else:
        models = {"name": MODEL_VOLUME, "hostPath": {"path": config.model_root, "type": "Directory"}}
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") not in OUR_VOLUMES] + [
        # The agent creates the directory; an engine scheduled before it waits in ContainerCreating.
        {"name": SOCKET_VOLUME, "hostPath": {"path": sockets, "type": "Directory"}},
        models,
        # Which pod this is, as the API server will confirm to the agent: a token bound to the
        # pod, for weightcache's audience only (useless against the API server itself).
        {"name": IDENTITY_VOLUME, "projected": {"sources": [{"serviceAccountToken": {
            "audience": IDENTITY_AUDIENCE, "expirationSeconds": IDENTITY_TOKEN_SECONDS, "path": "token"}}]}},
    ]
    if cs.sharding_rules:  # the rules the cache's agents read, from the ConfigMap the operator keeps for them
        volumes.append({"name": SHARDING_VOLUME, "configMap": {"name": configmap_name(es.cache_name)}})
    if compile_dir is not None:
        volumes.append(compile_cache_volume(compile_dir))
    return volumes


def _pin_to_group(spec: dict[str, Any], es: EngineSetSpec, name: str, p: Placement) -> None:
    """Tie a pod spec to its group's node and GPUs (the claim, or the runtime class)."""
    spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), HOSTNAME_LABEL: p.node}
    tolerations = list(spec.get("tolerations") or [])
    if GPU_TOLERATION not in tolerations:
        tolerations.append(dict(GPU_TOLERATION))
    spec["tolerations"] = tolerations
    spec.pop("nodeName", None)  # the scheduler places it (the claim must be allocated first)
    if es.mode == "dra":
        claims = [x for x in spec.get("resourceClaims") or [] if x.get("name") != CLAIM_REF]
        spec["resourceClaims"] = claims + [{"name": CLAIM_REF, "resourceClaimName": claim_name(name, p.group)}]
    else:
        spec["runtimeClassName"] = es.runtime_class


def render_pod(
    es: EngineSetSpec,
    cs: WeightCacheSpec,
    config: OperatorConfig,
    namespace: str,
    name: str,
    p: Placement,
    slot: int,
    serving: bool = False,
    role: str = "auto",
) -> dict[str, Any]:
    """Engine pod ``<name>-<group>-<slot>`` on the group's node and GPUs.

    role: "auto" (primary when the group has none), or "standby" for a pod a rollout adds
    beside a serving primary.
    """
    template = copy.deepcopy(dict(es.template))
    spec: dict[str, Any] = dict(template["spec"])
    sockets = socket_dir(namespace, es.cache_name)
    labels, annotations = _pod_metadata(es, cs, config, template, name, p, serving)

    env = _env(es, cs, namespace, name, p, model_dir(cs), role)
    mounts = _our_mounts(cs, sockets)
    # The EngineSet's compile cache on this node, for the containers that can write it (root).
    compile_dir = compile_cache_dir(es, cs, config, namespace, name)
    writers = [compile_dir is not None and container_may_write(c, spec) for c in spec["containers"]]
    spec["containers"] = [_engine_container(c, es, env, mounts, sockets, w)
                          for c, w in zip(spec["containers"], writers)]
    # Init containers, native sidecars (init containers that keep running) and ephemeral containers
    # get no mounts of ours, and any mount of our volumes (or at our paths) they name is read-only:
    # no container of an engine pod may unlink, rename or plant a file beside the agent's sockets.
    for kind in ("initContainers", "ephemeralContainers"):
        if spec.get(kind):
            spec[kind] = [_read_only_mounts(c, OUR_VOLUMES, sockets) for c in spec[kind]]
    spec["volumes"] = _pod_volumes(spec, es, cs, config, sockets, compile_dir if any(writers) else None)
    _pin_to_group(spec, es, name, p)

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(name, p.group, slot),
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": spec,
    }


def claim_selector(gpus: tuple[str, ...] | list[str]) -> str:
    """CEL for the claim: only these GPUs, by the UUID attribute their driver publishes."""
    return f"device.attributes[device.driver].uuid in [{', '.join(json.dumps(u) for u in gpus)}]"


def render_claim(es: EngineSetSpec, namespace: str, name: str, p: Placement) -> dict[str, Any]:
    """ResourceClaim ``<name>-<group>`` for the group's GPUs (resource.k8s.io/v1; its spec is immutable)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": claim_name(name, p.group),
            "namespace": namespace,
            "labels": _object_labels(name, p.group),
            "annotations": _placement_annotations(p),
        },
        "spec": {"devices": {"requests": [{
            "name": CLAIM_REQUEST,
            "exactly": {
                "deviceClassName": es.device_class,
                "allocationMode": "ExactCount",
                "count": len(p.gpus),
                "selectors": [{"cel": {"expression": claim_selector(p.gpus)}}],
            },
        }]}},
    }


def render_service(es: EngineSetSpec, namespace: str, name: str) -> dict[str, Any]:
    """The Service in front of each group's serving engine."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": es.service_name,
            "namespace": namespace,
            "labels": {LABEL_MANAGED_BY: MANAGED_BY, LABEL_ENGINESET: name},
        },
        "spec": {
            "type": "ClusterIP",
            "selector": service_selector(name),
            "ports": [{"name": "http", "port": es.port, "targetPort": es.target_port, "protocol": "TCP"}],
        },
    }
