"""Binding a module from manifest columns: the C extension and the Python path agree on every case.

The C loop handles the common case itself and hands anything unusual to the Python path,
which names the problems; either way the module ends up the same, or nothing is swapped.
"""
from __future__ import annotations

import glob
import importlib.machinery
import os
import shutil
import sysconfig
import weakref

import pytest
import torch
from torch import nn

from bind_fixtures import native, nothing_swapped  # noqa: F401 (native: a fixture)
from weightcache_agent.errors import AttachError
from weightcache_agent.load.layout import lay_out
from weightcache_agent.client import rebind
from weightcache_agent.client.rebind import _bindfast, bind_manifest, survey



class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=False)  # holds bias=None: the search for leftovers runs
        self.norm = nn.LayerNorm(4)
        self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))


class Model(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([Block() for _ in range(layers)])
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def meta_model(layers: int = 2) -> Model:
    with torch.device("meta"):
        return Model(layers)


def arena(extra: dict[str, torch.Tensor] | None = None, drop: tuple[str, ...] = (), layers: int = 2,
          order=None) -> tuple[torch.Tensor, dict, dict]:
    """A uint8 arena holding the Model's tensors (tied head named once) in manifest order,
    or in the order `order` sorts their names."""
    g = torch.Generator().manual_seed(1)
    values = {n: (torch.randn(t.shape, generator=g) * 10).to(t.dtype) for n, t in meta_model(layers).state_dict().items()
              if n != "head.weight" and n not in drop}
    values.update(extra or {})
    names = sorted(values, key=order) if order else list(values)
    layout = lay_out([(n, values[n].dtype, tuple(values[n].shape), "weight") for n in names])
    base = torch.zeros(layout.size, dtype=torch.uint8)
    for slot in layout.slots:
        base[slot.offset:slot.offset + slot.nbytes].copy_(values[slot.name].contiguous().view(-1).view(torch.uint8))
    return base, layout.to_manifest(), values


def test_the_extensions_are_built_where_a_compiler_exists():
    from weightcache_agent.load import fp8

    if not (shutil.which("cc") or shutil.which("gcc")) or not os.path.exists(
            os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no C compiler or Python headers here: the pure-Python paths serve")
    for name, module, beside in (("_bindfast", _bindfast, rebind.__file__), ("_fp8cpu", fp8._fp8cpu, fp8.__file__)):
        # Which builds are there, and which one this interpreter would load: a build for another
        # Python (or none at all, e.g. on a machine that started bare) reads the same from here.
        found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(os.path.dirname(beside), name + ".*")))
        assert module is not None, (f"setup.py's optional {name} is not importable: this Python loads "
                                    f"*{importlib.machinery.EXTENSION_SUFFIXES[0]}, beside it: {found}; build it with "
                                    "`python3 setup.py build_ext --inplace` (or see the pip install log)")


def test_every_tensor_is_bound_in_place_to_the_arena(native):
    base, columns, values = arena()
    m = meta_model()
    before = dict(m.named_parameters(remove_duplicate=False))
    tensors = bind_manifest(m, base, columns, native=native)
    assert all(p is before[n] for n, p in m.named_parameters(remove_duplicate=False))
    assert m.head.weight is m.embed.weight
    lo, hi = base.data_ptr(), base.data_ptr() + base.numel()
    for name, t in m.state_dict().items():
        expected = values["embed.weight" if name == "head.weight" else name]
        assert torch.equal(t, expected) and lo <= t.data_ptr() < hi, name
    assert all(tensors[n] is t for n, t in m.state_dict(keep_vars=True).items() if n in tensors)


def test_undeclared_tensors_become_buffers(native):
    base, columns, values = arena({"layers.0.proj.weight_scale_inv": torch.ones(1, 1)})
    m = meta_model()
    bind_manifest(m, base, columns, native=native)
    assert torch.equal(m.layers[0].proj.weight_scale_inv, torch.ones(1, 1))
    assert "layers.0.proj.weight_scale_inv" in m.state_dict()


@pytest.mark.parametrize("case,message", [
    ("missing", r"layers\.1\.norm\.bias: still on the meta device"),
    ("shape", r"layers\.0\.norm\.weight: model expects \(4,\) float32, cache holds \(5,\) float32"),
    ("dtype", r"layers\.0\.steps: model expects \(2,\) int64, cache holds \(2,\) int32"),
    ("homeless", r"decoder\.x: cache tensor has nowhere to go \(no submodule 'decoder'\)"),
    ("collision", r"layers\.0\.proj\.in_features: cache tensor has nowhere to go"),
])
def test_refusals_name_the_tensor_and_swap_nothing(native, case, message):
    extra = {"shape": {"layers.0.norm.weight": torch.zeros(5)}, "dtype": {"layers.0.steps": torch.zeros(2, dtype=torch.int32)},
             "homeless": {"decoder.x": torch.zeros(1)}, "collision": {"layers.0.proj.in_features": torch.zeros(1)}}.get(case)
    base, columns, _ = arena(extra, drop=("layers.1.norm.bias",) if case == "missing" else ())
    m = meta_model()
    with pytest.raises(AttachError, match=message):
        bind_manifest(m, base, columns, native=native)
    assert nothing_swapped(m)


def test_malformed_columns_are_refused(native):
    base, columns, _ = arena()
    for broken in ({**columns, "form": [len(columns["forms"])] * len(columns["name"])},
                   {**columns, "offset": [o + 1 for o in columns["offset"]]},
                   {**columns, "offset": columns["offset"][:-1]},
                   {**columns, "offset": [2 ** 40] * len(columns["name"])},
                   {**columns, "forms": [[d, shape, [-1] * len(stride)] for d, shape, stride in columns["forms"]]},
                   {**columns, "forms": [[d, shape, stride + [1]] for d, shape, stride in columns["forms"]]},
                   {**columns, "forms": [[d, shape + [2 ** 63], stride + [1]] for d, shape, stride in columns["forms"]]},
                   {**columns, "forms": columns["forms"][:-1] + [[d, [float(x) for x in shape], stride]
                                                                 for d, shape, stride in columns["forms"][-1:]]}):
        m = meta_model()
        with pytest.raises((ValueError, IndexError, TypeError, RuntimeError)):
            bind_manifest(m, base, broken, native=native)
        assert nothing_swapped(m)


def test_rows_in_runs_and_out_of_them_each_get_their_own_bytes(native):
    """The C loop makes like rows of evenly spaced layers a run at a time; layers out of
    order (the arena holds layer 3 last) break the runs, and every row still gets its bytes."""
    base, columns, values = arena(layers=9, order=lambda name: name.startswith("layers.3."))
    m = meta_model(layers=9)
    bind_manifest(m, base, columns, native=native)
    for name, t in m.state_dict().items():
        assert torch.equal(t, values["embed.weight" if name == "head.weight" else name]), name
    assert len({t.data_ptr() for t in m.state_dict().values()}) == len(values)


def test_the_c_bind_drops_each_runs_views_before_it_makes_the_next(monkeypatch):
    """A bind makes and swaps a run of views at a time, so later runs reuse the memory earlier
    ones held (views made all at once cost a first attach a page fault per ~10 rows)."""
    if _bindfast is None:
        pytest.skip("C extension not built")
    base, columns, values = arena(layers=40)
    m = meta_model(layers=40)
    husks: list[weakref.ref] = []
    alive: list[int] = []

    def swap(current: torch.Tensor, view: torch.Tensor) -> None:
        alive.append(sum(h() is not None for h in husks))
        husks.append(weakref.ref(view))
        torch._C._swap_tensor_impl(current, view)

    monkeypatch.setattr(rebind, "_swap", swap)
    monkeypatch.setattr(rebind, "_torch_rows", None)  # the C bind's own views
    bind_manifest(m, base, columns)
    assert len(alive) == len(values) == 1 + 40 * 4
    assert max(alive) <= 40, alive  # one run: the same tensor of every layer
    assert all(torch.equal(t, values["embed.weight" if n == "head.weight" else n]) for n, t in m.state_dict().items())


def test_a_run_that_reaches_past_the_arena_is_refused_and_swaps_nothing(native):
    base, columns, _ = arena(layers=9)
    m = meta_model(layers=9)
    with pytest.raises(RuntimeError, match="out of bounds"):
        bind_manifest(m, base[:columns["offset"][-2]].clone(), columns, native=native)
    assert nothing_swapped(m)


def test_before_swap_runs_once_every_row_checked_out_and_its_error_swaps_nothing(native):
    """What the cuda mapping waits on (its access, granted meanwhile) runs before the first swap."""
    base, columns, values = arena()
    m = meta_model()
    seen = []

    def refuse() -> None:
        seen.append(nothing_swapped(m))
        raise OSError("access refused")

    with pytest.raises(OSError, match="access refused"):
        bind_manifest(m, base, columns, native=native, before_swap=refuse)
    assert seen == [True]
    assert nothing_swapped(m)
    bind_manifest(m, base, columns, native=native, before_swap=lambda: seen.append("ok"))
    assert seen == [True, "ok"] and torch.equal(m.layers[1].norm.weight, values["layers.1.norm.weight"])


def test_a_survey_taken_before_the_reply_binds_the_same_and_a_later_change_is_still_found():
    if _bindfast is None:
        pytest.skip("C extension not built")
    base, columns, values = arena({"layers.0.proj.extra": torch.ones(3)})
    m = meta_model()
    surveyed = survey(m)
    with torch.device("meta"):  # declared after the survey: the C loop hands the module to the Python path
        m.layers[0].proj.register_parameter("extra", nn.Parameter(torch.empty(3)))
    bind_manifest(m, base, columns, surveyed=surveyed)
    assert torch.equal(m.layers[0].proj.extra, torch.ones(3))
    assert not any(t.is_meta for t in m.state_dict().values())

    m = meta_model()
    bind_manifest(m, base, {**columns, "name": [n.replace(".extra", ".bonus") for n in columns["name"]]},
                  surveyed=survey(m))
    assert torch.equal(m.layers[0].proj.bonus, torch.ones(3)) and "layers.0.proj.bonus" in m.state_dict()


def test_modules_nested_deeper_than_the_c_walk_goes_bind_through_the_python_path():
    class Chain(nn.Module):
        def __init__(self, depth: int) -> None:
            super().__init__()
            self.inner = Chain(depth - 1) if depth else None
            self.weight = nn.Parameter(torch.empty(2))

    with torch.device("meta"):
        m = Chain(80)
    names = [name for name, _ in m.named_parameters()]
    layout = lay_out([(n, torch.float32, (2,), "weight") for n in names])
    base = torch.arange(layout.size, dtype=torch.uint8)
    tensors = bind_manifest(m, base, layout.to_manifest())
    deepest = m
    while deepest.inner is not None:
        deepest = deepest.inner
    assert len(tensors) == 81 and not deepest.weight.is_meta
    assert deepest.weight.data_ptr() == base.data_ptr() + layout.slots[-1].offset


def test_a_row_named_twice_does_not_hide_a_tensor_left_out(native):
    """Whether anything stays on meta is decided by distinct tensors bound, not rows counted."""
    base, columns, _ = arena(drop=("layers.1.norm.bias",))
    twice = {**columns, **{k: columns[k] + columns[k][:1] for k in ("name", "offset", "form")}}
    m = meta_model()
    with pytest.raises(AttachError, match=r"layers\.1\.norm\.bias: still on the meta device"):
        bind_manifest(m, base, twice, native=native)
    assert nothing_swapped(m)


def test_names_that_are_no_utf8_bind_or_are_refused_as_any_other(native):
    """A lone surrogate (JSON allows one) in rows the module does not declare: as a leaf it is a
    new buffer like any other; as a submodule nothing is named so."""
    base, columns, _ = arena({"layers.0.proj.\ud800": torch.ones(1)})
    m = meta_model()
    bind_manifest(m, base, columns, native=native)
    assert torch.equal(m.layers[0].proj.get_buffer("\ud800"), torch.ones(1))
    base, columns, _ = arena({"decoder\ud800.x": torch.zeros(1)})
    m = meta_model()
    with pytest.raises(AttachError, match="nowhere to go"):
        bind_manifest(m, base, columns, native=native)
    assert nothing_swapped(m)


def test_a_module_built_under_inference_mode_binds_on_every_path(native):
    """Inference tensors cannot take a normal tensor's place in torch: the row binder declines
    them and the C bind does those rows its own way, with the same result."""
    base = torch.arange(64, dtype=torch.float32).view(torch.uint8)
    columns = {"name": ["weight", "bias"], "offset": [0, 64], "form": [0, 1],
               "forms": [["float32", [2, 8], [8, 1]], ["float32", [2], [1]]]}
    with torch.inference_mode():
        m = nn.Linear(8, 2, device="meta")
    assert m.weight.is_inference()
    bind_manifest(m, base, columns, native=native)
    assert torch.equal(m.weight, torch.arange(16, dtype=torch.float32).view(2, 8))
    assert m.bias.tolist() == [16.0, 17.0] and m.weight.data_ptr() == base.data_ptr()
