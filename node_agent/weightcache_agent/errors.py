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
    model's name as the engine knows it, and `held`, what the agent says it holds (``model``:
    its checkpoint's path; ``fields``: its fingerprint fields), only make the message readable:
    beside each differing field it names the agent's model path, revision,
    quantization, dtype and tensor parallelism, so that the agent to fix is plain.
    """

    def __init__(self, differences: dict[str, tuple[object, object]], model: str | None = None,
                 held: dict[str, object] | None = None):
        self.differences = dict(differences)
        self.model = model
        self.held = dict(held or {})
        lines = [f"{key}: cache={cache!s} engine={engine!s}" for key, (cache, engine) in sorted(self.differences.items())]
        super().__init__("fingerprint mismatch" + (f" for {model}" if model else "") + ": " + "; ".join(lines)
                         + _holds(self.held))


# What a mismatch says the agent holds, in this order: (field, as the message names it).
_HELD_FIELDS = (("revision", "revision"), ("quantization", "quantization"),
                ("dtype", "dtype"), ("tp_size", "tp"), ("tp_rank", "rank"))


def _holds(held: dict[str, object]) -> str:
    """' (the agent holds PATH: revision R, quantization Q, ...)', from an agent's refusal; '' when it said nothing."""
    fields = held.get("fields") if isinstance(held.get("fields"), dict) else {}
    said = [f"{name} {str(fields[key])[:64] if fields[key] is not None else '(none)'}"
            for key, name in _HELD_FIELDS if key in fields]
    path = held.get("model")
    if not said and not isinstance(path, str):
        return ""
    where = str(path)[:512] if isinstance(path, str) else "a model"
    return f" (the agent holds {where}" + (f": {', '.join(said)}" if said else "") + ")"


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
