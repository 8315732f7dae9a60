"""vLLM's `--load-format weightcache`, registered through vLLM's plugin entry point.

vLLM calls `register` in every process that may load a model (front end, engine core,
each tensor-parallel worker) because `pyproject.toml` names it under the
`vllm.general_plugins` entry point group: installing weightcache next to vLLM is the whole
integration. `register` imports vLLM's loader registry and `vllm_loader` (the loader
itself) only when vLLM runs it, so importing this module costs nothing anywhere else.
"""
from __future__ import annotations

LOAD_FORMAT = "weightcache"


def register() -> None:
    """Make `--load-format weightcache` known to vLLM (idempotent: vLLM may call it more than once)."""
    from vllm.model_executor import model_loader

    registered = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    if LOAD_FORMAT in registered:
        return
    from .vllm_loader import WeightcacheModelLoader

    model_loader.register_model_loader(LOAD_FORMAT)(WeightcacheModelLoader)
