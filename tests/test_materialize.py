"""attach(materialize=..., cast_small=...): computed buffers, assembled places, small casts.

A tiny checkpoint on disk, attached in-process (`mode="off"`, the agent's own loader) and
through a real agent process: computed buffers are filled on the weights' device, a
missing persistent weight is still refused by name, forgotten buffers are caught, and
only 1-D tensors are ever cast (and reported); weight matrices stay zero-copy.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from engine_fixtures import short_run_dir
from weightcache_agent import CacheSpec, attach
from weightcache_agent.client.materialize import Materialize, Pending
from weightcache_agent.errors import AttachError
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import write_checkpoint

BF16 = torch.bfloat16


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "proj.weight": torch.randn(16, 8, generator=gen).to(BF16),
        "proj.bias": torch.randn(16, generator=gen).to(BF16),
        "parts.0.weight": torch.randn(4, 8, generator=gen).to(BF16),
        "parts.1.weight": torch.randn(4, 8, generator=gen).to(BF16),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "toy"), tensors(), {"model_type": "toy"})


class Toy(nn.Module):
    """A linear layer, a fused place made of two cache tensors, and two computed buffers."""

    def __init__(self, bias_dtype: torch.dtype = BF16, weight_dtype: torch.dtype = BF16, extra: bool = False):
        super().__init__()
        self.proj = nn.Linear(8, 16, dtype=weight_dtype)
        self.proj.bias = nn.Parameter(torch.empty(16, dtype=bias_dtype))
        self.fused = nn.Parameter(torch.empty(2, 4, 8, dtype=BF16))
        self.register_buffer("table", torch.empty(16, dtype=torch.float32), persistent=False)
        self.register_buffer("steps", torch.empty(4, dtype=torch.long), persistent=False)
        if extra:
            self.scale = nn.Parameter(torch.empty(3, dtype=BF16))  # persistent, in no checkpoint


def build(**kwargs) -> Toy:
    with torch.device("meta"):
        return Toy(**kwargs)


def compute(module: nn.Module, pending: Pending) -> None:
    assert sorted(pending.buffers) == ["steps", "table"]
    module.table.copy_(torch.arange(16, dtype=torch.float32, device=pending.device) / 2)
    module.steps.copy_(torch.arange(4, device=pending.device))
    parts = [pending.claimed[f"parts.{e}.weight"] for e in range(2)]
    module.fused = nn.Parameter(torch.stack(parts), requires_grad=False)


def fused_place(module: nn.Module, claimed: list[str]) -> list[str]:
    assert claimed == ["parts.0.weight", "parts.1.weight"]
    return ["fused"]


FUSE = Materialize(fill=compute, claim=lambda name: name.startswith("parts."), places=fused_place)


def test_computed_buffers_and_assembled_places_fill_what_the_cache_lacks(checkpoint):
    spec = CacheSpec(model=checkpoint)
    with pytest.raises(AttachError, match=r"table: still on the meta device"):
        attach(build(), spec, mode="off")  # without materialize: refused, as before

    model = build()
    att = attach(model, spec, mode="off", materialize=FUSE)
    want = tensors()
    assert torch.equal(model.proj.weight, want["proj.weight"]) and torch.equal(model.proj.bias, want["proj.bias"])
    assert torch.equal(model.table, torch.arange(16) / 2) and model.steps.tolist() == [0, 1, 2, 3]
    assert torch.equal(model.fused, torch.stack([want["parts.0.weight"], want["parts.1.weight"]]))
    assert sorted(att.computed) == ["fused", "steps", "table"] and att.cast == []
    # still non-persistent: a state_dict of the attached model is the checkpoint's names
    assert set(model.state_dict()) == {"proj.weight", "proj.bias", "fused"}
    att.close()


def test_a_missing_persistent_weight_is_still_refused_by_name(checkpoint):
    model = build(extra=True)
    with pytest.raises(AttachError) as err:
        attach(model, CacheSpec(model=checkpoint), mode="off", materialize=FUSE)
    assert "scale: still on the meta device" in str(err.value) and "table" not in str(err.value)
    # nothing half-done: the buffers set aside are back, on meta, and still non-persistent
    assert model.table.is_meta and model.fused.is_meta and "table" in model._non_persistent_buffers_set


def test_a_buffer_that_materialize_forgets_is_named(checkpoint):
    def forgetful(module: nn.Module, pending: Pending) -> None:
        module.steps.zero_()
        module.fused = nn.Parameter(torch.stack(list(pending.claimed.values())), requires_grad=False)

    with pytest.raises(AttachError, match=r"table: not computed \(materialize left it empty\)"):
        attach(build(), CacheSpec(model=checkpoint), mode="off",
               materialize=Materialize(forgetful, FUSE.claim, FUSE.places))

    def failing(module: nn.Module, pending: Pending) -> None:
        raise RuntimeError("rope type 'yarn' is unknown")

    with pytest.raises(AttachError, match=r"materialize failed: RuntimeError: rope type 'yarn' is unknown"):
        attach(build(), CacheSpec(model=checkpoint), mode="off", materialize=Materialize(failing, FUSE.claim, FUSE.places))


def test_small_tensors_are_cast_only_when_asked_and_reported(checkpoint):
    spec = CacheSpec(model=checkpoint)
    with pytest.raises(AttachError) as err:
        attach(build(bias_dtype=torch.float32), spec, mode="off", materialize=FUSE)
    message = str(err.value)
    assert "proj.bias: model expects (16,) float32, cache holds (16,) bfloat16" in message
    assert "attach(cast_small=True) would cast the small one(s): proj.bias" in message

    model = build(bias_dtype=torch.float32)
    att = attach(model, spec, mode="off", materialize=FUSE, cast_small=True)
    assert att.cast == ["proj.bias: bfloat16 -> float32"]
    assert model.proj.bias.dtype == torch.float32 and torch.equal(model.proj.bias, tensors()["proj.bias"].float())
    assert isinstance(model.proj.bias, nn.Parameter)
    # the weight matrix is a view of the arena (the same storage as the fused parts), not a copy
    assert model.proj.weight.dtype == BF16
    assert model.proj.weight.untyped_storage().data_ptr() == att.tensors["proj.weight"].untyped_storage().data_ptr()
    assert model.proj.bias.untyped_storage().data_ptr() != model.proj.weight.untyped_storage().data_ptr()
    att.close()


def test_a_weight_matrix_is_never_cast(checkpoint):
    with pytest.raises(AttachError, match=r"proj.weight: model expects \(16, 8\) float32, cache holds \(16, 8\) bfloat16"):
        attach(build(weight_dtype=torch.float32), CacheSpec(model=checkpoint), mode="off", materialize=FUSE,
               cast_small=True)


def test_through_a_real_agent(checkpoint):
    socket = os.path.join(short_run_dir(), "agent.sock")
    agent = AgentProcess(checkpoint, socket)
    try:
        agent.wait_ready()
        model = build(bias_dtype=torch.float32)
        att = attach(model, CacheSpec(model=checkpoint), socket=socket, materialize=FUSE, cast_small=True)
        assert att.source == "agent" and sorted(att.computed) == ["fused", "steps", "table"]
        assert att.cast == ["proj.bias: bfloat16 -> float32"]
        # the agent may serve GPU memory (backend auto): computed and cast tensors land beside the weights
        device = model.proj.weight.device
        assert model.table.device == model.proj.bias.device == model.fused.device == device
        assert torch.equal(model.proj.weight.cpu(), tensors()["proj.weight"])
        assert torch.equal(model.table.cpu(), torch.arange(16) / 2)
        att.close()
    finally:
        agent.stop()
