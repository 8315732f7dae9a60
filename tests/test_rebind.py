"""Rebinding a meta-device module onto cache tensors: what succeeds and what is refused."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from weightcache_agent.errors import AttachError
from weightcache_agent.rebind import rebind


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
