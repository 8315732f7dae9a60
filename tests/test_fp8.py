"""Block-wise FP8: quantize on load, scale shapes, error bound, pre-quantized pass-through."""
from __future__ import annotations

import json
import os

import pytest
import torch

from loader_fixtures import full_tensors, load
from weightcache_agent.load import fp8
from weightcache_agent.errors import CheckpointError, UnsupportedQuantization
from weightcache_agent.testing.synthetic import LlamaShape, llama_tensors, qwen2_shape, write_checkpoint, write_llama_checkpoint
from weightcache_agent.testing.synthetic_moe import MoeShape, fp8_config, moe_tensors, prequantize


def rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact.float()).norm() / exact.float().norm()).item()


def test_quantize_on_load_linear_weights_only(tmp_path):
    # intermediate 200: blocks that do not fill 128 columns / rows at the edges
    model = write_llama_checkpoint(str(tmp_path / "q"), qwen2_shape(intermediate_size=200))
    full = full_tensors(model)
    cache, held = load(model, quantization="fp8-block")
    kinds = {s.name: s.kind for s in cache.layout.slots}
    quantized = 0
    for name, tensor in full.items():
        if fp8.quantizable(name, tuple(tensor.shape)):
            quantized += 1
            w, s = held[name], held[fp8.scale_name(name)]
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            assert tuple(s.shape) == (-(-tensor.shape[0] // 128), -(-tensor.shape[1] // 128))
            assert kinds[fp8.scale_name(name)] == "extra" and kinds[name] == "weight"
            assert rel_error(fp8.dequantize(w, s), tensor) < 0.035, name
        else:
            assert held[name].dtype == tensor.dtype and torch.equal(held[name], tensor), name
    assert quantized == 2 * 7  # q k v o gate up down, two layers
    for keep in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.bias",
                 "model.layers.0.input_layernorm.weight"):
        assert held[keep].dtype == torch.bfloat16
    assert fp8.scale_name("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight_scale_inv"


def test_quantize_matches_reference_rounding_exactly():
    x = (torch.randn(300, 260) * 0.05).to(torch.bfloat16)
    x[0, 0] = 0.0
    x[128:256, :128] = 0.0  # an all-zero block
    out = torch.empty(300, 260, dtype=fp8.FP8)
    scale = torch.empty(fp8.scale_shape((300, 260)))
    fp8.quantize_rows(x, out, scale)
    expanded = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    reference = (x.float() / expanded).to(fp8.FP8)
    assert torch.equal(out.view(torch.uint8), reference.view(torch.uint8))
    assert (x.float().abs() / expanded).max() <= 448
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two
    assert scale[1, 0] == 1.0 and torch.all(out[128:256, :128].float() == 0)


def test_fp8_under_tp_quantizes_the_rank_slice(tmp_path):
    # every TP=2 split on the 128 grid (k/v 256 rows, intermediate 512: 128 or 256 per rank)
    model = write_llama_checkpoint(str(tmp_path / "q"), LlamaShape(intermediate_size=512, num_key_value_heads=8))
    full = full_tensors(model)
    whole = load(model, quantization="fp8-block")[1]
    for rank in range(2):
        held = load(model, quantization="fp8-block", tp_size=2, tp_rank=rank)[1]
        for name, dim in (("model.layers.1.self_attn.o_proj.weight", 1), ("model.layers.1.mlp.up_proj.weight", 0)):
            want = full[name].chunk(2, dim)[rank]
            s = held[fp8.scale_name(name)]
            assert tuple(s.shape) == fp8.scale_shape(tuple(want.shape))
            assert rel_error(fp8.dequantize(held[name], s), want) < 0.035
            # the scales are sharded with their weights: a rank holds exactly the TP=1 cache's blocks
            assert torch.equal(held[name].view(torch.uint8), whole[name].view(torch.uint8).chunk(2, dim)[rank])
            assert torch.equal(s, whole[fp8.scale_name(name)].chunk(2, dim)[rank])


def prequantized(tmp_path, family: str = "deepseek"):
    # every split dim a multiple of 2 * 128, so TP=2 slices fall on block boundaries
    shape = MoeShape(family=family, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                     num_attention_heads=8, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
    tensors = prequantize(moe_tensors(shape))
    return write_checkpoint(str(tmp_path / "ds"), tensors, fp8_config(shape.config(torch.bfloat16)), shards=2)


def test_prequantized_passes_through_bit_exact(tmp_path):
    model = prequantized(tmp_path)
    full = full_tensors(model)
    assert any(t.dtype == fp8.FP8 for t in full.values())
    cache, held = load(model, quantization="fp8-block")
    assert set(held) == set(full)
    for name, tensor in full.items():
        assert held[name].dtype == tensor.dtype
        assert torch.equal(held[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert {s.name for s in cache.layout.slots if s.kind == "extra"} == {n for n in full if n.endswith("weight_scale_inv")}


def test_prequantized_tp_slices_weight_and_scale_together(tmp_path):
    model = prequantized(tmp_path)
    full = full_tensors(model)
    for rank in range(2):
        held = load(model, quantization="fp8-block", tp_size=2, tp_rank=rank)[1]
        for name, dim in (("model.layers.1.mlp.experts.0.down_proj.weight", 1),
                          ("model.layers.1.self_attn.q_b_proj.weight", 0),
                          ("model.layers.0.mlp.gate_proj.weight", 0)):
            scale = fp8.scale_name(name)
            w_want = full[name].view(torch.uint8).chunk(2, dim)[rank]
            s_want = full[scale].chunk(2, dim)[rank]
            assert torch.equal(held[name].view(torch.uint8), w_want), name
            assert torch.equal(held[scale], s_want), scale
            # dequantizing the rank's slice gives the same numbers as slicing the dequantized whole
            whole = fp8.dequantize(full[name], full[scale]).chunk(2, dim)[rank]
            assert torch.equal(fp8.dequantize(held[name], held[scale]), whole)


def test_prequantized_tp_off_block_boundary_is_refused(tmp_path):
    model = prequantized(tmp_path)
    with pytest.raises(CheckpointError, match=r"tensor '.*'.*\d+ wide.*128-element FP8 block boundary"):
        load(model, quantization="fp8-block", tp_size=4)


def test_prequantized_needs_matching_spec_and_config(tmp_path):
    model = prequantized(tmp_path)
    with pytest.raises(UnsupportedQuantization, match=r"already fp8-block.*--quantization fp8-block"):
        load(model)
    cfg_path = os.path.join(model, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(UnsupportedQuantization, match=r"'fp8-per-tensor' is refused: per-tensor FP8"):
        load(model, quantization="fp8-block")
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(UnsupportedQuantization, match=r"'gptq' is refused: GPTQ"):
        load(model, quantization="fp8-block")
    del cfg["quantization_config"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match=r"config\.json: no quantization_config.*weight_scale_inv"):
        load(model, quantization="fp8-block")


def test_non_finite_weight_is_refused_naming_tensor(tmp_path):
    shape = LlamaShape()
    t = llama_tensors(shape)
    t["model.layers.1.mlp.up_proj.weight"][3, 7] = float("inf")
    model = write_checkpoint(str(tmp_path / "inf"), t, shape.config(torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight'.*non-finite"):
        load(model, quantization="fp8-block")


def test_fingerprint_records_fp8_source(tmp_path):
    on_load = load(write_llama_checkpoint(str(tmp_path / "a"), LlamaShape()), quantization="fp8-block")[0]
    none = load(str(tmp_path / "a"))[0]
    passthrough = load(prequantized(tmp_path), quantization="fp8-block")[0]
    assert on_load.fields["quantization_config"] != none.fields["quantization_config"]
    assert on_load.fields["quantization_config"] != passthrough.fields["quantization_config"]


def test_the_c_quantizer_gives_the_torch_paths_bytes_for_every_bf16_value():
    if fp8._fp8cpu is None:
        pytest.skip("the _fp8cpu extension was not built (no C compiler): the torch path serves")
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = every[torch.isfinite(every.float())]
    g = torch.Generator().manual_seed(3)
    cases = [finite[: finite.numel() // 256 * 256].view(-1, 256),  # every finite value, blocks of mixed range
             (torch.randn(300, 260, generator=g) * torch.logspace(-30, 30, 260, base=2.0)).bfloat16(),  # ragged
             torch.zeros(5, 3, dtype=torch.bfloat16)]
    for x in cases:
        got = (torch.empty(x.shape, dtype=fp8.FP8), torch.empty(fp8.scale_shape(tuple(x.shape))))
        want = (torch.empty(x.shape, dtype=fp8.FP8), torch.empty(fp8.scale_shape(tuple(x.shape))))
        fp8.quantize_rows(x, *got)
        fp8.quantize_rows(x, *want, native=False)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("native", [True, False])
def test_non_finite_values_are_refused_with_their_rows(native):
    x = torch.randn(300, 140).bfloat16()
    x[200, 5] = float("nan")
    with pytest.raises(CheckpointError, match=r"tensor 'w': non-finite values in rows 128\.\.256"):
        fp8.quantize_rows(x, torch.empty(300, 140, dtype=fp8.FP8), torch.empty(3, 2), "w", native=native)
