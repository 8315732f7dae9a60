"""Hugging Face transformers causal LMs, attached from the cache like `from_pretrained`.

`from_cache(directory or CacheSpec, socket=...)` returns the same model, in eval mode,
that `AutoModelForCausalLM.from_pretrained(directory)` returns (bf16: the same logits bit
for bit), without allocating or initialising its weights (fused experts may be copies,
below). Flow:
  1. config.json -> `AutoModelForCausalLM.from_config` under `torch.device("meta")`, in the
     dtype the cache holds (the loader's own resolution of `dtype="auto"`), while a thread warms
     the attach path on the agent's device (`client.early`);
  2. fp8-block caches: every linear layer the cache quantized (`load.fp8.quantizable`)
     becomes transformers' `FP8Linear` (128x128 blocks), fused experts `FP8Experts`;
  3. `client.attach` with a `Materialize` that computes the non-persistent buffers the
     way transformers does when it loads (empty on the weights' device, then the model's
     own `_init_weights` on their owner, every bound tensor marked initialised so nothing
     else is touched), and maps renamed and fused checkpoint tensors (below); `cast_small=True` casts the
     1-D tensors transformers declares in another dtype (`FP8Linear` biases are float32);
  4. FP8 compute: transformers' own kernels where they load without a download (CUDA and
     the `kernels` package with its cache); otherwise each FP8 layer dequantizes its
     weight per call (the weights stay FP8 and zero-copy).

Checkpoint names. The cache holds tensors under the checkpoint's names; where transformers
rewrites them on load (its `conversion_mapping`), `Conversions` reproduces the rewrite:
renames bind the tensor at its new name, zero-copy; expert fusion (transformers 5 declares
`mlp.experts.gate_up_proj` [E, 2I, H], gate rows then up rows, and `mlp.experts.down_proj`
[E, H, I], while checkpoints keep `mlp.experts.<e>.{gate,up,down}_proj.weight`) makes each
fused parameter one strided view of the arena where the experts lie at a constant stride,
else a copy on the weights' device (`report.experts_copied`). Any other conversion is
refused by name. FP8 experts need moe_intermediate_size % 128 == 0.

This module imports transformers at its own import (the optional extra
`weightcache[transformers]`); nothing else in the package imports it.
"""
from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear, load_finegrained_fp8_kernel

from ..client.materialize import Materialize, Pending
from ..client import warmup
from ..client.session import Attachment, attach
from ..errors import AttachError
from ..load import fp8
from ..load.checkpoint import open_checkpoint
from ..load.dtypes import torch_dtype
from ..load.fingerprint import resolved_dtype
from ..spec import CacheSpec

log = logging.getLogger(__name__)
_swap = torch._C._swap_tensor_impl

FP8_COMPUTE = ("auto", "transformers", "dequantize")


@dataclass
class CacheReport:
    """What `from_cache` did besides binding by name; `model.weightcache` after it returns."""

    attachment: Attachment
    fp8_compute: str | None = None  # "transformers" (its FP8 kernels), "dequantize", or None (not FP8)
    experts_zero_copy: list[str] = field(default_factory=list)  # fused expert parameters that are arena views
    experts_copied: list[str] = field(default_factory=list)  # ... that had to be assembled as copies

    def close(self) -> None:
        self.attachment.close()


def from_cache(source: str | CacheSpec, *, socket: str | None = None, mode: str = "client",
               quantization: str = "none", dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
               fp8_compute: str = "auto", fallback: bool = False, **attach_args: Any) -> PreTrainedModel:
    """The transformers model of checkpoint `source`, its weights attached from the cache.

    source: the checkpoint directory (config.json + safetensors) or a whole `CacheSpec`
    (then `quantization` and `dtype` come from it). socket/mode/fallback and any other
    keyword (role, group, on_promote, ...) go to `attach`. device: where the caller expects
    the weights (an error if the cache holds them elsewhere); default: wherever it does.
    fp8_compute: "auto", "transformers" (its FP8 kernels or an error) or "dequantize".
    The lease and what was done: `model.weightcache` (a `CacheReport`; `.close()` ends it).
    """
    if fp8_compute not in FP8_COMPUTE:
        raise ValueError(f"fp8_compute must be one of {FP8_COMPUTE}, got {fp8_compute!r}")
    if isinstance(source, CacheSpec):
        spec = source
    else:
        spec = CacheSpec(model=source, quantization=quantization,
                         dtype=dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."))
    if mode != "off":
        warmup.begin(socket)  # the attach path warmed while transformers builds the model
    model = build_meta(spec)
    report_box: dict[str, list[str]] = {"zero_copy": [], "copied": []}
    attachment = attach(model, spec, socket=socket, mode=mode, fallback=fallback,
                        materialize=materializer(model, report_box), cast_small=True, **attach_args)
    try:
        where = model.get_input_embeddings().weight.device
        if device is not None and not _same_device(torch.device(device), where):
            raise AttachError(f"the cache holds {spec.model}'s weights on {where}, not on {torch.device(device)}")
        model.requires_grad_(False)
        report = CacheReport(attachment, experts_zero_copy=report_box["zero_copy"], experts_copied=report_box["copied"])
        if spec.quantization == "fp8-block":
            report.fp8_compute = _choose_fp8_compute(model, where, fp8_compute)
    except BaseException:
        attachment.close()
        raise
    model.weightcache = report
    if attachment.cast:
        log.info("cast %d small tensor(s) to the model's dtype: %s", len(attachment.cast), ", ".join(attachment.cast[:4]))
    if report.experts_copied:
        log.warning("%d fused expert tensor(s) assembled as copies (the cache's experts do not lie at one stride)",
                    len(report.experts_copied))
    return model.eval()


def build_meta(spec: CacheSpec) -> PreTrainedModel:
    """The model of `spec.model`'s config.json on the meta device, FP8 layers applied for fp8-block."""
    try:
        config = AutoConfig.from_pretrained(spec.model)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{spec.model}: transformers cannot read its config.json: {e}") from None
    dtype = torch_dtype(resolved_dtype(spec, open_checkpoint(spec.model)))
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(f"{spec.model}: model_type {config.model_type!r} is not a causal LM that transformers "
                         f"{transformers.__version__} knows (AutoModelForCausalLM has no class for {type(config).__name__})")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model._weightcache_conversions = Conversions(model, spec.model)
    if spec.quantization == "fp8-block":
        _apply_fp8_layers(model)
    return model


class Conversions:
    """The checkpoint-name rewrites transformers applies when it loads this model, as the cache maps them.

    Renamings (`WeightRenaming`, e.g. Mixtral's `.block_sparse_moe.` -> `.mlp.`, GPT-NeoX's
    `embed_out.` -> `lm_head.`) bind the cache tensor to the renamed place, zero-copy. Expert
    fusions (`WeightConverter` with `MergeModulelist(dim=0)`, then `Concatenate(dim=1)` for two
    sources) assemble the fused parameter from the per-expert tensors. Any other conversion is
    refused by name before anything is read.
    """

    def __init__(self, model: PreTrainedModel, where: str):
        self.renames: list[Any] = []
        self.fusions: list[Any] = []
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
        except ImportError:  # another transformers layout: the attach itself names what does not fit
            return
        unknown = []
        for c in get_model_conversion_mapping(model, add_legacy=False):
            ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(c, "operations", ())]
            kind = type(c).__name__
            if kind == "WeightRenaming" and len(c.target_patterns) == 1:
                self.renames.append(c)
            elif kind == "WeightConverter" and len(c.target_patterns) == 1 and all(".*." in p for p in c.source_patterns) \
                    and ops == [("MergeModulelist", 0)] + ([("Concatenate", 1)] if len(c.source_patterns) > 1 else []):
                self.fusions.append(c)
            else:
                steps = ", ".join(f"{op}(dim={dim})" if dim is not None else op for op, dim in ops)
                unknown.append(f"{kind} {', '.join(c.source_patterns)} -> {', '.join(c.target_patterns)}"
                               + (f" by {steps}" if steps else ""))
        if unknown:
            raise ValueError(f"{where}: model_type {model.config.model_type!r} is not supported yet: transformers "
                             f"converts its checkpoint tensors when it loads in a way the cache does not reproduce "
                             f"({'; '.join(unknown)})")

    def map(self, name: str) -> tuple[str, int, int] | None:
        """Where checkpoint tensor `name` goes when it is not bound as it is named: (place, expert, part)
        for a fused expert (part: its position in the concatenation), (place, -1, -1) for a renamed
        tensor, None for neither."""
        renamed = name
        for rename in self.renames:
            renamed, _ = rename.rename_source_key(renamed)
        base, suffix = renamed, ""
        if renamed.endswith("." + fp8.SCALE_SUFFIX):  # FP8 scales follow their weights
            base, suffix = renamed.removesuffix(fp8.SCALE_SUFFIX) + "weight", "_scale_inv"
        for fusion in self.fusions:
            target, pattern = fusion.rename_source_key(base)
            if pattern is None:
                continue
            expert = re.search(re.escape(pattern.lstrip(".")).replace(r"\*", r"(\d+)") + "$", base)
            if expert is None or not target.endswith(fusion.target_patterns[0].lstrip(".")):
                continue
            return target + suffix, int(expert.group(1)), fusion.source_patterns.index(pattern)
        return (renamed, -1, -1) if renamed != name else None


# -- FP8 ----------------------------------------------------------------------------------------


def _apply_fp8_layers(model: PreTrainedModel) -> None:
    block = (fp8.BLOCK, fp8.BLOCK)
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and fp8.quantizable(f"{name}.weight", (module.out_features, module.in_features)):
            with torch.device("meta"):
                new = FP8Linear(module.in_features, module.out_features, block_size=block,
                                has_bias=module.bias is not None)
        elif _is_fused_experts(module):
            intermediate = module.down_proj.shape[-1]
            if intermediate % fp8.BLOCK:
                raise ValueError(f"{name}: FP8 experts with an intermediate size of {intermediate} (not a multiple of "
                                 f"{fp8.BLOCK}) cannot be fused: gate and up rows would share scale blocks")
            with torch.device("meta"):
                new = FP8Experts(module.config if hasattr(module, "config") else model.config.get_text_config(),
                                 block_size=block)
            new.act_fn = module.act_fn
        else:
            continue
        model.set_submodule(name, new)
        replaced += 1
    if not replaced:
        raise ValueError(f"{type(model).__name__}: no linear layer is FP8 in an fp8-block cache of this model")


def _choose_fp8_compute(model: PreTrainedModel, device: torch.device, wanted: str) -> str:
    why = "the weights are not on a CUDA device" if device.type != "cuda" else ""
    if wanted != "dequantize" and not why:
        try:
            load_finegrained_fp8_kernel()
        except Exception as e:  # ImportError without `kernels`; anything a hub download raises offline
            why = f"transformers' FP8 kernel did not load ({type(e).__name__}: {str(e)[:200]})"
        else:
            return "transformers"
    if wanted == "transformers":
        raise AttachError(f"fp8_compute='transformers': {why}")
    for module in model.modules():
        if type(module) is FP8Linear:
            module.__class__ = DequantizingFP8Linear
        elif type(module) is FP8Experts:
            module.__class__ = DequantizingFP8Experts
    log.info("FP8 layers dequantize per call%s", f" ({why})" if why and wanted == "auto" else "")
    return "dequantize"


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block-FP8 weight [N, K] with scales [ceil(N/128), ceil(K/128)] in `dtype`."""
    n, k = weight.shape
    scale = scale_inv.repeat_interleave(fp8.BLOCK, 0)[:n].repeat_interleave(fp8.BLOCK, 1)[:, :k]
    return (weight.to(torch.float32) * scale).to(dtype)


class DequantizingFP8Linear(FP8Linear):
    """transformers' `FP8Linear`, its matmul on the weight dequantized per call (no FP8 kernel needed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, dequantize(self.weight, self.weight_scale_inv, x.dtype), bias)


class DequantizingFP8Experts(FP8Experts):
    """transformers' `FP8Experts`, each expert's matmul on its dequantized weight."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
               activation_scale: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, dequantize(weight, weight_scale_inv, x.dtype))


# -- what the cache does not hold by name ---------------------------------------------------------


def _is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    return gate_up is not None and down is not None and gate_up.dim() == 3 and down.dim() == 3


def materializer(model: PreTrainedModel, report: dict[str, list[str]]) -> Materialize:
    """Non-persistent buffers computed as transformers computes them; renamed tensors bound where
    transformers puts them; fused experts assembled from the per-expert tensors."""
    conversions: Conversions = model._weightcache_conversions
    mapped: dict[str, tuple[str, int, int]] = {}

    def claim(name: str) -> bool:
        where = conversions.map(name)
        if where is not None:
            mapped[name] = where
        return where is not None

    def places(module: nn.Module, claimed: list[str]) -> list[str]:
        return [mapped[name][0] for name in claimed]

    def fill(module: nn.Module, pending: Pending) -> None:
        _compute_buffers(model, pending)
        fused: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
        for name, view in pending.claimed.items():
            place, expert, part = mapped[name]
            if expert < 0:
                _bind_renamed(model, place, name, view)
            else:
                fused.setdefault(place, {}).setdefault(expert, {})[part] = view
        for place, experts in fused.items():
            _fuse(model, place, experts, report)

    return Materialize(fill=fill, claim=claim, places=places)


def _compute_buffers(model: PreTrainedModel, pending: Pending) -> None:
    owners = dict.fromkeys(name.rpartition(".")[0] for name in pending.buffers)
    inits = {prefix: mod for prefix, mod in model.named_modules() if isinstance(mod, PreTrainedModel)}
    computed = set(pending.buffers)
    for prefix in owners:
        owner = model.get_submodule(prefix)
        # transformers' init functions skip a tensor marked initialised: the bound (read-only) ones must be
        for leaf, tensor in list(owner._parameters.items()) + list(owner._buffers.items()):
            if tensor is not None and f"{prefix}.{leaf}".lstrip(".") not in computed:
                tensor._is_hf_initialized = True
        # the nearest PreTrainedModel above the owner: composite models initialise each part their way
        parent = max((p for p in inits if p == "" or prefix == p or prefix.startswith(p + ".")), key=len)
        with torch.no_grad():
            inits[parent]._init_weights(owner)


def _declared(model: nn.Module, place: str) -> tuple[nn.Module, str, torch.Tensor]:
    prefix, _, leaf = place.rpartition(".")
    owner = model.get_submodule(prefix)
    tensor = owner._parameters.get(leaf)
    if tensor is None:
        tensor = owner._buffers.get(leaf)
    return owner, leaf, tensor


def _bind_renamed(model: nn.Module, place: str, name: str, view: torch.Tensor) -> None:
    _, _, current = _declared(model, place)
    if current.shape != view.shape or current.dtype != view.dtype:
        raise AttachError(f"cannot attach: {name} (transformers' {place}): model expects {tuple(current.shape)} "
                          f"{current.dtype}, cache holds {tuple(view.shape)} {view.dtype}")
    _swap(current, view)  # the model's own Parameter takes over the arena view, as a bind by name does


def _fuse(model: nn.Module, place: str, experts: dict[int, dict[int, torch.Tensor]],
          report: dict[str, list[str]]) -> None:
    owner, leaf, declared = _declared(model, place)
    count = declared.shape[0]
    parts = 1 + max(max(p) for p in experts.values())
    missing = [f"expert {e} part {k}" for e in range(count) for k in range(parts) if k not in experts.get(e, {})]
    if missing or len(experts) != count:
        raise AttachError(f"cannot attach: {place}: the cache lacks {', '.join(missing[:4]) or 'no expert'} of "
                          f"{count} experts (or holds more: {len(experts)})")
    groups = [[experts[e][k] for k in range(parts)] for e in range(count)]
    fused = _strided_view(groups)
    if fused is not None and fused.shape == declared.shape and fused.dtype == declared.dtype:
        report["zero_copy"].append(place)
    else:
        fused = torch.stack([torch.cat(group) for group in groups])
        report["copied"].append(place)
    if fused.shape != declared.shape or fused.dtype != declared.dtype:
        raise AttachError(f"cannot attach: {place}: the model expects {tuple(declared.shape)} {declared.dtype}, "
                          f"the cache's experts make {tuple(fused.shape)} {fused.dtype}")
    _swap(declared, fused)


def _strided_view(groups: list[list[torch.Tensor]]) -> torch.Tensor | None:
    """groups[e] = tensors [R, C] to stack as [E, n*R, C]: one view of their storage when they lie
    back to back within an expert and at one stride between experts; None otherwise."""
    first = groups[0][0]
    rows, cols = first.shape
    ptr = first.untyped_storage().data_ptr()
    n = len(groups[0])
    for group in groups:
        if len(group) != n:
            return None
        for t in group:
            if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous() \
                    or t.untyped_storage().data_ptr() != ptr:
                return None
    start = first.storage_offset()
    step = groups[1][0].storage_offset() - start if len(groups) > 1 else n * rows * cols
    if step < n * rows * cols:
        return None
    for e, group in enumerate(groups):
        for k, t in enumerate(group):
            if t.storage_offset() != start + e * step + k * rows * cols:
                return None
    return first.as_strided((len(groups), n * rows, cols), (step, cols, 1), start)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def greedy_generate(model: PreTrainedModel, tokens: list[int], max_tokens: int,
                    stop: Callable[[int], bool] = lambda t: False) -> list[int]:
    """Greedy continuation with the model's own KV cache: at most `max_tokens` new ids."""
    device = model.get_input_embeddings().weight.device
    # transformers >= 5.2x names the KV cache `cache` (argument and output); earlier ones `past_key_values`
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        out = model(torch.tensor([tokens], device=device), use_cache=True)
        new: list[int] = []
        while True:
            nxt = int(out.logits[0, -1].argmax())
            new.append(nxt)
            if len(new) >= max_tokens or stop(nxt):
                return new
            out = model(torch.tensor([[nxt]], device=device), use_cache=True, **{key: out[key]})


__all__ = ["CacheReport", "DequantizingFP8Experts", "DequantizingFP8Linear", "build_meta", "dequantize", "from_cache",
           "greedy_generate", "materializer"]
