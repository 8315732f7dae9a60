"""vLLM's block FP8 from the arena: vLLM's own FP8 linear method and post-processing code, run by
`--load-format weightcache` on real agents' tensors, in vLLM's virtual environment.

vLLM's CPU build has FP8 GEMMs only for CPUs with AMX, so no engine is started here: one probe
process (`vllm_fp8_probe.py`) builds vLLM's model through the load format, runs vLLM's
`process_weights_after_loading` with the kernel named (vLLM's DeepGEMM kernel class as on a
Hopper GPU, UE8M0 scales on, its GPU-only pieces stood in for; or vLLM's CPU kernel) and reports
what vLLM holds afterwards; two more processes do the same as the ranks of TP 2. Checkpoints:
a tiny Llama whose projections fall on 128x128 blocks, bf16 (the agent quantizes it,
`--quantization fp8-block`: powers-of-two scales) and pre-quantized DeepSeek-V3 style
(amax/448 scales, which vLLM's DeepGEMM re-quantizes).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess

import pytest
import torch

from test_vllm import VLLM_PYTHON, vllm_env
from weightcache_agent.client.session import attach
from weightcache_agent.spec import CacheSpec
from weightcache_agent.testing.agent_process import AgentNotReady, AgentProcess
from weightcache_agent.testing.synthetic import (LlamaShape, llama_tensors, skeleton_module, write_checkpoint,
                                                 write_word_tokenizer)
from weightcache_agent.testing.synthetic_moe import fp8_config, prequantize

PROBE = os.path.join(os.path.dirname(__file__), "vllm_fp8_probe.py")
# head_dim 64: TP 2 gives every q, k, v, gate, up and down shard whole 128-row blocks; TP 4 does not (k: 64 rows)
SHAPE = LlamaShape(hidden_size=512, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, vocab_size=512)
BLOCK_FP8 = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}}
# compressed-tensors' FP8 W8A8 (per-channel weights, dynamic per-token activations), as llm-compressor writes it
COMPRESSED_TENSORS_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                          "config_groups": {"group_0": {
                              "targets": ["Linear"],
                              "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                          "dynamic": False},
                              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                    "symmetric": True, "dynamic": True}}}}
FP8_AGENT = ("--quantization", "fp8-block", "--dtype", "bfloat16")

pytestmark = [pytest.mark.timeout(900), pytest.mark.skipif(not VLLM_PYTHON and not os.environ.get("CI"),
                                                           reason="no vLLM environment ($WEIGHTCACHE_VLLM_PYTHON)")]


def probe(checks: list[dict]) -> tuple[list[dict], str]:
    proc = probe_start(checks)
    return probe_end(proc, checks)


def probe_start(checks: list[dict]) -> subprocess.Popen:
    assert VLLM_PYTHON, "CI must provide $WEIGHTCACHE_VLLM_PYTHON (tests/vllm_venv.sh)"
    # vLLM's UE8M0 re-quantization is torch.compile'd: on a CPU that means a C++ build per shape, for no check here
    return subprocess.Popen([VLLM_PYTHON, PROBE, json.dumps(checks)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=vllm_env(TORCHDYNAMO_DISABLE="1"), cwd=os.path.dirname(PROBE))


def probe_end(proc: subprocess.Popen, checks: list[dict]) -> tuple[list[dict], str]:
    out, _ = proc.communicate(timeout=600)
    results = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(checks), f"probe failed ({proc.returncode}):\n{out[-6000:]}"
    return results, out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8-models")
    tensors = llama_tensors(SHAPE)
    out = {"bf16": str(root / "bf16"), "fp8": str(root / "fp8")}
    write_checkpoint(out["bf16"], tensors, SHAPE.config(torch.bfloat16))
    write_checkpoint(out["fp8"], prequantize(tensors), fp8_config(SHAPE.config(torch.bfloat16)))
    for directory in out.values():
        write_word_tokenizer(directory, SHAPE.vocab_size)
    return out


@pytest.fixture(scope="module")
def agents(models, tmp_path_factory):
    sockets = tmp_path_factory.mktemp("fp8-sockets")
    specs = {"fp8": (models["fp8"], ()), "bf16q": (models["bf16"], ()),
             **{f"bf16q-r{r}": (models["bf16"], ("--tp-size", "2", "--tp-rank", str(r))) for r in (0, 1)}}
    procs = {name: AgentProcess(model, str(sockets / f"{name}.sock"), *FP8_AGENT, *extra)
             for name, (model, extra) in specs.items()}
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield {name: proc.socket for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def one_rank(models, agents, tmp_path_factory):
    """One probe process: the checks of a single rank, one after another."""
    nowhere = str(tmp_path_factory.mktemp("nowhere") / "none.sock")
    checks = {
        "checkpoint scales, DeepGEMM": dict(op="load", model=models["fp8"], socket=agents["fp8"]),
        "agent-quantized, DeepGEMM": dict(op="load", model=models["bf16"], socket=agents["bf16q"], overrides=BLOCK_FP8),
        "agent-quantized, CPU kernel": dict(op="load", model=models["bf16"], socket=agents["bf16q"], kernel="cpu",
                                            overrides=BLOCK_FP8),
        "checkpoint functions": dict(op="functions", model=models["fp8"]),
        "shard sizes": dict(op="validate", parts=[512, 256, 256], tp=[2, 4], **{"in": 512}),
        "per-tensor": dict(op="load", model=models["bf16"], socket=agents["bf16q"], fallback=False,
                           overrides={"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}),
        "no agent, no disk copy": dict(op="load", model=models["bf16"], socket=nowhere, overrides=BLOCK_FP8),
        "compressed-tensors": dict(op="load", model=models["bf16"], socket=agents["bf16q"], fallback=False,
                                   overrides={"quantization_config": COMPRESSED_TENSORS_FP8}),
    }
    results, log = probe(list(checks.values()))
    return dict(zip(checks, results)), log


def assert_views(result: dict) -> None:
    for name, layer in result["layers"].items():
        assert layer["weight_view"] and layer["weight_same_bytes"], name
        assert layer["scale_values_equal"], name
    assert result["views"] >= 0.99 * (result["views"] + result["copies"])


def test_agent_quantized_fp8_stays_a_view_through_deepgemms_post_processing(one_rank):
    results, log = one_rank
    result = results["agent-quantized, DeepGEMM"]
    assert result["quantization"] == "fp8-block" and len(result["layers"]) == 8
    assert_views(result)
    for name, layer in result["layers"].items():
        # vLLM laid the scales out for DeepGEMM (a new tensor, counted); its outputs are the arena's numbers
        assert not layer["scale_view"] and layer["scale_column_major"], name
        assert layer["max_error"] < 1e-2, name
    assert set(result["by_kind"]) == {"weight_scale_inv"}
    # vLLM's own functions: its block strategy keeps the tensors; its UE8M0 re-quantization changes no value
    # of the agent's (powers-of-two) scales, which is why the loader skips it
    assert result["functions"] == {"block_strategy_keeps_tensors": True, "requant_same_values": True,
                                   "requant_same_bytes": True, "powers_of_two": True}
    line = next(x for x in log.splitlines() if "weightcache: bf16 rank 0/1 attached" in x and "weight_scale_inv" in x)
    assert "copied (weight_scale_inv " in line


def test_vllms_cpu_fp8_kernel_keeps_every_byte_a_view(one_rank):
    result = one_rank[0]["agent-quantized, CPU kernel"]
    assert_views(result)
    assert result["copies"] == 0 and all(layer["scale_view"] for layer in result["layers"].values())


def test_checkpoint_scales_that_deepgemm_requantizes_are_copied_and_named(one_rank):
    results, log = one_rank
    result = results["checkpoint scales, DeepGEMM"]
    assert result["quantization"] == "fp8-block"
    assert not any(layer["weight_view"] for layer in result["layers"].values())
    # every FP8 weight byte copied (one byte an element), counted under its name, and why in the log line
    assert result["by_kind"]["weight"] == sum(layer["rows"] * layer["cols"] for layer in result["layers"].values())
    line = next(x for x in log.splitlines() if "weightcache: fp8 rank 0/1 attached" in x)
    assert "copied (weight 3.0 MiB, weight_scale_inv " in line
    assert "8 FP8 layer(s) copied: their block scales are not powers of two" in line
    # vLLM's re-quantization changes these scales' weights (so it must run, on a copy), and the arena still
    # holds the checkpoint's bytes afterwards: nothing wrote it
    assert results["checkpoint functions"] == {"block_strategy_keeps_tensors": True, "requant_same_values": False,
                                               "requant_same_bytes": False, "powers_of_two": False}
    assert result["functions"] == results["checkpoint functions"]


def test_unserved_fp8_forms_are_named_and_a_model_only_the_agent_holds_does_not_fall_back(one_rank):
    results, _ = one_rank
    assert "'fp8' per-tensor or per-channel (weight_scale, no weight_block_size) is not served" in \
        results["per-tensor"]["error"]
    assert "vLLM quantization 'compressed-tensors' is not served from the cache" in results["compressed-tensors"]["error"]
    error = results["no agent, no disk copy"]["error"]
    assert "AgentUnavailable" in error and "no disk fallback" in error and "has no quantization_config" in error


def test_a_tp_size_whose_shards_are_not_whole_blocks_is_refused_by_the_agent_and_by_vllm(models, one_rank, tmp_path):
    assert one_rank[0]["shard sizes"]["2"] is None
    assert "output_partition_size = 64 is not divisible by weight quantization block_n = 128" in \
        one_rank[0]["shard sizes"]["4"]
    agent = AgentProcess(models["fp8"], str(tmp_path / "tp4.sock"), *FP8_AGENT, "--tp-size", "4", "--tp-rank", "0")
    with pytest.raises(AgentNotReady, match=r"k_proj.*64.*128-element FP8 block boundary"):
        agent.wait_ready()
    agent.stop()


def test_tp2_ranks_hold_their_block_aligned_shards_as_views(agents, models):
    port = free_port()  # rank 0 listens there for rank 1
    checks = [[dict(op="load", model=models["bf16"], socket=agents[f"bf16q-r{r}"], tp=2, rank=r, port=port,
                    overrides=BLOCK_FP8)] for r in (0, 1)]
    procs = [probe_start(c) for c in checks]
    ranks = [probe_end(p, c)[0][0] for p, c in zip(procs, checks)]
    whole = tp1_tensors(models["bf16"], agents["bf16q"])
    for rank, result in enumerate(ranks):
        assert_views(result)
        for name, layer in result["layers"].items():
            weight, scale = rank_shard(whole, name, rank)
            assert layer["weight_sha"] == sha(weight), name
            assert layer["scale_sha"] == sha(scale), name


def tp1_tensors(model: str, socket: str) -> dict[str, torch.Tensor]:
    """The TP 1 agent's tensors under the checkpoint's names (copies: the lease ends here)."""
    from weightcache_agent.load.checkpoint import open_checkpoint
    from weightcache_agent.load import fp8

    records = open_checkpoint(model).tensors
    declared = {}
    for name, record in records.items():
        quantized = fp8.quantizable(name, record.shape)
        declared[name] = (record.shape, torch.float8_e4m3fn if quantized else torch.bfloat16)
        if quantized:
            declared[fp8.scale_name(name)] = (fp8.scale_shape(record.shape), torch.float32)
    module = skeleton_module(declared)
    held = attach(module, CacheSpec(model=model, dtype="bfloat16", quantization="fp8-block"), socket=socket)
    try:
        return {name: tensor.clone() for name, tensor in held.tensors.items()}
    finally:
        held.close()


def rank_shard(whole: dict[str, torch.Tensor], fused: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What rank `rank` of 2 holds of vLLM's layer `fused`, cut from the whole at block boundaries."""
    prefix, _, leaf = fused.rpartition(".")
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(leaf)
    if parts is None:  # o_proj, down_proj: row parallel, split along the input
        return (whole[f"{fused}.weight"].chunk(2, 1)[rank], whole[f"{fused}.weight_scale_inv"].chunk(2, 1)[rank])
    weight = torch.cat([whole[f"{prefix}.{p}.weight"].view(torch.uint8).chunk(2, 0)[rank] for p in parts])
    scale = torch.cat([whole[f"{prefix}.{p}.weight_scale_inv"].chunk(2, 0)[rank] for p in parts])
    return weight, scale


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
