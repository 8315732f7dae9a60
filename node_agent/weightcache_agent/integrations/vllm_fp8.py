"""vLLM's FP8 models from the arena: the quantization forms served, and block FP8 kept as views.

Which of vLLM's quantization forms the cache serves, and how vLLM's post-load processing of block
FP8 keeps the arena's weights as views.

Which forms (`cache_quantization`, from vLLM's model and quantization config):
  - `fp8` with `weight_block_size` [128, 128] (float8_e4m3fn `weight` + fp32 `weight_scale_inv` per
    128x128 block, DeepSeek-V3 style): served, from an agent holding `fp8-block`. The agent reads such a
    checkpoint as it is, or quantizes a bf16 checkpoint itself (`--quantization fp8-block`); vLLM is then
    told the model is block FP8 by `--hf-overrides` (its `quantization_config`), config.json untouched;
    such a model has no disk copy vLLM could load, so a miss cannot fall back to disk (`disk_serves`).
  - every other form is a miss named by `NotServable` with its reason: `fp8` per-tensor or per-channel
    (`weight_scale`), other block sizes, vLLM's online FP8 (`fp8_per_tensor`, `fp8_per_block`, ...),
    `compressed-tensors`, and all other methods.

What post-load processing does to block FP8 (`kept_as_views`), per kernel vLLM picks:
  - CUTLASS, Triton, vLLM's CPU kernel (kept on its unpacked path by the loader): the weight and scale
    stay as they are loaded: views;
  - DeepGEMM with UE8M0 scales (Hopper and Blackwell's default): vLLM re-quantizes each weight in place
    so its block scales are powers of two, then lays the scales out for DeepGEMM (a new tensor). The arena
    is read-only and shared, so it must not be written: where a layer's scales already are powers of two
    (the agent's own quantizer makes them so, as do UE8M0 checkpoints) the re-quantization changes no
    value (it may move a factor of two between a block's weights and its scale; a block whose largest
    magnitude is below 1e-4, which vLLM's re-quantization clamps and rounds coarser, keeps the arena's
    finer values), and it is skipped for that layer (the weight stays a view, only the small scale
    tensor is vLLM's new copy); where they are not, the layer's weight and scale are copied first and
    vLLM re-quantizes its copy, counted and named in the loader's log line.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._engine_common import NotServable

BLOCK = [128, 128]

# Why each method vLLM names is not served from the cache (the method as vLLM spells it).
_NOT_SERVED = {
    "compressed-tensors": "its FP8 schemes keep the scale as weight_scale and post-process per scheme (per-tensor "
                          "scales of fused layers requantized to one, per-channel weights transposed), which the "
                          "agent's layout does not hold",
    "fp8_per_tensor": "vLLM's online FP8 quantizes bf16 weights after loading them; start the agent with "
                      "--quantization fp8-block and tell vLLM the model is block FP8 instead (--hf-overrides)",
    "fp8_per_block": "vLLM's online FP8 declares bf16 weights and quantizes them after loading; start the agent "
                     "with --quantization fp8-block and tell vLLM the model is block FP8 instead (--hf-overrides)",
    "fp8_per_channel": "vLLM's online FP8 quantizes bf16 weights after loading them; start the agent with "
                       "--quantization fp8-block and tell vLLM the model is block FP8 instead (--hf-overrides)",
}

# What tells vLLM a bf16 checkpoint is served as block FP8 by the agent (its --hf-overrides).
HF_OVERRIDES = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": BLOCK}}


def cache_quantization(model_config: Any, quant_config: Any, cache_config: Any = None) -> str:
    """The agent's quantization for vLLM's: "none" or "fp8-block"; `NotServable` naming any other form."""
    method = model_config.quantization
    if not method:
        return "none"
    if method == "fp8":
        block = getattr(quant_config, "weight_block_size", None)
        if not getattr(quant_config, "is_checkpoint_fp8_serialized", True):
            raise NotServable("vLLM quantization 'fp8' of an unquantized checkpoint (online, per-tensor) is not "
                              "served from the cache: vLLM quantizes it after loading; start the agent with "
                              f"--quantization fp8-block and pass vLLM --hf-overrides '{json.dumps(HF_OVERRIDES)}'")
        if block is None:
            raise NotServable("vLLM quantization 'fp8' per-tensor or per-channel (weight_scale, no weight_block_size) "
                              "is not served from the cache: after loading, vLLM requantizes fused q|k|v and gate|up "
                              "to one scale and transposes the weight, a form the agent does not hold; serve a "
                              "checkpoint with weight_block_size [128, 128]")
        if list(block) != BLOCK:
            raise NotServable(f"vLLM quantization 'fp8' with weight_block_size {list(block)} is not served from the "
                              "cache: the agent holds 128x128 blocks only")
        if str(getattr(cache_config, "cache_dtype", "auto")).startswith("fp8"):
            raise NotServable("an FP8 KV cache (--kv-cache-dtype fp8) is not served from the cache: its scales "
                              "are not among the agent's tensors")
        if getattr(quant_config, "activation_scheme", "dynamic") != "dynamic":
            raise NotServable("vLLM quantization 'fp8' with static activation scales is not served from the cache")
        return "fp8-block"
    why = _NOT_SERVED.get(method, "its linear methods re-lay or rescale weights after loading in ways the agent's "
                                  "layout does not hold")
    raise NotServable(f"vLLM quantization {method!r} is not served from the cache: {why}")


def disk_serves(model_dir: str, quantization: str) -> str | None:
    """None when vLLM's own loader can read this model from disk; else why not (a bf16 checkpoint that
    vLLM was told is block FP8: only an agent quantizing it holds those weights)."""
    if quantization != "fp8-block":
        return None
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and config.get("quantization_config"):
        return None
    return (f"{os.path.join(model_dir, 'config.json')} has no quantization_config: the checkpoint on disk is not FP8 "
            "(vLLM was told it is by --hf-overrides), so only an agent started with --quantization fp8-block can "
            "serve it")


def kv_scales_as_vllm_makes_them(model: nn.Module, device: torch.device) -> None:
    """An FP8 model's attention layers declare KV-cache scales (`q_scale`, `k_scale`, `v_scale`,
    `prob_scale`) that a checkpoint without them leaves at vLLM's "not loaded" value, and that vLLM's
    post-processing turns into its defaults: made again here for real (the model was built with its
    parameters on meta), since the cache holds no such tensors."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    with device:
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, BaseKVCacheMethod):
                method.create_weights(module)


def _powers_of_two(scale: torch.Tensor) -> bool:
    """Whether every scale is a positive power of two (its mantissa is exactly one half)."""
    mantissa, _ = torch.frexp(scale.float())
    return bool((mantissa == 0.5).all())


def _private_copy(param: nn.Parameter) -> nn.Parameter:
    """`param`'s values in memory of this process, with the attributes vLLM hung on it."""
    copy = nn.Parameter(param.data.clone(), requires_grad=False)
    copy.__dict__.update(param.__dict__)
    return copy


def _requantizers(kernel: Any) -> list[Any]:
    """The kernel objects that would re-quantize a layer's weight in place to UE8M0 scales: DeepGEMM's
    (alone, or as the fallback of a kernel that dispatches between two)."""
    found = []
    for k in (kernel, getattr(kernel, "fallback", None), getattr(kernel, "base", None)):
        if k is not None and getattr(k, "use_deep_gemm_e8m0", False) and getattr(k, "is_deep_gemm_supported", True):
            found.append(k)
    return found


@contextlib.contextmanager
def kept_as_views(model: nn.Module, arena_tensors: list[torch.Tensor]) -> Iterator[list[str]]:
    """Around vLLM's `process_weights_after_loading`: no block-FP8 layer's arena view is written (see the
    module docstring). Yields the list the reasons for copies are appended to, for the log line."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in arena_tensors]
    lo = min((s for s, _ in spans), default=0)
    hi = max((s + n for s, n in spans), default=0)
    notes: list[str] = []
    skipped: list[Any] = []
    copied = 0
    try:
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(method, Fp8LinearMethod) or not getattr(method, "block_quant", False):
                continue
            weight, scale = module.weight, getattr(module, "weight_scale_inv", None)
            requant = _requantizers(getattr(method, "fp8_linear", None))
            if not requant or scale is None or not lo <= weight.data_ptr() < hi:
                continue
            if scale.dtype == torch.float32 and _powers_of_two(scale):
                for k in requant:  # every value is the same after UE8M0 re-quantization: nothing to write
                    k.use_deep_gemm_e8m0 = False
                    skipped.append(k)
                continue
            # vLLM will rewrite this layer's weight and scale: it gets its own copies to rewrite (new
            # parameters: the bound ones are the attachment's record of what is in the arena)
            for leaf in ("weight", "weight_scale_inv"):
                module._parameters[leaf] = _private_copy(module._parameters[leaf])
            copied += 1
        if copied:
            notes.append(f"{copied} FP8 layer(s) copied: their block scales are not powers of two and vLLM's "
                         "DeepGEMM re-quantizes them to UE8M0 in place")
        yield notes
    finally:
        for k in skipped:  # its kernels run with UE8M0 activation scales, as vLLM chose
            k.use_deep_gemm_e8m0 = True
