"""Where every tensor lives inside an arena, decided before any data is read.

The loader plans the tensors (name, dtype, shape); `lay_out` packs them at aligned
offsets into one arena and the result travels to engines as the manifest. The layout
hash covers every (name, offset, shape, stride, dtype), so an agent re-adopting an
arena and an engine rebuilding views can both check they agree on every byte.

A layout may also fuse: engines such as vLLM run q|k|v as one `qkv_proj` and gate|up as
one `gate_up_proj` (each rank's shards back to back). With `fuse` the parts of each such
group are placed back to back with no gap, so the fused parameter is one view; the
loader still fills the parts by name (`slots`), and the manifest lists the fused rows in
their place (`rows`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

from .dtypes import DType, dtype_name

# 256 bytes: the widest alignment a CUDA kernel or a vector load asks of a tensor start.
TENSOR_ALIGNMENT = 256


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    kind: str = "weight"  # "weight": from the checkpoint; "extra": made by the loader (e.g. scales)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @functools.cached_property
    def stride(self) -> tuple[int, ...]:
        stride, acc = [], 1
        for dim in reversed(self.shape):
            stride.append(acc)
            acc *= max(dim, 1)
        return tuple(reversed(stride))


@dataclass(frozen=True)
class ArenaLayout:
    slots: tuple[TensorSlot, ...]  # what the loader fills, by name
    size: int
    # fused rows served in place of their parts: (the fused row, its parts' names in order)
    fused: tuple[tuple[TensorSlot, tuple[str, ...]], ...] = ()

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @functools.cached_property
    def rows(self) -> tuple[TensorSlot, ...]:
        """What the manifest lists: every slot, except that a fused group's parts give way to its one row."""
        if not self.fused:
            return self.slots
        first = {parts[0]: row for row, parts in self.fused}
        inside = {name for _, parts in self.fused for name in parts}
        return tuple(first[s.name] if s.name in first else s for s in self.slots
                     if s.name in first or s.name not in inside)

    @functools.cached_property  # hashes every row: computed once per layout, not per attach
    def layout_hash(self) -> str:
        return hash_rows(self.size, [[s.name, s.offset, list(s.shape), list(s.stride), dtype_name(s.dtype), s.kind]
                                     for s in self.rows])

    def to_manifest(self) -> dict[str, list]:
        """Columns, not one object per tensor, and each distinct (dtype, shape, stride) sent once:
        a model repeats a handful of forms thousands of times, and small nested lists are
        what makes JSON slow to parse (2001 tensors: 0.6 ms instead of 3.3)."""
        forms: dict[tuple, int] = {}
        rows = self.rows
        index = [forms.setdefault((dtype_name(s.dtype), s.shape, s.stride), len(forms)) for s in rows]
        return {
            "name": [s.name for s in rows],
            "offset": [s.offset for s in rows],
            "form": index,
            "forms": [[dtype, list(shape), list(stride)] for dtype, shape, stride in forms],
        }


def hash_rows(size: int, rows: list[list[Any]]) -> str:
    """The layout hash of an arena of `size` bytes holding `rows` of [name, offset, shape, stride, dtype, kind]."""
    return hashlib.sha256(json.dumps([size, rows], separators=(",", ":")).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Fusion:
    """Parts that an engine runs as one tensor: `<prefix>.<part>.<leaf>` for each part, in order,
    served as `<prefix>.<fused>.<leaf>` (rows stacked along dim 0)."""

    fused: str
    parts: tuple[str, ...]

    def pattern(self) -> re.Pattern[str]:
        alternatives = "|".join(re.escape(p) for p in self.parts)
        return re.compile(rf"^(?P<prefix>.+)\.(?P<part>{alternatives})\.(?P<leaf>weight|bias|weight_scale_inv)$")


# vLLM's `packed_modules_mapping` for the Llama family (Llama, Mistral, Qwen2/3).
LAYOUTS: dict[str, tuple[Fusion, ...]] = {
    "file": (),
    "vllm": (Fusion("qkv_proj", ("q_proj", "k_proj", "v_proj")), Fusion("gate_up_proj", ("gate_proj", "up_proj"))),
}


def lay_out(tensors: Iterable[tuple[str, DType, tuple[int, ...], str]], granularity: int = 4096,
            fuse: tuple[Fusion, ...] = ()) -> ArenaLayout:
    """Pack (name, dtype, shape, kind) at TENSOR_ALIGNMENT offsets; round the size up to `granularity`.

    With `fuse`, each complete group of parts (all present, one dtype, the same trailing
    shape) is placed back to back at its first part's turn and served as one fused row;
    an incomplete group keeps its parts apart (an engine then copies them)."""
    tensors = [(name, dtype, tuple(shape), kind) for name, dtype, shape, kind in tensors]
    groups = _groups(tensors, fuse)
    member = {name: key for key, names in groups.items() for name in names}
    by_name = {t[0]: t for t in tensors}
    slots, fused, offset = [], [], 0
    for name, dtype, shape, kind in tensors:
        key = member.get(name)
        if key is None:
            slots.append(TensorSlot(name, dtype, shape, offset, kind))
            offset = _round_up(offset + slots[-1].nbytes, TENSOR_ALIGNMENT)
            continue
        names = groups.pop(key, None)
        if names is None:  # placed with its group already
            continue
        start = offset
        for part in names:
            _, pdtype, pshape, pkind = by_name[part]
            slots.append(TensorSlot(part, pdtype, pshape, offset, pkind))
            offset += slots[-1].nbytes
        first = by_name[names[0]]
        rows = sum(by_name[n][2][0] for n in names)
        fused.append((TensorSlot(key, first[1], (rows, *first[2][1:]), start, first[3]), tuple(names)))
        offset = _round_up(offset, TENSOR_ALIGNMENT)
    return ArenaLayout(tuple(slots), max(_round_up(offset, granularity), granularity), tuple(fused))


def _groups(tensors: list[tuple[str, DType, tuple[int, ...], str]], fuse: tuple[Fusion, ...]) -> dict[str, list[str]]:
    """fused name -> its parts' names in order, for the groups that can be one tensor."""
    if not fuse:
        return {}
    found: dict[str, dict[str, tuple]] = {}
    for fusion in fuse:
        pattern = fusion.pattern()
        for t in tensors:
            m = pattern.match(t[0])
            if m:
                key = f"{m['prefix']}.{fusion.fused}.{m['leaf']}"
                found.setdefault(key, {})[m["part"]] = (fusion, t)
    out: dict[str, list[str]] = {}
    for key, parts in found.items():
        fusion = next(iter(parts.values()))[0]
        if set(parts) != set(fusion.parts):
            continue
        members = [parts[p][1] for p in fusion.parts]
        if len({(t[1], t[2][1:], t[3]) for t in members}) == 1 and all(len(t[2]) >= 1 for t in members):
            out[key] = [t[0] for t in members]
    return out


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
