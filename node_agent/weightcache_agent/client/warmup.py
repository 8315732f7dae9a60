"""`prepare()`: pay what a process pays once for its first attach while the engine starts.

A first attach in a fresh process costs more than later ones, for work that happens once
per process: importing the attach path (torch, the C bind loop, cuda-bindings), looking up
the GPU's ordinal by UUID, the driver's first import / reserve / map / set-access of a
shared allocation, and torch's first tensor over foreign device memory and its first
strided views of it. `prepare` does all of it on a small arena of its own -- made, exported,
imported and mapped read-only exactly as an agent's, then bound into a one-parameter module --
so that the engine's real attach is a later attach. An engine calls it while it starts
(before or while building its model), and may skip it.

Given the agent's socket, `prepare` also maps the agent's arena itself (an "arena" request:
the fd and the arena's id, no lease), and on the cuda backend has its read access granted,
which takes ~1 ms for tens of GiB. The attach on that socket then finds it mapped (`take`)
and only binds, where the arena's id in its manifest is the same; otherwise (the agent
restarted meanwhile, or was still loading) the attach drops that mapping and maps as always.
Until the attach takes it, the mapping holds the arena's memory as an attach does.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import torch
from torch import nn

from .. import protocol
from ..arena.cpu import CpuArena, map_readonly
from ..errors import WeightCacheError
from .rebind import bind_manifest

log = logging.getLogger(__name__)

_SIZE = 4096
_ASK_TIMEOUT = 5.0  # the agent answers an "arena" request at once, loading or not
# The agent's socket (as the kernel names its peer) -> (the arena's id, size, backend, device,
# the mapping, its grant). One per agent: a process of several ranks maps each rank's.
_premapped: dict[str, tuple[tuple, torch.Tensor, Callable[[], None]]] = {}
_premapped_lock = threading.Lock()


def prepare(device: int | str | None = None, socket: str | None = None) -> dict[str, float]:
    """Warm the attach path for `device` ("cpu", a CUDA ordinal, or None: the current CUDA device
    when CUDA is available, else cpu), and with `socket`, map that agent's arena for the attach
    to come. Returns seconds per step, for a log line ("arena" only where the arena was mapped:
    an agent that is absent or still loading is left to the attach)."""
    from . import session  # the attach module and everything it imports

    session.lease_threads.keep_one_idle()  # the attach's lease watcher, started now
    took: dict[str, float] = {}
    t0 = time.perf_counter()
    _dry_run(map_readonly, _cpu_arena)
    took["cpu"] = time.perf_counter() - t0
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        t1 = time.perf_counter()
        _prepare_cuda(int(str(device).removeprefix("cuda:")))
        took["cuda"] = time.perf_counter() - t1
    if socket is not None:
        t2 = time.perf_counter()
        if _map_ahead(socket):
            took["arena"] = time.perf_counter() - t2
    return took


def _map_ahead(socket: str) -> bool:
    """Map the arena of the agent at `socket` now, for its attach to take. False where it cannot
    be had now (logged): the attach maps as always."""
    from .session import _map_arena_meanwhile

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
        base, granted = _map_arena_meanwhile(reply, fds, copy_on_write=False)
    except (OSError, EOFError, WeightCacheError) as e:
        log.info("arena not mapped ahead from %s: %s", socket, e)
        return False
    finally:
        for fd in fds:
            os.close(fd)  # the mapping holds the memory
    with _premapped_lock:
        _premapped[peer] = (key, base, granted)
    return True


def take(peer: str, manifest: dict[str, Any]) -> tuple[torch.Tensor, Callable[[], None]] | None:
    """The arena mapped ahead from the agent at `peer` (what `_map_arena_meanwhile` returns), where
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


def _cpu_arena() -> tuple[Any, str]:
    arena = CpuArena(_SIZE, name="weightcache:prepare")
    arena.seal()
    return arena, "cpu"


def _prepare_cuda(ordinal: int) -> None:
    from ..arena.cuda import CudaArena, granularity, map_readonly_cuda
    from ..arena.devices import cuda_devices, local_ordinal

    uuid = next(d.uuid for d in cuda_devices() if d.ordinal == ordinal)
    local_ordinal(uuid)  # remembered from here on
    torch.empty(1, device=f"cuda:{ordinal}")

    def make() -> tuple[Any, str]:
        return CudaArena(granularity(ordinal), ordinal, uuid), uuid

    _dry_run(lambda fd, size, where: map_readonly_cuda(fd, size, where), make)
    torch.cuda.synchronize(ordinal)


def _dry_run(map_arena: Any, make: Any) -> None:
    """Make an arena, map it read-only from a dup of its fd (as an engine receives it), bind a module."""
    arena, where = make()
    fd = os.dup(arena.fd)
    try:
        base = map_arena(fd, arena.size, where) if where != "cpu" else map_arena(fd, arena.size)
        module = nn.Module()
        module.weight = nn.Parameter(torch.empty((2, 4), dtype=torch.bfloat16, device="meta"))
        bind_manifest(module, base, {"name": ["weight"], "offset": [0], "form": [0],
                                     "forms": [["bfloat16", [2, 4], [4, 1]]]})
        assert module.weight.data_ptr() == base.data_ptr()
        del module, base
    finally:
        os.close(fd)
        arena.close()
