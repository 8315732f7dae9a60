"""Helpers for the security tests: an agent a second uid may reach, and work done as that uid.

The attacker is a forked child that drops to `ATTACKER` (uid and gid 65534, `nobody`), which
the agent lets in through `--socket-group 65534`; the well-behaved engine is the test process
itself (root). Forked, not spawned: root's interpreter need not be readable by nobody.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from typing import Any, Callable

import pytest

from abuse_fixtures import LoggedAgent

ATTACKER = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")


def agent_dir() -> str:
    """A directory every uid may traverse: only the socket directory the agent makes decides who gets in."""
    base = tempfile.mkdtemp(prefix="wc-sec-")
    os.chmod(base, 0o755)
    atexit.register(shutil.rmtree, base, True)  # the worker's agents are gone by its exit
    return base


def open_agent(model: str, base: str, name: str, *extra: str) -> LoggedAgent:
    return LoggedAgent(model, os.path.join(base, "run", "agent.sock"), os.path.join(base, f"{name}.log"),
                       "--socket-group", str(ATTACKER), *extra)


class AsAttacker:
    """A forked child running as the attacker's uid, serving commands one at a time over pipes.

    `handle(command) -> dict` runs in the child (it keeps its own state between commands:
    sockets, leases, fds); `ask(command)` returns what it answered. The child lives until `close()`."""

    def __init__(self, handle: Callable[[dict[str, Any]], dict[str, Any]]):
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(self._to_child)
                os.close(self._from_child)
                os.setgroups([])
                os.setgid(ATTACKER)
                os.setuid(ATTACKER)
                commands = os.fdopen(to_child_r)
                for line in commands:
                    try:
                        answer = handle(json.loads(line))
                    except BaseException as e:  # noqa: BLE001 -- reported to the parent, never raised in a fork
                        answer = {"failed": repr(e)[:2000]}
                    os.write(from_child_w, json.dumps(answer).encode() + b"\n")
            finally:
                os._exit(0)
        os.close(to_child_r)
        os.close(from_child_w)
        self._answers = os.fdopen(self._from_child)

    def ask(self, **command: Any) -> dict[str, Any]:
        os.write(self._to_child, json.dumps(command).encode() + b"\n")
        line = self._answers.readline()
        assert line, "the attacker's process died"
        answer = json.loads(line)
        assert "failed" not in answer, answer["failed"]
        return answer

    def close(self) -> None:
        os.close(self._to_child)
        os.waitpid(self.pid, 0)
        self._answers.close()


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field}")
