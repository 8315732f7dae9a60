"""Deterministic synthetic MoE and pre-quantized FP8 checkpoints (next to `synthetic`).

The loader's tests and benchmarks need the tensor names of the MoE families its presets
cover -- Mixtral (`block_sparse_moe.experts.E.w1/w2/w3`), Qwen-MoE (`mlp.experts.E.*_proj`
plus `shared_expert`), DeepSeek-V2/V3 (MLA attention, `mlp.experts`, `shared_experts`)
-- and a DeepSeek-V3-style checkpoint already in block FP8 (`weight_scale_inv` next to
each linear weight, `quantization_config.weight_block_size = [128, 128]`). Same
arguments, same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..load import fp8
from .synthetic import write_checkpoint

FAMILIES = ("mixtral", "qwen_moe", "deepseek")


@dataclass
class MoeShape:
    family: str = "mixtral"
    hidden_size: int = 256
    intermediate_size: int = 512  # dense layers / shared expert
    moe_intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_experts: int = 4
    vocab_size: int = 512
    # DeepSeek MLA
    q_lora_rank: int = 128
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64

    def config(self, dtype: torch.dtype) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "vocab_size": self.vocab_size,
            "torch_dtype": str(dtype).removeprefix("torch."), "rms_norm_eps": 1e-6,
        }
        if self.family == "mixtral":
            cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=self.num_experts,
                       num_experts_per_tok=2)
        elif self.family == "qwen_moe":
            cfg.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=self.num_experts,
                       moe_intermediate_size=self.moe_intermediate_size,
                       shared_expert_intermediate_size=self.intermediate_size, num_experts_per_tok=2)
        elif self.family == "deepseek":
            cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                       n_routed_experts=self.num_experts, n_shared_experts=1, first_k_dense_replace=1,
                       moe_intermediate_size=self.moe_intermediate_size, q_lora_rank=self.q_lora_rank,
                       kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                       qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        else:
            raise ValueError(f"unknown MoE family {self.family!r}; known: {', '.join(FAMILIES)}")
        return cfg


def moe_tensors(shape: MoeShape, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, v, e, mi = shape.hidden_size, shape.vocab_size, shape.num_experts, shape.moe_intermediate_size
    head_dim = h // shape.num_attention_heads

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * dims[-1] ** -0.5).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(v, h)}
    for n in range(shape.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = norm(h)
        if shape.family == "deepseek":
            heads, qk = shape.num_attention_heads, shape.qk_nope_head_dim + shape.qk_rope_head_dim
            out[p + "self_attn.q_a_proj.weight"] = rand(shape.q_lora_rank, h)
            out[p + "self_attn.q_a_layernorm.weight"] = norm(shape.q_lora_rank)
            out[p + "self_attn.q_b_proj.weight"] = rand(heads * qk, shape.q_lora_rank)
            out[p + "self_attn.kv_a_proj_with_mqa.weight"] = rand(shape.kv_lora_rank + shape.qk_rope_head_dim, h)
            out[p + "self_attn.kv_a_layernorm.weight"] = norm(shape.kv_lora_rank)
            out[p + "self_attn.kv_b_proj.weight"] = rand(heads * (shape.qk_nope_head_dim + shape.v_head_dim),
                                                         shape.kv_lora_rank)
            out[p + "self_attn.o_proj.weight"] = rand(h, heads * shape.v_head_dim)
        else:
            kv = shape.num_key_value_heads * head_dim
            out[p + "self_attn.q_proj.weight"] = rand(h, h)
            out[p + "self_attn.k_proj.weight"] = rand(kv, h)
            out[p + "self_attn.v_proj.weight"] = rand(kv, h)
            out[p + "self_attn.o_proj.weight"] = rand(h, h)
        out[p + "post_attention_layernorm.weight"] = norm(h)
        if shape.family == "mixtral":
            out[p + "block_sparse_moe.gate.weight"] = rand(e, h)
            for x in range(e):
                q = f"{p}block_sparse_moe.experts.{x}."
                out[q + "w1.weight"] = rand(mi, h)
                out[q + "w2.weight"] = rand(h, mi)
                out[q + "w3.weight"] = rand(mi, h)
        elif shape.family == "deepseek" and n == 0:  # first_k_dense_replace = 1: a dense MLP
            _mlp(out, p + "mlp.", rand, shape.intermediate_size, h)
        else:
            out[p + "mlp.gate.weight"] = rand(e, h)
            if shape.family == "deepseek":
                out[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(e, dtype=torch.float32)
            for x in range(e):
                _mlp(out, f"{p}mlp.experts.{x}.", rand, mi, h)
            if shape.family == "qwen_moe":
                _mlp(out, p + "mlp.shared_expert.", rand, shape.intermediate_size, h)
                out[p + "mlp.shared_expert_gate.weight"] = rand(1, h)
            else:
                _mlp(out, p + "mlp.shared_experts.", rand, mi, h)
    out["model.norm.weight"] = torch.ones(h, dtype=dtype)
    out["lm_head.weight"] = rand(v, h)
    return out


def _mlp(out: dict[str, torch.Tensor], prefix: str, rand: Any, inter: int, hidden: int) -> None:
    out[prefix + "gate_proj.weight"] = rand(inter, hidden)
    out[prefix + "up_proj.weight"] = rand(inter, hidden)
    out[prefix + "down_proj.weight"] = rand(hidden, inter)


def write_moe_checkpoint(directory: str, shape: MoeShape | None = None, dtype: torch.dtype = torch.bfloat16,
                         seed: int = 0, shards: int = 1) -> str:
    shape = shape or MoeShape()
    return write_checkpoint(directory, moe_tensors(shape, dtype, seed), shape.config(dtype), shards)


def prequantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 style: each quantizable weight -> fp8 + fp32 weight_scale_inv = amax/448 per block.

    Deliberately the reference recipe (exact amax/448 scales, not the loader's powers of two),
    so a pass-through that re-quantized anything would show.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not fp8.quantizable(name, tuple(t.shape)):
            out[name] = t
            continue
        rows, cols = t.shape
        r_blocks, c_blocks = fp8.scale_shape((rows, cols))
        padded = torch.zeros(r_blocks * fp8.BLOCK, c_blocks * fp8.BLOCK)
        padded[:rows, :cols] = t.float()
        blocks = padded.view(r_blocks, fp8.BLOCK, c_blocks, fp8.BLOCK)
        scale = (blocks.abs().amax(dim=(1, 3)) / fp8.FP8_MAX).clamp(min=1e-12)
        q = (blocks / scale[:, None, :, None]).to(fp8.FP8).view(r_blocks * fp8.BLOCK, c_blocks * fp8.BLOCK)
        out[name] = q[:rows, :cols].contiguous()
        out[fp8.scale_name(name)] = scale.contiguous()
    return out


def fp8_config(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [fp8.BLOCK, fp8.BLOCK]})
