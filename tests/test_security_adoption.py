"""Rejoin adopts only the bytes this agent loaded, from memfds sealed as it seals its own, once per token.

A second uid holds real leases (and so real rejoin tokens). After the agent is killed it
rejoins the successor first, offering a sealed memfd of altered bytes, and a copy of the
true bytes sealed against writes alone; neither is adopted (the first fails the keyed
digest the agent recorded, the second the seals), though each token is honoured for a
lease. The well-behaved engine (root) rejoins next with the real arena, which is adopted.
At the next restart the attacker's spent tokens are refused; its fresh one is not.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import signal
import socket
from typing import Any

from abuse_fixtures import no_traceback, right_bytes
from abuse_fixtures import disk, model  # noqa: F401 (fixtures)
from agent_fixtures import wait_for
from security_fixtures import AsAttacker, agent_dir, needs_root, open_agent
from weightcache_agent import protocol
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.spec import CacheSpec

ALL_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def attach(path: str, request: dict) -> tuple[socket.socket, dict, int]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    protocol.send_message(s, {"type": "attach", "role": "auto", "group": None, "request": request})
    reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
    assert reply["type"] == "manifest" and len(fds) == 1, reply
    return s, reply, fds[0]


def rejoin(path: str, manifest: dict, token: str, fd: int) -> tuple[socket.socket, dict]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(path)
    protocol.send_message(s, {"type": "rejoin", "role": "auto", "group": None, "pod": None, "token": token,
                              "fields": manifest["fields"], "fingerprint": manifest["fingerprint"],
                              "layout_hash": manifest["layout_hash"], "arenas": manifest["arenas"]}, [fd])
    reply, _ = protocol.recv_message(s, protocol.MAX_REPLY_BYTES)
    return s, reply


def copy_memfd(fd: int, size: int, flip: bool, seals: int) -> int:
    """A memfd with the arena's bytes (one flipped when `flip`), sealed with `seals`."""
    source = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    data = bytearray(source)
    source.close()
    if flip:
        data[len(data) // 2] ^= 0x40
    copy = os.memfd_create("forged", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.pwrite(copy, bytes(data), 0)
    fcntl.fcntl(copy, fcntl.F_ADD_SEALS, seals)
    return copy


def attacker(command: dict) -> dict:
    """In the attacker: `attach` three leases; `rejoin` with one of its tokens and a forged offer."""
    state: dict[str, Any] = attacker.__dict__.setdefault("state", {"socks": []})
    if command["do"] == "attach":
        state["leases"] = []
        for _ in range(3):
            s, manifest, fd = attach(command["socket"], command["request"])
            state["socks"].append(s)
            state["leases"].append((manifest, fd))
        return {"tokens": [m["rejoin_token"] for m, _ in state["leases"]]}
    manifest, fd = state["leases"][0]
    size = manifest["arenas"][0]["size"]
    offer = copy_memfd(fd, size, flip=command["offer"] == "altered",
                       seals=ALL_SEALS if command["offer"] == "altered" else fcntl.F_SEAL_WRITE)
    try:
        s, reply = rejoin(command["socket"], manifest, command["token"], offer)
    finally:
        os.close(offer)
    state["socks"].append(s)
    return reply


@needs_root
def test_rejoin_adopts_only_the_loaded_bytes_and_a_token_once(model, disk):
    base = agent_dir()
    agents = [open_agent(model, base, "first")]
    child = None
    try:
        first = agents[0]
        first.wait_ready()
        request = engine_request(CacheSpec(model=model))
        engine_sock, engine_manifest, engine_fd = attach(first.socket, request)  # the well-behaved engine
        child = AsAttacker(attacker)
        tokens = child.ask(do="attach", socket=first.socket, request=request)["tokens"]
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        engine_sock.close()

        second = open_agent(model, base, "second", "--adopt-wait", "30")
        agents.append(second)
        wait_for(lambda: _answers(second.socket), 60, "the restarted agent's socket")
        # The attacker is first, with real tokens and forged arenas: a lease each, no adoption.
        altered = child.ask(do="rejoin", socket=second.socket, token=tokens[0], offer="altered")
        assert altered["type"] == "rejoined" and altered["adopted"] is False, altered
        write_sealed_only = child.ask(do="rejoin", socket=second.socket, token=tokens[1], offer="write-sealed")
        assert write_sealed_only["type"] == "rejoined" and write_sealed_only["adopted"] is False, write_sealed_only
        assert second.status()["phase"] == "adopting", "a forged arena ended the wait for the real one"
        # A token is used once: the same one again is refused.
        again = child.ask(do="rejoin", socket=second.socket, token=tokens[0], offer="altered")
        assert again == {"type": "error", "code": "rejoin_refused", "message": again["message"]}, again
        # The real engine's arena is adopted, and every engine then reads the checkpoint's bytes.
        engine_sock, rejoined = rejoin(second.socket, engine_manifest, engine_manifest["rejoin_token"], engine_fd)
        assert rejoined["type"] == "rejoined" and rejoined["adopted"] is True, rejoined
        status = second.wait_ready()
        assert status["adopted"] is True and status["progress"]["bytes_done"] == 0
        assert status["integrity"]["state"] == "verified"
        right_bytes(second, disk)
        log = second.log()
        assert "refused to adopt the arena offered by" in log and "differs from the recorded digest" in log
        assert "not sealed against writes, growth, shrinking and new seals" in log

        # Across a restart too: the spent tokens are refused; the fresh one handed at the rejoin works.
        second.proc.send_signal(signal.SIGKILL)
        second.proc.wait()
        engine_sock.close()
        third = open_agent(model, base, "third", "--adopt-wait", "30")
        agents.append(third)
        wait_for(lambda: _answers(third.socket), 60, "the second restart's socket")
        for token in tokens[:2]:
            spent = child.ask(do="rejoin", socket=third.socket, token=token, offer="altered")
            assert spent["code"] == "rejoin_refused", spent
        engine_sock, rejoined = rejoin(third.socket, engine_manifest, rejoined["rejoin_token"], os.dup(engine_fd))
        assert rejoined["type"] == "rejoined" and rejoined["adopted"] is True, rejoined
        assert third.wait_ready()["adopted"] is True
        right_bytes(third, disk)
        engine_sock.close()
        for agent in agents[1:]:
            no_traceback(agent)
    finally:
        if child is not None:
            child.close()
        for agent in agents:
            agent.stop()
        shutil.rmtree(base, ignore_errors=True)


def _answers(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
        return True
    except OSError:
        return False
