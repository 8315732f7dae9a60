"""weightcache: LLM weights kept resident by a node agent, attached zero-copy by engines.

The engine-facing API is `CacheSpec` + `attach`; everything here imports torch but
never kopf or kubernetes.
"""
from .client import Attachment, agent_status, attach
from .errors import (
    AgentUnavailable,
    AttachError,
    CheckpointError,
    FingerprintMismatch,
    OutOfMemory,
    ProtocolError,
    UnsupportedQuantization,
    WeightCacheError,
)
from .spec import CacheSpec

__all__ = [
    "AgentUnavailable", "AttachError", "Attachment", "CacheSpec", "CheckpointError", "FingerprintMismatch",
    "OutOfMemory", "ProtocolError", "UnsupportedQuantization", "WeightCacheError", "agent_status", "attach",
]
__version__ = "0.1.0"
