"""Tensor-parallel and expert-parallel sharding: each rank holds exactly its slices."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from loader_fixtures import full_tensors, load, ranks
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.errors import CheckpointError
from weightcache_agent.load.fingerprint import fingerprint_fields
from weightcache_agent.load.loader import plan_tensors
from weightcache_agent.spec import CacheSpec
from weightcache_agent.testing.synthetic import LlamaShape, llama_tensors, qwen2_shape, write_checkpoint, write_llama_checkpoint
from weightcache_agent.testing.synthetic_moe import MoeShape, write_moe_checkpoint

# Expected split dim per tensor name, written out independently of the presets.
DENSE_DIMS = [
    (r"embed_tokens\.weight$|lm_head\.weight$", 0),
    (r"\.(q|k|v)_proj\.(weight|bias)$", 0),
    (r"\.(gate|up)_proj\.weight$", 0),
    (r"\.(o|down)_proj\.weight$", 1),
    (r"\.(w1|w3)\.weight$", 0),
    (r"\.w2\.weight$", 1),
    (r"\.(q_b_proj|kv_b_proj)\.weight$", 0),
]


def expected_dim(name: str) -> int | None:
    if re.search(r"\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", name):
        return None
    for pattern, dim in DENSE_DIMS:
        if re.search(pattern, name):
            return dim
    return None


def check_tp(model: str, tp: int) -> dict[str, torch.Tensor]:
    full = full_tensors(model)
    held = ranks(model, tp)
    for name, tensor in full.items():
        dim = expected_dim(name)
        parts = [r[name] for r in held]
        if dim is None:
            for p in parts:
                assert torch.equal(p, tensor), f"{name} should be replicated"
        else:
            for p, chunk in zip(parts, torch.chunk(tensor, tp, dim)):
                assert p.shape == chunk.shape, f"{name}: {tuple(p.shape)} vs {tuple(chunk.shape)}"
                assert torch.equal(p, chunk), name
            assert torch.equal(torch.cat(parts, dim), tensor), name
    for r in held:
        assert set(r) == set(full)
    return full


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dense_tp_ranks_hold_exactly_their_chunks(tmp_path, family, tp):
    shape = qwen2_shape() if family == "qwen2" else LlamaShape()
    model = write_llama_checkpoint(str(tmp_path / family), shape, shards=2)
    full = check_tp(model, tp)
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in full  # biases split with their column layers


@pytest.mark.parametrize("family", ["mixtral", "qwen_moe", "deepseek"])
def test_moe_under_tp(tmp_path, family):
    model = write_moe_checkpoint(str(tmp_path / family), MoeShape(family=family))
    check_tp(model, 2)


@pytest.mark.parametrize("family", ["mixtral", "qwen_moe", "deepseek"])
def test_expert_parallel_places_whole_experts_with_global_names(tmp_path, family):
    shape = MoeShape(family=family, num_experts=4)
    model = write_moe_checkpoint(str(tmp_path / family), shape)
    full = full_tensors(model)
    held = [load(model, tp_size=2, tp_rank=r, expert_parallel=True)[1] for r in range(2)]
    for rank, tensors in enumerate(held):
        mine = {int(m.group(1)) for n in tensors if (m := re.search(r"\.experts\.(\d+)\.", n))}
        assert mine == {2 * rank, 2 * rank + 1}
        for name, t in tensors.items():
            if ".experts." in name:
                assert torch.equal(t, full[name]), f"{name} must be whole under expert parallelism"
        # attention is still tensor-parallel
        o = "model.layers.1.self_attn.o_proj.weight"
        assert torch.equal(tensors[o], torch.chunk(full[o], 2, 1)[rank])
    experts = {n for n in full if ".experts." in n}
    assert {n for t in held for n in t if ".experts." in n} == experts
    assert not (set(held[0]) & set(held[1]) & experts)


def test_expert_parallel_needs_expert_count(tmp_path):
    model = write_moe_checkpoint(str(tmp_path / "m"), MoeShape(family="mixtral"))
    cfg_path = os.path.join(model, "config.json")
    cfg = json.load(open(cfg_path))
    del cfg["num_local_experts"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match=r"config\.json.*num_local_experts"):
        load(model, tp_size=2, expert_parallel=True)


def test_non_divisible_size_names_tensor_dim_and_numbers(tmp_path):
    model = write_llama_checkpoint(str(tmp_path / "m"), LlamaShape(num_attention_heads=6, num_key_value_heads=6,
                                                                   hidden_size=192, intermediate_size=200))
    with pytest.raises(CheckpointError) as e:
        load(model, tp_size=4)
    msg = str(e.value)
    assert "model.safetensors" in msg and "tensor 'model." in msg
    assert re.search(r"(dim \d of size \d+.*tp_size 4|= 6 does not divide by tp_size 4)", msg), msg


def test_kv_heads_must_divide(tmp_path):
    model = write_llama_checkpoint(str(tmp_path / "m"), LlamaShape(num_attention_heads=8, num_key_value_heads=2))
    with pytest.raises(CheckpointError, match=r"k_proj.*num_key_value_heads = 2 does not divide by tp_size 4"):
        load(model, tp_size=4)


def test_row_parallel_reads_only_its_bytes(tmp_path):
    model = write_llama_checkpoint(str(tmp_path / "m"), LlamaShape())
    ckpt = open_checkpoint(model)
    plan = {p.name: p for p in plan_tensors(ckpt, CacheSpec(model, tp_size=4, tp_rank=3))}
    o = plan["model.layers.0.self_attn.o_proj.weight"]
    segments = o.shard.segments()
    rows, cols = ckpt.tensors[o.name].shape
    assert len(segments) == rows and all(s.nbytes == cols // 4 * 2 for s in segments)
    assert segments[0].file_offset == ckpt.tensors[o.name].start + 3 * cols // 4 * 2
    q = plan["model.layers.0.self_attn.q_proj.weight"]
    assert len(q.shard.segments()) == 1 and q.shard.nbytes == ckpt.tensors[q.name].nbytes // 4
    read = sum(p.shard.nbytes for p in plan.values())
    assert read < ckpt.nbytes * 0.3  # only the rank's quarter (+ small replicated norms)


def test_fused_qkv_and_gate_up_split_per_part(tmp_path):
    shape = LlamaShape(num_attention_heads=8, num_key_value_heads=4)
    t = llama_tensors(shape)
    p = "model.layers.0."
    q, k, v = (t.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv")
    gate, up = t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")
    t[p + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
    t[p + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
    model = write_checkpoint(str(tmp_path / "fused"), t, shape.config(torch.bfloat16))
    for rank in range(2):
        held = load(model, tp_size=2, tp_rank=rank)[1]
        want_qkv = torch.cat([x.chunk(2)[rank] for x in (q, k, v)])
        assert torch.equal(held[p + "self_attn.qkv_proj.weight"], want_qkv)
        assert torch.equal(held[p + "mlp.gate_up_proj.weight"], torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))


def test_yaml_rules_override_preset_and_change_fingerprint(tmp_path):
    model = write_llama_checkpoint(str(tmp_path / "m"), LlamaShape())
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - pattern: 'mlp\\.down_proj\\.weight$'\n    mode: replicated\n"
                     "  - pattern: 'input_layernorm\\.weight$'\n    mode: column\n")
    full = full_tensors(model)
    held = [load(model, tp_size=2, tp_rank=r, sharding=str(rules))[1] for r in range(2)]
    down, norm, o = ("model.layers.1.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight",
                     "model.layers.1.self_attn.o_proj.weight")
    for r in range(2):
        assert torch.equal(held[r][down], full[down])  # the rule won over the preset
        assert torch.equal(held[r][norm], full[norm].chunk(2)[r])
        assert torch.equal(held[r][o], full[o].chunk(2, 1)[r])  # preset still applies to the rest
    ckpt = open_checkpoint(model)
    by_rules = fingerprint_fields(CacheSpec(model, tp_size=2, sharding=str(rules)), ckpt)["sharding"]
    by_preset = fingerprint_fields(CacheSpec(model, tp_size=2), ckpt)["sharding"]
    assert by_rules.startswith("rules:") and by_preset == "preset:llama"
    rules.write_text(rules.read_text().replace("replicated", "row"))
    assert fingerprint_fields(CacheSpec(model, tp_size=2, sharding=str(rules)), ckpt)["sharding"] != by_rules


def test_preset_by_name_and_unknown_architecture(tmp_path):
    shape = LlamaShape(model_type="mystery", architectures=["MysteryForCausalLM"])
    model = write_llama_checkpoint(str(tmp_path / "m"), shape)
    with pytest.raises(CheckpointError, match=r"no sharding preset for model_type 'mystery'"):
        load(model, tp_size=2)
    held = load(model, tp_size=2, tp_rank=1, sharding="llama")[1]
    full = full_tensors(model)
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(held[name], full[name].chunk(2, 1)[1])
    with pytest.raises(CheckpointError, match="neither a preset"):
        load(model, tp_size=2, sharding="no-such-preset-or-file")
