"""Rebinding a meta-device module onto cache tensors: what succeeds and what is refused."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from weightcache_agent.errors import AttachError
from weightcache_agent.client.rebind import rebind


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.zeros(3))


def meta_tied() -> Tied:
    with torch.device("meta"):
        return Tied()


def cache() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(10, 4, generator=g), "norm.weight": torch.randn(4, generator=g),
            "norm.bias": torch.randn(4, generator=g), "table": torch.arange(3.0)}


def test_tied_weights_are_bound_once_under_every_name():
    m, c = meta_tied(), cache()
    counts = rebind(m, c)
    assert counts == {"parameters": 3, "buffers": 1, "extra": 0}
    assert m.head.weight is m.embed.weight
    assert m.head.weight.data_ptr() == c["embed.weight"].data_ptr()
    assert not m.head.weight.requires_grad
    assert m.table.data_ptr() == c["table"].data_ptr()
    out = m.head(m.norm(m.embed(torch.tensor([1, 2]))))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_extra_cache_tensors_become_buffers_of_their_module():
    m, c = meta_tied(), cache()
    c["head.weight_scale_inv"] = torch.ones(1, 1)
    assert rebind(m, c)["extra"] == 1
    assert "weight_scale_inv" in dict(m.head.named_buffers())
    assert m.head.weight_scale_inv.data_ptr() == c["head.weight_scale_inv"].data_ptr()


def test_missing_tensor_leaves_meta_and_is_refused():
    m, c = meta_tied(), cache()
    del c["norm.bias"]
    with pytest.raises(AttachError, match=r"norm\.bias: still on the meta device"):
        rebind(m, c)


def test_shape_and_dtype_disagreements_are_named():
    m, c = meta_tied(), cache()
    c["norm.weight"] = torch.zeros(5)
    c["norm.bias"] = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(AttachError) as err:
        rebind(m, c)
    assert "norm.weight: model expects (4,) float32, cache holds (5,) float32" in str(err.value)
    assert "norm.bias: model expects (4,) float32, cache holds (4,) float16" in str(err.value)


def test_cache_tensor_without_a_home_is_refused_unless_not_strict():
    c = cache()
    c["decoder.extra"] = torch.zeros(1)
    with pytest.raises(AttachError, match="no submodule 'decoder'"):
        rebind(meta_tied(), c)
    assert rebind(meta_tied(), c, strict=False)["parameters"] == 3


class Loaded(nn.Parameter):
    """A parameter subclass like the ones engines use to carry a loader callback."""


def test_parameters_keep_identity_class_and_attributes():
    m, c = meta_tied(), cache()
    expected = c["norm.weight"].clone()
    m.norm.weight = Loaded(m.norm.weight)  # a subclass on meta, with an attribute an engine hung on it
    m.norm.weight.weight_loader = "mine"
    before = {n: p for n, p in m.named_parameters()}
    rebind(m, c)
    after = dict(m.named_parameters())
    assert all(after[n] is before[n] for n in before)
    assert type(m.norm.weight) is Loaded and m.norm.weight.weight_loader == "mine"
    assert c["norm.weight"] is m.norm.weight and torch.equal(m.norm.weight, expected)


def test_a_refused_attach_swaps_nothing():
    m, c = meta_tied(), cache()
    c["norm.bias"] = torch.zeros(5)
    kept = dict(c)
    with pytest.raises(AttachError, match="norm.bias"):
        rebind(m, c)
    assert all(p.is_meta for p in m.parameters()) and all(b.is_meta for b in m.buffers())
    assert all(c[n] is kept[n] and not c[n].is_meta for n in c)


def test_linear_without_bias_and_a_tie_named_once_take_the_search_path():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    m[1].weight = m[0].weight
    w = torch.randn(4, 4)
    expected = w.clone()
    assert rebind(m, {"0.weight": w})["parameters"] == 1
    assert m[1].weight is m[0].weight and torch.equal(m[1].weight, expected)
    assert w.is_meta  # consumed: its storage now backs the module's own parameter
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    with pytest.raises(AttachError, match=r"1\.weight: still on the meta device"):
        rebind(m, {"0.weight": torch.randn(4, 4)})
