"""`prepare()` at engine start, and the phases an attach reports, on the cpu backend."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from agent_fixtures import wait_for
from weightcache_agent.errors import AgentUnavailable
from weightcache_agent.testing.agent_process import AgentProcess
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


def _bound_in(module: torch.nn.Module, base: torch.Tensor) -> bool:
    lo, hi = base.data_ptr(), base.data_ptr() + base.numel()
    return all(lo <= t.data_ptr() < hi for t in module.state_dict().values())


def _checkpoint_tensors(model: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from weightcache_agent.load.checkpoint import open_checkpoint

    files = {r.file for r in open_checkpoint(model).tensors.values()}
    return {n: t.to(dtype) for f in files for n, t in load_file(f).items()}


def test_prepare_with_the_socket_maps_the_arena_and_the_attach_binds_into_that_mapping(model, tmp_path):
    from weightcache_agent import CacheSpec, attach, prepare
    from weightcache_agent.client import mapping
    from weightcache_agent.load.checkpoint import open_checkpoint
    from weightcache_agent.testing.synthetic import skeleton_module

    sock = str(tmp_path / "a.sock")
    with AgentProcess(model, sock, "--backend", "cpu") as agent:
        took = prepare("cpu", socket=sock)
        assert "arena" in took
        (key, base, _), = mapping._premapped.values()
        assert agent.status()["attaches"] == 0, "the arena request is no attach"
        module = skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})
        att = attach(module, CacheSpec(model=model), socket=sock)
        try:
            assert not mapping._premapped, "the attach took the mapping"
            assert att._arenas[0]["id"] == key[0]
            assert _bound_in(module, base), "every tensor lies in the arena mapped at prepare()"
            expected = _checkpoint_tensors(model, torch.bfloat16)
            assert all(torch.equal(t, expected[n]) for n, t in module.state_dict().items())
            assert agent.status()["attaches"] == 1
        finally:
            att.close()


def test_prepare_finds_the_agent_in_the_environment_the_operator_injects(model, tmp_path, monkeypatch):
    """Without `socket`, prepare() maps the arena of the agent the attach will find in the
    environment -- but only where that names one: two devices and no rank map nothing."""
    from weightcache_agent import prepare
    from weightcache_agent.client import mapping
    from weightcache_agent.load.checkpoint import open_checkpoint

    sock = str(tmp_path / "GPU-a.sock")
    shapes = {n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()}
    monkeypatch.setenv("WEIGHTCACHE_SOCKET_DIR", str(tmp_path))
    monkeypatch.setenv("WEIGHTCACHE_DEVICES", "GPU-a,GPU-b")
    with AgentProcess(model, sock, "--backend", "cpu"):
        assert "arena" not in prepare("cpu") and not mapping._premapped, "which rank's agent is unknown"
        assert "arena" in prepare("cpu", rank=0)
        _attach_takes_the_mapping(model, shapes)
        monkeypatch.delenv("WEIGHTCACHE_DEVICES")
        monkeypatch.setenv("WEIGHTCACHE_SOCKET", sock)
        assert "arena" in prepare("cpu")
        _attach_takes_the_mapping(model, shapes)


def _attach_takes_the_mapping(model: str, shapes: dict) -> None:
    from weightcache_agent import CacheSpec, attach
    from weightcache_agent.client import mapping
    from weightcache_agent.testing.synthetic import skeleton_module

    (_, base, _), = mapping._premapped.values()
    module = skeleton_module(shapes)
    att = attach(module, CacheSpec(model=model))  # the socket from the same environment
    try:
        assert not mapping._premapped and _bound_in(module, base), "the attach bound into the mapping made ahead"
    finally:
        att.close()


def test_a_mapping_of_an_arena_since_replaced_is_dropped_and_the_attach_maps_the_new_one(model, tmp_path):
    """The agent restarted between prepare() and attach, now holding other bytes (another dtype):
    the attach must bind the new arena, not the one mapped at prepare()."""
    from weightcache_agent import CacheSpec, attach, prepare
    from weightcache_agent.client import mapping
    from weightcache_agent.load.checkpoint import open_checkpoint
    from weightcache_agent.testing.synthetic import skeleton_module

    sock = str(tmp_path / "a.sock")
    with AgentProcess(model, sock, "--backend", "cpu", "--dtype", "float32"):
        assert "arena" in prepare("cpu", socket=sock)
    (old_key, old_base, _), = mapping._premapped.values()
    old_bytes = old_base.numel()
    del old_base
    with AgentProcess(model, sock, "--backend", "cpu", "--dtype", "bfloat16"):
        shapes = {n: (r.shape, torch.bfloat16) for n, r in open_checkpoint(model).tensors.items()}
        module = skeleton_module(shapes)
        att = attach(module, CacheSpec(model=model, dtype="bfloat16"), socket=sock)
        try:
            assert not mapping._premapped
            assert att._arenas[0]["id"] != old_key[0] and att.bytes < old_bytes
            expected = _checkpoint_tensors(model, torch.bfloat16)
            assert all(torch.equal(t, expected[n]) for n, t in module.state_dict().items())
        finally:
            att.close()


def test_prepare_maps_nothing_where_no_agent_answers_or_it_is_not_ready(model, tmp_path):
    """No agent, or one still waiting to adopt its predecessor's arena: prepare() goes on without
    the arena (the attach maps it), and says so by leaving "arena" out."""
    from weightcache_agent import CacheSpec, attach, prepare
    from weightcache_agent.client import mapping
    from weightcache_agent.load.checkpoint import open_checkpoint
    from weightcache_agent.testing.synthetic import skeleton_module

    sock = str(tmp_path / "a.sock")
    assert "arena" not in prepare("cpu", socket=sock)
    shapes = {n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()}
    first = AgentProcess(model, sock, "--backend", "cpu")
    first.wait_ready()
    att = attach(skeleton_module(shapes), CacheSpec(model=model), socket=sock)
    first.proc.kill()  # its state file still names this engine's lease
    first.proc.wait()
    att.close()  # and this engine will not rejoin: the next agent waits for it in vain
    waiting = AgentProcess(model, sock, "--backend", "cpu", "--adopt-wait", "20")
    try:
        def adopting() -> bool:
            try:
                return waiting.status()["phase"] == "adopting"
            except AgentUnavailable:
                return False

        wait_for(adopting, 10, "the agent waiting for its predecessor's engines")
        assert "arena" not in prepare("cpu", socket=sock)
        assert not mapping._premapped
        assert waiting.status()["phase"] == "adopting", "still waiting: the answer was no"
    finally:
        waiting.stop()


def test_the_lease_watcher_waits_ready_when_the_attach_comes(model, tmp_path):
    """prepare() starts the thread that will watch the attach's lease (starting one inside the
    attach would cost it 0.1-0.3 ms); that thread watches for real -- it sees the agent go -- and
    closing the attachment ends it, while the next idle one is already waiting."""
    from weightcache_agent import CacheSpec, attach, prepare
    from weightcache_agent.client.session import lease_threads
    from weightcache_agent.load.checkpoint import open_checkpoint
    from weightcache_agent.testing.synthetic import skeleton_module

    sock = str(tmp_path / "a.sock")
    agent = AgentProcess(model, sock, "--backend", "cpu")
    try:
        agent.wait_ready()
        prepare("cpu")
        idle = lease_threads._idle
        assert idle is not None and idle.is_alive()
        module = skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})
        att = attach(module, CacheSpec(model=model), socket=sock)
        assert att._watcher is idle
        wait_for(lambda: lease_threads._idle not in (None, idle) and lease_threads._idle.is_alive(), 5,
                 "the next idle watcher")
        agent.stop()
        wait_for(lambda: not att.agent_alive, 10, "the watcher to see the agent go")
        att.close()
        assert not idle.is_alive()
    finally:
        agent.stop()


_ENGINE_STARTING = """
import json, sys, threading, time
import torch
import weightcache_agent
from weightcache_agent import CacheSpec, attach
from weightcache_agent.client import early, mapping, session
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.synthetic import skeleton_module
model = sys.argv[1]
module = skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})
done = early.wait()
out = {"early": None if done is None else {"device": done.device, "took": sorted(done.took), "error": done.error},
       "premapped": len(mapping._premapped), "cuda_initialized": torch.cuda.is_initialized()}
idle = session.lease_threads._idle
att = attach(module, CacheSpec(model=model))
out.update(watcher_was_idle=idle is not None and att._watcher is idle, source=att.source,
           meta=sum(p.is_meta for p in module.parameters()))
if done is not None:
    out["prepare_again"] = weightcache_agent.prepare("cpu")["cpu"] == done.took["cpu"]  # the same figure: not run twice
print(json.dumps(out))
att.close()
"""


def _engine_starting(model: str, env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCACHE_")}
    out = subprocess.run([sys.executable, "-c", _ENGINE_STARTING, model], capture_output=True, text=True, timeout=120,
                         env={**clean, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_engine_whose_environment_names_its_agent_prepares_while_it_starts(model, tmp_path):
    """Nothing called: importing the package after torch, with the agent in the environment (as the
    operator injects it), warms the attach path on the agent's device on a thread while the model is
    built; the attach waits for it and finds its lease watcher started. No arena is held for an
    attach that may never come, and no GPU context is made for an agent that serves no GPU.
    `$WEIGHTCACHE_PREPARE=off` and an environment that names no agent start nothing."""
    sock = str(tmp_path / "a.sock")
    with AgentProcess(model, sock, "--backend", "cpu") as agent:
        started = _engine_starting(model, {"WEIGHTCACHE_SOCKET": sock})
        assert started["early"] == {"device": "cpu", "took": ["cpu"], "error": None}
        assert started["premapped"] == 0 and started["cuda_initialized"] is False
        assert started["watcher_was_idle"] and started["source"] == "agent" and started["meta"] == 0
        assert started["prepare_again"] is True
        off = _engine_starting(model, {"WEIGHTCACHE_SOCKET": sock, "WEIGHTCACHE_PREPARE": "off"})
        assert off["early"] is None and not off["watcher_was_idle"] and off["source"] == "agent"
        assert agent.status()["attaches"] == 2
    unnamed = subprocess.run([sys.executable, "-c", "import torch, weightcache_agent; from weightcache_agent import attach; "
                              "from weightcache_agent.client import early; assert early._current is None"],
                             capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCACHE_")})
    assert unnamed.returncode == 0, unnamed.stderr[-2000:]


def test_preparing_at_start_leaves_our_commands_and_quick_exits_alone(model, tmp_path):
    """`weightcache status` in an engine's environment imports no torch (it never prepares); a process
    that imports the attach path and exits at once exits cleanly; an unknown `$WEIGHTCACHE_PREPARE`
    value is named in a warning and starts nothing."""
    sock = str(tmp_path / "a.sock")
    env = {**os.environ, "WEIGHTCACHE_SOCKET": sock}
    with AgentProcess(model, sock, "--backend", "cpu"):
        status = subprocess.run([sys.executable, "-c", textwrap.dedent("""
            import sys
            from weightcache_agent.cli import main
            code = main(["status", "--json"])
            assert "torch" not in sys.modules, "status imported torch"
            sys.exit(code)
        """)], capture_output=True, text=True, timeout=60, env=env)
        assert status.returncode == 0, status.stderr[-2000:]
        quick = subprocess.run([sys.executable, "-c", "import torch, weightcache_agent; from weightcache_agent import attach"],
                               capture_output=True, text=True, timeout=60, env=env)
        assert quick.returncode == 0 and "Traceback" not in quick.stderr, quick.stderr[-2000:]
        odd = subprocess.run([sys.executable, "-c", textwrap.dedent("""
            import logging, torch
            logging.basicConfig()
            import weightcache_agent
            from weightcache_agent import attach
            from weightcache_agent.client import early
            assert early._current is None
        """)], capture_output=True, text=True, timeout=60, env={**env, "WEIGHTCACHE_PREPARE": "sometimes"})
        assert odd.returncode == 0, odd.stderr[-2000:]
        assert "$WEIGHTCACHE_PREPARE='sometimes' is neither auto nor off" in odd.stderr
