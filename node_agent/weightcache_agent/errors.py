"""One exception family for everything weightcache refuses or cannot do.

Engines catch `WeightCacheError` to decide whether to fall back to a disk load; each
subclass names one kind of refusal so callers and tests can tell them apart, and every
message names what was wrong and where.
"""
from __future__ import annotations


class WeightCacheError(Exception):
    """Base class of every error weightcache raises on purpose."""


class CheckpointError(WeightCacheError):
    """A checkpoint on disk is missing, truncated or contradicts itself."""


class UnsupportedQuantization(WeightCacheError):
    """A quantization method whose effect cannot live in shared tensors alone."""


class FingerprintMismatch(WeightCacheError):
    """The agent holds different weights than the engine asked for.

    `differences` maps each differing field to (cache value, engine value); `model`, the
    model's name as the engine knows it, only makes the message readable.
    """

    def __init__(self, differences: dict[str, tuple[object, object]], model: str | None = None):
        self.differences = dict(differences)
        self.model = model
        lines = [f"{key}: cache={cache!s} engine={engine!s}" for key, (cache, engine) in sorted(self.differences.items())]
        super().__init__("fingerprint mismatch" + (f" for {model}" if model else "") + ": " + "; ".join(lines))


class ProtocolError(WeightCacheError):
    """A peer sent something that is not a valid weightcache frame."""


class AgentUnavailable(WeightCacheError):
    """No agent answered on the socket (not running, or it went away)."""


class UntrustedAgent(AgentUnavailable):
    """What serves the socket is not the agent: its process runs as a uid the client does not trust."""


class AttachError(WeightCacheError):
    """The cache does not fit the module: shape, dtype, or tensors left on meta."""


class OutOfMemory(WeightCacheError):
    """The arena would not fit in the memory available."""
