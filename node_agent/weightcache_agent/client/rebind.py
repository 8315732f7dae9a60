"""Point a meta-device module's parameters and buffers at cache tensors, in place.

Each declared tensor keeps its identity: the module's own `Parameter` (or buffer) object
takes over the cache tensor's storage (`torch._C._swap_tensor_impl`, the primitive under
`torch.utils.swap_tensors`), so tied weights, parameter subclasses and attributes engines
hang on parameters (e.g. a `weight_loader`) all survive, and nothing is reassigned. The
swap itself costs well under a microsecond; a whole bind costs ~5 us per tensor, most of it
torch creating the view, where `load_state_dict(assign=True)` costs ~90 us (DESIGN §3).

`rebind` consumes the tensors it is given: afterwards `tensors[name]` is the module's own
object for that name, and the tensor object passed in is an empty husk. Cache tensors the
module does not declare (e.g. FP8 `weight_scale_inv`) become buffers of the owning
submodule. Anything still on meta afterwards, or a shape/dtype that disagrees, is an
`AttachError` listing every case; on such an error nothing has been swapped.

`bind_manifest` is the attach path: it builds the views from the manifest's rows (packed,
as the agent sends them, or JSON columns) and binds them in one pass, in C where the
optional `_bindfast` extension was built, falling back to the Python path for anything the
C loop does not handle itself (errors, tensors it cannot place) -- same results either way.
Where `weightcache build-native` compiled the torch-native row binder for the running torch
(`native_build`), the C loop hands it each row: the module's tensor takes its place in the
arena inside torch, with no view object made.
The C loop's walk of the module tree (`survey`) needs no manifest: `attach` takes it while
the agent prepares its answer.
"""
from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Mapping
from typing import Callable, Iterator

import torch
from torch import nn

from ..load.dtypes import torch_dtype
from ..packed_rows import PackedRows, columns_of
from ..errors import AttachError

from . import native_build

try:
    from . import _bindfast
except ImportError:  # built without a C compiler: the Python path does the same work
    _bindfast = None
# An escape hatch, and a way to compare the paths: "0" binds in Python, "c" in C without the
# torch-native row binder.
_NATIVE = os.environ.get("WEIGHTCACHE_NATIVE_BIND", "1")
if _NATIVE == "0":
    _bindfast = None
_torch_rows = native_build.load() if _bindfast is not None and _NATIVE != "c" else None

_MAX_LISTED = 12
_swap = torch._C._swap_tensor_impl
# Views made below autograd's view tracking cost half as much (~1 us less each); weights
# need no autograd history, and every bound tensor is a plain tensor on the arena's storage.
_untracked_views = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", contextlib.nullcontext)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Thousands of new tensor objects would trigger full GC passes over the whole model (~100 ms)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def survey(module: nn.Module) -> object | None:
    """What the C bind needs to know of `module` before any manifest: every parameter and
    buffer by qualified name, and how many distinct tensors they are. It depends on the module
    alone, so `attach` takes it while the agent prepares its answer; a module changed after it
    must be surveyed again. None without the C extension."""
    if _bindfast is None:
        return None
    with gc_paused():
        return _bindfast.survey(module)


def bind_manifest(module: nn.Module, base: torch.Tensor, rows: dict[str, list] | PackedRows, strict: bool = True,
                  native: bool = True, surveyed: object | None = None,
                  before_swap: Callable[[], None] | None = None) -> Mapping[str, torch.Tensor]:
    """Views of the uint8 arena `base` per manifest row, bound into `module`; returns name -> the
    tensor now bound. `rows`: columns (`ArenaLayout.to_manifest`) or packed (`PackedRows`).
    `surveyed`: `survey(module)`, taken since nothing changed the module. `before_swap` is called
    once every row has checked out, before the module takes the first view (what it raises,
    nothing swapped). Malformed rows raise ValueError, TypeError, KeyError or IndexError; a
    module that does not fit raises `AttachError`."""
    with gc_paused(), _untracked_views():
        forms = _forms(base, rows.forms if isinstance(rows, PackedRows) else rows["forms"])
        if native and _bindfast is not None:
            packed = rows if isinstance(rows, PackedRows) else PackedRows.from_columns(rows)
            done = _bindfast.bind(module, surveyed, packed.data, packed.count, forms, _swap, before_swap,
                                  _torch_rows)
            if done is not None:
                bound, extras = done
                for owner, leaf, row in extras:
                    owner.register_buffer(leaf, bound[row], persistent=True)
                return BoundTensors(packed, bound)
        columns = columns_of(rows)
        tensors = _views(forms, columns)
        _rebind(module, tensors, strict, before_swap)
        return tensors


class BoundTensors(Mapping[str, torch.Tensor]):
    """Name -> bound tensor, from the packed rows and the tensors bound per row. The names are
    made into strs on first use: an attach needs none of them."""

    def __init__(self, rows: PackedRows, bound: list[torch.Tensor]):
        self._rows, self._bound, self._by_name = rows, bound, None

    def _table(self) -> dict[str, torch.Tensor]:
        if self._by_name is None:
            self._by_name = dict(zip(self._rows.names(), self._bound))
        return self._by_name

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def manifest_views(base: torch.Tensor, columns: dict[str, list]) -> dict[str, torch.Tensor]:
    """One strided view of the uint8 arena `base` per manifest row, unbound."""
    return _views(_forms(base, columns["forms"]), columns)


def _views(forms: list[tuple], columns: dict[str, list]) -> dict[str, torch.Tensor]:
    views = {}
    for name, form, offset in zip(columns["name"], columns["form"], columns["offset"], strict=True):
        as_strided, shape, stride, itemsize = forms[form][:4]
        start, misaligned = divmod(offset, itemsize)
        if misaligned:
            raise ValueError(f"tensor {name!r} at offset {offset} is not aligned to its elements")
        views[name] = as_strided(shape, stride, start)
    return views


def _forms(base: torch.Tensor, forms: list) -> list[tuple]:
    """(as_strided of `base` viewed as the form's dtype, shape, stride, itemsize, dtype, extent,
    limit, `base` viewed as the form's dtype) per form: a tensor of the form spans `extent`
    elements, the arena holds `limit`. The C bind checks each row against these before it makes
    any view; as_strided itself (and the torch-native row binder) refuses a view that reaches
    past the arena."""
    typed: dict[str, torch.Tensor] = {}
    out = []
    for dtype_key, shape, stride in forms:
        whole = typed.get(dtype_key)
        if whole is None:
            whole = typed[dtype_key] = base.view(torch_dtype(dtype_key))
        shape, stride, limit = tuple(shape), tuple(stride), whole.numel()
        if len(shape) != len(stride) or not all(type(v) is int and 0 <= v < 2**62 for v in shape + stride):
            extent = limit + 1  # no row fits: the Python path has torch name the problem
        elif 0 in shape:
            extent = 0
        else:
            extent = min(1 + sum((d - 1) * s for d, s in zip(shape, stride)), limit + 1)
        out.append((whole.as_strided, shape, stride, whole.element_size(), whole.dtype, extent, limit, whole))
    return out


def rebind(module: nn.Module, tensors: dict[str, torch.Tensor], strict: bool = True) -> dict[str, int]:
    """Rebind `module` to `tensors` (name -> tensor). Returns counts per kind."""
    with gc_paused():
        return _rebind(module, tensors, strict)


def _rebind(module: nn.Module, tensors: dict[str, torch.Tensor], strict: bool,
            before_swap: Callable[[], None] | None = None) -> dict[str, int]:
    modules, tables, places = _walk(module)
    problems: list[str] = []
    targets: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, module's tensor, cache tensor)
    extras: list[tuple[nn.Module, str, str]] = []
    seen: set[int] = set()
    counts = {"parameters": 0, "buffers": 0, "extra": 0}
    covered = 0  # declared places named by the cache
    for name, view in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        owner = modules.get(prefix)
        if owner is None:
            if strict:
                problems.append(f"{name}: cache tensor has nowhere to go (no submodule {prefix!r})")
            continue
        current = owner._parameters.get(leaf)
        kind = "parameters"
        if current is None:
            current, kind = owner._buffers.get(leaf), "buffers"
            if current is None:
                if leaf in owner._parameters or leaf in owner._buffers or hasattr(owner, leaf):
                    if strict:
                        problems.append(f"{name}: cache tensor has nowhere to go "
                                        f"({prefix or 'the root'} already has an attribute {leaf!r})")
                else:
                    extras.append((owner, leaf, name))
                continue
        covered += 1
        if id(current) in seen:  # a tied tensor the cache also holds under another name: bound once
            continue
        if current.shape != view.shape or current.dtype != view.dtype:
            problems.append(f"{name}: model expects {tuple(current.shape)} {_dt(current.dtype)}, cache holds "
                            f"{tuple(view.shape)} {_dt(view.dtype)}")
            continue
        seen.add(id(current))
        targets.append((name, current, view))
        counts[kind] += 1

    # Where the cache named every declared place, nothing can stay on meta: skip the search
    # (it runs where a table holds None, e.g. nn.Linear(bias=False), or a tie is named once).
    if covered != places:
        problems += _left_on_meta(modules, tables, seen)
    if problems:
        shown = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        raise AttachError(f"cannot attach: {shown}{more}")

    if before_swap is not None:
        before_swap()
    for name, current, view in targets:
        _swap(current, view)
        tensors[name] = current
    for owner, leaf, name in extras:
        owner.register_buffer(leaf, tensors[name], persistent=True)
    counts["extra"] = len(extras)
    return counts


def _walk(module: nn.Module) -> tuple[dict[str, nn.Module], list[tuple[str, dict]], int]:
    """One walk of the module tree: every submodule by qualified name, every non-empty
    `_parameters` / `_buffers` table with its owner's name prefix, and how many entries they hold."""
    modules = {"": module}
    order = [("", module)]
    tables = []
    places = 0
    for prefix, mod in order:  # grows while it is walked
        dot = prefix + "." if prefix else ""
        for table in (mod._parameters, mod._buffers):
            if table:
                tables.append((dot, table))
                places += len(table)
        for name, child in mod._modules.items():
            if child is not None:
                modules[dot + name] = child
                order.append((dot + name, child))
    return modules, tables, places


COMPUTED_HINT = ("non-persistent buffers are computed by the model, never saved: attach with materialize= (a function "
                 "that computes them, see weightcache_agent.client.materialize), or load a Hugging Face model with "
                 "weightcache_agent.integrations.transformers.from_cache, which computes them as transformers does")


def _left_on_meta(modules: dict[str, nn.Module], tables: list[tuple[str, dict]], bound: set[int]) -> list[str]:
    """A meta tensor no cache tensor was aimed at, named once even where it is tied; a non-persistent
    buffer (one no checkpoint holds, e.g. RoPE's inv_freq) said to be one, with how to fill it."""
    named: set[int] = set()
    problems, computed = [], False
    for dot, table in tables:
        owner = modules[dot[:-1]]
        for leaf, tensor in table.items():
            if tensor is not None and tensor.is_meta and id(tensor) not in bound and id(tensor) not in named:
                named.add(id(tensor))
                if table is owner._buffers and leaf in owner._non_persistent_buffers_set:
                    computed = True
                    problems.append(f"{dot}{leaf}: still on the meta device (a non-persistent buffer)")
                else:
                    problems.append(f"{dot}{leaf}: still on the meta device (not in the cache)")
    if computed:  # the fix goes first: the list after it may be cut short
        problems.insert(0, COMPUTED_HINT)
    return problems


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
