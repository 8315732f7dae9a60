"""Forcing a restart: per-uid caps, bounded fields and replies, status that never waits on a reader.

A second uid (the attacker) takes every lease it can with the longest fields allowed, then
floods the agent with status requests whose replies it never reads. Throughout, the agent
keeps answering status at once (what the node supervisor's liveness check asks) and a
well-behaved engine of another uid (root) attaches and reads the checkpoint's bytes.
"""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time

from abuse_fixtures import ask, no_traceback, right_bytes, serves_correctly
from abuse_fixtures import disk, model  # noqa: F401 (fixtures)
from agent_fixtures import wait_for
from security_fixtures import ATTACKER, AsAttacker, agent_dir, needs_root, open_agent
from weightcache_agent import protocol
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.spec import CacheSpec

MAX_LEASES = 64
PER_UID = MAX_LEASES // 2  # the default share


def attacker(command: dict) -> dict:
    """In the attacker: `take` leases until refused (held), `flood` unread status requests."""
    state = attacker.__dict__.setdefault("state", {"held": [], "idle": []})
    if command["do"] == "take":
        codes = []
        for i in range(command["tries"]):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(command["socket"])
            message = {"type": "attach", "role": "primary", "group": f"{'g' * 240}{i:04d}",
                       "pod": {"namespace": "n" * 63, "name": "p" * 250 + f"{i:03d}", "uid": "u" * 64},
                       "request": command["request"]}
            protocol.send_message(s, message)
            reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
            for fd in fds:
                os.close(fd)
            codes.append(reply.get("code") or reply["type"])
            if reply["type"] == "manifest":
                state["held"].append(s)
            else:
                s.close()
        too_long = {"namespace": "n" * 64, "name": "p", "uid": "u"}
        refusal = ask(command["socket"], {"type": "attach", "role": "primary", "group": None, "pod": too_long,
                                          "request": command["request"]})
        return {"codes": codes, "too_long": refusal.get("message", "")}
    if command["do"] == "flood":
        opened = refused = 0
        deadline = time.monotonic() + command["seconds"]
        while time.monotonic() < deadline:
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(command["socket"])
                s.setblocking(False)
                for _ in range(8):  # eight status requests, no reply ever read
                    s.send(protocol.encode_message({"type": "status"}))
                state["idle"].append(s)
                opened += 1
            except OSError:
                refused += 1
                s.close()
            if len(state["idle"]) > 400:  # keep the newest: the oldest were dropped by now
                state["idle"].pop(0).close()
        return {"opened": opened, "refused": refused}
    raise ValueError(command)


@needs_root
def test_one_uid_cannot_take_every_lease_nor_stall_status(model, disk, capsys):
    base = agent_dir()
    agent = open_agent(model, base, "agent", "--max-leases", str(MAX_LEASES))
    child = None
    try:
        agent.wait_ready()
        request = engine_request(CacheSpec(model=model))
        child = AsAttacker(attacker)
        taken = child.ask(do="take", socket=agent.socket, request=request, tries=MAX_LEASES + 8)
        assert taken["codes"][:PER_UID] == ["manifest"] * PER_UID, taken["codes"]
        assert set(taken["codes"][PER_UID:]) == {"too_many_leases"}, taken["codes"]
        assert "namespace (at most 63 characters)" in taken["too_long"], taken["too_long"]
        clients = agent.status()["clients"]
        assert len(clients) == PER_UID and {c["uid"] for c in clients} == {ATTACKER}
        # The other uid is not locked out: the engine attaches, in a group of its own, and reads the right bytes.
        right_bytes(agent, disk)
        # Every status reply is bounded: the largest fields, the attacker's whole share of leases.
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(agent.socket)
        protocol.send_message(s, {"type": "status"})
        size = protocol.HEADER.unpack(s.recv(protocol.HEADER.size, socket.MSG_WAITALL))[3]
        s.close()
        per_lease = size / PER_UID
        assert size < (16 << 10) + PER_UID * 1024, f"status of {size} bytes with {PER_UID} leases"

        # The flood: replies that are never read, from as many connections as the uid may open.
        result: dict = {}
        flooding = threading.Thread(target=lambda: result.update(
            child.ask(do="flood", socket=agent.socket, seconds=8.0)))
        flooding.start()
        slowest, answered, attaches = 0.0, 0, 0
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            status = agent.status()  # what the supervisor's liveness check asks
            slowest = max(slowest, time.monotonic() - t0)
            answered += 1
            assert status["phase"] == "ready"
            if answered % 10 == 0:
                right_bytes(agent, disk)
                attaches += 1
            time.sleep(0.02)
        flooding.join()
        with capsys.disabled():
            print(f"\nuid {ATTACKER} held {PER_UID} of {MAX_LEASES} leases (status {size} bytes, "
                  f"at most {per_lease:.0f} per lease); flood of {result['opened']} connections with 8 unread status "
                  f"requests each ({result['refused']} refused at its connection cap): {answered} status answers "
                  f"meanwhile, slowest {slowest * 1e3:.0f} ms, {attaches} correct attaches")
        # well inside the supervisor's poll timeout; a busy 2-core CI box adds its own scheduling delay
        assert slowest < 1.0, f"a status request waited {slowest:.2f}s behind the flood"
        assert result["opened"] > 100
        log = agent.log()
        assert "left status replies unread" in log or "holds its cap" in log
        assert agent.proc.poll() is None
    finally:
        if child is not None:
            child.close()
    try:
        wait_for(lambda: [c for c in agent.status()["clients"] if c["uid"] == ATTACKER] == [], 15,
                 "the attacker's leases ending with its process")
        serves_correctly(agent, disk)
        no_traceback(agent)
    finally:
        agent.stop()
        shutil.rmtree(base, ignore_errors=True)
