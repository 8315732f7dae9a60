"""Fill a replica's arena from another replica on the same node: a device-to-device copy.

A node with more GPUs than the tensor-parallel size holds several replicas of the cache,
and rank r of every replica holds the same bytes. The first replica reads the checkpoint;
every other one asks the first one's agent for its arena through the ordinary attach (so
the fingerprint is checked exactly as for an engine), checks that the layout is the one
it prepared itself, and copies the arena whole into its own: GPU to GPU over NVLink or
PCIe for the cuda backend (a memory copy for cpu), at the interconnect's rate, with no
checkpoint read and no re-quantization.

Data flow: connect to the source socket (waiting while its agent starts) -> attach (the
source answers once it has loaded) -> manifest + arena fd -> same fields, layout hash and
size as ours, else `PeerCopyRefused` -> map the fd read-only for both GPUs -> copy ->
detach. Any failure leaves the caller to read the disk instead.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from .. import protocol
from ..errors import AgentUnavailable, WeightCacheError
from .fingerprint import differences, engine_request

log = logging.getLogger(__name__)


class PeerCopyRefused(WeightCacheError):
    """The source replica cannot give this one its bytes (another cache, a failed load, no peer access)."""


def fill_from_peer(source: str, prepared: Any, arena: Any, timeout: float = 3600.0) -> dict[str, Any]:
    """Copy the arena of the agent at `source` into `arena` (ours, unsealed). Returns what was done.

    `prepared` is this agent's PreparedCache: the source must serve exactly its fields and layout.
    """
    started = time.monotonic()
    conn = _connect(source, min(timeout, 600.0))
    fds: list[int] = []
    try:
        conn.settimeout(timeout)  # the source answers an attach only once its own load is done
        protocol.send_message(conn, {"type": "attach", "pid": os.getpid(), "role": "primary", "group": None,
                                     "pod": None, "request": engine_request(prepared.spec, with_revision=True)})
        reply, fds = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
        waited = time.monotonic() - started
        if reply.get("type") == "error":
            raise PeerCopyRefused(f"replica at {source} refused: {reply.get('code')}: {reply.get('message')}")
        arenas = reply.get("arenas")
        if reply.get("type") != "manifest" or not isinstance(arenas, list) or len(arenas) != 1 or len(fds) != 1:
            raise PeerCopyRefused(f"replica at {source} answered no single-arena manifest")
        fields = reply.get("fields") if isinstance(reply.get("fields"), dict) else {}
        diff = differences(prepared.fields, fields)
        if diff:
            raise PeerCopyRefused(f"replica at {source} holds other weights (differs in {', '.join(diff)})")
        size, mapped = prepared.layout.size, arenas[0].get("size")
        # The source's arena is the layout rounded up to its allocation granularity (a mapping must cover
        # whole granules); anything else is another layout.
        if reply.get("layout_hash") != prepared.layout.layout_hash or not isinstance(mapped, int) \
                or not size <= mapped <= arena.size or reply.get("backend") != arena.backend:
            raise PeerCopyRefused(f"replica at {source} lays its arena out differently")
        t0 = time.monotonic()
        if arena.backend == "cuda":
            _copy_cuda(fds[0], mapped, size, str(arenas[0].get("device")), arena)
        else:
            _copy_cpu(fds[0], size, arena)
        copy_seconds = time.monotonic() - t0
    finally:
        for fd in fds:
            os.close(fd)
        try:
            protocol.send_message(conn, {"type": "detach"})
        except OSError:
            pass
        conn.close()
    log.info("filled %.2f GiB from the replica at %s in %.1f ms (%.1f GB/s; waited %.2f s for it)", size / 2**30,
             source, copy_seconds * 1e3, size / max(copy_seconds, 1e-9) / 1e9, waited)
    return {"source": source, "device": arenas[0].get("device"), "bytes": size, "copy_seconds": copy_seconds,
            "wait_seconds": waited}


def _connect(path: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return protocol.connect(path)
        except AgentUnavailable:
            if time.monotonic() > deadline:
                raise PeerCopyRefused(f"no replica answered at {path} within {timeout:.0f}s") from None
            time.sleep(0.05)


def _copy_cuda(fd: int, mapped: int, size: int, owner_uuid: str, arena: Any) -> None:
    from ..arena.cuda import PeerView

    view = PeerView(fd, mapped, owner_uuid, readers=[arena.ordinal])
    try:
        view.copy_into(arena.device_tensor()[:size])
    finally:
        view.release()


def _copy_cpu(fd: int, size: int, arena: Any) -> None:
    from ..arena.cpu import map_readonly

    src = map_readonly(fd, size)
    buffer = arena.writable(populate=True)
    try:
        dest = torch.frombuffer(buffer, dtype=torch.uint8, count=size)
        dest.copy_(src)
        del dest  # the arena's seal closes the mapping: no view of it may outlive the copy
    finally:
        buffer.release()
