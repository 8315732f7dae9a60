"""How an engine maps the agent's arena: read-only, a memfd (cpu) or a VMM allocation (cuda).

An attach maps the arena its manifest came with (`map_arena_meanwhile`: on the cuda backend
the read access is granted on a thread while the rows are checked). An engine that gave
`prepare()` the agent's socket has it mapped already: `map_ahead` asks the agent for the
arena alone (an "arena" request: the fd and the arena's id, no lease), maps it and has its
access granted (~1 ms for tens of GiB) while the engine starts, and the attach on that socket
takes the mapping (`take`) where its manifest names the same arena id; otherwise (the agent
restarted meanwhile) the mapping is dropped and the attach maps the new arena. Until taken,
the mapping holds the arena's memory as an attachment does.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import torch

from .. import protocol
from ..arena.cpu import map_private, map_readonly
from ..errors import AttachError, WeightCacheError
from .readonly import guard

log = logging.getLogger(__name__)

_ASK_TIMEOUT = 5.0  # the agent answers an "arena" request at once, loading or not
# The agent's socket (as the kernel names its peer) -> (the arena's id, size, backend, device,
# the mapping, its grant). One per agent: a process of several ranks maps each rank's.
_premapped: dict[str, tuple[tuple, torch.Tensor, Callable[[], None]]] = {}
_premapped_lock = threading.Lock()


def map_arena(manifest: dict[str, Any], fds: list[int], copy_on_write: bool = False) -> torch.Tensor:
    """The agent's arena (from a manifest reply and its fds), mapped read-only as one uint8 tensor."""
    base, granted = map_arena_meanwhile(manifest, fds, copy_on_write)
    granted()
    return base


def map_arena_meanwhile(manifest: dict[str, Any], fds: list[int],
                        copy_on_write: bool) -> tuple[torch.Tensor, Callable[[], None]]:
    """`map_arena`, and what to call before anything reads the arena (the cuda backend grants
    access on a thread while the rows are checked)."""
    arena = manifest["arenas"][0]
    backend = manifest.get("backend", "cpu")
    if backend == "cpu":
        return map_cpu(fds[0], arena["size"], copy_on_write), _granted
    if copy_on_write:
        raise AttachError(f"copy_on_write is for the cpu backend; the agent serves {str(backend)[:16]!r}, whose "
                          "weights are read-only: clone a tensor before changing it")
    if backend == "cuda":
        from ..arena.cuda import map_readonly_cuda_meanwhile

        return map_readonly_cuda_meanwhile(fds[0], arena["size"], arena["device"])
    raise AttachError(f"agent serves the {backend!r} backend, which this client cannot map")


def _granted() -> None:
    """A mapping whose access was set as it was made."""


def map_cpu(fd: int, size: int, copy_on_write: bool) -> torch.Tensor:
    """A memfd arena: read-only and guarded, or private (`copy_on_write`)."""
    if copy_on_write:
        return map_private(fd, size)
    base = map_readonly(fd, size)
    guard(base)  # a write into it: a message naming the cause, not a bare SIGSEGV
    return base


def map_ahead(socket: str) -> bool:
    """Map the arena of the agent at `socket` now, for its attach to take. False where it cannot
    be had now (logged): the attach maps as always."""
    fds: list[int] = []
    try:
        conn = protocol.connect(socket)
        try:
            conn.settimeout(_ASK_TIMEOUT)
            protocol.send_message(conn, {"type": "arena"})
            reply, fds = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
            peer = conn.getpeername()
        finally:
            conn.close()
        if reply.get("type") != "arena":
            log.info("arena not mapped ahead: the agent at %s says %s", socket, str(reply.get("message"))[:200])
            return False
        key = _arena_key(reply)
        if key is None or len(fds) != 1:
            raise WeightCacheError(f"an arena reply with {len(fds)} fd(s) and arenas {str(reply.get('arenas'))[:200]}")
        base, granted = map_arena_meanwhile(reply, fds, copy_on_write=False)
    except (OSError, EOFError, KeyError, TypeError, ValueError, WeightCacheError) as e:  # the attach will say
        log.info("arena not mapped ahead from %s: %s", socket, e)
        return False
    finally:
        for fd in fds:
            os.close(fd)  # the mapping holds the memory
    with _premapped_lock:
        _premapped[peer] = (key, base, granted)
    return True


def take(peer: str, manifest: dict[str, Any]) -> tuple[torch.Tensor, Callable[[], None]] | None:
    """The arena mapped ahead from the agent at `peer` (what `map_arena_meanwhile` returns), where
    it is the one `manifest` names; None otherwise. Either way the mapping is no longer held here."""
    with _premapped_lock:
        held = _premapped.pop(peer, None)
    if held is None:
        return None
    key, base, granted = held
    return (base, granted) if key == _arena_key(manifest) else None  # a dropped mapping waits for its grant


def _arena_key(reply: dict[str, Any]) -> tuple | None:
    """What makes two replies name the same arena: its id, size, backend and device."""
    arenas = reply.get("arenas")
    if not isinstance(arenas, list) or len(arenas) != 1 or not isinstance(arenas[0], dict):
        return None
    arena = arenas[0]
    if not isinstance(arena.get("id"), str) or not isinstance(arena.get("size"), int):
        return None
    return arena["id"], arena["size"], arena.get("backend"), arena.get("device"), reply.get("backend")
