"""Point a meta-device module's parameters and buffers at cache tensors, in place.

Direct assignment into `_parameters` / `_buffers`, resolved through one dict of
submodules, costs a few microseconds per tensor; `load_state_dict(assign=True)` costs
~80x more (DESIGN §3). Tied weights (one Parameter reachable under several names) are
rebound once and assigned under every name. Cache tensors the module does not declare
(e.g. FP8 `weight_scale_inv`) become buffers of the owning submodule. Anything still on
meta afterwards, or a shape/dtype that disagrees, is an `AttachError` listing every case.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .errors import AttachError

_MAX_LISTED = 12


def rebind(module: nn.Module, tensors: dict[str, torch.Tensor], strict: bool = True) -> dict[str, int]:
    """Rebind `module` to `tensors` (name -> tensor). Returns counts per kind."""
    modules = dict(module.named_modules(remove_duplicate=False))
    param_names = _aliases(module.named_parameters(remove_duplicate=False))
    buffer_names = _aliases(module.named_buffers(remove_duplicate=False))
    problems: list[str] = []
    counts = {"parameters": 0, "buffers": 0, "extra": 0}
    claimed: set[str] = set()

    for names in param_names.values():
        source = next((n for n in names if n in tensors), None)
        if source is None:
            continue
        view = tensors[source]
        if _check(source, modules, names, view, problems, is_param=True):
            new = nn.Parameter(view, requires_grad=False)
            for name in names:
                prefix, _, leaf = name.rpartition(".")
                modules[prefix]._parameters[leaf] = new
            counts["parameters"] += 1
        claimed.update(names)

    for names in buffer_names.values():
        source = next((n for n in names if n in tensors), None)
        if source is None:
            continue
        view = tensors[source]
        if _check(source, modules, names, view, problems, is_param=False):
            for name in names:
                prefix, _, leaf = name.rpartition(".")
                modules[prefix]._buffers[leaf] = view
            counts["buffers"] += 1
        claimed.update(names)

    for name, view in tensors.items():
        if name in claimed:
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

    left = [n for n, p in module.named_parameters() if p.is_meta] + [n for n, b in module.named_buffers() if b.is_meta]
    problems += [f"{n}: still on the meta device (not in the cache)" for n in left]
    if problems:
        shown = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise AttachError(f"cannot attach: {shown}{more}")
    return counts


def _aliases(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, tensor in named:
        by_id.setdefault(id(tensor), []).append(name)
    return by_id


def _check(source: str, modules: dict[str, nn.Module], names: list[str], view: torch.Tensor,
           problems: list[str], is_param: bool) -> bool:
    prefix, _, leaf = names[0].rpartition(".")
    current = (modules[prefix]._parameters if is_param else modules[prefix]._buffers)[leaf]
    if current is None:
        return True
    if tuple(current.shape) != tuple(view.shape) or current.dtype != view.dtype:
        problems.append(f"{source}: model expects {tuple(current.shape)} {_dt(current.dtype)}, cache holds "
                        f"{tuple(view.shape)} {_dt(view.dtype)}")
        return False
    return True


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
