"""What a model declares but the cache does not hold by name: computed, assembled or cast.

A model built on the meta device can declare three kinds of tensors that no cache tensor
binds one to one:
- non-persistent buffers its constructor computes (RoPE `inv_freq`, ...): no checkpoint
  carries them, so without help every such model is refused;
- places its code fills from several cache tensors (experts fused into one 3-D weight);
- small tensors declared in another float dtype than the cache holds (a bias that a
  quantized layer creates in float32 next to bfloat16 weights).

`bind` wraps `rebind.bind_manifest` when `attach` is given a `Materialize` or
`cast_small=True`:
  1. before: non-persistent meta buffers the manifest does not name, and the places a
     `Materialize` declares, are set aside; cache tensors it claims are held back from the
     bind; each small tensor to cast has its meta placeholder retyped to the cache's dtype;
  2. the bind itself, unchanged: zero-copy, and a missing persistent weight is still
     refused by name;
  3. after: set-aside buffers return as empty tensors on the weights' device (floats full
     of NaN), `Materialize.fill` computes them and its places, and whatever is still on
     meta, or still NaN, is an `AttachError` naming it. Casts are copies of 1-D tensors
     only (biases, norms): large weights are never cast, they stay zero-copy.
The module is left as it was when anything fails before the bind succeeded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from ..errors import AttachError
from ..load.dtypes import torch_dtype
from .rebind import bind_manifest, gc_paused, manifest_views

_swap = torch._C._swap_tensor_impl
_MAX_LISTED = 12
CAST_MAX_DIMS = 1  # biases, norms, per-channel scales: never a weight matrix


@dataclass
class Pending:
    """What `Materialize.fill` is asked to produce, and what it may use."""

    device: torch.device  # where the cache's tensors live
    buffers: list[str]  # non-persistent buffers, already on `device` and empty (floats: NaN)
    places: list[str]  # the places `Materialize.places` named, still on meta
    claimed: dict[str, torch.Tensor]  # cache tensors `Materialize.claim` took, as read-only views


@dataclass
class Materialize:
    """How `attach` completes a model whose cache lacks some of its tensors.

    fill(module, pending): compute `pending.buffers` in place (or re-register them) and
    set every name in `pending.places` (from `pending.claimed`, zero-copy where it can).
    claim(name): True for cache tensors that `fill` consumes instead of the bind.
    places(module, claimed): declared parameters/buffers that `fill` sets (fused experts,
    tensors the checkpoint names differently), given the names `claim` took.
    """

    fill: Callable[[nn.Module, Pending], None]
    claim: Callable[[str], bool] | None = None
    places: Callable[[nn.Module, list[str]], Iterable[str]] | None = None


@dataclass
class Adjust:
    """One attach's options and, afterwards, its report."""

    materialize: Materialize | None = None
    cast_small: bool = False
    computed: list[str] = field(default_factory=list)  # buffers and places filled, not bound
    cast: list[str] = field(default_factory=list)  # "name: cache dtype -> model dtype"

    @classmethod
    def of(cls, materialize: Materialize | Callable[[nn.Module, Pending], None] | None,
           cast_small: bool) -> "Adjust | None":
        if materialize is None and not cast_small:
            return None
        if materialize is not None and not isinstance(materialize, Materialize):
            if not callable(materialize):
                raise TypeError(f"materialize must be a Materialize or a callable, got {type(materialize).__name__}")
            materialize = Materialize(fill=materialize)
        return cls(materialize, cast_small)


def bind(module: nn.Module, base: torch.Tensor, columns: dict[str, list], strict: bool,
         adjust: Adjust | None) -> dict[str, torch.Tensor]:
    """`bind_manifest`, completed by `adjust` (see the module docstring); with None, exactly it."""
    if adjust is None:
        return bind_manifest(module, base, columns, strict)
    with gc_paused():
        return _bind(module, base, columns, strict, adjust)


def _bind(module: nn.Module, base: torch.Tensor, columns: dict[str, list], strict: bool,
          adjust: Adjust) -> dict[str, torch.Tensor]:
    mat = adjust.materialize
    modules = dict(module.named_modules(remove_duplicate=False))
    names = columns["name"]
    if mat is not None and mat.claim is not None:
        keep = [not mat.claim(n) for n in names]
        claimed_cols = _select(columns, [not k for k in keep])
        columns = _select(columns, keep)
        names = columns["name"]
    else:
        claimed_cols = None
    aside, buffers, places = _set_aside(module, modules, mat, set(names), claimed_cols)

    casts, mismatched = _casts(modules, columns)
    if not adjust.cast_small:
        casts = []
    retyped = []
    try:
        for _, table, leaf, _ in aside:
            del table[leaf]
        for name, current, cache_dtype in casts:
            meta = torch.empty(current.shape, dtype=cache_dtype, device="meta")
            _swap(current, meta)  # the placeholder takes the cache's dtype; `meta` holds the model's
            retyped.append((current, meta))
        try:
            tensors = dict(bind_manifest(module, base, columns, strict))
        except AttachError as e:
            if mismatched and not adjust.cast_small:
                shown = ", ".join(mismatched[:_MAX_LISTED]) + (" ..." if len(mismatched) > _MAX_LISTED else "")
                raise AttachError(f"{e}; attach(cast_small=True) would cast the small one(s): {shown}") from None
            raise
    except BaseException:
        for current, meta in retyped:
            _swap(current, meta)
        for _, table, leaf, tensor in aside:
            table[leaf] = tensor
        raise

    device = base.device
    for name, table, leaf, tensor in aside:
        if name in buffers:
            fresh = torch.empty_like(tensor, device=device)
            if fresh.is_floating_point():
                fresh.fill_(float("nan"))  # a buffer that `fill` forgets is caught, not garbage
            table[leaf] = fresh
        else:
            table[leaf] = tensor
    if mat is not None:
        claimed = manifest_views(base, claimed_cols) if claimed_cols is not None else {}
        try:
            mat.fill(module, Pending(device=device, buffers=list(buffers), places=list(places), claimed=claimed))
        except AttachError:
            raise
        except Exception as e:  # the model's own code failed: not a malformed manifest, not a reason to fall back
            raise AttachError(f"cannot attach: materialize failed: {type(e).__name__}: {e}") from e
        _check_filled(modules, buffers, places)
    for (name, current, cache_dtype), (_, meta) in zip(casts, retyped):
        _swap(current, current.detach().to(meta.dtype))
        adjust.cast.append(f"{name}: {_dt(cache_dtype)} -> {_dt(meta.dtype)}")
        tensors[name] = current
    adjust.computed = buffers + places
    return tensors


def _set_aside(module: nn.Module, modules: dict[str, nn.Module], mat: Materialize | None, in_cache: set[str],
               claimed_cols: dict[str, list] | None) -> tuple[list, list[str], list[str]]:
    """What `mat` fills instead of the bind: (aside: (name, table, leaf, tensor), the non-persistent meta
    buffers the cache does not name, the places `mat` declares)."""
    aside: list[tuple[str, dict, str, torch.Tensor]] = []
    buffers: list[str] = []
    if mat is None:
        return aside, buffers, []
    for prefix, owner in modules.items():
        for leaf in owner._non_persistent_buffers_set:
            tensor = owner._buffers.get(leaf)
            name = f"{prefix}.{leaf}" if prefix else leaf
            if tensor is not None and tensor.is_meta and name not in in_cache:
                aside.append((name, owner._buffers, leaf, tensor))
                buffers.append(name)
    claimed_names = claimed_cols["name"] if claimed_cols is not None else []
    places = list(dict.fromkeys(mat.places(module, claimed_names))) if mat.places is not None else []
    places = [name for name in places if name not in buffers]
    for name in places:
        _, table, leaf = _place(modules, name)
        aside.append((name, table, leaf, table[leaf]))
    return aside, buffers, places


def _select(columns: dict[str, list], keep: list[bool]) -> dict[str, list]:
    out = {key: [v for v, k in zip(columns[key], keep) if k] for key in ("name", "offset", "form")}
    out["forms"] = columns["forms"]
    return out


def _place(modules: dict[str, nn.Module], name: str) -> tuple[nn.Module, dict, str]:
    prefix, _, leaf = name.rpartition(".")
    owner = modules.get(prefix)
    if owner is not None:
        for table in (owner._parameters, owner._buffers):
            if table.get(leaf) is not None:
                return owner, table, leaf
    raise AttachError(f"cannot attach: {name}: named by materialize's places, but the model declares no such tensor")


def _casts(modules: dict[str, nn.Module], columns: dict[str, list]) -> tuple[list, list[str]]:
    """Cache tensors whose model place differs only in float dtype and is small enough to copy."""
    forms = columns["forms"]
    casts, names = [], []
    for name, form in zip(columns["name"], columns["form"]):
        dtype_key, shape, _ = forms[form]
        prefix, _, leaf = name.rpartition(".")
        owner = modules.get(prefix)
        if owner is None:
            continue
        current = owner._parameters.get(leaf)
        if current is None:
            current = owner._buffers.get(leaf)
        if current is None or not current.is_meta or tuple(current.shape) != tuple(shape):
            continue
        cache_dtype = torch_dtype(dtype_key)
        if current.dtype == cache_dtype or not (current.is_floating_point() and cache_dtype.is_floating_point):
            continue
        if current.dim() <= CAST_MAX_DIMS:
            casts.append((name, current, cache_dtype))
            names.append(name)
    return casts, names


def _check_filled(modules: dict[str, nn.Module], buffers: list[str], places: list[str]) -> None:
    problems = []
    for name in buffers + places:
        prefix, _, leaf = name.rpartition(".")
        owner = modules[prefix]
        tensor = owner._parameters.get(leaf)
        if tensor is None:
            tensor = owner._buffers.get(leaf)
        if tensor is None or tensor.is_meta:
            problems.append(f"{name}: still on the meta device (materialize did not fill it)")
        elif name in buffers and tensor.is_floating_point() and bool(torch.isnan(tensor).any()):
            problems.append(f"{name}: not computed (materialize left it empty)")
    if problems:
        shown = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise AttachError(f"cannot attach: {shown}{more}")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
