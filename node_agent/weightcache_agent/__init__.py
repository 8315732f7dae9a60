"""weightcache: LLM weights kept resident by a node agent, attached zero-copy by engines.

The engine-facing API is `CacheSpec` + `attach` (and `prepare`, which an engine may call
while it starts, so that its first attach costs what a later one does). Names are resolved lazily (PEP 562):
importing the package costs nothing, so `weightcache operator` and `weightcache status`
never import torch, and nothing here ever imports kopf or kubernetes.

Layers, lowest first; a module imports only from layers below its own (and its own
subpackage), which `tests/test_layers.py` checks:
  base      errors, spec, quantization, protocol,        what every process shares
            packed_rows (a manifest's rows, binary),
            logs, usage (help layout, exit codes)
  arena     cpu (memfd), cuda (VMM), devices             the memory weights live in
  load      checkpoint -> shard -> quantize -> arena     the cold path, and the fingerprint
  client    session (attach), rebind                     what an engine imports
  serve     agent, supervisor, HTTP, process groups      the node agent's processes
  testing   synthetic checkpoints                        for tests and the demo
  integrations  transformers (`from_cache`)             attach paths for model libraries (optional extras)
  engine    reference engine, model, demo                a user of all of the above
  cli       `weightcache` subcommands                    the entry points
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Attachment": "client.session",
    "agent_status": "protocol",
    "attach": "client.session",
    "CacheSpec": "spec",
    "prepare": "client.warmup",
    "AgentUnavailable": "errors",
    "AttachError": "errors",
    "CheckpointError": "errors",
    "FingerprintMismatch": "errors",
    "OutOfMemory": "errors",
    "ProtocolError": "errors",
    "UnsupportedQuantization": "errors",
    "WeightCacheError": "errors",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weightcache_agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value
