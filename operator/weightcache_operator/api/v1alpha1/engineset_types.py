"""An EngineSet's ``.spec`` -> a validated, normalized ``EngineSetSpec``.

The CRD's schema and CEL reject most bad specs at apply time; this module checks the
same rules again (objects can reach the operator without them: an older CRD, CEL
off, validation bypassed) and the ones only the operator can check, because they
need the WeightCache: the engine template must not ask the device plugin for a
number of GPUs other than the cache's tensor-parallel size.

Every failure is a ``SpecError`` (the WeightCache's, from ``weightcache_types``) with a CamelCase
reason and a message naming the field; the reconcile turns it into a condition and
an Event and leaves the running pods alone. Downstream code (placement, builders)
sees only ``EngineSetSpec``.
"""
from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .weightcache_types import SOCKET_ROOT, SpecError, plain

MODES = ("dra", "visibleDevices")
DEFAULT_PORT = 8000
DEFAULT_DEVICE_CLASS = "gpu.nvidia.com"
DEFAULT_RUNTIME_CLASS = "nvidia"
MAX_REPLICAS = 64
MAX_STANDBYS = 8
MAX_NAME = 50
# The device plugin's resource: the engine's GPUs come from the group's claim (or
# NVIDIA_VISIBLE_DEVICES), never from here.
GPU_RESOURCE = "nvidia.com/gpu"

_DNS_LABEL_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclasses.dataclass(frozen=True)
class EngineSetSpec:
    """What one EngineSet asks for, with defaults applied and rules checked."""

    cache_name: str
    template: Mapping[str, Any]  # a PodTemplateSpec as plain dicts
    replicas: int = 1
    standbys: int = 1
    service_name: str = ""
    port: int = DEFAULT_PORT
    target_port: int = DEFAULT_PORT
    mode: str = "dra"
    device_class: str = DEFAULT_DEVICE_CLASS
    runtime_class: str = DEFAULT_RUNTIME_CLASS
    drain_seconds: int = 30
    progress_deadline: int = 600
    # spec.compileCache.enabled: a host directory on the node for the engines' compile caches
    # (controller/engineset/compile_cache.py), unless the cluster admin has turned it off.
    compile_cache: bool = True

    @property
    def slots(self) -> int:
        """Pods per group: the primary and its standbys."""
        return self.standbys + 1


def _int(path: str, value: Any, default: int, lo: int, hi: int, reason: str = "InvalidSpec") -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(reason, f"spec.{path} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise SpecError(reason, f"spec.{path} must be between {lo} and {hi}, got {value}")
    return value


def _template(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError("InvalidTemplate", "spec.template must be a PodTemplateSpec object")
    template = plain(value)
    spec = template.get("spec")
    if not isinstance(spec, Mapping):
        raise SpecError("InvalidTemplate", "spec.template.spec is required: the engine pod's spec")
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise SpecError("InvalidTemplate", "spec.template.spec.containers must have at least one container: the engine")
    for i, c in enumerate(containers):
        if not isinstance(c, Mapping) or not isinstance(c.get("name"), str) or not c.get("name"):
            raise SpecError("InvalidTemplate", f"spec.template.spec.containers[{i}] needs a name")
    for i, v in enumerate(spec.get("volumes") or []):
        host = (v.get("hostPath") or {}).get("path") if isinstance(v, Mapping) else None
        if isinstance(host, str) and _reaches_socket_root(host):
            raise SpecError("InvalidTemplate",
                            f"spec.template.spec.volumes[{i}] ({v.get('name')}) is the host path {host!r}, which holds "
                            f"the agents' socket directories ({SOCKET_ROOT}): the operator mounts the cache's own "
                            "directory into every container, read-only")
    meta = template.get("metadata")
    if meta is not None and not isinstance(meta, Mapping):
        raise SpecError("InvalidTemplate", "spec.template.metadata must be an object")
    return template


def _reaches_socket_root(path: str) -> bool:
    """Whether a host path is the socket root, inside it, or above it (so a mount of it reaches the sockets)."""
    norm = posixpath.normpath("/" + path.lstrip("/"))  # one leading slash: normpath keeps two as they are
    return norm == SOCKET_ROOT or norm.startswith(SOCKET_ROOT + "/") or SOCKET_ROOT.startswith(norm.rstrip("/") + "/")


def parse_engineset(name: str, spec: Mapping[str, Any]) -> EngineSetSpec:
    """Validate an EngineSet spec (defaults maybe not applied) and normalize it."""
    if not isinstance(name, str) or len(name) > MAX_NAME or not _DNS_LABEL_1035.match(name):
        raise SpecError("InvalidName", f"EngineSet name {name!r} must be a DNS-1035 label of at most "
                                       f"{MAX_NAME} characters: it names the Service and prefixes the pods")
    if not isinstance(spec, Mapping):
        raise SpecError("InvalidSpec", "spec must be an object")
    ref = spec.get("cacheRef")
    cache = ref.get("name") if isinstance(ref, Mapping) else None
    if not isinstance(cache, str) or len(cache) > 63 or not _DNS_SUBDOMAIN.match(cache):
        raise SpecError("InvalidCacheRef", f"spec.cacheRef.name must name a WeightCache in this namespace, got {cache!r}")

    replicas = _int("replicas", spec.get("replicas"), 1, 0, MAX_REPLICAS, "InvalidReplicas")
    standbys = spec.get("standbys")
    if isinstance(standbys, int) and not isinstance(standbys, bool) and standbys < 0:
        raise SpecError("InvalidStandbys", f"spec.standbys must not be negative, got {standbys}")
    standbys = _int("standbys", standbys, 1, 0, MAX_STANDBYS, "InvalidStandbys")

    service = spec.get("service") or {}
    if not isinstance(service, Mapping):
        raise SpecError("InvalidSpec", "spec.service must be an object")
    service_name = service.get("name") or name
    if not isinstance(service_name, str) or len(service_name) > 63 or not _DNS_LABEL_1035.match(service_name):
        raise SpecError("InvalidSpec", f"spec.service.name {service_name!r} must be a DNS-1035 label")
    port = _int("service.port", service.get("port"), DEFAULT_PORT, 1, 65535)
    target_port = _int("service.targetPort", service.get("targetPort"), port, 1, 65535)

    binding = spec.get("gpuBinding") or {}
    if not isinstance(binding, Mapping):
        raise SpecError("InvalidGpuBinding", "spec.gpuBinding must be an object")
    mode = binding.get("mode", "dra")
    if mode not in MODES:
        raise SpecError("InvalidGpuBinding", f"spec.gpuBinding.mode {mode!r} is not one of {', '.join(MODES)}")
    device_class = binding.get("deviceClassName", DEFAULT_DEVICE_CLASS)
    if not isinstance(device_class, str) or not _DNS_SUBDOMAIN.match(device_class):
        raise SpecError("InvalidGpuBinding", f"spec.gpuBinding.deviceClassName {device_class!r} is not a DeviceClass name")
    runtime_class = binding.get("runtimeClassName", DEFAULT_RUNTIME_CLASS)
    if not isinstance(runtime_class, str) or not _DNS_SUBDOMAIN.match(runtime_class):
        raise SpecError("InvalidGpuBinding", f"spec.gpuBinding.runtimeClassName {runtime_class!r} is not a RuntimeClass name")

    compile_cache = spec.get("compileCache") or {}
    if not isinstance(compile_cache, Mapping):
        raise SpecError("InvalidSpec", "spec.compileCache must be an object")
    enabled = compile_cache.get("enabled", True)
    if not isinstance(enabled, bool):
        raise SpecError("InvalidSpec", f"spec.compileCache.enabled must be true or false, got {enabled!r}")

    return EngineSetSpec(
        cache_name=cache,
        template=_template(spec.get("template")),
        replicas=replicas,
        standbys=standbys,
        service_name=service_name,
        port=port,
        target_port=target_port,
        mode=mode,
        device_class=device_class,
        runtime_class=runtime_class,
        drain_seconds=_int("drainSeconds", spec.get("drainSeconds"), 30, 0, 3600),
        progress_deadline=_int("progressDeadlineSeconds", spec.get("progressDeadlineSeconds"), 600, 10, 86400),
        compile_cache=enabled,
    )


def _quantity(value: Any) -> int | None:
    """A GPU count as written in resources (an integer or its string); None if not a whole number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def check_gpu_resources(es: EngineSetSpec, tp: int) -> None:
    """The template may repeat the group's GPU count as an nvidia.com/gpu request, never contradict it.

    The GPUs of a group are the cache replica's ``tp`` GPUs, handed over by the
    claim (or NVIDIA_VISIBLE_DEVICES); an ``nvidia.com/gpu`` of another count says
    the engine expects another tensor-parallel size than the cache holds.
    """
    containers: Sequence[Mapping[str, Any]] = es.template["spec"]["containers"]
    for i, c in enumerate(containers):
        resources = c.get("resources") or {}
        for kind in ("limits", "requests"):
            values = resources.get(kind) if isinstance(resources, Mapping) else None
            if not isinstance(values, Mapping) or GPU_RESOURCE not in values:
                continue
            count = _quantity(values[GPU_RESOURCE])
            if count != tp:
                raise SpecError(
                    "TensorParallelMismatch",
                    f"spec.template.spec.containers[{i}] ({c.get('name')}) {kind} {GPU_RESOURCE}="
                    f"{values[GPU_RESOURCE]} but WeightCache {es.cache_name} has tensor-parallel size {tp}: "
                    f"each group runs on one replica of the cache ({tp} GPUs); remove the {GPU_RESOURCE} "
                    "request or make it equal",
                )
