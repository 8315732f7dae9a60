"""Agent + client over real sockets between real processes (cpu backend)."""
from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from agent_fixtures import Probe, fd_count, map_count, maps_libtorch, open_files, wait_for
from weightcache_agent import CacheSpec, FingerprintMismatch, UnsupportedQuantization, agent_status, attach
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.errors import AgentUnavailable, WeightCacheError
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint

SHAPE = LlamaShape(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=8192)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-llama"), SHAPE)


@pytest.fixture
def agent(model, tmp_path):
    proc = AgentProcess(model, str(tmp_path / "sock" / "agent.sock"), "--handshake-timeout", "1")
    proc.wait_ready()
    yield proc
    proc.stop()


def meta_module(model: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    return skeleton_module({n: (r.shape, dtype or r.dtype) for n, r in open_checkpoint(model).tensors.items()})


def test_two_engines_share_one_arena_zero_copy(model, agent):
    a, b = Probe(model, agent.socket), Probe(model, agent.socket)
    try:
        assert a.hello["source"] == b.hello["source"] == "agent"
        assert {c["pid"] for c in agent.status()["clients"]} == {a.hello["pid"], b.hello["pid"]}
        size = a.hello["bytes"]
        assert size > 32 * 2**20
        ta, tb = a.ask("touch"), b.ask("touch")
        for t in (ta, tb):
            assert t["inside_memfd"], "a parameter does not point into the shared mapping"
            assert t["read_only"]
            assert t["rss_anon_growth"] < 0.1 * size, f"engine copied weights: anon RSS grew {t['rss_anon_growth']} bytes"
        assert ta["checksum"] == tb["checksum"]
        assert a.ask("verify") == {"identical": True}
        assert b.ask("verify") == {"identical": True}
    finally:
        a.close()
        b.close()


def test_write_faults_in_the_writer_only_and_the_memfd_is_sealed(model, agent):
    writer, reader = Probe(model, agent.socket), Probe(model, agent.socket)
    try:
        assert reader.ask("map-writable")["writable_map"] is False
        assert writer.ask("write") == {"writing": True}
        assert writer.proc.wait(10) == -signal.SIGSEGV
        assert reader.ask("verify") == {"identical": True}
        assert [c["pid"] for c in agent.status()["clients"]] == [reader.hello["pid"]]
    finally:
        writer.close()
        reader.close()


def test_engine_keeps_correct_weights_after_agent_sigkill(model, agent):
    probe = Probe(model, agent.socket)
    try:
        agent.proc.kill()
        agent.proc.wait()
        assert probe.ask("verify") == {"identical": True}
        assert probe.ask("status")["agent_alive"] is False
        assert probe.ask("touch")["inside_memfd"]
    finally:
        probe.close()


@pytest.mark.parametrize("overrides,expected", [
    ({"dtype": "float16"}, {"dtype": ("bfloat16", "float16")}),
    ({"tp_size": 2, "tp_rank": 1}, {"tp_size": (1, 2), "tp_rank": (0, 1), "sharding": None}),
    ({"quantization": "fp8-block"}, {"quantization": ("none", "fp8-block"), "quantization_config": None}),
    ({"expert_parallel": True}, {"expert_parallel": (False, True)}),
    ({"sharding": "llama"}, {"sharding": None}),
])
def test_fingerprint_mismatch_names_each_field(model, agent, overrides, expected):
    with pytest.raises(FingerprintMismatch) as err:
        attach(meta_module(model), CacheSpec(model=model, **overrides), socket=agent.socket)
    assert set(err.value.differences) == set(expected)
    for field, values in expected.items():
        if values is not None:
            assert f"{field}: cache={values[0]} engine={values[1]}" in str(err.value)
    assert agent.status()["clients"] == []


def test_fingerprint_is_content_identity_not_path(model, agent, tmp_path):
    same = shutil.copytree(model, tmp_path / "copy" / os.path.basename(model))
    attach(meta_module(str(same)), CacheSpec(model=str(same)), socket=agent.socket).close()  # same bytes, other path
    changed = write_llama_checkpoint(str(tmp_path / "other" / os.path.basename(model)), SHAPE, seed=0, shards=2)
    with pytest.raises(FingerprintMismatch, match=r"content: cache=\w+ engine=\w+") as err:
        attach(meta_module(changed), CacheSpec(model=changed), socket=agent.socket)
    assert set(err.value.differences) == {"content"}
    renamed = shutil.copytree(model, tmp_path / "qwen-7b")  # the name is no part of the identity
    with attach(meta_module(str(renamed)), CacheSpec(model=str(renamed)), socket=agent.socket) as att:
        assert att.source == "agent"


def test_fallback_loads_from_disk_on_mismatch_or_missing_agent(model, agent, tmp_path):
    module = meta_module(model, torch.float16)
    att = attach(module, CacheSpec(model=model, dtype="float16"), socket=agent.socket, fallback=True)
    assert att.source == "disk"
    disk = load_file(os.path.join(model, "model.safetensors"))
    params = dict(module.named_parameters())
    assert all(torch.equal(disk[n].half(), params[n].cpu()) for n in disk)
    with pytest.raises(AgentUnavailable, match="no agent answers"):
        attach(meta_module(model), CacheSpec(model=model), socket=str(tmp_path / "none.sock"))
    assert attach(meta_module(model), CacheSpec(model=model), socket=str(tmp_path / "none.sock"), fallback=True).source == "disk"


@pytest.mark.parametrize("method", ["fp8-per-tensor", "marlin", "awq", "gptq", "int3-magic"])
def test_refused_quantization_methods(model, tmp_path, method):
    sock = str(tmp_path / "q.sock")
    proc = subprocess.run([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", sock,
                           "--quantization", method], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"quantization method {method!r} is refused" in proc.stderr
    assert "wrong numbers silently" in proc.stderr
    assert not os.path.exists(sock)
    with pytest.raises(UnsupportedQuantization, match=method):
        CacheSpec(model=model, quantization=method)


def test_off_mode_matches_disk_bit_for_bit(model):
    module = meta_module(model)
    att = attach(module, CacheSpec(model=model), mode="off")
    assert att.source == "disk"
    disk = load_file(os.path.join(model, "model.safetensors"))
    params = dict(module.named_parameters())
    assert all(torch.equal(disk[n], params[n].cpu()) for n in disk)


def test_daemon_mode_starts_one_agent_and_reuses_it(model, tmp_path):
    sock = str(tmp_path / "d" / "agent.sock")
    try:
        first = attach(meta_module(model), CacheSpec(model=model), socket=sock, mode="daemon", timeout=60)
        assert first.source == "agent"
        second = attach(meta_module(model), CacheSpec(model=model), socket=sock, mode="daemon", timeout=60)
        assert len(agent_status(sock)["clients"]) == 2
        second.close()
        first.close()
    finally:  # the daemon agent runs in its own session: stop it whatever happened above
        try:
            os.kill(agent_status(sock)["pid"], signal.SIGTERM)
        except (WeightCacheError, ProcessLookupError):
            pass


def test_status_cli_json_and_text(model, agent):
    probe = Probe(model, agent.socket)
    try:
        out = subprocess.run([sys.executable, "-m", "weightcache_agent", "status", "--socket", agent.socket, "--json"],
                             capture_output=True, text=True, check=True).stdout
        status = json.loads(out)
        assert {"fingerprint", "bytes", "tensors", "clients", "backend", "load_seconds", "model"} <= set(status)
        assert status["tensors"] == len(open_checkpoint(model).tensors)
        assert status["bytes"] == open_checkpoint(model).nbytes
        assert [c["pid"] for c in status["clients"]] == [probe.hello["pid"]]
        assert status["clients"][0]["role"] == "primary" and status["clients"][0]["attached_at"] > 0
        text = subprocess.run([sys.executable, "-m", "weightcache_agent", "status", "--socket", agent.socket],
                              capture_output=True, text=True, check=True).stdout
        assert status["fingerprint"] in text and str(probe.hello["pid"]) in text
    finally:
        probe.close()


def test_sigterm_removes_socket_and_a_second_agent_is_refused(model, tmp_path):
    sock = str(tmp_path / "one.sock")
    first = AgentProcess(model, sock)
    first.wait_ready()
    second = subprocess.run([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", sock],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 3 and "already serving" in second.stderr
    assert first.status()["phase"] == "ready"
    assert first.stop() == 0
    assert not os.path.exists(sock)


def test_attach_detach_cycles_leak_nothing(model, agent):
    pid = agent.proc.pid
    spec = CacheSpec(model=model)
    attach(meta_module(model), spec, socket=agent.socket).close()  # warm up lazily created state
    gc.collect()
    fds, maps, own_fds = open_files(pid), map_count(pid), fd_count(os.getpid())
    for _ in range(200):
        attach(meta_module(model), spec, socket=agent.socket).close()

    gc.collect()
    assert agent.status()["clients"] == []
    # The agent closes a connection on its own thread after the client hangs up: let it settle.
    wait_for(lambda: not open_files(pid) - fds, 5, "the agent back at the fds it had")
    assert map_count(pid) <= maps + 4  # thread stacks may be cached by glibc, never one mapping per attach
    assert fd_count(os.getpid()) <= own_fds


def test_agent_refuses_to_serve_a_bad_spec(model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket",
                           str(tmp_path / "s.sock"), "--tp-size", "2", "--tp-rank", "2"], capture_output=True, text=True)
    assert proc.returncode == 2 and "tp_rank must be in [0, 2)" in proc.stderr


def test_error_reply_is_a_weightcache_error(model, agent):
    primary = attach(meta_module(model), CacheSpec(model=model), socket=agent.socket, group="g")
    try:
        with pytest.raises(WeightCacheError, match="already has a primary"):
            attach(meta_module(model), CacheSpec(model=model), socket=agent.socket, group="g")
    finally:
        primary.close()


def _niceness(pid: int) -> set[int]:
    """The niceness of every thread of `pid` (field 19 of each task's stat)."""
    values = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                values.add(int(f.read().rsplit(")", 1)[1].split()[16]))
        except FileNotFoundError:  # a client's thread that ended meanwhile
            pass
    return values


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root (CAP_SYS_NICE)")
def test_the_agent_and_every_thread_of_it_run_at_the_raised_priority(model, tmp_path):
    with AgentProcess(model, str(tmp_path / "nice.sock"), "--nice", "-3") as agent:
        probe = Probe(model, agent.socket)  # a client's thread, started after the priority was set
        try:
            assert len(os.listdir(f"/proc/{agent.proc.pid}/task")) > 2
            assert _niceness(agent.proc.pid) == {-3}
        finally:
            probe.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root (CAP_SYS_NICE)")
def test_load_threads_give_up_the_agents_raised_priority():
    """A load is bulk work: its threads run at nice 0 while the agent's others stay raised."""
    code = (
        "import os, threading\n"
        "from weightcache_agent.load.reading import at_normal_priority\n"
        "os.setpriority(os.PRIO_PROCESS, 0, -3)\n"
        "seen = {}\n"
        "def load():\n"
        "    at_normal_priority()\n"
        "    seen['load'] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())\n"
        "def serve():\n"
        "    seen['serve'] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())\n"
        "for target in (load, serve):\n"
        "    t = threading.Thread(target=target); t.start(); t.join()\n"
        "print(seen['load'], seen['serve'], os.getpriority(os.PRIO_PROCESS, 0))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "-3", "-3"]


def test_status_answers_with_the_last_reading_while_a_new_one_is_slow():
    import threading
    import time

    from weightcache_agent.serve.agent import Sampled

    readings, slow = iter([1, 2]), threading.Event()

    def read() -> int:
        if slow.is_set():
            time.sleep(0.5)  # the driver busy with engines mapping arenas
        return next(readings)

    sampled = Sampled(read, ttl=0.05)
    assert sampled.get() == 1  # the first reading is waited for
    slow.set()
    time.sleep(0.1)
    t0 = time.monotonic()
    assert sampled.get() == 1 and sampled.get() == 1  # stale: answered at once, one refresh started
    assert time.monotonic() - t0 < 0.4  # not the 0.5 s the reading takes, whatever the machine's load
    wait_for(lambda: sampled.get() == 2, what="the background reading")


@pytest.mark.parametrize("quant,dtype,needs_torch", [("none", "auto", False), ("fp8-block", "auto", False),
                                                     ("none", "float16", True)])
def test_a_cold_load_imports_torch_only_for_a_cast(model, tmp_path, quant, dtype, needs_torch):
    """Bytes as they are and bf16 -> FP8 (the C quantizer) need no torch: the agent fills from its
    first second. A cast runs in torch, imported for it."""
    with AgentProcess(model, str(tmp_path / "cold.sock"), "--quantization", quant, "--dtype", dtype) as agent:
        assert maps_libtorch(agent.proc.pid) is needs_torch
