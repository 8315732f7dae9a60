"""A compact Llama/Qwen2 decoder, built on the meta device and filled by `attach`.

Why our own: the reference engine must build instantly on `meta`, carry parameter names
that match Hugging Face checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...) so
the cache's manifest rebinds onto it one to one, and declare FP8 layers whose dtypes
match the arena exactly (the rebind checks shape and dtype strictly).

Data flow: `ModelConfig.from_pretrained(dir)` reads config.json; `build_model(config)`
creates `CausalLM` under `torch.device("meta")` (no memory, no init); `attach()`
points every parameter at the cache; `prepare()` then computes the RoPE tables on the
weights' device (they are not persistent, so they are never in the cache and never
left on meta). `forward` takes token ids and an optional `KVCache`; `generate` is the
greedy loop the HTTP server calls.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..load.dtypes import torch_dtype

FP8_BLOCK = 128  # block-wise FP8: one fp32 scale per 128x128 tile of a weight
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a Hugging Face config.json that decides shapes and numerics."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    tie_word_embeddings: bool
    model_type: str = "llama"
    rope_scaling: dict[str, Any] | None = None
    eos_token_id: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16  # of every tensor that is not FP8
    quantization: str = "none"  # "none" | "fp8-block"
    tp_size: int = 1  # this rank holds 1/tp_size of the heads, of the MLP and of the vocabulary

    @classmethod
    def from_pretrained(cls, directory: str, dtype: torch.dtype | None = None, quantization: str = "none",
                        tp_size: int = 1) -> "ModelConfig":
        path = os.path.join(directory, "config.json")
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"{directory}: no config.json; the engine builds the model from it") from None
        return cls.from_dict(raw, dtype=dtype, quantization=quantization, tp_size=tp_size, where=path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], dtype: torch.dtype | None = None, quantization: str = "none",
                  tp_size: int = 1, where: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{where}: model_type {model_type!r} is not a Llama/Qwen2-family decoder "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        rope = raw.get("rope_parameters") or {}
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                # transformers 5 writes RoPE settings as `rope_parameters` (theta and scaling in one dict)
                rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                # Qwen2 always has q/k/v biases; Llama declares them with attention_bias.
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                model_type=model_type,
                rope_scaling=raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None),
                eos_token_id=_as_tuple(raw.get("eos_token_id")),
                dtype=dtype or torch_dtype(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
                quantization=quantization,
                tp_size=tp_size,
            )
        except KeyError as e:
            raise ValueError(f"{where}: missing required field {e.args[0]!r}") from None
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.quantization not in ("none", "fp8-block"):
            raise ValueError(f"the reference engine computes with quantization none or fp8-block, not {self.quantization!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} attention heads are not a multiple of "
                             f"{self.num_key_value_heads} key/value heads")
        for what, n in (("attention heads", self.num_attention_heads), ("key/value heads", self.num_key_value_heads),
                        ("intermediate size", self.intermediate_size), ("vocabulary", self.vocab_size)):
            if n % self.tp_size:
                raise ValueError(f"{what} ({n}) do not split evenly over tp_size={self.tp_size}")
        kind = (self.rope_scaling or {}).get("rope_type") or (self.rope_scaling or {}).get("type")
        if kind not in (None, "default", "linear", "llama3"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3 are)")

    @property
    def local_heads(self) -> int:
        return self.num_attention_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return self.num_key_value_heads // self.tp_size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def local_vocab(self) -> int:
        # embed_tokens and lm_head are vocab-parallel (the loader's sharding presets split them on dim 0)
        return self.vocab_size // self.tp_size


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


# -- layers -------------------------------------------------------------------------------------


class Linear(nn.Module):
    """y = x W^T (+ b) with W in the model dtype; named like nn.Linear for checkpoint names."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Fp8BlockLinear(nn.Module):
    """A linear layer whose weight is float8_e4m3fn with one fp32 scale per 128x128 block.

    The module declares `weight_scale_inv` itself (shape ceil(out/128) x ceil(in/128)) so
    the cache's scale tensor rebinds onto a declared buffer with a checked shape. Compute
    dequantizes blockwise in fp32 (w = fp8 * scale), casts to the activation dtype and
    runs an ordinary matmul: slow next to a fused kernel, but exact to the format.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.empty(
            math.ceil(out_features / FP8_BLOCK), math.ceil(in_features / FP8_BLOCK), dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        scale = self.weight_scale_inv.repeat_interleave(FP8_BLOCK, 0)[: self.out_features]
        scale = scale.repeat_interleave(FP8_BLOCK, 1)[:, : self.in_features]
        return (self.weight.to(torch.float32) * scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementations, then scale in the model dtype.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary:
    """RoPE cos/sin tables. Plain tensors, not buffers: computed by `prepare`, never cached."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        c = self.config
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64, device=device) / c.head_dim))
        inv_freq = _scaled_inv_freq(inv_freq, c.rope_scaling)
        positions = torch.arange(c.max_position_embeddings, dtype=torch.float64, device=device)
        freqs = torch.outer(positions, inv_freq).to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (batch, heads, seq, head_dim); positions: (seq,)."""
        assert self.cos is not None and self.sin is not None, "call prepare() after attach"
        cos, sin = self.cos[positions], self.sin[positions]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def _scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any] | None) -> torch.Tensor:
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    # llama3: long wavelengths slowed by `factor`, short ones kept, smooth ramp between.
    factor, low, high = float(scaling["factor"]), float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen) - low) / (high - low)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, out)


class KVCache:
    """Keys and values of every layer for one sequence; grows by concatenation."""

    def __init__(self, layers: int):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers

    @property
    def length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else k.shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None:
            k, v = torch.cat((old_k, k), dim=2), torch.cat((old_v, v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def _linear(config: ModelConfig, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
    kind = Fp8BlockLinear if config.quantization == "fp8-block" else Linear
    return kind(in_features, out_features, bias, config.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary):
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self.heads, self.kv_heads, self.head_dim = config.local_heads, config.local_kv_heads, config.head_dim
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = _linear(config, h, self.heads * self.head_dim, bias)
        self.k_proj = _linear(config, h, self.kv_heads * self.head_dim, bias)
        self.v_proj = _linear(config, h, self.kv_heads * self.head_dim, bias)
        self.o_proj = _linear(config, self.heads * self.head_dim, h)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary.apply(q, positions), self.rotary.apply(k, positions)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if self.kv_heads != self.heads:  # grouped-query attention: each kv head serves a group of q heads
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        past = k.shape[2] - t
        if t == 1:
            mask = None  # one new token sees everything before it
        else:
            # causal with an offset: query i (absolute past+i) sees keys 0..past+i
            mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(diagonal=past)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i = config.hidden_size, config.local_intermediate
        self.gate_proj = _linear(config, h, i)
        self.up_proj = _linear(config, h, i)
        self.down_proj = _linear(config, i, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = Attention(config, layer, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """`model.*` in the checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, rotary: Rotary):
        super().__init__()
        # Given its weight, nn.Embedding skips its initialiser: on meta that runs through torch's
        # reference ops, whose first use imports torch._dynamo (seconds of an engine's start-up).
        self.embed_tokens = nn.Embedding(config.local_vocab, config.hidden_size, _freeze=True, _weight=torch.empty(
            config.local_vocab, config.hidden_size, dtype=config.dtype))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, n, rotary) for n in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rotary = Rotary(config)
        self.model = DecoderModel(config, self.rotary)
        self.lm_head = Linear(config.hidden_size, config.local_vocab, False, config.dtype)
        self.tensor_parallel = False  # set by engine.tensor_parallel.parallelize: collectives join the ranks
        if config.tie_word_embeddings:
            # One Parameter under both names: rebind fills it once from `model.embed_tokens.weight`.
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare(self) -> None:
        """Compute what the cache does not hold (RoPE tables) on the weights' device."""
        weight = self.model.embed_tokens.weight
        if weight.is_meta:
            raise RuntimeError("prepare() before attach: the weights are still on the meta device")
        self.rotary.prepare(weight.device, self.config.dtype)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens: (batch, seq) int64 -> logits (batch, seq, vocab) in fp32."""
        if self.config.tp_size != 1 and not self.tensor_parallel:
            raise NotImplementedError(f"this process holds 1/{self.config.tp_size} of the model: tensor-parallel "
                                      "forward needs every rank: engine.tensor_parallel.parallelize joins them")
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, positions, cache)
        return self.lm_head(self.model.norm(x)).to(torch.float32)

    @torch.inference_mode()
    def generate(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation of `tokens`: at most `max_tokens` new ids, stopping at EOS."""
        cache = KVCache(self.config.num_hidden_layers)
        device = self.model.embed_tokens.weight.device
        logits = self(torch.tensor([tokens], dtype=torch.long, device=device), cache)
        out: list[int] = []
        while True:
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if len(out) >= max_tokens or nxt in self.config.eos_token_id:
                return out
            logits = self(torch.tensor([[nxt]], dtype=torch.long, device=device), cache)


def build_model(config: ModelConfig) -> CausalLM:
    """The model on the meta device: no memory, no initialisation, ready for `attach`."""
    with torch.device("meta"):
        return CausalLM(config).eval()
