"""`prepare()` at engine start, and the phases an attach reports, on the cpu backend."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from agent_fixtures import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), LlamaShape(num_hidden_layers=2))


def test_prepare_then_first_attach_in_a_fresh_process(model, tmp_path):
    """In a new process: prepare() warms the path on an arena of its own (no agent involved), then the
    real attach binds every parameter into the agent's arena and says where its time went."""
    sock = str(tmp_path / "a.sock")
    agent = AgentProcess(model, sock, "--backend", "cpu")
    try:
        agent.wait_ready()
        engine = textwrap.dedent(f"""
            import json, sys, torch
            import weightcache_agent
            from weightcache_agent import CacheSpec, agent_status, attach
            from weightcache_agent.load.checkpoint import open_checkpoint
            from weightcache_agent.testing.synthetic import skeleton_module
            took = weightcache_agent.prepare()
            before = agent_status({sock!r})["attaches"]
            module = skeleton_module({{n: (r.shape, r.dtype) for n, r in open_checkpoint({model!r}).tensors.items()}})
            att = attach(module, CacheSpec(model={model!r}), socket={sock!r})
            params = dict(module.named_parameters())
            print(json.dumps({{"took": sorted(took), "before": before, "phases": att.phases, "seconds": att.seconds,
                              "meta": sum(p.is_meta for p in params.values()), "count": len(params)}}))
            att.close()
        """)
        out = subprocess.run([sys.executable, "-c", engine], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        import json

        result = json.loads(out.stdout.strip().splitlines()[-1])
        # the cpu path always; the GPU's too where the engine process sees one (then the agent's arena is still cpu)
        assert result["took"] == (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
        assert result["before"] == 0, "prepare() must not talk to the agent"
        assert result["meta"] == 0 and result["count"] > 0
        phases = result["phases"]
        assert set(phases) == {"request", "round trip", "map", "bind"}
        assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= result["seconds"]
        assert agent.status()["attaches"] == 1
    finally:
        agent.stop()
