"""A restarted agent takes its arena back from a still-attached engine instead of the disk."""
from __future__ import annotations

import os
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


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


def test_restarted_agent_serves_the_adopted_arena_without_torch(model, tmp_path):
    """Status, the rejoin and a newcomer's attach come from the predecessor's record: torch is never
    loaded into the restarted agent, until a request for another spec needs the checkpoint parsed."""
    from weightcache_agent import CacheSpec, protocol
    from weightcache_agent.load.fingerprint import engine_request

    sock = str(tmp_path / "agent.sock")
    first = AgentProcess(model, sock)
    first.wait_ready()
    assert _maps_torch(first.proc.pid), "a cold load runs torch code: the check below would prove nothing"
    probe = Probe(model, sock)
    second = None
    try:
        wait_for(lambda: os.path.exists(os.path.join(tmp_path, ".agent.sock.prepared")), what="the record")
        first.proc.kill()
        first.proc.wait()
        wait_for(lambda: probe.ask("status")["agent_alive"] is False)
        started = time.monotonic()
        second = AgentProcess(model, sock)
        status = second.wait_ready()
        serving = time.monotonic() - started
        assert status["adopted"] is True and status["progress"]["bytes_done"] == 0
        assert status["tensors"] > 0 and status["fingerprint"]
        newcomer = Probe(model, sock)
        try:
            assert newcomer.ask("verify") == {"identical": True}
        finally:
            newcomer.close()
        assert not _maps_torch(second.proc.pid), "the restarted agent loaded torch"
        assert serving < 5.0, f"process start -> serving took {serving:.2f}s"

        # Another spec: its fields need the checkpoint, parsed on demand; the agent keeps serving.
        conn = protocol.connect(sock)
        try:
            protocol.send_message(conn, {"type": "attach", "pid": 0, "role": "standby", "group": None, "pod": None,
                                         "request": engine_request(CacheSpec(model=model, dtype="float16"))})
            reply, fds = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
        finally:
            conn.close()
        assert (reply["type"], reply["code"], fds) == ("error", "fingerprint_mismatch", [])
        assert reply["engine_fields"]["dtype"] == "float16" and reply["fields"]["dtype"] == "bfloat16"
        assert second.status()["phase"] == "ready"
    finally:
        probe.close()
        if second is not None:
            assert second.stop() == 0


def test_a_stale_record_is_not_served_from(model, tmp_path):
    """Files touched since the record was written: the restarted agent plans from the checkpoint (and
    still adopts: the content is the same)."""
    sock = str(tmp_path / "agent.sock")
    first = AgentProcess(model, sock)
    first.wait_ready()
    probe = Probe(model, sock)
    second = None
    try:
        wait_for(lambda: os.path.exists(os.path.join(tmp_path, ".agent.sock.prepared")), what="the record")
        first.proc.kill()
        first.proc.wait()
        config = os.path.join(model, "config.json")
        os.utime(config, ns=(time.time_ns(), time.time_ns()))  # same bytes, another signature
        second = AgentProcess(model, sock)
        status = second.wait_ready()
        assert status["adopted"] is True and status["progress"]["bytes_done"] == 0
        assert _maps_torch(second.proc.pid), "planned from the checkpoint: torch was expected"
        newcomer = Probe(model, sock)
        try:
            assert newcomer.ask("verify") == {"identical": True}
        finally:
            newcomer.close()
    finally:
        probe.close()
        if second is not None:
            assert second.stop() == 0
