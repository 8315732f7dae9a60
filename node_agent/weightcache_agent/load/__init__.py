"""The cold path: safetensors on disk -> this rank's shard -> quantized -> a filled arena.

`checkpoint` reads headers and validates files; `sharding` says which slice of each tensor
a tensor-parallel rank owns; `fp8` quantizes to block FP8; `layout` places every tensor in
the arena; `plan` holds the types the stages share; `pipeline` (host memory) and
`cuda_fill` (GPU) move the bytes, advancing `progress` (status, bar, log lines); `loader`
orchestrates them; `fingerprint` names what a
load produces, so an agent and an engine can tell whether they mean the same bytes.

May import: the base modules (`errors`, `spec`, `quantization`) and `arena`. Never `serve`,
`client`, `engine` or `testing`.
"""
