"""A WeightCache's ``.spec`` -> a validated, normalized ``WeightCacheSpec``.

The CRD rejects bad specs at apply time (OpenAPI schema + CEL). The operator checks
the same rules again here because an object can reach it without them: created
before the CRD was upgraded, on a cluster where CEL validation is off, or with
validation bypassed. Such an object must end up as a Degraded condition with the
reason, never as agents serving wrong numbers. Everything downstream (manifest
builders, status) works on ``WeightCacheSpec`` only, never on the raw dict.
"""
from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from weightcache_agent import quantization

# The agents' host socket root: part of the contract with engine pods (they mount their cache's
# directory under it), so a constant of the API, not a setting.
SOCKET_ROOT = "/run/weightcache"

# The agent decides what it can serve from shared tensors; the operator only repeats its verdict
# earlier, at the spec, so it takes the list from the agent rather than keeping a copy to drift.
SUPPORTED_QUANTIZATION = quantization.ALLOWED
# The well-known methods the CRD's CEL rule names, refused with a reason rather than as unknown:
# the agent's table of their reasons is its own, so the names are listed here and a test holds
# them to the CRD's rule and to the agent's refusals.
REFUSED_QUANTIZATION = ("fp8-per-tensor", "marlin", "awq", "gptq")
# The CRD's CEL rule carries the same sentence.
REFUSED_WHY = (
    "it keeps part of its effect outside the shared tensors (Python-side metadata or a "
    "re-layout of the weights), so a raw tensor share would serve wrong numbers silently; "
    f"use {' or '.join(SUPPORTED_QUANTIZATION)}."
)
DTYPES = ("auto", "bfloat16", "float16", "float32")
# Rule modes the agent knows (node_agent sharding.MODES).
MODES = ("column", "row", "vocab", "replicated")

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PRESET = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
# A revision reaches the agent's command line: never a leading '-' (it would be read as one
# of the agent's flags), no spaces or control characters. The CRD's CEL rule is the same.
_REVISION = re.compile(r"^[A-Za-z0-9_.+/:@=][A-Za-z0-9_.+/:@=-]*$")


class SpecError(ValueError):
    """A spec the operator will not render. ``reason`` is a CamelCase condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclasses.dataclass(frozen=True)
class ShardingRule:
    pattern: str
    mode: str
    dim: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pattern": self.pattern, "mode": self.mode}
        if self.dim is not None:
            out["dim"] = self.dim
        return out


@dataclasses.dataclass(frozen=True)
class WeightCacheSpec:
    """What one WeightCache asks for, with defaults applied and rules checked.

    Not the agent's ``weightcache_agent.spec.CacheSpec``: that one is what an engine asks of
    one agent rank (``tp_size``, ``tp_rank``); this one is a whole cache across nodes
    (``tensor`` and the other parallel sizes, where its model comes from, how agents run)."""

    model_path: str | None
    model_pvc: str | None
    revision: str | None
    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    expert: int = 1
    quantization: str = "none"
    dtype: str = "auto"
    sharding_preset: str | None = None
    sharding_rules: tuple[ShardingRule, ...] = ()
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Mapping[str, Any], ...] = ()
    gpus_per_node: int | None = None
    agent_image: str | None = None
    agent_resources: Mapping[str, Any] | None = None

    @property
    def model_display(self) -> str:
        """Short form for the MODEL printer column."""
        base = self.model_path if self.model_path is not None else f"pvc/{self.model_pvc}"
        return f"{base}@{self.revision}" if self.revision else base


def _int(path: str, value: Any, default: int, lo: int, hi: int) -> int:
    reason = "InvalidParallelism" if path.startswith(("parallelism", "gpusPerNode")) else "InvalidSpec"
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(reason, f"{path} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise SpecError(reason, f"{path} must be between {lo} and {hi}, got {value}")
    return value


def check_quantization(method: Any) -> str:
    """Return the method if the agent can serve it; raise a SpecError that says why not."""
    if not isinstance(method, str):
        raise SpecError("InvalidQuantization", f"quantization must be a string, got {method!r}")
    if method in REFUSED_QUANTIZATION:
        raise SpecError("RefusedQuantization", f"quantization {method} is refused: {REFUSED_WHY}")
    if method not in SUPPORTED_QUANTIZATION:
        raise SpecError(
            "UnknownQuantization",
            f"quantization {method!r} is unknown; supported: {', '.join(SUPPORTED_QUANTIZATION)} "
            "(an unknown method may keep effects outside the shared tensors, so it is refused)",
        )
    return method


def _model(spec: Mapping[str, Any]) -> tuple[str | None, str | None, str | None]:
    model = spec.get("model")
    if not isinstance(model, Mapping):
        raise SpecError("InvalidModelSource", "spec.model is required: set model.path or model.pvc")
    path, pvc, revision = model.get("path"), model.get("pvc"), model.get("revision")
    if (path is None) == (pvc is None):
        raise SpecError(
            "InvalidModelSource",
            "exactly one of model.path or model.pvc must be set: the agent loads one model "
            "directory, either under the node's model root or from a PersistentVolumeClaim.",
        )
    if path is not None:
        if not isinstance(path, str) or not path or len(path) > 1024:
            raise SpecError("InvalidModelSource", f"model.path must be a non-empty string, got {path!r}")
        if path.startswith("/") or ".." in path.split("/"):
            raise SpecError(
                "InvalidModelSource",
                f"model.path {path!r} must be relative to the node's model root and must not "
                "contain '..': the agent only sees the model root, mounted read-only.",
            )
        # Normalize "a//b/./c/" to "a/b/c" so equal paths render equal pods.
        path = posixpath.normpath(path)
    if pvc is not None:
        if not isinstance(pvc, str) or len(pvc) > 253 or not _DNS_SUBDOMAIN.match(pvc):
            raise SpecError("InvalidModelSource", f"model.pvc {pvc!r} is not a valid claim name")
    if revision is not None and (not isinstance(revision, str) or len(revision) > 128):
        raise SpecError("InvalidSpec", "model.revision must be a string of at most 128 characters")
    if revision and not _REVISION.fullmatch(revision):
        raise SpecError("InvalidSpec", f"model.revision {revision!r} may hold only letters, digits and . _ + / : @ = - "
                                       "and must not start with '-' (the agent would read it as one of its own flags)")
    return path, pvc, (revision or None)


def _sharding(spec: Mapping[str, Any]) -> tuple[str | None, tuple[ShardingRule, ...]]:
    sharding = spec.get("sharding")
    if sharding is None:
        return None, ()
    if not isinstance(sharding, Mapping):
        raise SpecError("InvalidSharding", "spec.sharding must be an object with preset or rules")
    preset, rules = sharding.get("preset"), sharding.get("rules")
    if preset is not None and (not isinstance(preset, str) or len(preset) > 63 or not _PRESET.match(preset)):
        raise SpecError("InvalidSharding", f"sharding.preset {preset!r} is not a preset name")
    if rules is None:
        return preset, ()
    if not isinstance(rules, Sequence) or isinstance(rules, str) or not 1 <= len(rules) <= 256:
        raise SpecError("InvalidSharding", "sharding.rules must be a list of 1..256 rules")
    out = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, Mapping):
            raise SpecError("InvalidSharding", f"sharding.rules[{i}] must be an object")
        pattern, mode, dim = rule.get("pattern"), rule.get("mode"), rule.get("dim")
        if not isinstance(pattern, str) or not pattern:
            raise SpecError("InvalidSharding", f"sharding.rules[{i}].pattern must be a non-empty regex")
        try:
            re.compile(pattern)
        except re.error as e:
            raise SpecError("InvalidSharding", f"sharding.rules[{i}].pattern is not a regex: {e}") from None
        if mode not in MODES:
            raise SpecError("InvalidSharding", f"sharding.rules[{i}].mode must be one of {', '.join(MODES)}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim <= 7):
            raise SpecError("InvalidSharding", f"sharding.rules[{i}].dim must be an integer 0..7")
        out.append(ShardingRule(pattern=pattern, mode=mode, dim=dim))
    return preset, tuple(out)


def parse_spec(spec: Mapping[str, Any]) -> WeightCacheSpec:
    """Validate a WeightCache spec (as stored, defaults maybe not applied) and normalize it."""
    if not isinstance(spec, Mapping):
        raise SpecError("InvalidSpec", "spec must be an object")
    path, pvc, revision = _model(spec)
    par = spec.get("parallelism") or {}
    if not isinstance(par, Mapping):
        raise SpecError("InvalidParallelism", "spec.parallelism must be an object")
    tensor = par.get("tensor")
    if isinstance(tensor, int) and not isinstance(tensor, bool) and tensor <= 0:
        raise SpecError("InvalidParallelism", "parallelism.tensor must be a positive number of GPUs.")
    tensor = _int("parallelism.tensor", tensor, 1, 1, 64)
    pipeline = _int("parallelism.pipeline", par.get("pipeline"), 1, 1, 64)
    data = _int("parallelism.data", par.get("data"), 1, 1, 1024)
    expert = _int("parallelism.expert", par.get("expert"), 1, 1, 64)
    quantization = check_quantization(spec.get("quantization", "none"))
    dtype = spec.get("dtype", "auto")
    if dtype not in DTYPES:
        raise SpecError("InvalidSpec", f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    preset, rules = _sharding(spec)

    node_selector = spec.get("nodeSelector") or {}
    if not isinstance(node_selector, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in node_selector.items()
    ):
        raise SpecError("InvalidSpec", "nodeSelector must map label names to strings")
    tolerations = spec.get("tolerations") or []
    if not isinstance(tolerations, Sequence) or not all(isinstance(t, Mapping) for t in tolerations):
        raise SpecError("InvalidSpec", "tolerations must be a list of objects")

    gpus = spec.get("gpusPerNode")
    if gpus is not None:
        gpus = _int("gpusPerNode", gpus, 1, 1, 64)
        if tensor > gpus:
            raise SpecError(
                "InvalidParallelism",
                "parallelism.tensor must not exceed gpusPerNode: one node agent serves all "
                "tensor-parallel ranks of the cache from the GPUs of its own node.",
            )

    agent = spec.get("agent") or {}
    if not isinstance(agent, Mapping):
        raise SpecError("InvalidSpec", "spec.agent must be an object")
    image = agent.get("image")
    if image is not None and (not isinstance(image, str) or not image):
        raise SpecError("InvalidSpec", "agent.image must be a non-empty string")
    resources = agent.get("resources")
    if resources is not None and not isinstance(resources, Mapping):
        raise SpecError("InvalidSpec", "agent.resources must be an object")

    return WeightCacheSpec(
        model_path=path,
        model_pvc=pvc,
        revision=revision,
        tensor=tensor,
        pipeline=pipeline,
        data=data,
        expert=expert,
        quantization=quantization,
        dtype=dtype,
        sharding_preset=preset,
        sharding_rules=rules,
        node_selector=tuple(sorted((str(k), str(v)) for k, v in node_selector.items())),
        tolerations=tuple(dict(t) for t in tolerations),
        gpus_per_node=gpus,
        agent_image=image,
        agent_resources=plain(resources) if resources else None,
    )


def plain(value: Any) -> Any:
    """Deep-copy kopf's mapping views into plain dicts/lists (for rendering and hashing)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
