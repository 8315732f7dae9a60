"""Keyed digests of an arena's bytes: how the agent knows the weights it serves are the ones it loaded.

An arena is digested in fixed segments (so that a check can be paced, one segment at a
time, and a mismatch names where), each with a secret key the agent draws once and keeps
in its own 0600 files: without the key, nobody who can write the arena's bytes can make
altered bytes digest like the originals, nor learn anything from the digests (they are
never sent to a client).

- cpu: HMAC-SHA256 per segment of `CPU_SEGMENT_BYTES`, under a key derived from the agent's key
  and the segment's index (SHA-256 runs on the CPU's SHA extensions, faster than BLAKE2b there;
  OpenSSL releases the GIL, so segments are hashed on several threads at once).
- cuda: a keyed polynomial hash computed by a GPU kernel where the bytes are
  (`arena/cuda_digest.py`), per segment of `CUDA_SEGMENT_BYTES`.

A digest is the list of segment values (hex), with the algorithm and segment size it was
made with: two digests are comparable only when those agree.
"""
from __future__ import annotations

import hmac
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

KEY_BYTES = 32
CPU_SEGMENT_BYTES = 64 << 20
CPU_ALGORITHM = "hmac-sha256/v1"


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


@dataclass(frozen=True)
class ArenaDigest:
    """What an arena digested to, and how: comparable with another only for the same algorithm, size, segments."""

    algorithm: str
    size: int
    segment_bytes: int
    values: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "size": self.size, "segment_bytes": self.segment_bytes,
                "values": list(self.values)}

    @classmethod
    def from_json(cls, doc: Any) -> "ArenaDigest | None":
        try:
            values = tuple(str(v) for v in doc["values"])
            digest = cls(str(doc["algorithm"]), int(doc["size"]), int(doc["segment_bytes"]), values)
        except (KeyError, TypeError, ValueError):
            return None
        return digest if digest.segment_bytes > 0 and len(values) == segment_count(digest.size,
                                                                                   digest.segment_bytes) else None


def segment_count(size: int, segment_bytes: int) -> int:
    return max(1, -(-size // segment_bytes))


def segment_range(size: int, segment_bytes: int, index: int) -> tuple[int, int]:
    """(offset, length) of segment `index` of an arena of `size` bytes."""
    offset = index * segment_bytes
    return offset, min(segment_bytes, size - offset)


def cpu_segment(view: memoryview, key: bytes, index: int) -> str:
    """HMAC-SHA256 of one segment's bytes (`view`), under a key bound to its index."""
    segment_key = hmac.digest(key, b"weightcache arena segment %d" % index, "sha256")
    return hmac.digest(segment_key, view, "sha256").hex()


def digest_all(segment: Callable[[int], str], count: int, threads: int | None = None) -> tuple[str, ...]:
    """Every segment's value, `segment(i)` run on several threads (each releases the GIL while it hashes)."""
    threads = threads or min(8, os.cpu_count() or 1, count)
    if threads <= 1:
        return tuple(segment(i) for i in range(count))
    with ThreadPoolExecutor(threads, thread_name_prefix="digest") as pool:
        return tuple(pool.map(segment, range(count)))
