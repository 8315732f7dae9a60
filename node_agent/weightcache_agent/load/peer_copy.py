"""Fill a replica's arena from another replica on the same node: a device-to-device copy.

A node with more GPUs than the tensor-parallel size holds several replicas of the cache,
and rank r of every replica holds the same bytes. The first replica reads the checkpoint;
every other one asks the first one's agent for its arena through the ordinary attach (so
the fingerprint is checked exactly as for an engine), checks that the layout is the one
it prepared, and copies the arena whole into its own: GPU to GPU over NVLink or PCIe for
the cuda backend (a memory copy for cpu), at the interconnect's rate, with no checkpoint
read, no re-quantization and no torch.

Data flow: `PeerArena(source)` connects to the source socket (waiting while its agent
starts) and attaches (the source answers once it has loaded) -> manifest + arena fd. The
agent then takes its plan from the source's record of its prepared cache when that still
holds (serve/prepared_record.py: no header read, no torch), else plans from the checkpoint
-> `copy_into(prepared, arena)`: same fields, layout hash and size as the plan, else
`PeerCopyRefused` -> the fd mapped read-only for both GPUs -> one copy -> `close()`
detaches. Any failure leaves the caller to read the disk instead.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from .. import protocol
from ..errors import AgentUnavailable, WeightCacheError
from ..spec import CacheSpec
from .fingerprint import differences, engine_request
from .progress import size_text

log = logging.getLogger(__name__)


class PeerCopyRefused(WeightCacheError):
    """The source replica cannot give this one its bytes (another cache, a failed load, no peer access)."""


class PeerArena:
    """The arena of the replica at `source`, attached (so its load is done) until `close()`."""

    def __init__(self, source: str, spec: CacheSpec, timeout: float = 3600.0):
        started = time.monotonic()
        self.source = source
        self.fds: list[int] = []
        self.conn = _connect(source, min(timeout, 600.0))
        try:
            self.conn.settimeout(timeout)  # the source answers an attach only once its own load is done
            protocol.send_message(self.conn, {"type": "attach", "pid": os.getpid(), "role": "primary", "group": None,
                                              "pod": None, "request": engine_request(spec, with_revision=True)})
            self.reply, self.fds = protocol.recv_message(self.conn, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
            self.wait_seconds = time.monotonic() - started
            if self.reply.get("type") == "error":
                raise PeerCopyRefused(f"replica at {source} refused: {self.reply.get('code')}: "
                                      f"{self.reply.get('message')}")
            arenas = self.reply.get("arenas")
            if self.reply.get("type") != "manifest" or not isinstance(arenas, list) or len(arenas) != 1 \
                    or len(self.fds) != 1:
                raise PeerCopyRefused(f"replica at {source} answered no single-arena manifest")
            self.arena_info = arenas[0] if isinstance(arenas[0], dict) else {}
        except BaseException:
            self.close()
            raise

    def copy_into(self, prepared: Any, arena: Any) -> dict[str, Any]:
        """Copy the source's arena into `arena` (ours, unsealed), planned as `prepared`. Returns what was done."""
        reply = self.reply
        fields = reply.get("fields") if isinstance(reply.get("fields"), dict) else {}
        diff = differences(prepared.fields, fields)
        if diff:
            raise PeerCopyRefused(f"replica at {self.source} holds other weights (differs in {', '.join(diff)})")
        size, mapped = prepared.layout.size, self.arena_info.get("size")
        # The source's arena is the layout rounded up to its allocation granularity (a mapping must cover
        # whole granules); anything else is another layout.
        if reply.get("layout_hash") != prepared.layout.layout_hash or not isinstance(mapped, int) \
                or not size <= mapped <= arena.size or reply.get("backend") != arena.backend:
            raise PeerCopyRefused(f"replica at {self.source} lays its arena out differently")
        t0 = time.monotonic()
        if arena.backend == "cuda":
            from ..arena.cuda import PeerView

            view = PeerView(self.fds[0], mapped, str(self.arena_info.get("device")), readers=[arena.ordinal])
            try:
                arena.copy_from(view, size)
            finally:
                view.release()
        else:
            arena.copy_from(self.fds[0], size)
        seconds = time.monotonic() - t0
        log.info("filled %s from the replica at %s in %.1f ms (%.1f GB/s; waited %.2f s for it)", size_text(size),
                 self.source, seconds * 1e3, size / max(seconds, 1e-9) / 1e9, self.wait_seconds)
        return {"source": self.source, "device": self.arena_info.get("device"), "bytes": size,
                "copy_seconds": seconds, "wait_seconds": self.wait_seconds}

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        try:
            protocol.send_message(self.conn, {"type": "detach"})
        except OSError:
            pass
        self.conn.close()


def _connect(path: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return protocol.connect(path)
        except AgentUnavailable:
            if time.monotonic() > deadline:
                raise PeerCopyRefused(f"no replica answered at {path} within {timeout:.0f}s") from None
            time.sleep(0.05)
