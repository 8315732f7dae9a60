"""`prepare()`: pay what a process pays once for its first attach while the engine starts.

A first attach in a fresh process costs more than later ones, for work that happens once
per process: importing the attach path (torch, the C bind loop, cuda-bindings), looking up
the GPU's ordinal by UUID, the driver's first import / reserve / map / set-access of a
shared allocation, and torch's first tensor over foreign device memory and its first
strided views of it. `prepare` does all of it on a small arena of its own -- made, exported,
imported and mapped read-only exactly as an agent's, then bound into a one-parameter module --
so that the engine's real attach is a later attach. An engine calls it while it starts
(before or while building its model), and may skip it.

Given the agent's socket -- or finding it in the environment the operator injects, as the
attach does -- `prepare` also maps the agent's arena itself, for the attach to take
(`mapping.map_ahead`).
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from ..arena.cpu import CpuArena, map_readonly
from . import early
from .env import socket_to_prepare
from .mapping import map_ahead
from .rebind import bind_manifest

_SIZE = 4096


def prepare(device: int | str | None = None, socket: str | None = None, rank: int | None = None) -> dict[str, float]:
    """Warm the attach path for `device` ("cpu", a CUDA ordinal, or None: the current CUDA device
    when CUDA is available, else cpu), and map the arena of the agent at `socket` for the attach
    to come. Without `socket`, the agent is the one the attach would find in the environment
    (`$WEIGHTCACHE_SOCKET`, else this `rank`'s device socket), where that names exactly one:
    a rank left unsaid with several devices in `$WEIGHTCACHE_DEVICES` maps nothing rather than
    another GPU's arena. Returns seconds per step, for a log line ("arena" only where the arena
    was mapped: an agent that is absent or still loading is left to the attach). Where the
    environment named the agent, the warm-up may have run at start already (`client.early`):
    it is not done twice."""
    from . import session  # the attach module and everything it imports

    session.lease_threads.keep_one_idle()  # the attach's lease watcher, started now
    if device is None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    device = "cpu" if str(device) == "cpu" else int(str(device).removeprefix("cuda:"))
    took = early.warmed(device) or warm(device)
    socket = socket or socket_to_prepare(rank)
    if socket is not None:
        t2 = time.perf_counter()
        if map_ahead(socket):
            took["arena"] = time.perf_counter() - t2
    return took


def begin(socket: str | None = None) -> None:
    """Prepare the attach path for the agent at `socket` (default: the one the environment names) on
    a thread, while the engine goes on starting (`client.early`): what `prepare` does, but for the
    agent's own device and without mapping its arena."""
    early.begin(_warm_for_agent, socket)


def _warm_for_agent(socket: str) -> tuple[int | str, dict[str, float]]:
    from ..protocol import agent_status
    from . import session  # the attach path's imports, off the engine's main thread

    status = agent_status(socket, timeout=5.0)  # answered at once, loading or not
    if status.get("backend") == "cuda":
        from ..arena.devices import local_ordinal

        device: int | str = local_ordinal(str(status.get("device")))  # the GPU the attach maps, no other
    elif status.get("backend") == "cpu":
        device = "cpu"
    else:
        raise ValueError(f"backend {str(status.get('backend'))[:40]!r}")
    took = warm(device)
    session.lease_threads.keep_one_idle()
    return device, took


def warm(device: int | str) -> dict[str, float]:
    """The once-per-process part of `prepare`: the cpu path, and `device`'s (a CUDA ordinal) where
    it is not "cpu". Seconds per step."""
    took: dict[str, float] = {}
    t0 = time.perf_counter()
    _dry_run(map_readonly, _cpu_arena)
    took["cpu"] = time.perf_counter() - t0
    if device != "cpu":
        t1 = time.perf_counter()
        _prepare_cuda(int(device))
        took["cuda"] = time.perf_counter() - t1
    return took


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
