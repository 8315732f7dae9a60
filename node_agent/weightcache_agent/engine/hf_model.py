"""The reference engine's model for architectures it does not implement: transformers'.

`native(directory)` says whether config.json names one of the engine's own decoders
(`model.SUPPORTED_MODEL_TYPES`); for any other causal LM, `load_transformers_model`
builds it with `integrations.transformers.from_cache` (meta device, non-persistent buffers
computed, FP8 layers for fp8-block) and wraps it in `TransformersLM`, which offers what
the server calls on a model: `config` (vocabulary, context, tp_size) and a greedy
`generate`. transformers is imported only here, and only when such a model is served.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ..client.session import Attachment
from ..spec import CacheSpec
from .model import SUPPORTED_MODEL_TYPES


@dataclass(frozen=True)
class ServedConfig:
    """What the server reads of a model's config."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_id: tuple[int, ...]
    model_type: str
    tp_size: int = 1


class TransformersLM:
    """A transformers causal LM behind the reference engine's model interface."""

    def __init__(self, model: Any):
        self.model = model
        cfg = model.config
        eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
        eos = cfg.eos_token_id if eos is None else eos
        self.config = ServedConfig(
            vocab_size=int(cfg.vocab_size),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", None) or 2048),
            eos_token_id=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),)),
            model_type=cfg.model_type)

    def generate(self, tokens: list[int], max_tokens: int) -> list[int]:
        from ..integrations.transformers import greedy_generate

        return greedy_generate(self.model, tokens, max_tokens, stop=lambda t: t in self.config.eos_token_id)


def native(directory: str) -> bool:
    """True when config.json names one of the engine's own architectures (or cannot be read: that path says why)."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            model_type = json.load(f).get("model_type", "llama")
    except (OSError, ValueError, AttributeError):
        return True
    return model_type in SUPPORTED_MODEL_TYPES


def load_transformers_model(spec: CacheSpec, mode: str = "off", socket: str | None = None,
                            **attach_args: Any) -> tuple[TransformersLM, Attachment]:
    if spec.tp_size != 1:
        raise ValueError(f"{spec.model}: the engine serves transformers models with tp_size=1 only, "
                         f"not {spec.tp_size}")
    try:
        from ..integrations.transformers import from_cache
    except ImportError as e:
        raise ValueError(f"{spec.model}: its model_type is not one of the engine's own "
                         f"({', '.join(SUPPORTED_MODEL_TYPES)}); serving it needs transformers "
                         f"(pip install 'weightcache[transformers]'): {e}") from None
    model = from_cache(spec, socket=socket, mode=mode, **attach_args)
    return TransformersLM(model), model.weightcache.attachment
