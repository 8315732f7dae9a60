"""The fingerprint covers the weights' bytes, not only their headers: real agents, real files.

A checkpoint author (or whoever can write the model directory) tries three things:

- replace the checkpoint in place (`os.replace` of new files with identical headers) while an
  agent serves the old arena: an engine naming the new files must get a named miss;
- hand the engine other weights under identical headers (a copy elsewhere with other bytes):
  a miss, not the agent's arena;
- swap the files while the agent loads them: the load is refused, never an arena mixing two
  checkpoints.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from weightcache_agent import CacheSpec, attach
from weightcache_agent.arena.cpu import new_cpu_arena
from weightcache_agent.errors import CheckpointError, FingerprintMismatch
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.load.loader import fill_cache, prepare_cache
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint

SHAPE = LlamaShape(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256)


def meta_module(model: str) -> torch.nn.Module:
    return skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})


def headers(model: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            with open(os.path.join(model, name), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                out[name] = f.read(n)
    return out


@pytest.fixture
def models(tmp_path):
    """Two checkpoints with byte-identical headers and different weights."""
    a = write_llama_checkpoint(str(tmp_path / "a"), SHAPE, seed=0, shards=2)
    b = write_llama_checkpoint(str(tmp_path / "b"), SHAPE, seed=1, shards=2)
    assert headers(a) == headers(b)
    return a, b


def replace_in_place(model: str, other: str) -> None:
    for name in sorted(os.listdir(other)):
        staged = os.path.join(model, f".{name}.new")
        shutil.copyfile(os.path.join(other, name), staged)
        os.replace(staged, os.path.join(model, name))


def test_checkpoint_replaced_in_place_is_a_named_miss(models, tmp_path):
    a, b = models
    with AgentProcess(a, str(tmp_path / "run" / "agent.sock")) as agent:
        served = attach(meta_module(a), CacheSpec(model=a), socket=agent.socket)
        served.close()
        replace_in_place(a, b)  # same names, same headers, other weights
        with pytest.raises(FingerprintMismatch) as e:
            attach(meta_module(a), CacheSpec(model=a), socket=agent.socket)
        assert "files" in e.value.differences, str(e.value)
        assert "replaced or rewritten since the agent loaded them" in str(e.value)
        assert agent.status()["misses"] >= 1


def test_other_weights_under_identical_headers_are_a_miss(models, tmp_path):
    a, b = models
    with AgentProcess(a, str(tmp_path / "run" / "agent.sock")) as agent:
        with pytest.raises(FingerprintMismatch) as e:
            attach(meta_module(b), CacheSpec(model=b), socket=agent.socket)
        assert "content" in e.value.differences, str(e.value)
        # A faithful copy of the agent's checkpoint elsewhere (other inodes, same bytes) still attaches.
        copy = shutil.copytree(a, str(tmp_path / "copy"))
        attached = attach(meta_module(copy), CacheSpec(model=copy), socket=agent.socket)
        assert attached.source == "agent"
        attached.close()


def test_checkpoint_swapped_during_a_load_is_refused_not_mixed(models):
    a, b = models
    prepared = prepare_cache(CacheSpec(model=a))  # headers read and planned: the load has begun
    replace_in_place(a, b)
    arena = new_cpu_arena(prepared.layout.size, prepared.spec, "swap")
    with pytest.raises(CheckpointError, match="changed while they were being loaded"):
        fill_cache(prepared, arena)
