"""Tensor parallelism on two GPUs: NCCL engines, shuffled device orderings, replicas by peer copy.

Skipped without two CUDA GPUs and cuda-bindings; `bench/tp_suite.sh` runs them on a node of
two H200s. The same logic runs on CPUs (gloo, cpu backend) in tests/test_tensor_parallel.py.

Every engine rank here runs with CUDA_VISIBLE_DEVICES in the reverse order of the agent's:
its ordinals point at the other GPU than the agent's, so only the UUID in the socket's
status leads it to the right arena. The tests prove it by content (the rank's weights equal
its slice of the checkpoint) and by the device the weights live on (its UUID).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from test_supervisor import Node
from test_tensor_parallel import PROMPT, rendezvous
from test_tensor_parallel import model, workdir  # noqa: F401 (fixtures: the same checkpoint)
from weightcache_agent import CacheSpec

HERE = os.path.dirname(os.path.abspath(__file__))


def _two_gpus() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


pytestmark = pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs and cuda-bindings")


@pytest.fixture(scope="module")
def nodes(model, workdir):
    """Two node supervisors on both GPUs, TP=2: one serves bf16, one fp8-block (on-load quantization)."""
    started = {q: Node(model, os.path.join(workdir, q), "--quantization", q, tp_size=2, backend="cuda")
               for q in ("none", "fp8-block")}
    try:
        yield {q: n.wait(lambda s: s["phase"] == "Ready", f"{q} ranks ready", timeout=120) | {"node": n}
               for q, n in started.items()}
    finally:
        for n in started.values():
            n.stop()


def reversed_env(status: dict) -> dict:
    order = ",".join(str(i) for i in reversed(range(torch.cuda.device_count())))
    return {**os.environ, "CUDA_VISIBLE_DEVICES": order, "WEIGHTCACHE_SOCKET_DIR": status["socketDir"],
            "WEIGHTCACHE_DEVICES": ",".join(status["gpuUUIDs"]), "NCCL_NVLS_ENABLE": "0"}


RANK_PROBE = textwrap.dedent("""
    import json, sys, torch
    from weightcache_agent import CacheSpec
    from weightcache_agent.arena.devices import cuda_uuid
    from weightcache_agent.client.session import socket_from_env
    from weightcache_agent.engine.server import _prepare_device, load_model
    model, rank = sys.argv[1], int(sys.argv[2])
    spec = CacheSpec(model=model, tp_size=2, tp_rank=rank)
    _prepare_device(socket_from_env(rank))
    m, att = load_model(spec, mode="client")
    disk, _ = load_model(spec, mode="off")
    held = dict(m.named_parameters())
    want = dict(disk.named_parameters())
    same = all(torch.equal(held[n].cpu(), want[n]) for n in want)
    w = held["model.layers.0.self_attn.q_proj.weight"]
    print(json.dumps({"uuid": cuda_uuid(w.device.index), "ordinal": w.device.index, "same": same,
                      "seconds": att.seconds}))
""")


def test_reversed_device_order_maps_each_rank_on_its_own_gpu(model, nodes):
    status = nodes["none"]
    for rank in range(2):
        out = subprocess.run([sys.executable, "-c", RANK_PROBE, model, str(rank)], env=reversed_env(status),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["uuid"] == status["gpuUUIDs"][rank], (rank, got)  # the agent's GPU, by UUID
        assert got["ordinal"] != rank  # ...under a local ordinal the reversal changed
        assert got["same"], f"rank {rank} maps bytes that are not its slice of the checkpoint"


def test_nccl_tp2_logits_equal_tp1(model, nodes, workdir):
    """Both ranks with reversed device orders, attached through their sockets, joined by NCCL."""
    from weightcache_agent.engine.server import load_model

    for quant, status in ((q, nodes[q]) for q in ("none", "fp8-block")):
        out, init = os.path.join(workdir, f"nccl-{quant}.pt"), rendezvous()
        env = reversed_env(status)
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "tp_probe.py"), model, quant, str(rank), "2",
                                   init, out, os.path.join(status["socketDir"], status["gpuUUIDs"][rank] + ".sock")],
                                  env=env, stderr=subprocess.PIPE, text=True) for rank in range(2)]
        for proc in procs:
            _, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
        got = torch.load(out)[quant]
        ref, _ = load_model(CacheSpec(model=model, quantization=quant), mode="off")
        ref = ref.to("cuda:0")
        ref.prepare()
        with torch.inference_mode():
            logits = ref(torch.tensor([PROMPT], device="cuda:0")).cpu()
        torch.testing.assert_close(got["logits"], logits, atol=0.08, rtol=0.03)
        assert got["tokens"] == ref.generate(PROMPT, 6), quant


ARENA_DIGEST = textwrap.dedent("""
    import hashlib, json, sys
    from test_tensor_parallel import arena_bytes
    from weightcache_agent import CacheSpec
    data = arena_bytes(sys.argv[1], CacheSpec(model=sys.argv[2])).cpu().numpy().tobytes()
    print(json.dumps({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
""")


def test_second_replica_on_the_other_gpu_is_a_peer_copy(model, workdir):
    node = Node(model, os.path.join(workdir, "replicas"), tp_size=1, backend="cuda")
    try:
        status = node.wait(lambda s: s["phase"] == "Ready", "two replicas", timeout=120)
        first, second = status["ranks"]
        assert first["device"] != second["device"]
        assert (first["filledFrom"], second["filledFrom"]) == ("disk", "peer")
        # Each arena hashed by a process that sees only its GPU: the comparison needs no context on both.
        digests = []
        for rank in (first, second):
            out = subprocess.run([sys.executable, "-c", ARENA_DIGEST, rank["socket"], model], capture_output=True,
                                 text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": rank["device"],
                                      "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")})
            assert out.returncode == 0, out.stderr[-2000:]
            digests.append(json.loads(out.stdout.strip().splitlines()[-1]))
        assert digests[0]["bytes"] > 0 and digests[0] == digests[1]
    finally:
        node.stop()
