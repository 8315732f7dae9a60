"""Where an agent's arena comes from, one function per source, and the device it lives on.

A fresh arena of the prepared layout's size (`new_arena`, cpu memfd or CUDA VMM), or one an
engine hands back by fd (the same call with `fd`); the plan from the checkpoint (`prepare`);
another replica's arena to copy from (`open_peer`, `copy_from_peer`). The arena holder
(serve/arena_holder.py) decides which source to use and in what order; these functions keep
no state of their own.

The loader's modules (and with them, for a cast or quantization, torch) are imported only
where a load from disk needs them: a restart that adopts an engine's arena from the
predecessor's record imports none of them.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ..arena.cpu import CpuArena, available_memory, new_cpu_arena
from ..arena.devices import Device
from ..errors import WeightCacheError
from ..spec import CacheSpec
from .prepared_record import RecordedCache

if TYPE_CHECKING:
    from ..load.loader import LoadedCache, PreparedCache
    from ..load.peer_copy import PeerArena

log = logging.getLogger(__name__)


def prepare(spec: CacheSpec, device_mark: str) -> "PreparedCache":
    """Headers and plan from the checkpoint."""
    from ..load.loader import prepare_cache  # torch-free, but a restart that adopts skips it

    return prepare_cache(spec, device=device_mark)


def device_mark(device: Device) -> str:
    if device.backend == "cpu":
        return "cpu"
    from ..arena.cuda import device_mark as cuda_mark

    return cuda_mark(device.ordinal)  # through the driver: makes the primary context, imports no torch


def new_arena(device: Device, spec: CacheSpec, socket_path: str, size: int, fd: int | None = None) -> Any:
    """A fresh arena for the prepared layout, or (with `fd`) one handed back by an engine."""
    if device.backend == "cuda":
        from ..arena.cuda import CudaArena

        return CudaArena(size, device.ordinal, device.uuid, fd=fd)
    if fd is not None:
        return CpuArena.adopt(fd, size)
    return new_cpu_arena(size, spec, name=f"weightcache:{os.path.basename(socket_path)}")


def loaded(prepared: Any, arena: Any, seconds: float) -> "LoadedCache":
    """The served cache: a filled arena and what was prepared for it (from a record or the checkpoint)."""
    if isinstance(prepared, RecordedCache):
        return prepared.loaded(arena, seconds)
    from ..load.loader import loaded_from

    return loaded_from(prepared, arena, seconds)


def open_peer(peer: str, spec: CacheSpec) -> "PeerArena | None":
    """The other replica's arena, once its load is done; None (logged): read the disk instead."""
    from ..load.peer_copy import PeerArena

    try:
        return PeerArena(peer, spec)
    except (WeightCacheError, OSError) as e:
        log.warning("no arena to copy from the replica at %s (%s); reading the checkpoint instead", peer, e)
        return None


def copy_from_peer(peer: "PeerArena", prepared: Any, arena: Any, where: str) -> dict[str, Any] | None:
    """This rank's arena filled from another replica's and sealed: the copy's timings, or None (logged;
    the arena closed): read the disk."""
    try:
        info = peer.copy_into(prepared, arena)
        arena.seal()
    except (WeightCacheError, OSError, RuntimeError) as e:
        arena.close()
        log.warning("could not copy the arena from the replica at %s (%s); reading the checkpoint instead",
                    where, e)
        return None
    return info


def read_free_bytes(device: Device) -> int | None:
    """Free memory where the arena lives: room for a second arena beside this one."""
    try:
        if device.backend == "cpu":
            return available_memory()
        from ..arena.cuda import free_memory

        return free_memory(device.ordinal)
    except (WeightCacheError, OSError) as e:
        log.debug("cannot read the free memory of %s: %s", device.uuid, e)
        return None
