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
import signal
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
from weightcache_agent.errors import CheckpointError, WeightCacheError
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.load.loader import load_cache
from weightcache_agent.serve.process_group import ProcessGroup
from weightcache_agent.testing.synthetic import LlamaShape, llama_tensors, write_checkpoint, write_llama_checkpoint
from weightcache_agent.testing.synthetic_moe import fp8_config, prequantize

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "..", "bench"))  # appended: nothing there shadows a test helper
from weightcache_agent.engine.launch import free_rendezvous as rendezvous  # noqa: E402 (torch-free)

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
    check_tp_options(EngineOptions(**opts, role="auto"))  # the ranks' agents decide the role together
    assert EngineOptions(**opts).engine == "tcp://127.0.0.1:29500"  # one id on every rank of the engine
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
    """Primary and standby TP=2 engines (role auto; the standby's ranks started by the one-command
    launcher, as in a pod) on one node supervisor: kill -9 every process of the primary, and both ranks
    promote the standby engine -- not, on rank 1, an older standby attached on that
    rank only, which each rank deciding alone would pick."""
    node = Node(model, os.path.join(workdir, "node"), tp_size=2)
    group = ProcessGroup(os.path.join(workdir, "engines"))
    partial = None
    try:
        status = node.wait(lambda s: s["phase"] == "Ready", "two ready ranks")
        sockets = [rank["socket"] for rank in status["ranks"]]
        env = {"WEIGHTCACHE_SOCKET_DIR": node.socket_dir, "WEIGHTCACHE_DEVICES": ",".join(status["gpuUUIDs"]),
               "OMP_NUM_THREADS": "1"}
        # The primary: one process per rank, started by hand, its steps overlapped.
        init = rendezvous()
        names = {init: "primary", "standby": "standby", "partial": "partial"}
        ranks = [group.start_engine(model, f"primary{r}", role="auto", group="g", env=env,
                                    extra=["--tp-size", "2", "--tp-rank", str(r), "--dist-init", init])
                 for r in range(2)]
        primary = ranks[0]
        primary.wait_serving(120)
        # An older standby on rank 1 alone: never complete, so never the one promoted.
        partial = standby_lease(sockets[1], CacheSpec(model=model, tp_size=2, tp_rank=1), "g", "partial")
        # The standby: as in a pod, one command starts both ranks (their steps one after another).
        standby = group.start_engine(model, "standby", role="auto", group="g", extra=["--tp-size", "2"],
                                     env={**env, "WEIGHTCACHE_ENGINE_START": "sequential",
                                          "WEIGHTCACHE_ENGINE_ID": "standby"})
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
        wait_until(lambda: "rank 1 start-up (seconds since process start)" in ranks[1].log(), 10)
        # Only rank 0's agent decides for the replica; an engine id that is no id is refused, saying what.
        with pytest.raises(WeightCacheError, match="goes to rank 0's agent"):
            protocol.agent_request(sockets[1], {"type": "group_claim", "group": "g", "engine": "x"})
        with pytest.raises(WeightCacheError, match="engine must be null or an id"):
            standby_lease(sockets[0], CacheSpec(model=model, tp_size=2, tp_rank=0), "g", "../x")
        # Role auto, decided for the whole engine: the first engine is primary on both ranks.
        assert primary.get("/readyz")[0] == 200 and standby.get("/readyz")[0] == 503
        assert roles(sockets, "g", names) == [{"primary": ["primary"], "standby": ["standby"]},
                                       {"primary": ["primary"], "standby": ["standby"], "partial": ["standby"]}]
        _, reference = tp1_reference(model, "none")
        code, body = primary.generate(PROMPT, 6)
        assert code == 200 and body["tokens"] == reference

        killed = time.monotonic()
        for rank in ranks:
            rank.kill()  # SIGKILL
        while True:
            code, body = standby.generate(PROMPT, 6)
            if code == 200:
                break
            assert code == 503, body
            assert time.monotonic() - killed < 10, "the standby engine did not take over"
            time.sleep(0.002)
        serving = time.monotonic() - killed
        assert body["tokens"] == reference and body["role"] == "primary"
        # The moment it serves, the standby engine is the one primary on every rank (the switch demoted
        # whatever a rank still held as primary); the partial standby stays one.
        now = roles(sockets, "g", names)
        assert [sorted(name for name, held in rank.items() if "primary" in held) for rank in now] == [["standby"]] * 2
        assert now[1]["partial"] == ["standby"], now
        # The killed engine's leases go as each rank's agent reads its connection's end: rank 1's may
        # not have by the time rank 0's promotion serves, as the agents read their sockets independently.
        expected = [{"standby": ["primary"]}, {"standby": ["primary"], "partial": ["standby"]}]
        wait_until(lambda: roles(sockets, "g", names) == expected, 10, interval=0.05)
        logged = node.log()
        assert "is primary on all 2 ranks in" in logged, logged[-3000:]
        print(f"\nTP=2 group promotion: kill -9 of the primary's 2 processes -> standby engine serving in "
              f"{serving * 1e3:.0f} ms")
        assert serving < 5.0, serving
        # The launcher keeps its ranks together: SIGTERM stops both, cleanly.
        standby.kill(signal.SIGTERM)
        assert standby.proc.wait(60) == 0, standby.log_tail()
        wait_until(lambda: not any(lease["group"] == "g" and lease["engine"] == "standby"
                                   for sock in sockets for lease in agent_status(sock)["clients"]), 10)
    finally:
        if partial is not None:
            partial.close()
        group.close()
        node.stop()


def standby_lease(sock: str, spec: CacheSpec, group: str, engine: str) -> "socket.socket":
    """A standby lease of engine `engine` held by this process on one rank's agent (the connection is the lease)."""
    conn = protocol.connect(sock)
    protocol.send_message(conn, {"type": "attach", "pid": os.getpid(), "role": "standby", "group": group,
                                 "pod": None, "engine": engine, "request": engine_request(spec)})
    reply, fds = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
    for fd in fds:
        os.close(fd)
    protocol.raise_on_error(reply, sock)
    assert reply["type"] == "manifest" and reply["role"] == "standby", reply
    return conn


def roles(sockets: list[str], group: str, names: dict[str, str]) -> list[dict[str, list[str]]]:
    """Per rank: each engine of `group` (by its name in `names`, keyed by engine id) -> its leases' roles."""
    out = []
    for sock in sockets:
        by_engine: dict[str, list[str]] = {}
        for lease in agent_status(sock)["clients"]:
            if lease["group"] == group:
                by_engine.setdefault(names.get(lease["engine"], lease["engine"]), []).append(lease["role"])
        out.append(by_engine)
    return out


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
