"""One arena, every engine: an agent started with default flags serves engines that name the
checkpoint's tensors (q_proj, k_proj, v_proj, gate_proj, up_proj: the reference engine,
transformers) and engines that name them fused (qkv_proj, gate_up_proj: vLLM, SGLang) at the
same time, each tensor a view of the same bytes: the parts are row blocks of the fused tensor.
vLLM itself attaching beside the reference engine and transformers: tests/test_vllm.py."""
from __future__ import annotations

import re

import pytest
import torch

from weightcache_agent import CacheSpec, attach
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.load.layout import FUSIONS, fuse_columns, lay_out
from weightcache_agent.load.loader import prepare_cache
from weightcache_agent import protocol
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import qwen2_shape, skeleton_module, write_llama_checkpoint

SHAPE = qwen2_shape()  # q/k/v biases too: fused rows of 1-D tensors


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2"), SHAPE)


def fused_names(tensors: dict) -> dict[str, tuple[tuple[int, ...], object]]:
    """The checkpoint's tensors as an engine with fused q|k|v and gate|up declares them."""
    out: dict[str, tuple[tuple[int, ...], object]] = {}
    for name, record in tensors.items():
        for fusion in FUSIONS:
            m = fusion.pattern().match(name)
            if m:
                fused = f"{m['prefix']}.{fusion.fused}.{m['leaf']}"
                shape, dtype = out.get(fused, ((0, *record.shape[1:]), record.dtype))
                out[fused] = ((shape[0] + record.shape[0], *shape[1:]), dtype)
                break
        else:
            out[name] = (tuple(record.shape), record.dtype)
    return out


def byte_offset(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


@pytest.mark.parametrize("tp", [1, 2])
def test_one_default_agent_serves_checkpoint_and_fused_names_from_the_same_bytes(model, tmp_path, tp):
    rank = tp - 1  # TP 2: rank 1, whose q, k, v are the second half of each head group
    # TP 1 passes an earlier version's --layout (accepted, ignored): both namings are served all the same
    flags = ["--tp-size", "2", "--tp-rank", "1"] if tp > 1 else ["--layout", "file"]
    agent = AgentProcess(model, str(tmp_path / "agent.sock"), *flags)
    with agent:
        agent.wait_ready()
        spec = CacheSpec(model=model, tp_size=tp, tp_rank=rank)
        # this rank's shard of every tensor (the agent's own plan): what both engines declare
        planned = {p.name: p for p in prepare_cache(spec).plan}
        checkpoint_module = skeleton_module({n: (p.shape, p.dtype) for n, p in planned.items()})
        fused_module = skeleton_module(fused_names(planned))
        by_name = attach(checkpoint_module, spec, socket=agent.socket)
        fused = attach(fused_module, spec, socket=agent.socket, names="fused")
        try:
            status = agent.status()  # both leases on one arena
            assert len(status["clients"]) == 2 and by_name._arenas == fused._arenas
            assert by_name.bytes == fused.bytes == status["bytes"]
            params = dict(checkpoint_module.named_parameters())
            fparams = dict(fused_module.named_parameters())
            arena = next(iter(params.values())).untyped_storage().nbytes()
            for t in [*params.values(), *fparams.values()]:  # views of the arena, nothing copied
                assert t.untyped_storage().nbytes() == arena
            groups = 0
            for name, tensor in fparams.items():
                if name in params:  # not fused: the same offset and bytes under both namings
                    assert byte_offset(tensor) == byte_offset(params[name]) and torch.equal(tensor, params[name])
                    continue
                parts = _parts(name)
                assert parts, name
                row = 0
                for part in parts:  # each part a row block of the fused view, at its place
                    p = params[part]
                    assert p.is_contiguous()
                    assert byte_offset(p) == byte_offset(tensor) + row * tensor.stride(0) * tensor.element_size()
                    assert torch.equal(tensor[row:row + p.shape[0]], p), part
                    row += p.shape[0]
                assert row == tensor.shape[0]
                groups += 1
            assert groups == SHAPE.num_hidden_layers * (2 + 1)  # qkv weight, qkv bias, gate_up weight per layer
        finally:
            by_name.close()
            fused.close()


def test_an_attach_naming_an_unknown_naming_is_refused_by_name(model, tmp_path):
    with AgentProcess(model, str(tmp_path / "agent.sock")) as agent:
        agent.wait_ready()
        with pytest.raises(ValueError, match="names must be one of checkpoint, fused"):
            attach(skeleton_module({}), CacheSpec(model=model), socket=agent.socket, names="vllm")
        # the agent refuses it too, from a client that does not check: one error reply, the agent serves on
        with protocol.connect(agent.socket) as conn:
            protocol.send_message(conn, {"type": "attach", "pid": 1, "role": "primary", "group": None, "pod": None,
                                         "request": {"spec": CacheSpec(model=model).to_json()}, "names": "x" * 1000})
            reply, _ = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES)
        assert reply["type"] == "error" and "names must be one of checkpoint, fused" in reply["message"]
        assert len(reply["message"]) < 200
        assert agent.status()["phase"] == "ready"


def test_the_fused_manifest_derived_from_a_record_is_the_layouts_own(model):
    """What a restarted agent serves from its record (the checkpoint's rows plus the groups) names
    the same rows at the same offsets as the layout it recorded."""
    records = open_checkpoint(model).tensors
    layout = lay_out((n, r.dtype, tuple(r.shape), "weight") for n, r in records.items())
    assert layout.groups and all(len(parts) in (2, 3) for _, parts in layout.groups)
    direct = layout.to_manifest("fused")
    derived = fuse_columns(layout.to_manifest("checkpoint"), [[f, list(p)] for f, p in layout.groups])

    def rows(columns):
        return {n: (o, columns["forms"][f][0], tuple(columns["forms"][f][1]))
                for n, o, f in zip(columns["name"], columns["offset"], columns["form"])}
    assert rows(direct) == rows(derived)
    # parts not back to back (a forged record) are refused
    broken = layout.to_manifest("checkpoint")
    k = broken["name"].index(layout.groups[0][1][1])
    broken["offset"][k] += 256
    with pytest.raises(ValueError, match="do not lie back to back"):
        fuse_columns(broken, layout.groups)


def _parts(fused_name: str) -> list[str]:
    for fusion in FUSIONS:
        m = re.match(rf"^(?P<prefix>.+)\.{fusion.fused}\.(?P<leaf>\w+)$", fused_name)
        if m:
            return [f"{m['prefix']}.{p}.{m['leaf']}" for p in fusion.parts]
    return []
