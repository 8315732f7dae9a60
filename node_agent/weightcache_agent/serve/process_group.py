"""Start, watch and stop agent and engine subprocesses: shared by the demo, the bench and tests.

Each child runs `python -m weightcache_agent agent|engine ...` in its own session (so a
Ctrl-C reaches only the supervising process, which then stops the children in order)
with a parent-death signal (so a supervisor killed outright does not leave orphans),
and logs to a file (never a pipe that nobody drains). `ProcessGroup.close()` stops every
child (engines first, then agents) and removes the sockets and files it created.
`http_json` is the small HTTP client everything here uses to talk to engines: plain
`http.client`, so proxy settings in the environment never reroute localhost traffic.
"""
from __future__ import annotations

import ctypes
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable

from .sockets import remove_socket_files
from ..protocol import agent_status
from ..errors import AgentUnavailable

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # looked up here: the child after fork only calls it


def die_with_parent() -> None:
    """In a forked child: receive SIGTERM when the parent dies, so no child outlives its supervisor."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def http_json(method: str, url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    """One request to `url` (http://host:port/path); returns (status, decoded JSON body)."""
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = None if body is None else (body if isinstance(body, (bytes, str)) else json.dumps(body))
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, "/" + path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        try:
            payload = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            payload = {"raw": raw.decode(errors="replace")}
        return response.status, payload
    finally:
        conn.close()


class ChildFailed(RuntimeError):
    """A child exited (or never became ready); the message carries its log's tail."""


class Child:
    """One subprocess with its log file."""

    def __init__(self, name: str, argv: list[str], log_path: str, env: dict[str, str] | None = None):
        self.name, self.argv, self.log_path = name, argv, log_path
        with open(log_path, "ab") as log_file:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent, env=env)
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; always reaps. Returns the exit status."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log().strip().splitlines()[-lines:])

    def check_alive(self) -> None:
        if not self.alive():
            raise ChildFailed(f"{self.name} (pid {self.pid}) exited with status {self.proc.returncode}:\n{self.log_tail()}")


class AgentChild(Child):
    def __init__(self, socket: str, model: str, log_path: str, extra: list[str] | None = None):
        self.socket = socket
        super().__init__("agent", [sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", socket,
                                   "--progress", "never", *(extra or [])], log_path)

    def status(self) -> dict[str, Any]:
        return agent_status(self.socket)

    def wait_ready(self, timeout: float = 120.0, on_status: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Poll the agent's status until its cache is loaded; `on_status` sees every poll (progress bars)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                status = agent_status(self.socket, timeout=5.0)
            except AgentUnavailable:
                time.sleep(0.01)
                continue
            if on_status is not None:
                on_status(status)
            if status["phase"] == "ready":
                return status
            if status["phase"] == "failed":
                raise ChildFailed(f"agent failed to load: {status.get('error')}")
            time.sleep(0.02)
        raise ChildFailed(f"agent not ready after {timeout:.0f}s:\n{self.log_tail()}")


class EngineChild(Child):
    def __init__(self, model: str, run_dir: str, name: str, socket: str | None = None, role: str = "primary",
                 group: str | None = None, mode: str = "client", extra: list[str] | None = None,
                 env: dict[str, str] | None = None):
        self.port_file = os.path.join(run_dir, f"{name}.port")
        self._port: int | None = None
        argv = [sys.executable, "-m", "weightcache_agent", "engine", "--model", model, "--mode", mode, "--role", role,
                "--port", "0", "--port-file", self.port_file]
        if socket:
            argv += ["--socket", socket]
        if group:
            argv += ["--group", group]
        super().__init__(name, argv + list(extra or []), os.path.join(run_dir, f"{name}.log"),
                         env={**os.environ, **env} if env else None)

    @property
    def port(self) -> int:
        if self._port is None:
            self._port = self.wait_listening()
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_listening(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with open(self.port_file) as f:
                    self._port = int(f.read())
                return self._port
            except (FileNotFoundError, ValueError):
                self.check_alive()
                time.sleep(0.01)
        raise ChildFailed(f"{self.name} did not listen within {timeout:.0f}s:\n{self.log_tail()}")

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
        return http_json("GET", self.url + path, timeout=timeout)

    def post(self, path: str, body: Any, timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
        return http_json("POST", self.url + path, body, timeout=timeout)

    def generate(self, tokens: list[int], max_tokens: int = 8) -> tuple[int, dict[str, Any]]:
        return self.post("/generate", {"tokens": tokens, "max_tokens": max_tokens})

    def wait_state(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 60.0, what: str = "state") -> dict[str, Any]:
        """Poll /healthz until `predicate(health)`; fail early if the engine dies or fails to load."""
        deadline = time.monotonic() + timeout
        self.wait_listening(timeout)
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                _, health = self.get("/healthz", timeout=5.0)
            except OSError:
                time.sleep(0.01)
                continue
            if predicate(health):
                return health
            if health.get("state") == "failed":
                raise ChildFailed(f"{self.name} failed: {health.get('error')}")
            time.sleep(0.01)
        raise ChildFailed(f"{self.name}: no {what} after {timeout:.0f}s:\n{self.log_tail()}")

    def wait_serving(self, timeout: float = 60.0) -> dict[str, Any]:
        """Attached and warmed up (ready for a primary, standing by for a standby)."""
        return self.wait_state(lambda h: h.get("state") == "serving", timeout, "warm attachment")


class ProcessGroup:
    """Owns every child it starts; `close()` (or leaving the `with`) stops them all and cleans up."""

    def __init__(self, run_dir: str, remove_run_dir: bool = True):
        self.run_dir = run_dir
        self.remove_run_dir = remove_run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.children: list[Child] = []

    def start_agent(self, model: str, name: str = "agent", extra: list[str] | None = None,
                    backend: str | None = None) -> AgentChild:
        """An agent on `<run_dir>/<name>.sock`; `backend` ("auto", "cpu", "cuda") is passed on when given."""
        args = (["--backend", backend] if backend else []) + list(extra or [])
        child = AgentChild(os.path.join(self.run_dir, f"{name}.sock"), model, os.path.join(self.run_dir, f"{name}.log"), args)
        self.children.append(child)
        return child

    def start_engine(self, model: str, name: str, **kwargs: Any) -> EngineChild:
        child = EngineChild(model, self.run_dir, name, **kwargs)
        self.children.append(child)
        return child

    def close(self) -> None:
        # Engines before agents: an engine leaving first is an orderly detach, not a lost agent.
        # Signal a whole tier at once, then reap it: stopping in parallel, not one by one.
        engines = [c for c in self.children if not isinstance(c, AgentChild)]
        agents = [c for c in self.children if isinstance(c, AgentChild)]
        for tier in (engines, agents):
            for child in tier:
                child.kill(signal.SIGTERM)
            for child in tier:
                child.stop()
        for child in self.children:
            if isinstance(child, AgentChild):
                remove_socket_files(child.socket)
        if self.remove_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
