"""What tests and demos need to exercise the cache for real, without a model download.

Synthetic checkpoints (`synthetic`, `synthetic_moe`): Llama-shaped and mixture-of-experts
models written as real safetensors files (bf16, or block FP8 already quantized), seeded so
the same call writes the same bytes. A real agent process (`agent_process`): started on a
socket from such a checkpoint, ready once its status says so, stopped as a pod or
service is. A test writes the checkpoint, starts the agent on it and attaches through the
socket, as an engine would. Useful to a user's own tests as much as to ours.

May import: the base modules and `load` (to quantize FP8 checkpoints the loader's way).
`agent_process` imports the base modules only, so it stays torch-free.
"""
