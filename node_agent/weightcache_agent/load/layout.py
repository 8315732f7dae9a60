"""Where every tensor lives inside an arena, decided before any data is read.

The loader plans the tensors (name, dtype, shape); `lay_out` packs them at aligned
offsets into one arena and the result travels to engines as the manifest. The layout
hash covers every (name, offset, shape, stride, dtype), so an agent re-adopting an
arena and an engine rebuilding views can both check they agree on every byte.

Every layout also fuses: engines such as vLLM and SGLang run q|k|v as one `qkv_proj` and
gate|up as one `gate_up_proj` (each rank's shards back to back), while the reference engine and
transformers name each part. The parts of each such group are placed back to back with no gap,
so one arena serves both: the manifest an engine asks for names either the checkpoint's
tensors (`to_manifest("checkpoint")`: each part a row block of the fused tensor, contiguous) or
the fused rows in their parts' place (`to_manifest("fused")`). The loader fills the parts by
name (`slots`); the layout hash covers the slots and the groups, so both namings share it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

from .dtypes import BY_NAME, DType, dtype_name

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
        return _contiguous(self.shape)


@dataclass(frozen=True)
class ArenaLayout:
    slots: tuple[TensorSlot, ...]  # what the loader fills, by name
    size: int
    # each fused group: (its name, its parts' names in order); the parts lie back to back
    groups: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @functools.cached_property  # hashes every row: computed once per layout, not per attach
    def layout_hash(self) -> str:
        return hash_rows(self.size, [[s.name, s.offset, list(s.shape), list(s.stride), dtype_name(s.dtype), s.kind]
                                     for s in self.slots], self.groups)

    def to_manifest(self, names: str = "checkpoint") -> dict[str, list]:
        """The rows an engine binds, named as `names` says (see NAMINGS): columns, not one object
        per tensor, and each distinct (dtype, shape, stride) sent once: a model repeats a handful
        of forms thousands of times, and small nested lists are what makes JSON slow to parse
        (2001 tensors: 0.6 ms instead of 3.3)."""
        forms: dict[tuple, int] = {}
        index = [forms.setdefault((dtype_name(s.dtype), s.shape, s.stride), len(forms)) for s in self.slots]
        columns = {
            "name": [s.name for s in self.slots],
            "offset": [s.offset for s in self.slots],
            "form": index,
            "forms": [[dtype, list(shape), list(stride)] for dtype, shape, stride in forms],
        }
        return columns if check_names(names) == "checkpoint" else fuse_columns(columns, self.groups)


# How an engine names what it binds: "checkpoint", each tensor under the checkpoint's own name
# (the reference engine, transformers); "fused", each fused group as one tensor (vLLM, SGLang).
NAMINGS = ("checkpoint", "fused")


def check_names(names: object) -> str:
    if names not in NAMINGS:
        raise ValueError(f"names must be one of {', '.join(NAMINGS)}, got {str(names)[:40]!r}")
    return names  # type: ignore[return-value]


def hash_rows(size: int, rows: list[list[Any]], groups: Iterable[tuple[str, Iterable[str]]]) -> str:
    """The layout hash of an arena of `size` bytes holding `rows` of [name, offset, shape, stride, dtype, kind],
    with `groups` ([fused name, [part names]]) served as one tensor each."""
    groups = [[fused, list(parts)] for fused, parts in groups]
    return hashlib.sha256(json.dumps([size, rows, groups], separators=(",", ":")).encode()).hexdigest()[:16]


def fuse_columns(columns: dict[str, list], groups: Iterable[tuple[str, Iterable[str]]]) -> dict[str, list]:
    """The "fused" manifest from the "checkpoint" one: each group's parts, which lie back to back
    in order, give way to one contiguous row at the first part's place. Raises ValueError when
    they do not lie that way (a record that is not what its layout wrote)."""
    at = {name: i for i, name in enumerate(columns["name"])}
    forms = [[dtype, list(shape), list(stride)] for dtype, shape, stride in columns["forms"]]
    known = {(dtype, tuple(shape), tuple(stride)): i for i, (dtype, shape, stride) in enumerate(forms)}
    replaced: dict[int, tuple[str, int, int]] = {}
    skipped: set[int] = set()
    for fused, parts in groups:
        rows = [at[p] for p in parts]
        dtype, shape, _ = forms[columns["form"][rows[0]]]
        offset, total = columns["offset"][rows[0]], 0
        for r in rows:
            pdtype, pshape, pstride = forms[columns["form"][r]]
            if pdtype != dtype or pshape[1:] != shape[1:] or list(pstride) != list(_contiguous(pshape)) \
                    or columns["offset"][r] != offset + total * math.prod(shape[1:]) * BY_NAME[dtype].itemsize:
                raise ValueError(f"{fused}: its parts do not lie back to back in the arena")
            total += pshape[0]
        fused_shape = (total, *shape[1:])
        form = known.setdefault((dtype, fused_shape, _contiguous(fused_shape)), len(known))
        if form == len(forms):
            forms.append([dtype, list(fused_shape), list(_contiguous(fused_shape))])
        replaced[rows[0]] = (fused, offset, form)
        skipped.update(rows[1:])
    out: dict[str, list] = {"name": [], "offset": [], "form": [], "forms": forms}
    for i, name in enumerate(columns["name"]):
        if i in skipped:
            continue
        name, offset, form = replaced.get(i, (name, columns["offset"][i], columns["form"][i]))
        out["name"].append(name)
        out["offset"].append(offset)
        out["form"].append(form)
    return out


def _contiguous(shape: Iterable[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class Fusion:
    """Parts that an engine runs as one tensor: `<prefix>.<part>.<leaf>` for each part, in order,
    served as `<prefix>.<fused>.<leaf>` (rows stacked along dim 0)."""

    fused: str
    parts: tuple[str, ...]

    def pattern(self) -> re.Pattern[str]:
        alternatives = "|".join(re.escape(p) for p in self.parts)
        return re.compile(rf"^(?P<prefix>.+)\.(?P<part>{alternatives})\.(?P<leaf>weight|bias|weight_scale_inv)$")


# vLLM's and SGLang's `packed_modules_mapping` for the Llama family (Llama, Mistral, Qwen2/3).
FUSIONS = (Fusion("qkv_proj", ("q_proj", "k_proj", "v_proj")), Fusion("gate_up_proj", ("gate_proj", "up_proj")))


def lay_out(tensors: Iterable[tuple[str, DType, tuple[int, ...], str]], granularity: int = 4096,
            fuse: tuple[Fusion, ...] = FUSIONS) -> ArenaLayout:
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
        for part in names:
            _, pdtype, pshape, pkind = by_name[part]
            slots.append(TensorSlot(part, pdtype, pshape, offset, pkind))
            offset += slots[-1].nbytes
        fused.append((key, tuple(names)))
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
