"""The reference engine: attach through a real agent, generate over real HTTP, refuse bad input.

Correctness is checked bit for bit: logits computed on weights attached from the agent
must equal those computed on the same checkpoint loaded in-process (`mode="off"`).
"""
from __future__ import annotations

import signal
import socket
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from engine_fixtures import PROMPT, llama_checkpoint, module_supervisor, qwen2_checkpoint, readyz  # noqa: F401
from weightcache_agent import CacheSpec
from weightcache_agent.engine.server import load_model
from weightcache_agent.errors import CheckpointError
from weightcache_agent.load.loader import load_cache
from weightcache_agent.engine.model import Fp8BlockLinear
from weightcache_agent.serve.process_group import http_json


@pytest.fixture(scope="module")
def cluster(module_supervisor, llama_checkpoint, qwen2_checkpoint):  # noqa: F811
    sup = module_supervisor
    llama_agent = sup.start_agent(llama_checkpoint, "llama", backend="cpu")
    qwen_agent = sup.start_agent(qwen2_checkpoint, "qwen", backend="cpu")
    engine = sup.start_engine(llama_checkpoint, "primary", socket=llama_agent.socket, group="g")
    # Started now so that their imports overlap with the rest; their tests come later.
    off = sup.start_engine(llama_checkpoint, "off", mode="off")
    orphan = sup.start_engine(llama_checkpoint, "orphan", socket=sup.run_dir + "/none.sock")
    # Asks for other weights than the agent holds (float16 of a bfloat16 cache) and may fall back: a cache miss.
    miss = sup.start_engine(llama_checkpoint, "miss", socket=llama_agent.socket, extra=["--fallback", "--dtype", "float16"])
    llama_agent.wait_ready()
    qwen_agent.wait_ready()
    engine.wait_state(lambda h: h["ready"], what="readiness")
    return SimpleNamespace(llama=llama_agent, qwen=qwen_agent, engine=engine, off=off, orphan=orphan, miss=miss)


def reference_tokens(model_dir: str, tokens: list[int], max_tokens: int) -> list[int]:
    model, attachment = load_model(CacheSpec(model=model_dir), mode="off")
    assert attachment.source == "disk"
    return model.generate(tokens, max_tokens)


def test_engine_attaches_and_generates(cluster, llama_checkpoint, time_bar):  # noqa: F811
    status, health = cluster.engine.get("/healthz")
    assert status == 200
    assert health["source"] == "agent" and health["role"] == "primary" and health["state"] == "serving"
    time_bar("the engine's attach", health["attach_seconds"], 1.0)
    assert readyz(cluster.engine) == 200
    clients = {c["pid"]: c for c in cluster.llama.status()["clients"]}
    assert clients[cluster.engine.pid]["role"] == "primary"

    status, reply = cluster.engine.generate(PROMPT, 12)
    assert status == 200, reply
    assert len(reply["tokens"]) == 12
    assert reply["tokens"] == reference_tokens(llama_checkpoint, PROMPT, 12)


@pytest.mark.parametrize("which", ["llama", "qwen"])
def test_logits_from_agent_equal_disk_bit_for_bit(cluster, which, llama_checkpoint, qwen2_checkpoint):  # noqa: F811
    model_dir, agent = (llama_checkpoint, cluster.llama) if which == "llama" else (qwen2_checkpoint, cluster.qwen)
    spec = CacheSpec(model=model_dir)
    attached, lease = load_model(spec, mode="client", socket=agent.socket, role="standby", group="bitwise")
    disk, from_disk = load_model(spec, mode="off")
    try:
        assert lease.source == "agent" and from_disk.source == "disk"
        tokens = torch.tensor([PROMPT + list(range(40, 60))])
        with torch.inference_mode():
            a, b = attached(tokens), disk(tokens)
        assert a.shape == (1, len(PROMPT) + 20, 512)
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"max abs diff {float((a - b).abs().max())}"
        if which == "qwen":  # biases present, and one Parameter under both tied names
            assert attached.model.layers[0].self_attn.q_proj.bias is not None
            assert attached.lm_head.weight is attached.model.embed_tokens.weight
            assert "lm_head.weight" not in lease.tensors
    finally:
        lease.close()


BAD_BODIES = [
    (b'{"tokens": [1, 2.5], "max_tokens": 4}', 400, "integers"),
    (b'{"tokens": [1, "2"], "max_tokens": 4}', 400, "integers"),
    (b'{"tokens": [true], "max_tokens": 4}', 400, "integers"),
    (b'{"tokens": [], "max_tokens": 4}', 400, "empty"),
    (b'{"tokens": "1 2 3"}', 400, "list"),
    (b'{"max_tokens": 4}', 400, "list"),
    (b'{"tokens": [1, 512]}', 400, "vocabulary"),
    (b'{"tokens": [-1]}', 400, "vocabulary"),
    (b'{"tokens": [1], "max_tokens": 0}', 400, "max_tokens"),
    (b'{"tokens": [1], "max_tokens": 100000}', 400, "max_tokens"),
    (b'{"tokens": [1], "max_tokens": "8"}', 400, "max_tokens"),
    (b'{"tokens": [1], "temperature": 0.7}', 400, "unknown field"),
    (b'{"tokens": [1, 2, 3], "max_tokens": 254}', 400, "context limit"),  # max_position_embeddings is 256
    (b'[1, 2, 3]', 400, "JSON object"),
    (b'{"tokens": [1, 2', 400, "not valid JSON"),
    (b'\xff\xfe', 400, "not valid JSON"),
    (b'{"tokens": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nests too deeply"),
    (b'{"tokens": [' + b"9" * 5000 + b"]}", 400, "not acceptable JSON"),
]


@pytest.mark.parametrize("body,code,message", BAD_BODIES, ids=[b[2] + str(i) for i, b in enumerate(BAD_BODIES)])
def test_bad_input_is_refused_with_a_message(cluster, body, code, message):
    status, reply = cluster.engine.post("/generate", body)
    assert status == code, reply
    assert message in reply["error"]


def test_engine_http_has_a_read_timeout_and_a_real_backlog():
    from weightcache_agent.engine.server import EngineServer, _Handler

    assert _Handler.timeout is not None and _Handler.timeout <= 60
    assert EngineServer.request_queue_size >= 128


def test_engine_keeps_serving_after_bad_requests(cluster):
    engine = cluster.engine
    _, first = engine.generate(PROMPT, 6)
    for body in [b"", b"garbage", b'{"tokens": [1, 2.5]}', b'{"tokens": [' + b"7," * 300 + b"7]}"]:
        assert 400 <= engine.post("/generate", body)[0] < 500
    assert http_json("GET", engine.url + "/generate")[0] == 405
    assert http_json("POST", engine.url + "/healthz", {})[0] == 405
    assert http_json("GET", engine.url + "/nope")[0] == 404

    # An oversize body and a request without Content-Length, on a raw socket: refused, connection closed.
    with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 411")
    # A client that connects and vanishes mid-request.
    with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"tok")

    status, again = engine.generate(PROMPT, 6)
    assert status == 200 and again["tokens"] == first["tokens"]
    assert engine.alive()


def test_fp8_block_logits_match_in_process_fp8(module_supervisor, llama_checkpoint):  # noqa: F811
    spec = CacheSpec(model=llama_checkpoint, quantization="fp8-block")
    try:
        probe = load_cache(spec, name="weightcache:fp8-probe")
    except CheckpointError as e:
        pytest.skip(f"fp8-block loading is not available in this checkout: {e}")
    probe.arena.close()
    agent = module_supervisor.start_agent(llama_checkpoint, "fp8", extra=["--quantization", "fp8-block"], backend="cpu")
    agent.wait_ready()
    attached, lease = load_model(spec, mode="client", socket=agent.socket)
    disk, _ = load_model(spec, mode="off")
    try:
        proj = attached.model.layers[0].self_attn.q_proj
        assert isinstance(proj, Fp8BlockLinear)
        assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight_scale_inv.dtype == torch.float32
        assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in lease.tensors
        tokens = torch.tensor([PROMPT])
        with torch.inference_mode():
            a, b = attached(tokens), disk(tokens)
            plain, _ = load_model(CacheSpec(model=llama_checkpoint), mode="off")
            c = plain(tokens)
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
        # and it is really quantized: close to the bf16 model, not equal to it
        assert not torch.equal(a, c)
        assert torch.nn.functional.cosine_similarity(a.flatten(), c.flatten(), dim=0) > 0.95
    finally:
        lease.close()


def test_off_mode_engine_serves_from_disk_and_stops_cleanly(cluster, llama_checkpoint):  # noqa: F811
    engine = cluster.off
    health = engine.wait_state(lambda h: h["ready"], what="readiness")
    assert health["source"] == "disk" and health["mode"] == "off"
    status, reply = engine.generate(PROMPT, 5)
    assert status == 200 and reply["tokens"] == reference_tokens(llama_checkpoint, PROMPT, 5)
    engine.kill(signal.SIGTERM)
    assert engine.proc.wait(10) == 0
    assert "shutting down (served 1 requests)" in engine.log()


def test_client_mode_without_agent_fails_with_a_clear_message(cluster):
    engine = cluster.orphan
    assert engine.proc.wait(60) == 1
    assert "no agent answers at" in engine.log()


@pytest.mark.parametrize("quantization", ["none", "fp8-block"])
def test_tensor_parallel_rank_builds_and_attaches_its_shard(qwen2_checkpoint, quantization):  # noqa: F811
    """Each rank's model declares its slice's shapes; the rebind checks them against the loader's slices."""
    full_model, _ = load_model(CacheSpec(model=qwen2_checkpoint), mode="off")
    for rank in range(2):
        spec = CacheSpec(model=qwen2_checkpoint, tp_size=2, tp_rank=rank, quantization=quantization)
        try:
            model, _ = load_model(spec, mode="off")
        except CheckpointError as e:
            pytest.skip(f"this checkout cannot load {quantization} with tp_size=2: {e}")
        attn = model.model.layers[0].self_attn
        assert attn.heads == 2 and attn.kv_heads == 1
        assert tuple(attn.q_proj.weight.shape) == (64, 128) and tuple(attn.o_proj.weight.shape) == (128, 64)
        assert tuple(model.model.embed_tokens.weight.shape) == (256, 128)  # vocab-parallel
        if quantization == "none":  # the rank's rows are exactly its part of the full tensor
            assert torch.equal(attn.k_proj.weight, full_model.model.layers[0].self_attn.k_proj.weight[32 * rank: 32 * (rank + 1)])
        with pytest.raises(NotImplementedError, match="tensor-parallel"):
            model(torch.tensor([PROMPT]))


def test_a_cache_miss_is_logged_counted_and_exposed(cluster):
    engine = cluster.miss
    health = engine.wait_state(lambda h: h["state"] == "serving", what="serving")
    assert health["source"] == "disk"
    assert "FingerprintMismatch" in health["cache_miss"] and "dtype: cache=bfloat16 engine=float16" in health["cache_miss"]
    with urllib.request.urlopen(engine.url + "/metrics", timeout=30) as reply:
        metrics = reply.read().decode()
    assert "\nweightcache_engine_cache_misses_total 1\n" in metrics
    assert 'weightcache_engine_weights_source{source="disk"} 1' in metrics
    _, healthy = cluster.engine.get("/healthz")
    with urllib.request.urlopen(cluster.engine.url + "/metrics", timeout=30) as reply:
        assert "\nweightcache_engine_cache_misses_total 0\n" in reply.read().decode()
    assert healthy["cache_miss"] is None
    assert any("WARNING" in line and "cache miss for tiny-llama" in line and "dtype: cache=bfloat16 engine=float16" in line
               for line in engine.log().splitlines()), engine.log_tail()
    assert cluster.llama.status()["misses"] >= 1
