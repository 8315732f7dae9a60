"""Operator-wide settings: what every rendered agent DaemonSet shares.

A WeightCache says *what* to load; how agents run on this cluster (which image by
default, which priority class, where the host keeps models, whether agents are
privileged) is the cluster admin's choice, made once in the Helm chart's values.
The chart passes those values to the operator container as environment variables;
`weightcache operator` flags override them. ``OperatorConfig.from_env`` is the only
place that reads the environment, so tests build an ``OperatorConfig`` directly.
"""
from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Mapping

# SOCKET_ROOT: a constant of the API (engine pods mount their cache's directory under it), re-exported here.
from .api.v1alpha1.weightcache_types import SOCKET_ROOT, SpecError, WeightCacheSpec  # noqa: F401

# Defaults match the chart's values.yaml; a test checks that they agree.
DEFAULT_AGENT_IMAGE = "ghcr.io/weightcache/agent:0.1.0"
DEFAULT_PRIORITY_CLASS = "system-node-critical"
DEFAULT_MODEL_ROOT = "/models"
# Host directory under which engine pods get their EngineSet's compile cache (see
# controller/engineset/compile_cache.py): node-local state, so under /var/lib.
DEFAULT_COMPILE_CACHE_ROOT = "/var/lib/weightcache/compile-cache"
AGENT_HTTP_PORT = 9464

ENV_PREFIX = "WEIGHTCACHE_"
# The taints kubeadm and most distributions put on control-plane nodes (the second, older name
# is still found on long-lived clusters).
CONTROL_PLANE_TAINTS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


def control_plane_taint_tolerated(toleration: Mapping[str, object]) -> str | None:
    """The control-plane taint (key:NoSchedule) `toleration` tolerates, or None.

    As the scheduler matches: an empty key with operator Exists tolerates every taint; the
    effect, when set, must be the taint's (NoSchedule); these taints carry no value."""
    key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    effect = toleration.get("effect") or ""
    if effect not in ("", "NoSchedule"):
        return None
    if not key and operator == "Exists":
        return f"{CONTROL_PLANE_TAINTS[0]}:NoSchedule"
    if key in CONTROL_PLANE_TAINTS and (operator == "Exists" or not toleration.get("value")):
        return f"{key}:NoSchedule"
    return None


def _env_seconds(name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not a number of seconds") from None


def _env_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    """Everything the operator needs besides the WeightCache itself."""

    agent_image: str = DEFAULT_AGENT_IMAGE
    # Agents run privileged with host paths: a WeightCache (any namespace editor's object)
    # may name only the default image or one of these, never an image of its own choosing.
    agent_allowed_images: tuple[str, ...] = ()
    # `--label-pods` of every agent: "auto" (promoted pods labelled from the node where the
    # cluster runs agents in one), or "off" where no admission policy bounds that write.
    agent_label_pods: str = "auto"
    agent_image_pull_policy: str = "IfNotPresent"
    # Image pull secrets (names in the WeightCache's namespace) for the agent pods.
    agent_image_pull_secrets: tuple[str, ...] = ()
    # The agent maps GPU memory of every GPU and hands out VMM handles; it runs
    # privileged by default. An admin can turn that off where the runtime already
    # exposes the GPUs (e.g. CDI) and the agent needs no extra device access.
    agent_privileged: bool = True
    # Group (name or gid, as the agent's node sees it) whose members may use the agent's
    # sockets besides root: give it to non-root engine pods as a supplemental group.
    # Empty means none: only root engines can attach.
    agent_socket_group: str = ""
    # Agents hold the weights engines serve from: evicting one costs minutes of
    # reload, so they run at node-critical priority. Empty means no priority class.
    priority_class: str = DEFAULT_PRIORITY_CLASS
    # RuntimeClass for the agent pods (e.g. "nvidia" where the NVIDIA runtime is not
    # the node's default). Empty means the node's default runtime.
    runtime_class: str = ""
    # Host directory with the models; mounted read-only into the agents.
    model_root: str = DEFAULT_MODEL_ROOT
    # Which model.path a WeightCache of a namespace may name (the model root is shared by every
    # namespace): per_namespace, only under "<namespace>/"; shared, under one of these prefixes
    # (for any namespace). Both unset: any path under the root.
    model_paths_per_namespace: bool = False
    model_paths_shared: tuple[str, ...] = ()
    # A WeightCache's tolerations put privileged agents where they tolerate: those that tolerate
    # the control plane's taint are refused unless the admin allows them.
    allow_control_plane_tolerations: bool = False
    # Engine pods get a host directory per EngineSet for their compile caches (torch.compile,
    # Triton, DeepGEMM, FlashInfer), so an engine after the first on a node starts warm. Off: no
    # engine pod gets one, whatever its EngineSet says.
    compile_cache: bool = True
    compile_cache_root: str = DEFAULT_COMPILE_CACHE_ROOT
    # How often each WeightCache's agents are polled for their state (seconds).
    poll_interval: float = 15.0
    # Per-request timeout when reading an agent's /status (seconds).
    agent_http_timeout: float = 3.0
    # Upper bound of per-node entries written into .status.nodes (the CRD's maxItems).
    max_node_entries: int = 32
    # The key the agents' control tokens derive from (see ``controller.weightcache.control``);
    # None: the agents name no engine holding a lease to this operator, so none is labelled
    # serving and no planned switchover runs; the EngineSets' conditions say why.
    control_key: bytes | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "OperatorConfig":
        """Read ``WEIGHTCACHE_*`` variables (as the chart sets them); unset ones keep defaults."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, object] = {}

        def get(name: str) -> str | None:
            return env.get(ENV_PREFIX + name)

        if (v := get("AGENT_IMAGE")):
            kwargs["agent_image"] = v
        if (v := get("AGENT_ALLOWED_IMAGES")) is not None:
            kwargs["agent_allowed_images"] = tuple(s.strip() for s in v.split(",") if s.strip())
        if (v := get("AGENT_LABEL_PODS")):
            kwargs["agent_label_pods"] = v.strip()
        if (v := get("AGENT_IMAGE_PULL_POLICY")):
            kwargs["agent_image_pull_policy"] = v
        if (v := get("AGENT_IMAGE_PULL_SECRETS")) is not None:
            kwargs["agent_image_pull_secrets"] = tuple(s.strip() for s in v.split(",") if s.strip())
        if (v := get("AGENT_PRIVILEGED")) is not None:
            kwargs["agent_privileged"] = _env_bool(v)
        if (v := get("AGENT_SOCKET_GROUP")) is not None:
            kwargs["agent_socket_group"] = v.strip()
        if (v := get("PRIORITY_CLASS")) is not None:
            kwargs["priority_class"] = v.strip()
        if (v := get("RUNTIME_CLASS")) is not None:
            kwargs["runtime_class"] = v.strip()
        if (v := get("MODEL_ROOT")):
            kwargs["model_root"] = v
        if (v := get("MODEL_PATHS_PER_NAMESPACE")) is not None:
            kwargs["model_paths_per_namespace"] = _env_bool(v)
        if (v := get("MODEL_PATHS_SHARED")) is not None:
            kwargs["model_paths_shared"] = tuple(s.strip().strip("/") for s in v.split(",") if s.strip().strip("/"))
        if (v := get("AGENT_ALLOW_CONTROL_PLANE")) is not None:
            kwargs["allow_control_plane_tolerations"] = _env_bool(v)
        if (v := get("COMPILE_CACHE")) is not None:
            kwargs["compile_cache"] = _env_bool(v)
        if (v := get("COMPILE_CACHE_ROOT")):
            kwargs["compile_cache_root"] = v.strip()
        if (v := get("POLL_INTERVAL")):
            kwargs["poll_interval"] = _env_seconds(ENV_PREFIX + "POLL_INTERVAL", v)
        if (v := get("AGENT_HTTP_TIMEOUT")):
            kwargs["agent_http_timeout"] = _env_seconds(ENV_PREFIX + "AGENT_HTTP_TIMEOUT", v)
        if (v := get("CONTROL_KEY_FILE")):
            with open(v, "rb") as f:
                kwargs["control_key"] = f.read().strip()
        return cls(**kwargs).checked()

    def checked(self) -> "OperatorConfig":
        """Fail at start-up, not at the first WeightCache, on settings that cannot work."""
        if not self.agent_image:
            raise ValueError("agent image must not be empty")
        if self.agent_label_pods not in ("auto", "off"):
            raise ValueError(f"agent label-pods must be auto or off: {self.agent_label_pods!r}")
        if self.agent_image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ValueError(f"bad image pull policy: {self.agent_image_pull_policy!r}")
        if not self.model_root.startswith("/"):
            raise ValueError(f"model root must be an absolute host path: {self.model_root!r}")
        self._check_compile_cache_root()
        if not (0.5 <= self.poll_interval <= 3600):
            raise ValueError(f"poll interval out of range (0.5..3600 s): {self.poll_interval}")
        if not (0.1 <= self.agent_http_timeout <= 60):
            raise ValueError(f"agent HTTP timeout out of range (0.1..60 s): {self.agent_http_timeout}")
        if self.control_key is not None and len(self.control_key) < 16:
            raise ValueError("the control key must be at least 16 bytes")
        if not (1 <= self.max_node_entries <= 32):
            raise ValueError("max node entries must be within the CRD's bound (1..32)")
        for prefix in self.model_paths_shared:
            if prefix.startswith("/") or ".." in prefix.split("/") or not prefix.strip("/"):
                raise ValueError(f"shared model path {prefix!r} must be a path relative to the model root, "
                                 "without '..'")
        return self

    def _check_compile_cache_root(self) -> None:
        # Engines write there and load what they find as code: the root must be a directory of its
        # own, never the node's root, the agents' socket root or the model root (or above them).
        root = self.compile_cache_root
        if not root.startswith("/") or posixpath.normpath(root) != root.rstrip("/") or root.rstrip("/") == "":
            raise ValueError(f"compile cache root must be an absolute, normalized host path other than /: {root!r}")
        for other, what in ((SOCKET_ROOT, "the agents' socket root"), (self.model_root, "the model root")):
            a, b = posixpath.normpath(root), posixpath.normpath(other)
            if a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/"):
                raise ValueError(f"compile cache root {root!r} overlaps {what} {other!r}")

    def agent_image_for(self, requested: str | None) -> str:
        """The image a WeightCache's agents run: the default, or its spec.agent.image where the
        admin allows that image; SpecError otherwise."""
        if requested is None or requested == self.agent_image or requested in self.agent_allowed_images:
            return requested or self.agent_image
        allowed = ", ".join((self.agent_image, *self.agent_allowed_images))
        raise SpecError("AgentImageNotAllowed",
                        f"agent.image {requested!r} is not an image the cluster admin allows for agents "
                        f"(allowed: {allowed}; the chart's agent.image and agent.allowedImages); "
                        "agents left unchanged")

    def model_path_allowed(self, namespace: str, path: str) -> bool:
        """Whether a WeightCache in `namespace` may load `path` (normalized, relative to the model root)."""
        if not self.model_paths_per_namespace and not self.model_paths_shared:
            return True
        roots = ((namespace,) if self.model_paths_per_namespace else ()) + self.model_paths_shared
        return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)

    def admit_cache(self, cs: WeightCacheSpec, namespace: str) -> None:
        """Refuse, with a SpecError, what the admin has not allowed a namespace's WeightCache: its agent
        image, a model path outside the namespace's roots, tolerations of the control plane's taint."""
        self.agent_image_for(cs.agent_image)
        if cs.model_path is not None and not self.model_path_allowed(namespace, cs.model_path):
            roots = ([f"{namespace}/"] if self.model_paths_per_namespace else []) + \
                [f"{p.rstrip('/')}/" for p in self.model_paths_shared]
            raise SpecError("ModelPathNotAllowed",
                            f"model.path {cs.model_path!r} is outside what namespace {namespace} may load "
                            f"(under the model root: {', '.join(roots)}; the chart's agent.modelPaths); "
                            "agents left unchanged")
        if not self.allow_control_plane_tolerations:
            for i, t in enumerate(cs.tolerations):
                taint = control_plane_taint_tolerated(t)
                if taint is not None:
                    raise SpecError("TolerationNotAllowed",
                                    f"tolerations[{i}] {dict(t)} tolerates the control plane's taint {taint}: "
                                    "privileged agents would run on control-plane nodes (the cluster admin allows "
                                    "that with the chart's agent.allowControlPlaneTolerations); agents left unchanged")

    def replace(self, **changes: object) -> "OperatorConfig":
        return dataclasses.replace(self, **changes).checked()  # type: ignore[arg-type]
