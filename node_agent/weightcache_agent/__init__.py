"""weightcache: LLM weights kept resident by a node agent, attached zero-copy by engines.

The engine-facing API is `CacheSpec` + `attach` (and `prepare`, which an engine may call
while it starts, so that its first attach costs what a later one does). Names are resolved lazily (PEP 562):
importing the package costs nothing, so `weightcache operator` and `weightcache status`
never import torch, and nothing here ever imports kopf or kubernetes. An engine process (one
that imported torch before this package) whose environment names its agent starts preparing
the attach path on a thread at this import, another once it takes `attach` or `prepare` from here
(`client.early`; `$WEIGHTCACHE_PREPARE=off` stops it).

Layers, lowest first; a module imports only from layers below its own (and its own
subpackage), which `tests/test_layers.py` checks:
  base      errors, spec, quantization, protocol,        what every process shares
            packed_rows (a manifest's rows, binary),
            logs, usage (help layout, exit codes),
            path_owners (who could swap a socket's directory)
  arena     cpu (memfd), cuda (VMM), devices             the memory weights live in
  load      checkpoint -> shard -> quantize -> arena     the cold path, and the fingerprint
  client    session (attach), rebind                     what an engine imports
  serve     agent, supervisor, HTTP, process groups      the node agent's processes
  testing   synthetic checkpoints, an agent process      for tests, benchmarks and the demo
  integrations  transformers (`from_cache`)             attach paths for model libraries (optional extras)
  engine    reference engine, model, demo                a user of all of the above
  cli       `weightcache` subcommands                    the entry points
            (compile_cache_prune: a node's compile caches)
"""
from __future__ import annotations

import importlib
import sys
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
    if name in ("attach", "Attachment", "prepare"):
        _begin_preparing()
    return value


def _begin_preparing() -> None:
    from .client.warmup import begin

    begin()


# An engine whose environment names its agent prepares the attach path while it goes on starting
# (`client.early`): from here where it imported torch first (never one of our own commands, which
# import this package before anything else), else once it asks for the attach.
if "torch" in sys.modules:
    from .client import early as _early

    if _early.wanted():
        import threading

        threading.Thread(target=_begin_preparing, name="weightcache-prepare-start", daemon=True).start()
