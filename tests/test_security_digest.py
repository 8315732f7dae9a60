"""The arena's keyed digest on the cpu backend: made at fill time, checked on a paced schedule and on
demand, and a changed arena is no longer handed out but replaced; the handle goes only to peers
admitted as for a lease.

On the cpu backend the arena is a sealed memfd that nobody can write (tests/test_socket_security.py),
so the response to a changed arena is driven here by changing what the scrub compares against, in an
agent run in-process; tests/test_security_digest_cuda.py writes a real arena through its handle.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time

from abuse_fixtures import ask, no_traceback, right_bytes
from abuse_fixtures import disk, model  # noqa: F401 (fixtures)
from agent_fixtures import wait_for
from security_fixtures import AsAttacker, agent_dir, needs_root, open_agent
from weightcache_agent import protocol
from weightcache_agent.arena.cpu import CpuArena
from weightcache_agent.arena.digest import ArenaDigest, new_key
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.serve.agent import Agent
from weightcache_agent.serve.status_cli import main as status_main
from weightcache_agent.spec import CacheSpec

MAX_LEASES = 8
PER_UID = MAX_LEASES // 2


def attacker(command: dict) -> dict:
    """In the attacker: `times` processes of its uid each ask for the arena; then it tries to attach and
    to verify. What each was answered."""
    codes = []
    for _ in range(command["times"]):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a process of the attacker's uid that takes the handle and keeps it
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(command["socket"])
                protocol.send_message(s, {"type": "arena"})
                reply, _fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
                os.write(w, (reply.get("code") or reply["type"]).encode())
            finally:
                os._exit(0)
        os.close(w)
        codes.append(os.read(r, 100).decode())
        os.close(r)
        os.waitpid(pid, 0)
    attach = ask(command["socket"], {"type": "attach", "role": "primary", "group": None,
                                     "request": command["request"]})
    verify = ask(command["socket"], {"type": "verify"})
    return {"codes": codes, "attach": attach.get("code") or attach["type"], "verify": verify.get("message", "")}


@needs_root
def test_scheduled_and_on_demand_checks_and_the_narrow_hand_out(model, disk, capsys):
    base = agent_dir()
    agent = open_agent(model, base, "agent", "--backend", "cpu",  # the cpu digest; the GPU's: test_security_digest_cuda
                       "--scrub-interval", "0.3", "--max-leases", str(MAX_LEASES))
    child = None
    try:
        status = agent.wait_ready()
        integrity = status["integrity"]
        assert integrity["state"] == "verified" and integrity["algorithm"] == "hmac-sha256/v1", integrity
        started = time.monotonic()
        wait_for(lambda: agent.status()["integrity"]["passes"] >= 3, 10, "three scheduled passes")
        integrity = agent.status()["integrity"]
        elapsed = time.monotonic() - started
        assert integrity["busy_seconds"] < 0.01 * (elapsed + 1.0), integrity  # within the 1% duty
        # On demand: root (the node's tooling) may ask; the CLI says the same.
        verified = ask(agent.socket, {"type": "verify"})
        assert verified["type"] == "verified" and verified["ok"] is True and verified["bytes"] > 0, verified
        assert status_main(["--socket", agent.socket, "--verify"]) == 0
        # The handle goes to a second uid only under the rules of a lease: its cap counts hand-outs.
        request = engine_request(CacheSpec(model=model))
        child = AsAttacker(attacker)
        answer = child.ask(socket=agent.socket, times=PER_UID + 1, request=request)
        assert answer["codes"] == ["arena"] * PER_UID + ["too_many_leases"], answer
        assert answer["attach"] == "too_many_leases", answer
        assert "verify needs a privileged peer" in answer["verify"], answer
        # ... while the other uid's engine still maps it ahead and attaches.
        reply = ask(agent.socket, {"type": "arena"})
        assert reply["type"] == "arena", reply
        right_bytes(agent, disk)
        with capsys.disabled():
            print(f"\ncpu scrub: {integrity['passes']} passes of {status['arena_bytes'] / 2**20:.1f} MiB in "
                  f"{elapsed:.1f}s, busy {integrity['busy_seconds'] * 1e3:.1f} ms; verify {verified['seconds'] * 1e3:.1f}"
                  f" ms")
        no_traceback(agent)
    finally:
        if child is not None:
            child.close()
        agent.stop()
        shutil.rmtree(base, ignore_errors=True)


class InProcess:
    """`Agent` run in this process (bind, serve, load on a thread), for a test that reaches its scrubber."""

    def __init__(self, model: str, sock: str, **kwargs):
        self.model, self.socket = model, sock
        self.agent = Agent(CacheSpec(model=model), sock, **kwargs)
        self.agent.bind()
        self.agent.start()
        self.loading = threading.Thread(target=self.agent.load, daemon=True)
        self.loading.start()

    def status(self) -> dict:
        return protocol.agent_status(self.socket)


def test_a_changed_arena_is_no_longer_handed_out_and_is_refilled(model, disk, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="weightcache_agent")
    run = InProcess(model, str(tmp_path / "run" / "a.sock"), scrub_interval=0.2)
    try:
        wait_for(lambda: run.agent.phase == "ready", 60, "the load")
        before = ask(run.socket, {"type": "arena"})["arenas"][0]["id"]
        scrubber = run.agent._scrubber
        # What the scrub would see had a peer written segment 0: bytes that no longer digest as recorded.
        values = list(scrubber.digest.values)
        values[0] = "0" * len(values[0])
        scrubber.digest = ArenaDigest(scrubber.digest.algorithm, scrubber.digest.size, scrubber.digest.segment_bytes,
                                      tuple(values))
        # scrubbed every 0.2 s: noticed within a few rounds, even on a busy 2-core machine
        wait_for(lambda: run.agent.tampered == 1, 5, "the scheduled scrub noticing")
        wait_for(lambda: run.agent.refills == 1 and run.agent.phase == "ready", 60, "the refill")
        status = run.status()
        assert status["integrity"]["tampered"] == 1 and status["integrity"]["refills"] == 1
        assert status["integrity"]["state"] == "verified"
        after = ask(run.socket, {"type": "arena"})["arenas"][0]["id"]
        assert after != before, "the changed arena is still handed out"
        right_bytes(run, disk)
        lines = [r.getMessage() for r in caplog.records if "changed since this agent filled it" in r.getMessage()]
        assert len(lines) == 1 and "no longer handing it out" in lines[0] and "uid=0" in lines[0], lines
    finally:
        run.agent.close()


def test_cpu_digest_throughput_and_sensitivity(capsys):
    """A keyed digest changes with any byte and with the key; its speed on this machine, printed."""
    size = 256 << 20
    arena = CpuArena(size, name="digest-bench")
    view = arena.writable()
    view[:] = os.urandom(1 << 20) * (size >> 20)
    view.release()
    arena.seal()
    key = new_key()
    t0 = time.perf_counter()
    digest = arena.digest(key)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    arena.digest_segment(key, 0)
    one = time.perf_counter() - t1
    assert arena.digest(key) == digest
    assert arena.digest(new_key()).values != digest.values
    with capsys.disabled():
        print(f"\ncpu digest: {size / seconds / 1e9:.2f} GB/s over {os.cpu_count()} cores "
              f"({arena.segment_bytes / one / 1e9:.2f} GB/s on one)")
    arena.close()
