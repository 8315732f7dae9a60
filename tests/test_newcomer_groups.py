"""Off Kubernetes a serving group is keyed by uid and name: engines of another uid that name the
same group hold a group of their own, so they can neither lock a real engine out of its group
nor be promoted in it (in a cluster the pod's namespace, in the group's name, does this).

A real agent; every engine is a real client (`attach`) in a process forked from this one that
runs as its own uid (the squatter: 65534; the real engines: another uid), both let onto the
socket by its group. A fork of a process that has initialised CUDA is unsafe (the child inherits a
driver state it cannot use), so after this process's CUDA tests the test skips: run it alone.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
from typing import Any

import pytest
import torch

from abuse_fixtures import disk_tensors, no_traceback, serves_correctly
from agent_fixtures import wait_for
from security_fixtures import ATTACKER, agent_dir, needs_root, open_agent
from weightcache_agent import CacheSpec, attach
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint

ENGINE_UID = 54321  # the real engines' uid; no such user needs to exist
GROUP = "chat"


class Engine:
    """An engine process running as `uid` (group: the socket's), holding one lease through the real
    client until it is killed; it reports its role once attached (or why not) and each promotion."""

    def __init__(self, uid: int, model: str, socket: str, role: str):
        self.uid = uid
        events_r, events_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            def say(event: dict[str, Any]) -> None:
                os.write(events_w, json.dumps(event).encode() + b"\n")

            try:
                os.close(events_r)
                os.setgroups([])
                os.setgid(ATTACKER)  # the socket's group lets it in
                os.setuid(uid)
                module = skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})
                lease = attach(module, CacheSpec(model=model), socket=socket, role=role, group=GROUP,
                               on_promote=lambda att: say({"promoted": att.role}))
                say({"attached": lease.role, "pid": os.getpid()})
                while True:
                    signal.pause()  # serving, until killed
            except BaseException as e:  # noqa: BLE001 -- reported to the test (a refusal is what it reads)
                say({"refused": f"{type(e).__name__}: {e}"[:500]})
            finally:
                os._exit(0)
        os.close(events_w)
        self._events = os.fdopen(events_r)
        self.hello = self.next_event(30)

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        if not select.select([self._events], [], [], timeout)[0]:
            return None
        line = self._events.readline()
        return json.loads(line) if line else None

    def stop(self) -> None:
        """The engine dies (SIGKILL), its lease with it."""
        if not self._events.closed:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self._events.close()


@needs_root
def test_a_squatter_of_another_uid_neither_locks_out_nor_joins_a_real_engines_group():
    if torch.cuda.is_initialized():  # by an earlier test in this process (known only now, not at collection)
        pytest.skip("this process has initialised CUDA, which a forked engine cannot inherit: run this file alone")
    base = agent_dir()  # every uid may traverse it: the engines read the checkpoint's files too
    model = write_llama_checkpoint(os.path.join(base, "m"), LlamaShape(num_hidden_layers=1))
    os.chmod(model, 0o755)
    for name in os.listdir(model):
        os.chmod(os.path.join(model, name), 0o644)
    agent = open_agent(model, base, "groups")
    engines: list[Engine] = []
    try:
        agent.wait_ready()

        def start(uid: int, role: str) -> Engine:
            engines.append(Engine(uid, model, agent.socket, role))
            return engines[-1]

        # The squatter takes the name first, as primary and with a standby of its own.
        squatter = start(ATTACKER, "primary")
        assert squatter.hello == {"attached": "primary", "pid": squatter.pid}, squatter.hello
        squatters_standby = start(ATTACKER, "standby")
        # The real engines are not locked out: their own group of that name, primary and standby.
        primary = start(ENGINE_UID, "primary")
        assert primary.hello == {"attached": "primary", "pid": primary.pid}, primary.hello
        standby = start(ENGINE_UID, "standby")
        assert standby.hello == {"attached": "standby", "pid": standby.pid}, standby.hello
        roles = {(c["uid"], c["pid"]): (c["group"], c["role"]) for c in agent.status()["clients"]}
        assert roles == {(ATTACKER, squatter.pid): (GROUP, "primary"),
                         (ATTACKER, squatters_standby.pid): (GROUP, "standby"),
                         (ENGINE_UID, primary.pid): (GROUP, "primary"),
                         (ENGINE_UID, standby.pid): (GROUP, "standby")}, roles

        # The squatter's primary dies: its own standby is promoted, the real engines' group is untouched.
        squatter.stop()
        assert squatters_standby.next_event(10) == {"promoted": "primary"}
        assert standby.next_event(0.5) is None

        # The real primary dies: the real standby is promoted, never the squatter's engine.
        primary.stop()
        assert standby.next_event(10) == {"promoted": "primary"}
        # "promoting" until the engine's acknowledgement reaches the agent, a moment after the event
        expected = {(ATTACKER, squatters_standby.pid): "primary", (ENGINE_UID, standby.pid): "primary"}
        wait_for(lambda: {(c["uid"], c["pid"]): c["role"] for c in agent.status()["clients"]} == expected, 10,
                 "both promotions acknowledged")

        for engine in engines:
            engine.stop()
        wait_for(lambda: agent.status()["clients"] == [], 10, "every lease ending")
        serves_correctly(agent, disk_tensors(model))  # and root is served as before
        no_traceback(agent)
    finally:
        for engine in engines:
            engine.stop()
        agent.stop()
        shutil.rmtree(base, ignore_errors=True)
