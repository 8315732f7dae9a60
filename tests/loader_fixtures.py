"""Helpers for the loader tests: read back what an arena holds, write hand-made safetensors."""
from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

import torch
from safetensors.torch import load_file

from weightcache_agent.arena.cpu import map_readonly
from weightcache_agent.load.dtypes import torch_dtype
from weightcache_agent.load.loader import LoadedCache, load_cache
from weightcache_agent.spec import CacheSpec


def arena_tensors(cache: LoadedCache) -> dict[str, torch.Tensor]:
    """Every slot of a loaded (sealed) arena as a tensor, through a read-only mapping of its fd."""
    base = map_readonly(cache.arena.fd, cache.layout.size)
    return {s.name: base[s.offset : s.offset + s.nbytes].view(torch_dtype(s.dtype)).view(s.shape) for s in cache.layout.slots}


def load(model: str, **spec: Any) -> tuple[LoadedCache, dict[str, torch.Tensor]]:
    cache = load_cache(CacheSpec(model, **spec), name="test")
    return cache, arena_tensors(cache)


def ranks(model: str, tp: int, **spec: Any) -> list[dict[str, torch.Tensor]]:
    return [load(model, tp_size=tp, tp_rank=r, **spec)[1] for r in range(tp)]


def full_tensors(model: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model, "*.safetensors"))):
        out.update(load_file(path))
    return out


def write_raw(path: str, header: dict[str, Any], data: bytes, header_len: int | None = None) -> None:
    """A safetensors file from a literal header (which may lie) and data bytes."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_len is None else header_len))
        f.write(raw)
        f.write(data)


def read_header(path: str) -> tuple[dict[str, Any], bytes]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        return header, f.read()
