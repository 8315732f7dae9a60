"""Block-wise FP8 (e4m3, 128x128 blocks, DeepSeek-V3 style): which tensors, and how.

`quantizable` picks the 2-D weights of the linear projections inside decoder layers
(attention and MLP / experts); embeddings, lm_head, norms, routers and biases keep their
dtype. `quantize_rows` turns rows of such a weight into float8_e4m3fn plus one fp32
`weight_scale_inv` per 128x128 block, so that dequantized = fp8 * scale
(`dequantize`).

Scales are powers of two (the UE8M0 choice of DeepSeek-V3.1 / DeepGEMM): the smallest
2^k with amax <= 448 * 2^k. Dividing by a power of two is exact, so the one rounding
is bf16 -> e4m3, and the relative error is that of e4m3 itself (the same as with an
exact amax/448 scale for every value not in the subnormal range). It is also what
makes this fast on a CPU: for bf16 input the block maximum comes from the int16 bits
(|x| orders like its bits), and the scaling multiply writes fp8 directly -- two passes
over cache-sized groups of 128 rows, with nothing allocated per element. The optional C
extension `_fp8cpu` runs those two passes vectorised and without the GIL; the torch path
is the reference it is tested against, bit for bit.
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, UnsupportedQuantization
from ..quantization import check_quantization
from .dtypes import BFLOAT16

if TYPE_CHECKING:
    import torch

    from .checkpoint import Checkpoint
    from .layout import TensorSlot
    from .plan import PlannedTensor

try:
    from . import _fp8cpu
except ImportError:  # built without a C compiler: the torch path gives the same bytes
    _fp8cpu = None

BLOCK = 128
FP8_MAX = 448.0
SCALE_SUFFIX = "weight_scale_inv"


# Linear projections of a decoder layer: *_proj (q/k/v/o, qkv, gate/up/down, gate_up,
# q_a/q_b, kv_a_proj_with_mqa, kv_b) and Mixtral's w1/w2/w3. Routers (`mlp.gate`,
# `block_sparse_moe.gate`) and `shared_expert_gate` do not match: they stay as they are.
_LINEAR = re.compile(r"(^|\.)layers\.\d+\..*\.(\w+_proj|\w+_proj_with_mqa|w1|w2|w3)\.weight$")


def __getattr__(name: str) -> Any:
    """`FP8`, torch's float8_e4m3fn: resolved on first use, so that planning (which only names
    tensors and shapes) imports no torch; the plan itself uses `dtypes.FP8_E4M3`."""
    if name == "FP8":
        import torch

        return torch.float8_e4m3fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and bool(_LINEAR.search(name))


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))


def scale_rows(scale_slot: "TensorSlot", row0: int, rows: int) -> tuple[int, int, int]:
    """Where the scales of weight rows [row0, row0 + rows) sit in the arena, a piece being whole
    128-row blocks (so its scales are whole rows of the scale slot): (offset, scale rows, scale columns)."""
    cols = scale_slot.shape[1]
    return scale_slot.offset + row0 // BLOCK * cols * 4, -(-rows // BLOCK), cols


def native_quantizer(cols: int) -> bool:
    """Whether `quantize_bf16_at` takes rows `cols` wide (built, and within its per-row buffers)."""
    return _fp8cpu is not None and cols <= 1 << 20


def quantized_natively(item: "PlannedTensor") -> bool:
    """Whether a planned tensor is bf16 -> FP8 that `quantize_bf16_at` makes (on addresses, no torch):
    the one test the cpu and GPU fills share for when torch is not needed."""
    return item.transform == "fp8" and item.source.dtype == BFLOAT16 and native_quantizer(item.shard.shape[1])


def quantize_bf16_at(src: int, out: int, scale: int, rows: int, cols: int, name: str = "?") -> None:
    """`quantize_rows` of bf16 [rows, cols] at host address `src` into e4m3 at `out` and fp32 scales at
    `scale`, by the C extension (`native_quantizer` says when it applies): no torch, no GIL."""
    bad = _fp8cpu.quantize_bf16(src, out, scale, rows, cols)
    if bad >= 0:
        raise CheckpointError(f"tensor {name!r}: non-finite values in rows {bad}..{min(bad + BLOCK, rows)}; cannot quantize")


def quantize_rows(src: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, name: str = "?",
                  native: bool = True) -> None:
    """Quantize `src` [R, C] into `out` (fp8, [R, C]) and `scale` (fp32, [ceil(R/128), ceil(C/128)]).

    `src` is a whole number of 128-row blocks of the weight (the last one may be short).
    bf16 on the CPU goes through the `_fp8cpu` C extension where it was built (same bytes,
    ~2.5x faster per core, and without the GIL); `native=False` forces the torch path.
    """
    import torch

    rows, cols = src.shape
    if native and native_quantizer(cols) and _plain_cpu(src, torch.bfloat16) and _plain_cpu(out, torch.float8_e4m3fn) \
            and _plain_cpu(scale, torch.float32) and tuple(out.shape) == (rows, cols) \
            and tuple(scale.shape) == scale_shape((rows, cols)):
        quantize_bf16_at(src.data_ptr(), out.data_ptr(), scale.data_ptr(), rows, cols, name)
        return
    full = cols // BLOCK * BLOCK
    # one scratch row group for the |x| bits, reused: a fresh allocation per group would
    # page-fault its way through memory and cost more than the arithmetic
    scratch = torch.empty(min(rows, BLOCK) * cols, dtype=torch.int16) if src.dtype == torch.bfloat16 else None
    for r0 in range(0, rows, BLOCK):
        r1 = min(r0 + BLOCK, rows)
        g, s, o = src[r0:r1], scale[r0 // BLOCK], out[r0:r1]
        amax = _block_amax(g, full, name, r0, scratch)
        k = _pow2_exponent(amax)
        s.copy_(torch.ldexp(torch.ones_like(amax), k))
        inv = torch.ldexp(torch.ones_like(amax), -k).to(g.dtype if g.dtype == torch.bfloat16 else torch.float32)
        if full:
            nb = full // BLOCK
            gv = g[:, :full] if g.dtype == torch.bfloat16 else g[:, :full].float()
            # exact power-of-two multiply, one rounding into e4m3, written straight into the arena
            torch.mul(gv.reshape(r1 - r0, nb, BLOCK), inv[:nb].view(1, nb, 1), out=o[:, :full].view(r1 - r0, nb, BLOCK))
        if full < cols:
            tail = g[:, full:] if g.dtype == torch.bfloat16 else g[:, full:].float()
            torch.mul(tail, inv[-1], out=o[:, full:])


def _plain_cpu(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()


def _block_amax(g: torch.Tensor, full: int, name: str, row: int, scratch: torch.Tensor | None) -> torch.Tensor:
    """max |x| of each 128-column block of the row group `g`, as fp32."""
    import torch

    rows, cols = g.shape
    if g.dtype == torch.bfloat16 and g.is_contiguous() and scratch is not None:
        bits = scratch[: rows * cols].view(rows, cols)
        torch.bitwise_and(g.view(torch.int16), 0x7FFF, out=bits)  # |x| as bits; same order as |x|
        parts = []
        if full:
            parts.append(bits[:, :full].reshape(rows * (full // BLOCK), BLOCK).amax(dim=1).view(rows, -1).amax(dim=0))
        if full < cols:
            parts.append(bits[:, full:].amax().view(1))
        amax_bits = torch.cat(parts) if len(parts) > 1 else parts[0]
        if bool((amax_bits >= 0x7F80).any()):
            raise CheckpointError(f"tensor {name!r}: non-finite values in rows {row}..{row + rows}; cannot quantize")
        return amax_bits.view(torch.bfloat16).float()
    a = g.float().abs()
    parts = []
    if full:
        parts.append(a[:, :full].reshape(rows, full // BLOCK, BLOCK).amax(dim=2).amax(dim=0))
    if full < cols:
        parts.append(a[:, full:].amax().view(1))
    amax = torch.cat(parts) if len(parts) > 1 else parts[0]
    if not bool(torch.isfinite(amax).all()):
        raise CheckpointError(f"tensor {name!r}: non-finite values in rows {row}..{row + rows}; cannot quantize")
    return amax


def _pow2_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest k with amax <= 448 * 2^k, exactly (448 = 0.875 * 2^9; frexp gives amax = m * 2^e)."""
    import torch

    mantissa, exponent = torch.frexp(amax)
    k = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)
    k = torch.where(amax > 0, k, torch.zeros_like(k))  # all-zero block: scale 1
    return k.clamp(-126, 127)  # keep 2^-k a normal bf16/fp32 number


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 [R, C] * per-block scale -> fp32 [R, C] (for tests and for engines without fp8 kernels)."""
    rows, cols = weight.shape
    expanded = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return weight.float() * expanded


def checkpoint_quantization(checkpoint: "Checkpoint") -> str | None:
    """The allowlisted method a checkpoint is already quantized with, or None; refuse the rest."""
    config = checkpoint.config or {}
    where = os.path.join(checkpoint.directory, "config.json")
    qc = config.get("quantization_config")
    if qc is None:
        scaled = next((n for n in checkpoint.tensors if n.endswith("." + SCALE_SUFFIX)), None)
        if scaled is not None:
            raise CheckpointError(f"{where}: no quantization_config, but the checkpoint has weight_scale_inv "
                                  f"tensors (e.g. {scaled!r}); cannot tell how to read them")
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: quantization_config is not an object")
    method = str(qc.get("quant_method")).lower()
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None:
            check_quantization("fp8-per-tensor")  # raises, saying why
        if not isinstance(block, list) or block != [BLOCK, BLOCK]:
            shown = repr(block) if len(repr(block)) <= 80 else repr(block)[:77] + "..."
            raise UnsupportedQuantization(
                f"{where}: fp8 with weight_block_size {shown} is refused: only [128, 128] blocks are on the allowlist"
            )
        return "fp8-block"
    check_quantization(method)  # awq, gptq, marlin, ...: refused with the reason
    raise UnsupportedQuantization(f"{where}: quantization_config.quant_method {method!r} is refused")
