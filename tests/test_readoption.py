"""A restarted agent takes its arena back from a still-attached engine instead of the disk."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from agent_fixtures import Probe, maps_libtorch, wait_for
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), LlamaShape(num_hidden_layers=2))


class Restart:
    """An agent that loaded `model` on `tmp_path/agent.sock`; in the `with` block an engine (the probe) is
    attached to it, the test kills it and starts its successor on the same socket. When the block ends the
    engine is closed and the successor stopped (its exit code must be 0 with `clean_exit`)."""

    def __init__(self, model: str, tmp_path: Path, *, clean_exit: bool = True) -> None:
        self.model, self.sock, self.clean_exit = model, str(tmp_path / "agent.sock"), clean_exit
        self.record = os.path.join(tmp_path, ".agent.sock.prepared")
        self.first = AgentProcess(model, self.sock)
        self.first.wait_ready()
        self.second: AgentProcess | None = None

    def __enter__(self) -> Restart:
        self.probe = Probe(self.model, self.sock)
        return self

    def kill_first(self) -> None:
        self.first.proc.kill()
        self.first.proc.wait()

    def start_second(self, *extra: str) -> dict[str, Any]:
        """The successor on the same socket; its status once ready."""
        self.second = AgentProcess(self.model, self.sock, *extra)
        return self.second.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.probe.close()
        if self.second is not None:
            code = self.second.stop()
            if self.clean_exit:
                assert code == 0


def test_restarted_agent_adopts_the_arena_without_reading_disk(model, tmp_path, time_bar):
    with Restart(model, tmp_path) as run:
        run.kill_first()
        wait_for(lambda: run.probe.ask("status")["agent_alive"] is False)
        status = run.start_second()
        assert status["adopted"] is True
        assert status["progress"]["bytes_done"] == 0, "the restarted agent read weights from disk"
        time_bar("the restarted agent's adoption", status["load_seconds"], 2.0)
        wait_for(lambda: run.probe.ask("status")["agent_alive"])
        assert run.probe.ask("status")["rejoins"] == 1
        assert [c["pid"] for c in run.second.status()["clients"]] == [run.probe.hello["pid"]]
        with contextlib.closing(Probe(model, run.sock)) as newcomer:  # served from the adopted arena
            assert newcomer.ask("verify") == {"identical": True}
            assert newcomer.ask("touch")["checksum"] == run.probe.ask("touch")["checksum"]
        assert run.probe.ask("verify") == {"identical": True}


def test_agent_restarted_with_another_spec_loads_from_disk_and_refuses_the_rejoin(model, tmp_path):
    with Restart(model, tmp_path, clean_exit=False) as run:
        run.kill_first()
        status = run.start_second("--dtype", "float16")
        assert status["adopted"] is False
        assert status["progress"]["bytes_done"] > 0
        time.sleep(0.3)  # the probe knocks, is refused, and gives up
        assert run.probe.ask("status")["agent_alive"] is False
        assert run.second.status()["clients"] == []
        assert run.probe.ask("verify") == {"identical": True}


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


def test_restarted_agent_serves_the_adopted_arena_without_torch(model, tmp_path, time_bar):
    """Status, the rejoin and a newcomer's attach come from the predecessor's record: torch is never
    loaded into the restarted agent, until a request for another spec needs the checkpoint parsed."""
    from weightcache_agent import CacheSpec, protocol
    from weightcache_agent.load.fingerprint import engine_request

    with Restart(model, tmp_path) as run:
        wait_for(lambda: os.path.exists(run.record), what="the record")
        run.kill_first()
        wait_for(lambda: run.probe.ask("status")["agent_alive"] is False)
        started = time.monotonic()
        status = run.start_second()
        serving = time.monotonic() - started
        assert status["adopted"] is True and status["progress"]["bytes_done"] == 0
        assert status["planned_from"] == "record"  # no header read
        assert status["tensors"] > 0 and status["fingerprint"]
        with contextlib.closing(Probe(model, run.sock)) as newcomer:
            assert newcomer.ask("verify") == {"identical": True}
        assert not maps_libtorch(run.second.proc.pid), "the restarted agent loaded torch"
        time_bar("a restarted agent's process start -> serving", serving, 5.0)

        # Another spec: its fields need the checkpoint, parsed on demand; the agent keeps serving.
        conn = protocol.connect(run.sock)
        try:
            protocol.send_message(conn, {"type": "attach", "pid": 0, "role": "standby", "group": None, "pod": None,
                                         "request": engine_request(CacheSpec(model=model, dtype="float16"))})
            reply, fds = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
        finally:
            conn.close()
        assert (reply["type"], reply["code"], fds) == ("error", "fingerprint_mismatch", [])
        assert reply["engine_fields"]["dtype"] == "float16" and reply["fields"]["dtype"] == "bfloat16"
        assert run.second.status()["phase"] == "ready"


def test_a_stale_record_is_not_served_from(model, tmp_path):
    """Files touched since the record was written: the restarted agent plans from the checkpoint (and
    still adopts: the content is the same)."""
    with Restart(model, tmp_path) as run:
        wait_for(lambda: os.path.exists(run.record), what="the record")
        run.kill_first()
        config = os.path.join(model, "config.json")
        os.utime(config, ns=(time.time_ns(), time.time_ns()))  # same bytes, another signature
        status = run.start_second()
        assert status["adopted"] is True and status["progress"]["bytes_done"] == 0
        assert status["planned_from"] == "checkpoint"
        with contextlib.closing(Probe(model, run.sock)) as newcomer:
            assert newcomer.ask("verify") == {"identical": True}
