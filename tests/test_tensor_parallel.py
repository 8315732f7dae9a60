"""Tensor parallelism on the cpu backend: real processes, gloo collectives, real sockets.

What a two-GPU node does with NCCL, done here with gloo on two CPU processes: the TP=2
forward equals the TP=1 forward; a TP=2 engine (one process per rank, rank 0 serving
HTTP) answers /generate with the TP=1 greedy tokens; a primary and a standby TP=2 group
on the same node supervisor fail over as whole groups; a second replica of a cache is
filled from the first one's arena, byte for byte, not from the checkpoint.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from agent_fixtures import maps_libtorch
from engine_fixtures import wait_until
from test_supervisor import Node
from weightcache_agent import CacheSpec, agent_status, protocol
from weightcache_agent.client.session import map_arena
from weightcache_agent.engine.server import EngineOptions, load_model
from weightcache_agent.engine.tp_engine import check_tp_options
from weightcache_agent.errors import CheckpointError
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.load.loader import load_cache
from weightcache_agent.serve.process_group import ProcessGroup
from weightcache_agent.testing.synthetic import LlamaShape, llama_tensors, write_checkpoint, write_llama_checkpoint
from weightcache_agent.testing.synthetic_moe import fp8_config, prequantize

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "..", "bench"))  # appended: nothing there shadows a test helper
from tcp_rendezvous import rendezvous  # noqa: E402 (the benchmark's, stdlib only)

# Every TP=2 split falls on the 128 grid of block FP8: q/k/v rows 256 -> 128 per rank, o_proj columns
# 256 -> 128, gate/up rows and down_proj columns 512 -> 256.
SHAPE = LlamaShape(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=512, max_position_embeddings=256)
PROMPT = [1, 17, 42, 255, 3, 99, 7, 300]


@pytest.fixture(scope="module")
def workdir():
    path = tempfile.mkdtemp(prefix="wc-tp-", dir="/tmp")  # short: socket paths are limited to 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def model(workdir) -> str:
    return write_llama_checkpoint(os.path.join(workdir, "model"), SHAPE, seed=1)


def tp1_reference(model: str, quantization: str) -> tuple[torch.Tensor, list[int]]:
    m, att = load_model(CacheSpec(model=model, quantization=quantization), mode="off")
    with torch.inference_mode():
        logits = m(torch.tensor([PROMPT]))
    tokens = m.generate(PROMPT, 6)
    att.close()
    return logits, tokens


def test_tp2_forward_on_gloo_equals_tp1(model, workdir):
    """Rank 1 in its own process, rank 0 in this one, each with its own shard from disk, joined by gloo."""
    from tp_probe import run_rank

    out, init = os.path.join(workdir, "tp2.pt"), rendezvous()
    quants = ("none", "fp8-block")
    peer = subprocess.Popen([sys.executable, os.path.join(HERE, "tp_probe.py"), model, ",".join(quants), "1", "2", init,
                             out], env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        got = run_rank(model, quants, 0, 2, init)
    finally:
        _, err = peer.communicate(timeout=120)
    assert peer.returncode == 0, err[-2000:]
    for quant in quants:
        logits, tokens = tp1_reference(model, quant)
        # bf16 weights and activations: partial sums added in another order differ by a few ulps
        torch.testing.assert_close(got[quant]["logits"], logits, atol=0.08, rtol=0.03)
        assert (got[quant]["logits"] - logits).abs().max() < 0.03 * logits.abs().max()
        assert torch.equal(got[quant]["logits"][0, -1].argmax(), logits[0, -1].argmax())
        assert got[quant]["tokens"] == tokens, quant


def test_tp_engine_options_are_checked():
    opts = dict(model="m", tp_size=2, tp_rank=1, dist_init="tcp://127.0.0.1:29500")
    check_tp_options(EngineOptions(**opts))
    with pytest.raises(ValueError, match="--role auto cannot be used with --tp-size > 1"):
        check_tp_options(EngineOptions(**opts, role="auto"))
    with pytest.raises(ValueError, match="needs --dist-init tcp://HOST:PORT"):
        check_tp_options(EngineOptions(**{**opts, "dist_init": None}))
    with pytest.raises(ValueError, match="must be tcp://HOST:PORT"):
        check_tp_options(EngineOptions(**{**opts, "dist_init": "env://"}))
    with pytest.raises(ValueError, match="--tp-rank 2 is outside"):
        check_tp_options(EngineOptions(**{**opts, "tp_rank": 2}))


def test_fp8_block_straddling_two_ranks_is_refused(workdir):
    """A block-FP8 checkpoint with intermediate 384: 192 rows per rank would split the block of rows 128..255
    and its weight_scale_inv row between the ranks, so TP=2 is refused; TP=1 loads it."""
    shape = LlamaShape(**{**SHAPE.__dict__, "intermediate_size": 384})
    tensors = prequantize(llama_tensors(shape, seed=3))
    ck = write_checkpoint(os.path.join(workdir, "straddle"), tensors, fp8_config(shape.config(torch.bfloat16)))
    with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj.*192 wide.*128-element FP8 block boundary"
                                              r".*straddle ranks"):
        load_cache(CacheSpec(model=ck, tp_size=2, tp_rank=0, quantization="fp8-block"))
    load_cache(CacheSpec(model=ck, quantization="fp8-block")).arena.close()


def test_tp2_groups_fail_over_whole(model, workdir):
    """Primary and standby TP=2 engines on one node supervisor: kill one primary rank, the standby group serves."""
    node = Node(model, os.path.join(workdir, "node"), tp_size=2)
    group = ProcessGroup(os.path.join(workdir, "engines"))
    try:
        status = node.wait(lambda s: s["phase"] == "Ready", "two ready ranks")
        env = {"WEIGHTCACHE_SOCKET_DIR": node.socket_dir, "WEIGHTCACHE_DEVICES": ",".join(status["gpuUUIDs"]),
               "OMP_NUM_THREADS": "1"}
        engines = {}
        # The standby group starts its steps one after another, the primary group overlapped: both must serve.
        for role, start in (("primary", "overlapped"), ("standby", "sequential")):
            init = rendezvous()
            engines[role] = [group.start_engine(model, f"{role}{r}", role=role, group="g",
                                                env={**env, "WEIGHTCACHE_ENGINE_START": start},
                                                extra=["--tp-size", "2", "--tp-rank", str(r), "--dist-init", init])
                             for r in range(2)]
        primary, standby = engines["primary"][0], engines["standby"][0]
        primary.wait_serving(120)
        standby.wait_serving(120)
        # Where each rank 0's start-up went, in the order it happened (seconds since its process started).
        for engine, overlapped in ((primary, True), (standby, False)):
            health = engine.get("/healthz")[1]
            at = health["startup"]
            steps = ["flags checked", "imports done", "device ready", "attached", "ranks said hello",
                     "collectives ready", "serving"]
            assert [at[s] for s in steps] == sorted(at[s] for s in steps) and at["flags checked"] > 0, at
            assert ("local warm-up" in at) == overlapped and "attach path prepared" in at, at
            assert set(health["attach_phases"]) == {"request", "round trip", "map", "bind"}
        wait_until(lambda: "rank 1 start-up (seconds since process start)" in engines["primary"][1].log(), 10)
        assert primary.get("/readyz")[0] == 200 and standby.get("/readyz")[0] == 503
        _, reference = tp1_reference(model, "none")
        code, body = primary.generate(PROMPT, 6)
        assert code == 200 and body["tokens"] == reference

        killed = time.monotonic()
        engines["primary"][1].kill()
        while True:
            code, body = standby.generate(PROMPT, 6)
            if code == 200:
                break
            assert code == 503, body
            assert time.monotonic() - killed < 10, "the standby group did not take over"
            time.sleep(0.002)
        assert body["tokens"] == reference and body["role"] == "primary"
        # The surviving primary rank retired on its own: lease ended, exit status 0.
        wait_until(lambda: not primary.alive(), 10)
        assert primary.proc.returncode == 0 and "retiring: rank 1 left" in primary.log()
        # Each GPU's agent now has exactly one lease: the standby group's rank, as primary.
        standby_pids = {e.pid for e in engines["standby"]}
        for rank in status["ranks"]:
            leases = [(c["pid"], c["role"]) for c in agent_status(rank["socket"])["clients"]]
            assert len(leases) == 1 and leases[0][0] in standby_pids and leases[0][1] == "primary", leases
    finally:
        group.close()
        node.stop()


def arena_bytes(sock: str, spec: CacheSpec) -> torch.Tensor:
    conn = protocol.connect(sock)
    try:
        protocol.send_message(conn, {"type": "attach", "pid": os.getpid(), "role": "primary", "group": None,
                                     "pod": None, "request": engine_request(spec)})
        reply, fds = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
        assert reply["type"] == "manifest", reply
        try:
            return map_arena(reply, fds)[: reply["bytes"]].clone()
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        conn.close()


def test_second_replica_is_copied_from_the_first(model, workdir):
    node = Node(model, os.path.join(workdir, "replicas"), "--replicas", "2", tp_size=1)
    try:
        status = node.wait(lambda s: s["phase"] == "Ready", "two ready replicas")
        first, second = status["ranks"]
        assert (first["filledFrom"], second["filledFrom"]) == ("disk", "peer")
        assert first["fingerprint"] == second["fingerprint"]
        copied, loaded = agent_status(second["socket"]), agent_status(first["socket"])
        assert copied["load_breakdown"]["peer_copy"] > 0
        # The copy took its plan from the first replica's record: no header read, no torch in that process.
        assert (loaded["planned_from"], copied["planned_from"]) == ("checkpoint", "peer")
        assert not maps_libtorch(copied["pid"])
        assert copied["layout_hash"] == loaded["layout_hash"]
        spec = CacheSpec(model=model)
        a, b = arena_bytes(first["socket"], spec), arena_bytes(second["socket"], spec)
        assert a.numel() > 0 and torch.equal(a, b)
    finally:
        node.stop()
