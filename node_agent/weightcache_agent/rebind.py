"""Point a meta-device module's parameters and buffers at cache tensors, in place.

Direct assignment into `_parameters` / `_buffers`, resolved through one dict of
submodules, costs a few microseconds per tensor; `load_state_dict(assign=True)` costs
~80x more (DESIGN §3). Tied weights (one Parameter reachable under several names) are
rebound once and assigned under every name. Cache tensors the module does not declare
(e.g. FP8 `weight_scale_inv`) become buffers of the owning submodule. Anything still on
meta afterwards, or a shape/dtype that disagrees, is an `AttachError` listing every case.
"""
from __future__ import annotations

import gc

import torch
from torch import nn

from .errors import AttachError

_MAX_LISTED = 12


def rebind(module: nn.Module, tensors: dict[str, torch.Tensor], strict: bool = True) -> dict[str, int]:
    """Rebind `module` to `tensors` (name -> tensor). Returns counts per kind."""
    # Thousands of new Parameter objects would trigger full GC passes over the whole model mid-rebind.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _rebind(module, tensors, strict)
    finally:
        if gc_was_enabled:
            gc.enable()


def _rebind(module: nn.Module, tensors: dict[str, torch.Tensor], strict: bool) -> dict[str, int]:
    modules, params, buffers = _slots(module)
    problems: list[str] = []
    counts = {"parameters": 0, "buffers": 0, "extra": 0}
    unbound: list[tuple[str, torch.Tensor]] = []

    for kind, groups in (("parameters", params), ("buffers", buffers)):
        for current, places in groups:
            source, view = places[0][2], None
            for _, _, name in places:
                if name in tensors:
                    source, view = name, tensors[name]
                    break
            if view is None:
                unbound.append((source, current))
                continue
            if current.shape != view.shape or current.dtype != view.dtype:
                problems.append(f"{source}: model expects {tuple(current.shape)} {_dt(current.dtype)}, cache holds "
                                f"{tuple(view.shape)} {_dt(view.dtype)}")
                unbound.append((source, current))
                continue
            # What nn.Parameter(view, requires_grad=False) does for a plain tensor, minus its Python frame.
            new = torch.Tensor._make_subclass(nn.Parameter, view, False) if kind == "parameters" else view
            for table, leaf, _ in places:
                table[leaf] = new
            counts[kind] += 1

    # Cache tensors the module does not declare (e.g. FP8 scales) become buffers of their owner.
    all_bound = counts["parameters"] + counts["buffers"] == len(tensors)  # the usual case: skip the search
    declared = set() if all_bound else {n for g in (params, buffers) for _, places in g for _, _, n in places}
    for name, view in () if all_bound else tensors.items():
        if name in declared:
            continue
        prefix, _, leaf = name.rpartition(".")
        owner = modules.get(prefix)
        if owner is None or hasattr(owner, leaf):
            if strict:
                where = f"no submodule {prefix!r}" if owner is None else f"{prefix or 'the root'} already has an attribute {leaf!r}"
                problems.append(f"{name}: cache tensor has nowhere to go ({where})")
            continue
        owner.register_buffer(leaf, view, persistent=True)
        counts["extra"] += 1

    problems += [f"{name}: still on the meta device (not in the cache)" for name, t in unbound if t.is_meta]
    if problems:
        shown = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise AttachError(f"cannot attach: {shown}{more}")
    return counts


# Where a tensor sits: (its owner's _parameters or _buffers dict, key there, qualified name).
Place = tuple[dict, str, str]
Group = tuple[torch.Tensor, list[Place]]


def _slots(module: nn.Module) -> tuple[dict[str, nn.Module], list[Group], list[Group]]:
    """One walk of the module tree: every submodule by name, and every parameter/buffer with all
    the places it is reachable from (tied weights, shared submodules)."""
    modules: dict[str, nn.Module] = {}
    params: dict[int, Group] = {}
    buffers: dict[int, Group] = {}
    stack = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        modules[prefix] = mod
        dot = prefix + "." if prefix else ""
        table = mod._parameters
        for leaf, tensor in table.items():
            if tensor is not None:
                group = params.get(id(tensor))
                if group is None:
                    params[id(tensor)] = (tensor, [(table, leaf, dot + leaf)])
                else:
                    group[1].append((table, leaf, dot + leaf))
        table = mod._buffers
        for leaf, tensor in table.items():
            if tensor is not None:
                group = buffers.get(id(tensor))
                if group is None:
                    buffers[id(tensor)] = (tensor, [(table, leaf, dot + leaf)])
                else:
                    group[1].append((table, leaf, dot + leaf))
        for name, child in mod._modules.items():
            if child is not None:
                stack.append((dot + name, child))
    return modules, list(params.values()), list(buffers.values())


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
