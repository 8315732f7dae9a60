"""transformers models attached from the cache equal `from_pretrained`: bf16 bit for bit, FP8 close.

Tiny random Llama, Qwen2 (q/k/v biases, tied embeddings) and Qwen3-MoE (fused experts)
checkpoints are written with `save_pretrained` in the test, served by a real agent or the
in-process loader, and compared on the same token batch with the model transformers
itself loads. The reference engine serves the MoE model through a real agent. Skipped
without transformers; the CUDA variants run where a GPU is.
"""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine_fixtures import short_run_dir  # noqa: E402
from weightcache_agent import CacheSpec  # noqa: E402
from weightcache_agent.engine.server import load_model  # noqa: E402
from weightcache_agent.errors import AttachError  # noqa: E402
from weightcache_agent.integrations.transformers import (  # noqa: E402
    DequantizingFP8Linear, from_cache, greedy_generate)
from weightcache_agent.serve.process_group import ProcessGroup  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_theta=500.0),  # saved as `rope_parameters`
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    # 4 experts per layer lie at one stride in the file (zero-copy fused views); 11 do not
    # (experts.10 sorts before experts.2), so their fused experts are copies.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=128, head_dim=32, num_experts=4,
                                                     num_experts_per_tok=2),
    # Mixtral: transformers renames `block_sparse_moe` to `mlp` and fuses experts w1 (gate) + w3 (up)
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe_11": lambda: transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=128, head_dim=32,
                                                        num_experts=11, num_experts_per_tok=2),
}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for n, (name, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(n)
        model = transformers.AutoModelForCausalLM.from_config(make(), dtype=torch.bfloat16)
        with torch.no_grad():  # biases and norms start as 0 and 1: make them matter
            for pname, p in model.named_parameters():
                if p.dim() == 1:
                    p.normal_(1.0 if "norm" in pname else 0.0, 0.5)
        out[name] = str(tmp_path_factory.mktemp("hf") / name)
        model.save_pretrained(out[name])
    return out


def tokens() -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(7))


def reference_logits(directory: str, device: str = "cpu") -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).to(device).eval()
    with torch.no_grad():
        return model(tokens().to(device)).logits


def logits(model, device: str = "cpu") -> torch.Tensor:
    with torch.no_grad():
        return model(tokens().to(device)).logits


@pytest.fixture(scope="module")
def moe_agent(checkpoints):
    sup = ProcessGroup(short_run_dir())
    try:
        agent = sup.start_agent(checkpoints["qwen3_moe"], "moe", backend="cpu")
        yield agent
    finally:
        sup.close()


def test_moe_through_an_agent_is_from_pretrained_bit_for_bit(checkpoints, moe_agent):
    moe_agent.wait_ready()
    model = from_cache(checkpoints["qwen3_moe"], socket=moe_agent.socket)
    att = model.weightcache.attachment
    assert att.source == "agent" and not model.training
    assert {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"} <= set(att.computed)
    assert torch.equal(logits(model), reference_logits(checkpoints["qwen3_moe"]))
    # every weight, fused experts included, is a view of the one arena the agent shares
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1
    model.weightcache.close()


def test_llama_is_from_pretrained_bit_for_bit(checkpoints):
    directory = checkpoints["llama"]
    model = from_cache(directory, mode="off")
    assert sorted(model.weightcache.attachment.computed) == ["model.rotary_emb.inv_freq",
                                                             "model.rotary_emb.original_inv_freq"]
    assert torch.equal(logits(model), reference_logits(directory))
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1
    # the reference engine's own Llama reads transformers 5's config.json (RoPE theta in `rope_parameters`)
    native, lease = load_model(CacheSpec(model=directory), mode="off")
    assert native.config.rope_theta == 500.0
    with torch.inference_mode():
        got, want = native(tokens()), reference_logits(directory).float()
    assert torch.allclose(got, want, atol=1e-2) and torch.equal(got.argmax(-1), want.argmax(-1))
    lease.close()


def test_qwen2_biases_and_tied_embeddings(checkpoints):
    directory = checkpoints["qwen2"]
    model = from_cache(directory, mode="off")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    assert torch.equal(logits(model), reference_logits(directory))
    assert model.weightcache.attachment.cast == []


def test_moe_fused_experts_zero_copy_or_copied(checkpoints):
    def places(leaf: str) -> list[str]:
        return [f"model.layers.{n}.mlp.experts.{leaf}" for n in range(2)]

    # (zero-copy, copied): experts.10 sorts before experts.2, and Mixtral's w2 (down) lies between w1 and w3
    expected = {"qwen3_moe": (["gate_up_proj", "down_proj"], []), "qwen3_moe_11": ([], ["gate_up_proj", "down_proj"]),
                "mixtral": (["down_proj"], ["gate_up_proj"])}
    for name, (zero_copy, copied) in expected.items():
        model = from_cache(checkpoints[name], mode="off")
        report = model.weightcache
        assert sorted(report.experts_zero_copy) == sorted(sum(map(places, zero_copy), []))
        assert sorted(report.experts_copied) == sorted(sum(map(places, copied), []))
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape[1:] == (2 * experts.down_proj.shape[-1], SMALL["hidden_size"])
        arena = model.model.embed_tokens.weight.untyped_storage().data_ptr()
        assert (experts.gate_up_proj.untyped_storage().data_ptr() == arena) is ("gate_up_proj" in zero_copy)
        assert torch.equal(logits(model), reference_logits(checkpoints[name])), name


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3_moe", "mixtral"])
def test_fp8_block_runs_on_fp8_weights_close_to_bf16(checkpoints, name):
    directory = checkpoints[name]
    model = from_cache(CacheSpec(model=directory, quantization="fp8-block"), mode="off")
    report = model.weightcache
    proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(proj, transformers.integrations.finegrained_fp8.FP8Linear)
    assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight_scale_inv.dtype == torch.float32
    assert report.fp8_compute == "dequantize" and isinstance(proj, DequantizingFP8Linear)
    if name == "qwen2":  # FP8Linear declares its bias in float32: cast from the cache's bf16, and said so
        assert "model.layers.0.self_attn.q_proj.bias: bfloat16 -> float32" in report.attachment.cast
        assert len(report.attachment.cast) == 2 * 3
    if name in ("qwen3_moe", "mixtral"):
        assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    got, want = logits(model).float(), reference_logits(directory).float()
    assert torch.isfinite(got).all() and not torch.equal(got, want)  # really quantized
    assert_close_to_bf16(got, want)


def assert_close_to_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """All logits: cosine > 0.99; every position > 0.95 (an MoE may route one token elsewhere); top-1 >= 75%."""
    whole = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    each = torch.nn.functional.cosine_similarity(got.flatten(0, 1), want.flatten(0, 1), dim=-1)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert whole > 0.99 and each.min() > 0.95 and agree >= 0.75, (whole, each.min(), agree)


def test_what_is_refused_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "llama-missing"
    directory.mkdir()
    src = checkpoints["llama"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    with pytest.raises(AttachError, match=r"model.layers.1.mlp.down_proj.weight: still on the meta device"):
        from_cache(str(directory), mode="off")

    # transformers concatenates OLMo-hybrid's q/k/v conv1d weights when it loads: refused before any attach
    hybrid = str(tmp_path / "olmo-hybrid")
    config = transformers.OlmoHybridConfig(**SMALL, pad_token_id=0, eos_token_id=1)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(hybrid)
    with pytest.raises(ValueError, match=r"model_type 'olmo_hybrid' is not supported yet: transformers converts its "
                                         r"checkpoint tensors .*linear_attn.q_conv1d.weight.* by Concatenate\(dim=0\)"):
        from_cache(hybrid, mode="off")


def test_a_transformers_engine_stands_by_and_takes_over(checkpoints, moe_agent):
    """`weightcache engine` serves the MoE through transformers, as a hot standby that is promoted."""
    directory = checkpoints["qwen3_moe"]
    moe_agent.wait_ready()
    # this process holds the group's primary lease; the engine joins the group as its standby
    primary = from_cache(directory, socket=moe_agent.socket, role="primary", group="moe")
    sup = ProcessGroup(short_run_dir())
    try:
        engine = sup.start_engine(directory, "moe-standby", socket=moe_agent.socket, group="moe", role="standby")
        health = engine.wait_serving()
        assert health["source"] == "agent" and health["role"] == "standby" and not health["ready"]
        primary.weightcache.close()  # the primary leaves: the agent promotes the standby
        engine.wait_state(lambda h: h["ready"], what="promotion")
        prompt = [3, 14, 15, 92, 65]
        status, reply = engine.generate(prompt, 6)
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        assert status == 200 and reply["tokens"] == greedy_generate(reference, prompt, 6)
    finally:
        sup.close()


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe"])
def test_cuda_agent_bf16_bit_exact_and_fp8(checkpoints, name):
    directory = checkpoints[name]
    sup = ProcessGroup(short_run_dir())
    try:
        for quantization in ("none", "fp8-block"):
            agent = sup.start_agent(directory, f"{name}-{quantization}", backend="cuda",
                                    extra=["--quantization", quantization])
            agent.wait_ready(120)
            model = from_cache(CacheSpec(model=directory, quantization=quantization), socket=agent.socket,
                               device="cuda")
            assert model.model.embed_tokens.weight.is_cuda and model.model.rotary_emb.inv_freq.is_cuda
            got, want = logits(model, "cuda"), reference_logits(directory, "cuda")
            if quantization == "none":
                assert torch.equal(got, want)
            else:
                print(f"{name} fp8 compute: {model.weightcache.fp8_compute}")
                assert_close_to_bf16(got.float(), want.float())
            model.weightcache.close()
    finally:
        sup.close()
