"""Shared helpers for tests that run real agent processes (the agent itself:
`weightcache_agent.testing.agent_process`)."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable

from weightcache_agent.testing.agent_process import maps_libtorch  # noqa: F401  (tests take it from here, with the other /proc probes)

PROBE = os.path.join(os.path.dirname(__file__), "engine_probe.py")


class Probe:
    """An engine process (tests/engine_probe.py) driven line by line."""

    def __init__(self, model: str, socket: str):
        self.proc = subprocess.Popen([sys.executable, PROBE, model, socket], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"probe died ({self.proc.wait()}): {self.proc.stderr.read()[-2000:]}")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll until `predicate()` holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout:.0f}s"
        time.sleep(0.02)


def in_child_as(uid: int, gid: int, work: Callable[[], dict[str, Any]],
                failed: Callable[[BaseException], dict[str, Any]]) -> dict[str, Any]:
    """What `work()` returns when run in a forked child as uid:gid (no supplementary groups).

    Forked, not spawned: the interpreter is loaded already, so the child needs no access to it
    (root's Python is not readable by others). An exception in the child, dropping privileges
    included, comes back as `failed(exception)`; the child never returns into the test run.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            try:
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                result = work()
            except BaseException as e:  # noqa: BLE001 -- reported to the parent, never raised in a fork
                result = failed(e)
            os.write(w, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return json.loads(out)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def open_files(pid: int) -> Counter:
    """What the fds of `pid` are open on, counted by kind ("socket", "/memfd:name (deleted)", a
    path): comparing two such counts ignores an fd another thread closed meanwhile."""
    kinds: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed while listed
            continue
        kinds[re.sub(r":\[\d+\]$", "", target)] += 1
    return kinds


def map_count(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for _ in f)


class FakeAgent:
    """A listener at `path` that treats each connection with `behaviour` (on its own thread)."""

    def __init__(self, path: str, behaviour):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.behaviour = behaviour
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                try:
                    self.behaviour(conn)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()
