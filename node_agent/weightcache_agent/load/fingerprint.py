"""The fingerprint: one hash over everything that decides the bytes in an arena.

`fingerprint_fields` lists those things by name -- the content identity of the
checkpoint (its headers, config and sampled data; never its path: an agent and an engine mount the same
model at different places), the revision label an operator gave it, parallelism and rank,
quantization and its config, dtype, sharding, layout version, and marks of the environment
(torch version, device). The agent publishes its fields; an engine computes its own from
its spec and `differences` names every field that disagrees, so a mismatch says exactly
what differs instead of "hash differs". The model's directory name travels beside the
fields (`model_name`) for messages only.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
from typing import TYPE_CHECKING, Any

from ..spec import CacheSpec

if TYPE_CHECKING:  # torch-free at import: the agent serving a re-adopted arena compares fields without it
    from .checkpoint import Checkpoint

# Bump when the loader would place or transform bytes differently for the same inputs.
LAYOUT_VERSION = 3  # 2: sharding plans, fp8-block with power-of-two scales; 3: every layout fuses q|k|v, gate|up

QUANTIZATION_CONFIGS: dict[str, dict[str, Any]] = {
    "none": {},
    "fp8-block": {"format": "float8_e4m3fn", "block": [128, 128], "scale": "weight_scale_inv",
                  "scale_rounding": "pow2"},
}


def resolved_dtype(spec: CacheSpec, checkpoint: Checkpoint) -> str:
    if spec.dtype != "auto":
        return spec.dtype
    from .dtypes import dtype_name

    found = checkpoint.floating_dtype()
    return dtype_name(found) if found is not None else "none"


def torch_version() -> str:
    """The installed torch's full version: from torch itself once imported, else from its
    package metadata (a file read, not the seconds an import of torch takes)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch

        return str(torch.__version__)


def environment_fields(device: str | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"torch": ".".join(torch_version().split("+")[0].split(".")[:2])}
    if device is not None:
        fields["device"] = device
    return fields


def fingerprint_fields(spec: CacheSpec, checkpoint: Checkpoint, device: str | None = "cpu",
                       sharding_identity: str | None = None) -> dict[str, Any]:
    """The fields of `spec` over `checkpoint`; `sharding_identity`, when given, stands in for resolving the plan."""
    from .fp8 import checkpoint_quantization
    from .sharding import plan_identity

    # quantized on load vs taken from a pre-quantized checkpoint: different bytes, same method name
    quant_config = dict(QUANTIZATION_CONFIGS[spec.quantization],
                        source="checkpoint" if checkpoint_quantization(checkpoint) else "load")
    fields = {
        "content": checkpoint.revision,
        # The operator's label (`--revision`, CacheSpec.revision): an engine that names one gets exactly that one.
        "revision": spec.revision,
        "tp_size": spec.tp_size,
        "tp_rank": spec.tp_rank,
        "pp_size": 1,
        "dp_size": 1,
        "expert_parallel": spec.expert_parallel,
        "quantization": spec.quantization,
        "quantization_config": _short_hash(quant_config),
        "dtype": resolved_dtype(spec, checkpoint),
        # the resolved plan (preset name, or hash of the YAML rules), not the flag: same flag, other file
        "sharding": sharding_identity or plan_identity(checkpoint, spec.sharding, spec.tp_size),
        "layout_version": LAYOUT_VERSION,
    }
    fields.update(environment_fields(device))
    return fields


# What `sharding.ShardingPlan.identity` can be: an engine's claim is checked against this shape only.
PLAN_IDENTITY_RE = re.compile(r"unsharded|preset:[a-z_]{1,32}|rules:[0-9a-f]{16}(\+preset:[a-z_]{1,32})?")


def model_name(path: str) -> str:
    """The model's directory name: what messages call it, never what identifies it."""
    return os.path.basename(str(path).rstrip("/")) or str(path)


def is_preset(sharding: str) -> bool:
    from .sharding import PRESETS

    return isinstance(sharding, str) and sharding in PRESETS


class RevisionRequired(Exception):
    """The agent cannot vouch for the engine's files by their signature: send the content identity."""


def engine_request(spec: CacheSpec, with_revision: bool = False) -> dict[str, Any]:
    """What an engine sends to attach: its spec, its checkpoint's file signature, its torch.

    Cheap by design: one stat per file, no header read or parsed. The agent derives the
    engine's full fields from it with `fields_for_request`, on the checkpoint it has already
    parsed. Where the agent does not recognise the signature, the engine asks again
    `with_revision` (the content identity of the headers, ~1 ms for 16 shards).
    Neither carries the model's path: the same files mounted elsewhere are the same model.
    """
    from .signature import content_identity, file_signature

    request = {"spec": spec.to_json(), "files": file_signature(spec.model), "torch": environment_fields(None)["torch"]}
    if spec.sharding is not None and not is_preset(spec.sharding):
        # A rules file is the engine's to read: the agent compares plan identities, it never opens a client's path.
        from .checkpoint import open_checkpoint
        from .sharding import plan_identity

        request["sharding_identity"] = plan_identity(open_checkpoint(spec.model), spec.sharding, spec.tp_size)
    if with_revision:
        request["content"] = content_identity(spec.model)
    return request


def fields_for_request(request: dict[str, Any], checkpoint: Checkpoint) -> dict[str, Any]:
    """The fields an engine would compute for its spec, had it parsed `checkpoint` itself.

    Every derived field (resolved dtype, quantization source, sharding plan) is a function of
    the spec and of the checkpoint's content, and the content is pinned by `content`: where
    the engine's content identity matches ours, the checkpoint is the same and so are the
    derivations. The engine's content is ours when its files carry the signature ours had when
    we read them; otherwise it must send its content identity (`RevisionRequired`).
    An engine that names no revision label leaves the field out: it accepts the agent's.
    """
    content = request.get("content")
    if content is None:
        if not checkpoint.signature or request.get("files") != checkpoint.signature:
            raise RevisionRequired()
        content = checkpoint.revision
    elif not isinstance(content, str):
        raise ValueError("content must be a string")
    known = CacheSpec.__dataclass_fields__
    spec = CacheSpec(**{k: v for k, v in request["spec"].items() if k in known})
    identity = None
    if spec.sharding is not None and not is_preset(spec.sharding):
        # The client named a rules file: take the plan identity it computed, never the path.
        identity = request.get("sharding_identity")
        if not isinstance(identity, str) or not PLAN_IDENTITY_RE.fullmatch(identity):
            raise ValueError("the spec names a sharding rules file: send its plan identity as sharding_identity "
                             "(the agent never reads a client's files)")
    fields = fingerprint_fields(spec, checkpoint, device=None, sharding_identity=identity)
    fields.update(content=content, torch=request["torch"])
    if spec.revision is None:
        del fields["revision"]
    return fields


def same_spec_fields(request: dict[str, Any], spec: CacheSpec, fields: dict[str, Any], signature: str,
                     content: str) -> dict[str, Any] | None:
    """`fields_for_request` without the checkpoint, where the engine asks for exactly our `spec`.

    Then every field derived from the checkpoint is ours (`fields`, computed from the same spec
    over the checkpoint we read) and only content, revision label and torch are the engine's own.
    None where the spec differs or names a rules file (its plan identity is the engine's);
    `RevisionRequired` as in `fields_for_request`.
    """
    known = CacheSpec.__dataclass_fields__
    theirs = CacheSpec(**{k: v for k, v in request["spec"].items() if k in known})
    if theirs.sharding is not None and not is_preset(theirs.sharding):
        return None
    if dataclasses.replace(theirs, model=spec.model, revision=spec.revision) != spec:
        return None
    engine_content = request.get("content")
    if engine_content is None:
        if not signature or request.get("files") != signature:
            raise RevisionRequired()
        engine_content = content
    elif not isinstance(engine_content, str):
        raise ValueError("content must be a string")
    out = {k: v for k, v in fields.items() if k not in ENGINE_MAY_OMIT}
    out.update(content=engine_content, torch=request["torch"])
    if theirs.revision is not None:
        out["revision"] = theirs.revision
    return out


def fingerprint(fields: dict[str, Any]) -> str:
    return _short_hash(fields)


# An engine cannot know the agent's device before it connects; the backend checks the
# device itself when it maps the arena, so an engine may leave this field out.
# Likewise the revision label: an engine that names none takes whichever the agent serves (the content is
# still checked).
ENGINE_MAY_OMIT = frozenset({"device", "revision"})


def differences(cache: dict[str, Any], engine: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Fields whose values differ, as name -> (cache value, engine value)."""
    keys = set(cache) | set(engine)
    keys -= {k for k in ENGINE_MAY_OMIT if k not in engine}
    return {
        key: (cache.get(key, "<absent>"), engine.get(key, "<absent>"))
        for key in sorted(keys)
        if cache.get(key, "<absent>") != engine.get(key, "<absent>")
    }


def _short_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
