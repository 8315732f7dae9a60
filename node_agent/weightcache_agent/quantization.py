"""Which quantization methods may be served from shared tensors, and why others may not.

A method is allowed only when its whole effect lives in the tensors the agent shares:
the bytes of the weights plus tensors such as `weight_scale_inv`. Everything else is
refused before any byte is read, with a message that says why.
"""
from __future__ import annotations

from .errors import UnsupportedQuantization

ALLOWED = ("none", "fp8-block")

# The reason each well-known method cannot be shared as raw tensors.
_REFUSED = {
    "fp8-per-tensor": "per-tensor FP8 keeps its activation scales and scheme flags in the engine's Python-side "
    "quantization config, not in the weight tensors",
    "marlin": "Marlin re-lays weights into a kernel-specific tiled layout and keeps workspace and permutation "
    "state in the engine process",
    "awq": "AWQ packs int4 weights with per-group zeros and a kernel-specific layout whose meaning lives in the "
    "engine's Python-side quantization config",
    "gptq": "GPTQ packs int4 weights with act-order permutations (g_idx) and per-group metadata that the engine "
    "re-lays out after loading",
}


# Names people type for an allowed method: the message suggests the method meant.
_ALIASES = {"fp8": "fp8-block", "fp8_block": "fp8-block", "fp8-blockwise": "fp8-block", "fp8_e4m3": "fp8-block",
            "blockwise-fp8": "fp8-block", "bf16": "none", "bfloat16": "none", "fp16": "none", "float16": "none"}


def check_quantization(method: str) -> str:
    """Return `method` if it can be served; raise `UnsupportedQuantization` naming why not."""
    if method in ALLOWED:
        return method
    meant = _ALIASES.get(str(method).lower())
    if meant == "none":
        raise UnsupportedQuantization(f"quantization method {method!r} is a dtype, not a quantization: use "
                                      f"--quantization none --dtype {str(method).lower().replace('bf16', 'bfloat16').replace('fp16', 'float16')}")
    if meant is not None:
        raise UnsupportedQuantization(f"quantization method {method!r} is not a method name here: did you mean "
                                      f"{meant!r}? (block-scaled FP8, the DeepSeek/Qwen FP8 checkpoint format). "
                                      f"Allowed: {', '.join(ALLOWED)}")
    why = _REFUSED.get(method, "it is not on the allowlist, so its effect on the weights is unknown")
    raise UnsupportedQuantization(
        f"quantization method {method!r} is refused: {why}; a raw tensor share would serve wrong numbers "
        f"silently. Allowed: {', '.join(ALLOWED)}"
    )


def quantization_arg(value: str) -> str:
    """argparse `type=` for `--quantization`: the method, or an error that says why not and what to use."""
    import argparse

    try:
        return check_quantization(value)
    except UnsupportedQuantization as e:
        raise argparse.ArgumentTypeError(str(e)) from None
