"""Which transformers architectures `from_cache` serves: a table, run by hand (not collected by pytest).

For each architecture: a tiny random model (2 layers, hidden 128) written with
`save_pretrained`, loaded by `from_pretrained` and by `from_cache(mode="off")` (the agent's
own loader, in-process); prints whether bf16 logits are equal bit for bit, and for an
fp8-block cache the cosine of all logits and the top-1 agreement against bf16, or the error
a user gets.

    PYTHONPATH=node_agent python tests/transformers_survey.py [model_type ...]
"""
from __future__ import annotations

import sys
import tempfile
from typing import Callable

import torch
import transformers

from weightcache_agent.integrations.transformers import from_cache

S = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=128)
MOE = dict(num_experts_per_tok=2)
CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": lambda: transformers.LlamaConfig(**S),
    "mistral": lambda: transformers.MistralConfig(**S),
    "qwen2": lambda: transformers.Qwen2Config(**S, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**S, head_dim=32),
    "gemma2": lambda: transformers.Gemma2Config(**S, head_dim=32),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**S, head_dim=32),
    "phi3": lambda: transformers.Phi3Config(**S, pad_token_id=0),
    "olmo2": lambda: transformers.Olmo2Config(**S),
    "granite": lambda: transformers.GraniteConfig(**S),
    "falcon": lambda: transformers.FalconConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2,
                                                num_attention_heads=4),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=128),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                                   num_hidden_layers=2, num_attention_heads=4),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**S, **MOE, moe_intermediate_size=128,
                                                     shared_expert_intermediate_size=128, num_experts=4),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**S, **MOE, moe_intermediate_size=128, head_dim=32, num_experts=4),
    "olmoe": lambda: transformers.OlmoeConfig(**S, **MOE, num_experts=4),
    "mixtral": lambda: transformers.MixtralConfig(**S, **MOE, num_local_experts=4),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**S, "num_key_value_heads": 4}, **MOE, moe_intermediate_size=128, n_routed_experts=4, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32),
    "olmo_hybrid": lambda: transformers.OlmoHybridConfig(**S, pad_token_id=0, eos_token_id=1),
}


def survey(name: str, directory: str) -> tuple[str, str]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.bfloat16)
    with torch.no_grad():  # biases and norms start as 0 and 1: make them matter
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in pname else 0.0, 0.3)
    model.save_pretrained(directory)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()(tokens).logits
    results = []
    for quantization in ("none", "fp8-block"):
        try:
            ours = from_cache(directory, mode="off", quantization=quantization)
            with torch.no_grad():
                got = ours(tokens).logits
        except Exception as e:  # the table shows what a user would see
            results.append(f"{type(e).__name__}: {str(e)[:160]}")
            continue
        report = ours.weightcache
        experts = f", experts zero-copy {len(report.experts_zero_copy)} copied {len(report.experts_copied)}" \
            if report.experts_zero_copy or report.experts_copied else ""
        if quantization == "none":
            results.append(f"{'equal' if torch.equal(got, want) else 'DIFFERENT'}{experts}")
        else:
            cos = torch.nn.functional.cosine_similarity(got.float().flatten(), want.float().flatten(), dim=0)
            top1 = (got.argmax(-1) == want.argmax(-1)).float().mean()
            results.append(f"cos {cos:.4f}, top-1 {top1:.0%} ({report.fp8_compute})")
    return results[0], results[1]


def main(names: list[str]) -> None:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print("| model_type | bf16 vs from_pretrained | fp8-block vs bf16 |\n| --- | --- | --- |")
    for name in names or CONFIGS:
        with tempfile.TemporaryDirectory() as directory:
            bf16, fp8 = survey(name, directory)
        print(f"| {name} | {bf16} | {fp8} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
