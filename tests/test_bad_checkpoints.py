"""Broken checkpoints are refused with the file and tensor named; the agent exits non-zero, serving nothing."""
from __future__ import annotations

import json
import os
import socket
import struct

import pytest

from loader_fixtures import load, read_header, write_raw
from weightcache_agent.errors import CheckpointError, OutOfMemory
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

SHAPE = LlamaShape(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


@pytest.fixture
def model(tmp_path) -> str:
    return write_llama_checkpoint(str(tmp_path / "m"), SHAPE, shards=2)


def shard(model: str, k: int = 2) -> str:
    return os.path.join(model, f"model-0000{k}-of-00002.safetensors")


def last_tensor(path: str) -> str:
    header, _ = read_header(path)
    header.pop("__metadata__", None)
    return max(header, key=lambda n: header[n]["data_offsets"][1])


def test_truncated_shard(model):
    path = shard(model)
    victim = last_tensor(path)
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError) as e:
        load(model)
    assert path in str(e.value) and repr(victim) in str(e.value) and "truncated" in str(e.value)


def test_header_length_beyond_file(model):
    path = shard(model)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(path) + 10))
    with pytest.raises(CheckpointError, match=rf"{path}: not a safetensors file, or truncated: its header length field points beyond the file"):
        load(model)


def test_offsets_out_of_range(model):
    path = shard(model)
    header, data = read_header(path)
    name = last_tensor(path)
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 4096, end + 4096]
    write_raw(path, header, data)
    with pytest.raises(CheckpointError, match=rf"{path}: tensor '{name}': data ends at byte {end + 4096}"):
        load(model)


def test_overlapping_offsets(model):
    path = shard(model)
    header, data = read_header(path)
    meta = header.pop("__metadata__", None)
    names = sorted(header, key=lambda n: header[n]["data_offsets"][0])
    a, b = names[0], names[1]
    size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    header[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0] + size]
    if meta:
        header["__metadata__"] = meta
    write_raw(path, header, data)
    with pytest.raises(CheckpointError, match=rf"{path}: tensors .*'{b}'.* overlap|{path}: tensors '{a}' and .* overlap"):
        load(model)


def test_index_names_missing_shard(model):
    os.remove(shard(model))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: names shard 'model-00002-of-00002"):
        load(model)


def test_tensor_in_index_absent_from_shard(model):
    index_path = os.path.join(model, "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    json.dump(index, open(index_path, "w"))
    with pytest.raises(CheckpointError, match=r"lists tensor 'model\.layers\.9\.mlp\.up_proj\.weight' in shard "
                                              r"'model-00001-of-00002\.safetensors'.*does not contain it"):
        load(model)


def test_unsupported_dtype(model):
    path = shard(model, 1)
    header, data = read_header(path)
    name = next(n for n in header if n != "__metadata__")
    header[name]["dtype"] = "F4"
    write_raw(path, header, data)
    with pytest.raises(CheckpointError, match=rf"{path}: tensor '{name}': unsupported dtype 'F4'"):
        load(model)


def test_config_missing(model):
    os.remove(os.path.join(model, "config.json"))
    load(model)  # one rank needs no plan
    with pytest.raises(CheckpointError, match=r"config\.json: missing, and choosing a sharding preset needs it"):
        load(model, tp_size=2)


def test_config_missing_a_field_the_plan_needs(model):
    path = os.path.join(model, "config.json")
    cfg = json.load(open(path))
    del cfg["num_attention_heads"]
    json.dump(cfg, open(path, "w"))
    with pytest.raises(CheckpointError, match=r"config\.json: has no 'num_attention_heads' field.*'model\.layers\.0\.self_attn\.\w+_proj\.weight' by attention heads"):
        load(model, tp_size=2)


def test_shape_contradicting_config(model):
    path = os.path.join(model, "config.json")
    cfg = json.load(open(path))
    cfg["vocab_size"] = 1000
    json.dump(cfg, open(path, "w"))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.embed_tokens\.weight' has 256 rows.*vocab_size 1000"):
        load(model)


def test_arena_larger_than_memory_is_refused_before_allocating(model, monkeypatch):
    monkeypatch.setenv("WEIGHTCACHE_MEMORY_LIMIT", "64K")
    with pytest.raises(OutOfMemory, match=r"needs \d+ bytes .* but WEIGHTCACHE_MEMORY_LIMIT=64K allows 65536 bytes"):
        load(model)
    monkeypatch.setenv("WEIGHTCACHE_MEMORY_LIMIT", "1G")
    load(model)


def assert_not_served(sock: str) -> None:
    assert not os.path.exists(sock)
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(OSError):
        s.connect(sock)


def test_agent_process_exits_nonzero_on_truncated_shard(model, tmp_path):
    path = shard(model)
    victim = last_tensor(path)
    os.truncate(path, os.path.getsize(path) - 100)
    sock = str(tmp_path / "run" / "agent.sock")
    agent = AgentProcess(model, sock)
    assert agent.proc.wait(60) == 1
    err = agent.stderr()
    assert path in err and repr(victim) in err, err
    assert_not_served(sock)


def test_agent_process_refuses_arena_beyond_memory(model, tmp_path):
    sock = str(tmp_path / "run" / "agent.sock")
    env_before = os.environ.get("WEIGHTCACHE_MEMORY_LIMIT")
    os.environ["WEIGHTCACHE_MEMORY_LIMIT"] = "100K"
    try:
        agent = AgentProcess(model, sock, "--tp-size", "2", "--tp-rank", "1")
    finally:
        if env_before is None:
            del os.environ["WEIGHTCACHE_MEMORY_LIMIT"]
        else:
            os.environ["WEIGHTCACHE_MEMORY_LIMIT"] = env_before
    assert agent.proc.wait(60) == 1
    err = agent.stderr()
    assert model in err and "tp_rank 1/2" in err and "WEIGHTCACHE_MEMORY_LIMIT=100K allows 102400 bytes" in err, err
    assert_not_served(sock)

