"""The node-wide compile cache of engine pods: one host directory per EngineSet and artifact key.

Why: an engine's weights attach in milliseconds, but a cold vLLM start still spends most of its
time on work that gives the same result every start on the same node: inspecting the model
class, torch.compile (Inductor, Triton kernels), DeepGEMM's and FlashInfer's JIT. The engines
keep that work in cache directories they name by environment variable; left alone those are in
the container's own filesystem and die with it. Here the operator gives every engine pod of an
EngineSet the same host directory on its node, so the second engine there (a standby, a
replacement, a rollout's new pod with the same image) starts warm.

How data flows: ``render_pod`` (manifests.py) asks ``compile_cache_dir`` for the pod's host
directory, ``<root>/<namespace>/<engineset>/<key>``; ``None`` when the cache is off (chart
value ``compileCache.enabled``, EngineSet ``spec.compileCache.enabled``). It then adds
``compile_cache_volume`` (hostPath, ``DirectoryOrCreate``: the kubelet creates it) and, to each
engine container that may write it (``container_may_write``), ``COMPILE_CACHE_MOUNT`` and the
variables of ``COMPILE_CACHE_ENV_VALUES`` that the container does not set itself.

The key is a hash of what makes compiled artifacts of one EngineSet incompatible: the
containers' images (torch, Triton, vLLM versions), the model and its revision, dtype,
quantization and the parallel sizes. It is a pure function of the specs (sorted JSON, no
randomness, no dict order), so a restarted operator renders the same directory. The engines'
own caches are content-addressed as well; the key keeps what they may not tell apart from
ever meeting, and lets an image change start from an empty directory instead of a mixed one.

Security: a hostPath is node-wide, and what is cached is code that engines load and run
(Triton kernels, Inductor's generated Python). An engine pod is only ever given the directory
the operator derives from the EngineSet's own namespace and name, both checked here to be DNS
labels (no ``/``, no ``..``), so no EngineSet can name a directory of another namespace or of
another EngineSet; and a template may not bring its own hostPath at, under or above the root
(``check_template_host_paths``: ``InvalidTemplate``).
"""
from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Any

from ...api.v1alpha1.engineset_types import EngineSetSpec
from ...api.v1alpha1.weightcache_types import SpecError, WeightCacheSpec
from ...config import OperatorConfig
from ..weightcache.manifests import content_hash

COMPILE_CACHE_VOLUME = "weightcache-compile-cache"
# Where every engine container finds its EngineSet's directory: fixed, so that the variables below
# and a template's own references to it need not know the host path.
COMPILE_CACHE_MOUNT = "/var/cache/weightcache-compile"

# What each engine reads, and the subdirectory it gets. SGLang sets DG_JIT_CACHE_DIR from
# SGLANG_DG_CACHE_DIR when it loads DeepGEMM, so both name the same directory; FlashInfer keeps
# its JIT modules under <FLASHINFER_WORKSPACE_BASE>/.cache/flashinfer; SGLang's own JIT kernels
# and newer FlashInfer builds go through tvm-ffi (TVM_FFI_CACHE_DIR).
COMPILE_CACHE_ENV: tuple[tuple[str, str], ...] = (
    ("VLLM_CACHE_ROOT", "vllm"),                 # vLLM: model-class inspection, torch.compile artifacts
    ("TORCHINDUCTOR_CACHE_DIR", "torchinductor"),  # torch.compile (Inductor's FX graph and code caches)
    ("TRITON_CACHE_DIR", "triton"),              # compiled Triton kernels
    ("DG_JIT_CACHE_DIR", "deep_gemm"),           # DeepGEMM's JIT kernels
    ("SGLANG_DG_CACHE_DIR", "deep_gemm"),        # the same, as SGLang names it
    ("SGLANG_CACHE_DIR", "sglang"),              # SGLang: torch.compile backend, FlashInfer autotune
    ("FLASHINFER_WORKSPACE_BASE", "flashinfer"),  # FlashInfer's JIT modules
    ("TVM_FFI_CACHE_DIR", "tvm-ffi"),            # SGLang's and FlashInfer's tvm-ffi JIT builds
)
COMPILE_CACHE_ENV_NAMES = tuple(name for name, _ in COMPILE_CACHE_ENV)
# The same as an engine container's variables (a template's own value of one wins).
COMPILE_CACHE_ENV_VALUES = tuple((name, f"{COMPILE_CACHE_MOUNT}/{sub}") for name, sub in COMPILE_CACHE_ENV)

# Kubernetes namespace names (DNS-1123 labels) and EngineSet names (DNS-1035, checked by
# parse_engineset): one path component each, never "." or "..".
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def compile_cache_key(es: EngineSetSpec, cs: WeightCacheSpec) -> str:
    """What makes an EngineSet's compiled artifacts incompatible, as 16 hex characters.

    Only the specs: the same EngineSet and WeightCache give the same key in every operator
    process (``content_hash`` is sorted JSON; the containers keep their template order)."""
    return content_hash({
        "images": [c.get("image") for c in es.template["spec"]["containers"]],
        "model": [cs.model_path, cs.model_pvc, cs.revision],
        "dtype": cs.dtype,
        "quantization": cs.quantization,
        "parallelism": [cs.tensor, cs.pipeline, cs.data, cs.expert],
    })


def compile_cache_dir(es: EngineSetSpec, cs: WeightCacheSpec, config: OperatorConfig, namespace: str,
                      name: str) -> str | None:
    """The host directory of this EngineSet's engine pods, or None where the cache is off.

    Derived here from the EngineSet's own namespace and name, never taken from the spec: the
    one thing an EngineSet chooses is whether it has a cache at all."""
    if not config.compile_cache or not es.compile_cache:
        return None
    for what, value in (("namespace", namespace), ("EngineSet name", name)):
        if not isinstance(value, str) or len(value) > 63 or not _DNS_LABEL.match(value):
            raise SpecError("InvalidName", f"{what} {value!r} is not a DNS label: it names a host directory")
    return f"{config.compile_cache_root.rstrip('/')}/{namespace}/{name}/{compile_cache_key(es, cs)}"


def compile_cache_volume(directory: str) -> dict[str, Any]:
    # DirectoryOrCreate: the kubelet makes the directory (and its parents, root-owned, 0755) on
    # the pod's first start on a node; nothing of the operator runs on the node for it.
    return {"name": COMPILE_CACHE_VOLUME, "hostPath": {"path": directory, "type": "DirectoryOrCreate"}}


def compile_cache_mount() -> dict[str, Any]:
    return {"name": COMPILE_CACHE_VOLUME, "mountPath": COMPILE_CACHE_MOUNT}


def container_may_write(container: Mapping[str, Any], pod_spec: Mapping[str, Any]) -> bool:
    """Whether `container` runs as root as far as the template says (the directory is the kubelet's:
    root-owned, 0755, and fsGroup does not apply to hostPath volumes).

    A container the template runs as another user (runAsUser, or runAsNonRoot with the image's
    user) gets no mount and no variables: it keeps its engines' defaults rather than failing to
    write a read-only cache. An image whose own USER is not root cannot be seen from here (docs)."""
    pod_sc = pod_spec.get("securityContext") or {}
    sc = container.get("securityContext") or {}
    user = sc.get("runAsUser", pod_sc.get("runAsUser"))
    if user is not None:
        return user == 0
    return not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot", False))


def reaches(path: str, root: str) -> bool:
    """Whether host path `path` is `root`, inside it, or above it (so a mount of it reaches `root`)."""
    norm = posixpath.normpath("/" + path.lstrip("/"))  # one leading slash: normpath keeps two as they are
    root = posixpath.normpath(root)
    return norm == root or norm.startswith(root + "/") or root.startswith(norm.rstrip("/") + "/")


def check_template_host_paths(es: EngineSetSpec, config: OperatorConfig) -> None:
    """Refuse a template that mounts the compile cache's root itself: a pod of it could read, and
    plant code in, the directories of every namespace's engines on its node."""
    for i, v in enumerate(es.template["spec"].get("volumes") or []):
        host = (v.get("hostPath") or {}).get("path") if isinstance(v, Mapping) else None
        if isinstance(host, str) and reaches(host, config.compile_cache_root):
            raise SpecError("InvalidTemplate",
                            f"spec.template.spec.volumes[{i}] ({v.get('name')}) is the host path {host!r}, which "
                            f"holds the engines' compile caches ({config.compile_cache_root}): the operator mounts "
                            "this EngineSet's own directory into its engine containers")
