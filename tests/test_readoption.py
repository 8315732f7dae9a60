"""A restarted agent takes its arena back from a still-attached engine instead of the disk."""
from __future__ import annotations

import time

import pytest

from agent_fixtures import AgentProcess, Probe, wait_for
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), LlamaShape(num_hidden_layers=2))


def test_restarted_agent_adopts_the_arena_without_reading_disk(model, tmp_path):
    sock = str(tmp_path / "agent.sock")
    first = AgentProcess(model, sock)
    first.wait_ready()
    probe = Probe(model, sock)
    second = None
    try:
        first.proc.kill()
        first.proc.wait()
        wait_for(lambda: probe.ask("status")["agent_alive"] is False)
        second = AgentProcess(model, sock)
        status = second.wait_ready()
        assert status["adopted"] is True
        assert status["progress"]["bytes_done"] == 0, "the restarted agent read weights from disk"
        assert status["load_seconds"] < 2.0
        wait_for(lambda: probe.ask("status")["agent_alive"])
        assert probe.ask("status")["rejoins"] == 1
        assert [c["pid"] for c in second.status()["clients"]] == [probe.hello["pid"]]
        newcomer = Probe(model, sock)  # served from the adopted arena
        try:
            assert newcomer.ask("verify") == {"identical": True}
            assert newcomer.ask("touch")["checksum"] == probe.ask("touch")["checksum"]
        finally:
            newcomer.close()
        assert probe.ask("verify") == {"identical": True}
    finally:
        probe.close()
        if second is not None:
            assert second.stop() == 0


def test_agent_restarted_with_another_spec_loads_from_disk_and_refuses_the_rejoin(model, tmp_path):
    sock = str(tmp_path / "agent.sock")
    first = AgentProcess(model, sock)
    first.wait_ready()
    probe = Probe(model, sock)
    second = None
    try:
        first.proc.kill()
        first.proc.wait()
        second = AgentProcess(model, sock, "--dtype", "float16")
        status = second.wait_ready()
        assert status["adopted"] is False
        assert status["progress"]["bytes_done"] > 0
        time.sleep(0.3)  # the probe knocks, is refused, and gives up
        assert probe.ask("status")["agent_alive"] is False
        assert second.status()["clients"] == []
        assert probe.ask("verify") == {"identical": True}
    finally:
        probe.close()
        if second is not None:
            second.stop()


def test_clean_shutdown_without_engines_leaves_nothing_to_adopt(model, tmp_path):
    sock = str(tmp_path / "agent.sock")
    first = AgentProcess(model, sock)
    first.wait_ready()
    assert first.stop() == 0
    second = AgentProcess(model, sock, "--adopt-wait", "30")
    t0 = time.monotonic()
    status = second.wait_ready()
    assert time.monotonic() - t0 < 25, "the agent waited for an adoption nobody could offer"
    assert status["adopted"] is False
    second.stop()
