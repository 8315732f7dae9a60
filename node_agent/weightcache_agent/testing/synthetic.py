"""Deterministic synthetic checkpoints in the Hugging Face layout.

The demo, the tests and the benchmarks all need real safetensors files with a real
`config.json`; this module writes them from a seed, so the same arguments always give
the same bytes. `llama_tensors` names tensors the way Llama/Qwen2 checkpoints do
(`model.layers.N.self_attn.q_proj.weight`, ...), `write_checkpoint` splits them into
shards with a `model.safetensors.index.json` when asked.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file

from ..load.dtypes import torch_dtype


@dataclass
class LlamaShape:
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: True (q/k/v biases)
    model_type: str = "llama"
    architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])

    def config(self, dtype: torch.dtype) -> dict[str, Any]:
        cfg = asdict(self)
        cfg["head_dim"] = self.hidden_size // self.num_attention_heads
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        cfg["hidden_act"] = "silu"
        return cfg


def qwen2_shape(**overrides: Any) -> LlamaShape:
    base = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], attention_bias=True, rope_theta=1e6)
    base.update(overrides)
    return LlamaShape(**base)


def llama_tensors(shape: LlamaShape, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights, scaled like an initialised model so a forward pass stays finite."""
    gen = torch.Generator().manual_seed(seed)
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    head_dim = h // shape.num_attention_heads
    kv = shape.num_key_value_heads * head_dim

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * dims[-1] ** -0.5).to(dtype)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(v, h)}
    for n in range(shape.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
        out[p + "self_attn.q_proj.weight"] = rand(h, h)
        out[p + "self_attn.k_proj.weight"] = rand(kv, h)
        out[p + "self_attn.v_proj.weight"] = rand(kv, h)
        if shape.attention_bias:
            out[p + "self_attn.q_proj.bias"] = rand(h)
            out[p + "self_attn.k_proj.bias"] = rand(kv)
            out[p + "self_attn.v_proj.bias"] = rand(kv)
        out[p + "self_attn.o_proj.weight"] = rand(h, h)
        out[p + "post_attention_layernorm.weight"] = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
        out[p + "mlp.gate_proj.weight"] = rand(i, h)
        out[p + "mlp.up_proj.weight"] = rand(i, h)
        out[p + "mlp.down_proj.weight"] = rand(h, i)
    out["model.norm.weight"] = torch.ones(h, dtype=dtype)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = rand(v, h)
    return out


def write_checkpoint(directory: str, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None,
                     shards: int = 1) -> str:
    """Write `tensors` as safetensors (sharded with an index when shards > 1) plus config.json."""
    os.makedirs(directory, exist_ok=True)
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    else:
        per = -(-len(names) // shards)
        weight_map = {}
        for k in range(shards):
            part = names[k * per : (k + 1) * per]
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, os.path.join(directory, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    if config is not None:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
    return directory


def write_llama_checkpoint(directory: str, shape: LlamaShape | None = None, dtype: torch.dtype = torch.bfloat16,
                           seed: int = 0, shards: int = 1) -> str:
    shape = shape or LlamaShape()
    return write_checkpoint(directory, llama_tensors(shape, dtype, seed), shape.config(dtype), shards)


def write_word_tokenizer(directory: str, vocab_size: int) -> None:
    """A word-level tokenizer for a synthetic checkpoint: tokens `w3` ... `w<vocab_size - 1>` split on
    whitespace, plus `<unk>`, `<s>`, `</s>`, so that an engine that needs a tokenizer (vLLM's OpenAI
    server) serves the checkpoint without a download. Written as the `tokenizers` library's own JSON
    (its WordLevel model; the WordPiece decoder joins tokens with spaces), which needs no library here."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
                 "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "model_max_length": 4096}, f, indent=1)


def skeleton_module(tensors: dict[str, tuple[tuple[int, ...], Any]]) -> torch.nn.Module:
    """A module tree on the meta device with one parameter per name (name -> (shape, dtype: torch's or a
    checkpoint record's)).

    Stands in for an engine's model where only the parameter names matter (tests, benchmarks).
    """
    root = torch.nn.Module()
    for name, (shape, dtype) in tensors.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        owner.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=torch_dtype(dtype), device="meta"), requires_grad=False))
    return root
