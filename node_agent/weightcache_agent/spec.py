"""`CacheSpec`: what an engine wants from a cache, and what an agent is asked to hold.

The same object travels both ways: the agent is started from one (CLI flags map onto its
fields) and the engine's client builds one to ask for weights. Both derive the
fingerprint from it, so a field added here is automatically checked on attach.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .quantization import check_quantization

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class CacheSpec:
    """What one rank's cache holds: the checkpoint, how it is split, and in what form.

    The agent is started from one (`weightcache agent` flags map onto the fields one to
    one: `agent_args()`); an engine passes one to `attach()`, and a mismatch with what the
    agent holds raises `FingerprintMismatch` naming each differing field.

    model: the checkpoint directory (`*.safetensors` + `config.json`) as this process
        sees it. The engine and the agent may see it at different paths: the content is
        compared, not the directory name.
    tp_size: tensor-parallel degree (1: unsharded). Each rank's cache holds only its shard.
    tp_rank: this rank, 0 <= tp_rank < tp_size.
    quantization: "none", or "fp8-block" (float8_e4m3fn weights in 128x128 blocks, each
        with a float32 `weight_scale_inv`; quantized at load time, or taken as is from a
        checkpoint quantized that way). Methods whose effect does not live in the tensors
        alone (per-tensor FP8, AWQ, GPTQ, Marlin) are refused with the reason.
    dtype: "auto" (the checkpoint's floating dtype), "bfloat16", "float16" or "float32";
        floating weights are cast to it at load time.
    sharding: a preset name or a YAML rules file saying how each tensor splits across
        ranks; None chooses from `config.json`'s architecture.
    expert_parallel: place whole experts per rank (mixture-of-experts models) instead of
        splitting every expert.
    revision: a label for the weights' version (e.g. a git revision or a date), shown in
        status and compared on attach: an engine that names one attaches only to an agent
        started with the same `--revision`.

    Invalid values raise `ValueError` (or `UnsupportedQuantization`) on construction.
    """

    model: str
    tp_size: int = 1
    tp_rank: int = 0
    quantization: str = "none"
    dtype: str = "auto"
    sharding: str | None = None  # preset name or YAML rules file; None: chosen from config.json
    expert_parallel: bool = False
    # A label (e.g. a git revision), part of the fingerprint: an engine that names one attaches only to an agent
    # started with the same. The checkpoint's content is checked besides, whatever the label says.
    revision: str | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.revision is not None and (not isinstance(self.revision, str) or not 0 < len(self.revision) <= 128):
            raise ValueError(f"revision must be a string of 1 to 128 characters, got {self.revision!r}")
        check_quantization(self.quantization)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def agent_args(self) -> list[str]:
        """The `weightcache agent` flags that ask for exactly this spec."""
        args = ["--model", self.model, "--tp-size", str(self.tp_size), "--tp-rank", str(self.tp_rank),
                "--quantization", self.quantization, "--dtype", self.dtype]
        if self.sharding:
            args += ["--sharding", self.sharding]
        if self.expert_parallel:
            args.append("--expert-parallel")
        if self.revision:
            args.append(f"--revision={self.revision}")  # one token: never read as a flag
        return args
