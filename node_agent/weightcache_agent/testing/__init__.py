"""Synthetic checkpoints for tests and demos: Llama-shaped and mixture-of-experts models
written as real safetensors files (bf16, or block FP8 already quantized), seeded so the
same call writes the same bytes. Useful to a user's own tests as much as to ours.

May import: the base modules and `load` (to quantize FP8 checkpoints the loader's way).
"""
