"""Pure builders: a validated ``WeightCacheSpec`` -> the Kubernetes objects that serve it.

No I/O and no kopf here: the same inputs give the same dicts, byte for byte, so the
reconcile can hash what they render and skip writes when nothing changed, and tests
can validate every object against the Kubernetes OpenAPI schemas.

What one WeightCache ``<ns>/<name>`` becomes:

- DaemonSet ``<name>-agent``: one privileged agent per selected GPU node running
  ``weightcache agent ...`` (the agent's command-line contract, see ``agent_args``),
  all GPUs visible, the socket directory (``socket_dir``: short by construction, so
  every ``<dir>/GPU-<UUID>.sock`` fits a Unix socket address) from the host (engine pods on the node mount the same directory to attach), the model root
  (host path) or the PVC mounted read-only at ``/models``;
- ConfigMap ``<name>-sharding``, only when the spec has explicit sharding rules,
  mounted as ``/etc/weightcache/sharding.yaml``;
- ServiceAccount ``weightcache-agent`` and a RoleBinding of it to the ClusterRole
  ``weightcache-agent`` (shipped by the chart), one pair per namespace, shared by
  every WeightCache there: the agents run as it, and its token is what rank 0 uses
  for its one API write at a failover (the serving label of the promoted engine pod;
  the chart's admission policy admits nothing else).

Owner references are added by the reconcile (they need the live owner's uid).
"""
from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import yaml

from ...api.v1alpha1.weightcache_types import WeightCacheSpec
from ...config import AGENT_HTTP_PORT, SOCKET_ROOT, OperatorConfig

LABEL_CACHE = "weightcache.io/cache"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
AGENT_APP = "weightcache-agent"
MANAGED_BY = "weightcache-operator"

# Hash of everything rendered into the DaemonSet; equal hash = nothing to write.
ANNOTATION_SPEC_HASH = "weightcache.io/spec-hash"
# Hash of the sharding rules, on the pod template: a rules change must roll the pods
# even though the pods only reference the ConfigMap by name.
ANNOTATION_SHARDING_HASH = "weightcache.io/sharding-hash"

MODEL_MOUNT = "/models"
SHARDING_DIR = "/etc/weightcache"
SHARDING_FILE = "sharding.yaml"
AGENT_CONTAINER = "agent"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
# Label published by NVIDIA GPU feature discovery: number of GPUs on the node.
GPU_COUNT_LABEL = "nvidia.com/gpu.count"


# The agents' identity in each WeightCache namespace; the ClusterRole of the same
# name and the admission policy that narrows it come with the chart.
AGENT_SERVICE_ACCOUNT = "weightcache-agent"
# The agents' control token (POST /switchover), from a Secret the operator creates (control.py).
CONTROL_MOUNT = "/etc/weightcache/control"
CONTROL_FILE = "token"
AGENT_CLUSTER_ROLE = "weightcache-agent"


def daemonset_name(name: str) -> str:
    return f"{name}-agent"


def configmap_name(name: str) -> str:
    return f"{name}-sharding"


# A Unix socket address holds 107 bytes; the longest socket name an agent makes in the
# directory is a device's: "GPU-" or "MIG-" + a 36-character UUID + ".sock".
MAX_SOCKET_PATH = 107
MAX_SOCKET_NAME = len("GPU-00000000-0000-0000-0000-000000000000.sock")


class SocketPathTooLong(ValueError):
    """A socket directory whose sockets would not fit an AF_UNIX address."""


# The directory's readable part (for people on the host): the namespace and the name cut to these.
SOCKET_DIR_NS_CHARS = 8
SOCKET_DIR_NAME_CHARS = 10
# What keeps two caches apart: base32 characters (5 bits each) of a SHA-256 of "<ns>/<name>".
# 24 characters are 120 bits, so finding a second namespace/name pair with the same directory
# is a 2^120 search; the readable part and the hash fill the 107-byte budget exactly
# (17 for "/run/weightcache/", 8 + 1 + 10 + 1 + 24 = 44, then "/" and a 45-byte device socket).
SOCKET_DIR_HASH_CHARS = 24


def socket_dir(namespace: str, name: str, root: str = SOCKET_ROOT) -> str:
    """Host (and container) directory with the agent's per-GPU sockets, short by construction.

    ``<root>/<ns[:8]>.<name[:10]>.<hash>``: the namespace and name cut short (for people
    reading the host), then 120 bits of a SHA-256 of the full pair in lowercase base32 (what
    keeps two caches apart: no namespace editor can search a name that lands in another
    cache's directory). At most 61 bytes under the default root, whatever the names' lengths
    (a namespace may have 63 characters, a name 253), so every device socket fits a Unix
    socket address. The full names are in the WeightCache's status (``socketDir``), and the
    agent records them in the directory (``--cache``) and refuses a directory another cache's
    agent has claimed.
    """
    digest = base64.b32encode(hashlib.sha256(f"{namespace}/{name}".encode()).digest()).decode().lower()
    leaf = f"{namespace[:SOCKET_DIR_NS_CHARS]}.{name[:SOCKET_DIR_NAME_CHARS]}.{digest[:SOCKET_DIR_HASH_CHARS]}"
    directory = f"{root.rstrip('/')}/{leaf}"
    if len(directory.encode()) + 1 + MAX_SOCKET_NAME > MAX_SOCKET_PATH:
        raise SocketPathTooLong(
            f"socket directory {directory} leaves no room for device sockets: Unix socket paths hold at most "
            f"{MAX_SOCKET_PATH} bytes and a device socket name takes {MAX_SOCKET_NAME + 1}; use a shorter socket root")
    return directory


def cache_identity(namespace: str, name: str, uid: str | None) -> str:
    """What ``--cache`` tells an agent it serves: ``<ns>/<name>[/<uid>]``."""
    return f"{namespace}/{name}/{uid}" if uid else f"{namespace}/{name}"


def selector_labels(name: str) -> dict[str, str]:
    """The DaemonSet's selector. Immutable once created: never add to it."""
    return {LABEL_NAME: AGENT_APP, LABEL_CACHE: name}


def agent_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: "node-agent",
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def model_dir(cs: WeightCacheSpec) -> str:
    """The model directory as the agent sees it inside the container."""
    if cs.model_path is not None:
        return f"{MODEL_MOUNT}/{cs.model_path}"
    return MODEL_MOUNT


def agent_args(cs: WeightCacheSpec, namespace: str, name: str, uid: str | None = None) -> list[str]:
    """Arguments after ``weightcache``: the agent's command-line contract.

    ``uid``: the WeightCache's, recorded by the agent in the socket directory with the names
    (``--cache``), so that an agent of another cache never serves from that directory."""
    args = [
        "agent",
        "--model", model_dir(cs),
        "--socket-dir", socket_dir(namespace, name),
        f"--cache={cache_identity(namespace, name, uid)}",
        "--tp-size", str(cs.tensor),
        "--devices", "all",
        "--quantization", cs.quantization,
        "--dtype", cs.dtype,
        "--backend", "auto",
        "--http-port", str(AGENT_HTTP_PORT),
    ]
    if cs.revision:
        # One token, "--revision=VALUE": whatever the value, the agent never reads it as a flag.
        args.append(f"--revision={cs.revision}")
    if cs.sharding_rules:
        # Rules (and the preset they go in front of) travel as a file.
        args += ["--sharding", f"{SHARDING_DIR}/{SHARDING_FILE}"]
    elif cs.sharding_preset:
        args += ["--sharding", cs.sharding_preset]
    if cs.expert > 1:
        args.append("--expert-parallel")
    return args


def sharding_yaml(cs: WeightCacheSpec) -> str:
    """The rules file the agent reads with ``--sharding <file>``: ``{preset?, rules}``.

    Without a preset the agent puts the rules in front of the preset it picks from
    config.json; with ``preset: none`` the rules stand alone.
    """
    doc: dict[str, Any] = {}
    if cs.sharding_preset:
        doc["preset"] = cs.sharding_preset
    doc["rules"] = [r.as_dict() for r in cs.sharding_rules]
    return yaml.safe_dump(doc, sort_keys=False)


def render_sharding_configmap(cs: WeightCacheSpec, namespace: str, name: str) -> dict[str, Any] | None:
    """The ConfigMap with explicit sharding rules, or None when the spec has none."""
    if not cs.sharding_rules:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(name),
            "namespace": namespace,
            "labels": agent_labels(name),
        },
        "data": {SHARDING_FILE: sharding_yaml(cs)},
    }


def content_hash(obj: Any) -> str:
    """Stable short hash of a JSON-able object (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _tolerations(cs: WeightCacheSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [dict(GPU_TOLERATION)]
    for t in cs.tolerations:
        t = {k: v for k, v in dict(t).items() if v is not None}
        if t not in out:
            out.append(t)
    return out


def _probes() -> dict[str, Any]:
    # /healthz answers as soon as the process serves HTTP, also while loading;
    # /readyz only once every rank is resident. A cold load can take many minutes,
    # so readiness never restarts anything (it only marks the pod not ready) and
    # liveness is on /healthz, gated by a startup probe for a slow first start.
    http = {"port": "http", "scheme": "HTTP"}
    return {
        "startupProbe": {
            "httpGet": {"path": "/healthz", **http},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 60,  # up to 5 minutes to open the HTTP port
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", **http},
            "periodSeconds": 20,
            "timeoutSeconds": 10,
            "failureThreshold": 6,
        },
        "readinessProbe": {
            "httpGet": {"path": "/readyz", **http},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
    }


def control_secret_name(name: str) -> str:
    return f"{name}-agent-control"


def _model_volume(cs: WeightCacheSpec, config: OperatorConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model volume and its mount: the cache's claim, or the node's model root."""
    if cs.model_pvc is not None:
        return ({"name": "models", "persistentVolumeClaim": {"claimName": cs.model_pvc, "readOnly": True}},
                {"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
    # type Directory, not DirectoryOrCreate: a node without the model root must
    # fail visibly (mount error) rather than get an empty directory created.
    return ({"name": "models", "hostPath": {"path": config.model_root, "type": "Directory"}},
            {
                "name": "models",
                "mountPath": MODEL_MOUNT,
                "readOnly": True,
                # Models mounted on the host later (e.g. an NFS share) show up without a restart.
                "mountPropagation": "HostToContainer",
            })


def _agent_storage(cs: WeightCacheSpec, namespace: str, name: str, config: OperatorConfig,
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, str]]:
    """(volumes, mounts, pod template annotations) for the sockets, the model and the sharding rules."""
    sockets = socket_dir(namespace, name)
    models, models_mount = _model_volume(cs, config)
    volumes: list[dict[str, Any]] = [
        {"name": "sockets", "hostPath": {"path": sockets, "type": "DirectoryOrCreate"}},
        models,
    ]
    mounts: list[dict[str, Any]] = [{"name": "sockets", "mountPath": sockets}, models_mount]
    annotations: dict[str, str] = {}
    if cs.sharding_rules:
        volumes.append({
            "name": "sharding",
            "configMap": {"name": configmap_name(name), "items": [{"key": SHARDING_FILE, "path": SHARDING_FILE}]},
        })
        mounts.append({"name": "sharding", "mountPath": SHARDING_DIR, "readOnly": True})
        # The rules live in a ConfigMap: a change to them must still roll the agents.
        annotations[ANNOTATION_SHARDING_HASH] = content_hash(sharding_yaml(cs))
    return volumes, mounts, annotations


def _agent_container(cs: WeightCacheSpec, config: OperatorConfig, args: list[str],
                     mounts: list[dict[str, Any]]) -> dict[str, Any]:
    if config.agent_privileged:
        security: dict[str, Any] = {"privileged": True}
    else:
        security = {"privileged": False, "allowPrivilegeEscalation": False}
    container: dict[str, Any] = {
        "name": AGENT_CONTAINER,
        "image": config.agent_image_for(cs.agent_image),
        "imagePullPolicy": config.agent_image_pull_policy,
        "command": ["weightcache"],
        "args": args,
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            # The agent's HTTP endpoints listen on the pod's IP only, not on every address.
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # The agent is not given GPUs through the device plugin (that would take
            # them away from engines); the NVIDIA runtime exposes all of them.
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
        ],
        "ports": [{"name": "http", "containerPort": AGENT_HTTP_PORT, "protocol": "TCP"}],
        "volumeMounts": mounts,
        "securityContext": security,
        **_probes(),
    }
    if config.agent_socket_group:
        container["env"].append({"name": "WEIGHTCACHE_SOCKET_GROUP", "value": config.agent_socket_group})
    if cs.agent_resources:
        container["resources"] = dict(cs.agent_resources)
    return container


def _agent_pod_spec(cs: WeightCacheSpec, config: OperatorConfig, container: dict[str, Any],
                    volumes: list[dict[str, Any]]) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        # The agent's one API write (the serving label at a failover) uses this
        # account's bound token; RBAC and the admission policy limit it to that.
        "serviceAccountName": AGENT_SERVICE_ACCOUNT,
        "automountServiceAccountToken": True,
        "containers": [container],
        "tolerations": _tolerations(cs),
        "volumes": volumes,
        "terminationGracePeriodSeconds": 30,
    }
    if cs.node_selector:
        pod_spec["nodeSelector"] = dict(cs.node_selector)
    if cs.gpus_per_node is not None:
        pod_spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{
                "key": GPU_COUNT_LABEL, "operator": "Gt", "values": [str(cs.gpus_per_node - 1)],
            }]}],
        }}}
    if config.priority_class:
        pod_spec["priorityClassName"] = config.priority_class
    if config.runtime_class:
        pod_spec["runtimeClassName"] = config.runtime_class
    if config.agent_image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in config.agent_image_pull_secrets]
    return pod_spec


def render_daemonset(cs: WeightCacheSpec, namespace: str, name: str, config: OperatorConfig,
                     uid: str | None = None) -> dict[str, Any]:
    """The agent DaemonSet for one WeightCache (``uid``: the WeightCache's), with its spec hash annotation set."""
    labels = agent_labels(name)
    volumes, mounts, template_annotations = _agent_storage(cs, namespace, name, config)
    args = agent_args(cs, namespace, name, uid)
    if config.agent_label_pods == "off":
        args += ["--label-pods", "off"]  # no admission policy bounds an agent's write here
    if config.control_key is not None:
        # The token for POST /switchover (planned switchovers of rolling upgrades); optional,
        # so agents start before the operator has created it.
        volumes.append({"name": "control", "secret": {"secretName": control_secret_name(name), "optional": True}})
        mounts.append({"name": "control", "mountPath": CONTROL_MOUNT, "readOnly": True})
        args += ["--control-token-file", f"{CONTROL_MOUNT}/{CONTROL_FILE}"]
    pod_spec = _agent_pod_spec(cs, config, _agent_container(cs, config, args, mounts), volumes)

    template_metadata: dict[str, Any] = {"labels": labels}
    if template_annotations:
        template_metadata["annotations"] = template_annotations
    ds: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": daemonset_name(name),
            "namespace": namespace,
            "labels": labels,
            "annotations": {},
        },
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            # One node at a time: a restarting agent reloads its node's weights
            # (engines already attached keep serving from the memory they map).
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "revisionHistoryLimit": 5,
            "template": {"metadata": template_metadata, "spec": pod_spec},
        },
    }
    ds["metadata"]["annotations"][ANNOTATION_SPEC_HASH] = daemonset_hash(ds)
    return ds


def daemonset_hash(ds: dict[str, Any]) -> str:
    """Hash of the parts of a rendered DaemonSet the operator owns (labels and spec)."""
    return content_hash({"labels": ds["metadata"].get("labels", {}), "spec": ds["spec"]})


def render_agent_service_account(namespace: str) -> dict[str, Any]:
    """The agents' ServiceAccount in one WeightCache namespace."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": AGENT_SERVICE_ACCOUNT,
            "namespace": namespace,
            "labels": {LABEL_NAME: AGENT_APP, LABEL_MANAGED_BY: MANAGED_BY},
        },
    }


def render_agent_role_binding(namespace: str) -> dict[str, Any]:
    """Binds the agents' ServiceAccount to the chart's ClusterRole, in this namespace only."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {
            "name": AGENT_SERVICE_ACCOUNT,
            "namespace": namespace,
            "labels": {LABEL_NAME: AGENT_APP, LABEL_MANAGED_BY: MANAGED_BY},
        },
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": AGENT_CLUSTER_ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": AGENT_SERVICE_ACCOUNT, "namespace": namespace}],
    }
