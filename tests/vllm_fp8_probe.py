"""Runs inside vLLM's virtual environment for tests/test_vllm_fp8.py: vLLM's own FP8 code on CPU
tensors from real agents, one process, no engine started.

    python vllm_fp8_probe.py '<json list of checks>'

vLLM's CPU build runs block FP8 only on CPUs with AMX; where it has no FP8 kernel (most CI
machines) a check names the kernel vLLM's post-processing runs (`kernel`):
  - "deepgemm": vLLM's own DeepGEMM kernel class, as on a Hopper GPU with UE8M0 scales (vLLM's
    default there), with its GPU-only pieces stood in for: DeepGEMM's scale-layout transform (a
    column-major copy, the layout it makes on Hopper) and the GEMM itself (dequantize, matmul);
    vLLM's in-place UE8M0 re-quantization and everything around it run as vLLM wrote them;
  - "cpu": vLLM's CPU block-FP8 kernel (its post-processing; its GEMM needs AMX).
A check: {"op": "load", "model": DIR, "socket": S, "kernel": K, "tp": N, "rank": R, "port": P,
"overrides": {...}, "fallback": bool} builds vLLM's model through `--load-format weightcache`;
{"op": "functions", "model": DIR} runs vLLM's post-processing functions on a checkpoint's FP8
tensors (a load's result has them for the agent's); {"op": "validate", "in": K, "parts": [rows...],
"tp": [N...]} asks vLLM's own block-shape check about a fused layer's shards. One line per check: `RESULT {...}`.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


def install_kernel(kind: str) -> None:
    """Put the kernel `kind` first among vLLM's CPU block-FP8 kernels (module docstring)."""
    import vllm.utils.deep_gemm as dg
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import DeepGemmFp8BlockScaledMMKernel
    from vllm.platforms import PlatformEnum

    class HopperDeepGemm(DeepGemmFp8BlockScaledMMKernel):
        apply_input_quant = False  # the stand-in GEMM takes the activations as they are

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.is_deep_gemm_supported = True
            self.use_deep_gemm_e8m0 = True

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        @classmethod
        def can_implement(cls, config: Any) -> tuple[bool, str | None]:
            return Fp8BlockScaledMMLinearKernel.can_implement(config)

        def apply_block_scaled_mm(self, A, B, As, Bs):  # noqa: N803 -- vLLM's names
            return A.float() @ dequantize(B, Bs).t()

    class AnyCpuFp8(CPUFp8BlockScaledMMKernel):
        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

    def column_major(sf: torch.Tensor, **_: Any) -> torch.Tensor:
        return sf.transpose(-1, -2).contiguous().transpose(-1, -2)

    dg._transform_sf_into_required_layout_impl = column_major
    chosen = {"deepgemm": HopperDeepGemm, "cpu": AnyCpuFp8}[kind]
    linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU] = [chosen]


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape
    return weight.float() * scale.float().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def build(check: dict) -> tuple[Any, Any]:
    from vllm.engine.arg_utils import EngineArgs

    extra = {"socket": check["socket"], "fallback": check.get("fallback", True), "timeout": 5}
    args = EngineArgs(model=check["model"], dtype="bfloat16", max_model_len=256, enforce_eager=True,
                      load_format="weightcache", model_loader_extra_config=extra,
                      tensor_parallel_size=check.get("tp", 1), hf_overrides=check.get("overrides") or {})
    return args.create_engine_config(), args


def load(check: dict) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader import get_model_loader

    install_kernel(check.get("kernel", "deepgemm"))
    config, _ = build(check)
    tp, rank = check.get("tp", 1), check.get("rank", 0)
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():  # once per process: a process is one rank of one group
            port = check.get("port") or free_port()
            # vLLM's CPU worker names the group's shared memory after its rendezvous port; so do the ranks here
            os.environ["VLLM_DIST_IDENT"] = str(port)
            init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(tp)
        loader = get_model_loader(config.load_config)
        try:
            model = loader.load_model(config, config.model_config)
        except Exception as e:  # noqa: BLE001 -- the test asserts on the message
            return {"error": f"{type(e).__name__}: {e}", "quantization": config.model_config.quantization}
        return describe(model, loader)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe(model: Any, loader: Any) -> dict:
    """Each FP8 layer as vLLM holds it after post-processing, and its output against the arena's numbers."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    arena = loader.attachment.tensors
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in arena.values()]
    lo, hi = min(s for s, _ in spans), max(s + n for s, n in spans)
    layers = {}
    gen = torch.Generator().manual_seed(0)
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, Fp8LinearMethod):
            continue
        weight, scale = module.weight, module.weight_scale_inv
        held_w, held_s = arena[f"{name}.weight"], arena[f"{name}.weight_scale_inv"]
        x = torch.randn(3, weight.shape[1], generator=gen).to(torch.bfloat16)
        want = x.float() @ dequantize(held_w, held_s).t()
        got = method.apply(module, x).float() if check_apply(method) else want
        layers[name] = {
            "weight_sha": sha(weight), "scale_sha": sha(held_s),
            "weight_view": lo <= weight.data_ptr() < hi,
            "weight_same_bytes": bool(torch.equal(weight.view(torch.uint8), held_w.view(torch.uint8))),
            "scale_view": lo <= scale.data_ptr() < hi,
            "scale_values_equal": bool(torch.equal(scale.float(), held_s.float())),
            "scale_column_major": scale.dim() == 2 and scale.stride(0) == 1 and scale.shape[0] > 1,
            "max_error": float((got - want).abs().max() / want.abs().max()),
            "rows": weight.shape[0], "cols": weight.shape[1],
        }
    from weightcache_agent.integrations._engine_common import copied_by_kind, view_bytes

    views, copies = view_bytes(model, loader.attachment)
    fused = "model.layers.0.mlp.gate_up_proj.weight"
    return {"layers": layers, "views": views, "copies": copies, "functions": functions(arena[fused], arena[fused + "_scale_inv"]),
            "by_kind": copied_by_kind(model, loader.attachment), "quantization": loader.quantization}


def sha(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def check_apply(method: Any) -> bool:
    """Whether this machine can run the layer's GEMM (the stand-in DeepGEMM can; vLLM's CPU one needs AMX)."""
    return type(method.fp8_linear).__name__ == "HopperDeepGemm"


def functions(w: torch.Tensor, s: torch.Tensor) -> dict:
    """vLLM's block-FP8 post-processing functions on one weight and its scales (copies: they write)."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (process_fp8_weight_block_strategy,
                                                                         requant_weight_ue8m0_inplace)

    from weightcache_agent.integrations.vllm_fp8 import _powers_of_two

    pw, ps = process_fp8_weight_block_strategy(w, s)
    w2, s2 = w.clone(), s.clone()
    requant_weight_ue8m0_inplace(w2, s2, block_size=[128, 128])
    return {"block_strategy_keeps_tensors": pw.data_ptr() == w.data_ptr() and ps.data_ptr() == s.data_ptr(),
            "requant_same_values": bool(torch.equal(dequantize(w2, s2), dequantize(w, s))),
            "requant_same_bytes": bool(torch.equal(w2.view(torch.uint8), w.view(torch.uint8))),
            "powers_of_two": _powers_of_two(s)}


def checkpoint_functions(check: dict) -> dict:
    """`functions` on a checkpoint's own FP8 tensors, read from its file."""
    from safetensors.torch import load_file

    disk = load_file(os.path.join(check["model"], "model.safetensors"))
    name = "model.layers.0.mlp.gate_proj.weight"
    return functions(disk[name], disk[name + "_scale_inv"])


def validate(check: dict) -> dict:
    """vLLM's own check of block-FP8 shard sizes (`validate_fp8_block_shape`) for a column-parallel
    layer of `out` rows at each TP size: None where it accepts, its message where it refuses."""
    from torch import nn
    from vllm.model_executor.layers.quantization.utils.fp8_utils import validate_fp8_block_shape

    out = {}
    for tp in check["tp"]:
        layer = nn.Module()
        layer.tp_size = tp
        parts = [p // tp for p in check["parts"]]
        try:
            validate_fp8_block_shape(layer, check["in"], sum(check["parts"]), check["in"], parts, [128, 128])
            out[str(tp)] = None
        except ValueError as e:
            out[str(tp)] = str(e)
    return out


def main() -> None:
    for check in json.loads(sys.argv[1]):
        result = {"load": load, "functions": checkpoint_functions, "validate": validate}[check["op"]](check)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
