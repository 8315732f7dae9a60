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


def check_quantization(method: str) -> str:
    """Return `method` if it can be served; raise `UnsupportedQuantization` naming why not."""
    if method in ALLOWED:
        return method
    why = _REFUSED.get(method, "it is not on the allowlist, so its effect on the weights is unknown")
    raise UnsupportedQuantization(
        f"quantization method {method!r} is refused: {why}; a raw tensor share would serve wrong numbers "
        f"silently. Allowed: {', '.join(ALLOWED)}"
    )
