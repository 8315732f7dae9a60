"""`weightcache agent` as a child process, for tests and benchmarks that need a real one.

The agent starts the way a user starts it (`python -m weightcache_agent agent`), on a socket
of the caller's, and counts as ready when its status over that socket says so: the same
question an engine or the operator asks, so a test waits for what they would wait for. If
the process exits first, what it wrote to stderr is the failure's message. It stops on
SIGTERM, the signal a stopped pod or service gets, so a test sees the shutdown users get;
`stop(kill=True)` is the crash a restart test needs.

Its stderr goes to a pipe the caller reads once it exited (a test asserting on the message),
or, given `log_path`, to that file (a long-lived agent whose output nobody reads while it
runs would otherwise fill the pipe and block).

Torch-free, only the base modules: a benchmark that times fresh processes imports it
without paying for torch, and the agent process imports what it needs itself.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

from ..errors import AgentUnavailable
from ..protocol import agent_status


class AgentNotReady(AssertionError):
    """The agent exited, or did not say ready in time. An AssertionError, so that in a test
    it reads as the test's failure."""


def maps_libtorch(pid: int) -> bool:
    """Whether process `pid` has torch's library mapped, that is, imported torch (Linux /proc)."""
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)


class AgentProcess:
    """One agent serving `model` on `socket`; `extra` are further agent flags.

    As a context manager: ready when the block starts, stopped when it ends (also when it
    never became ready). The class attributes are the defaults a subclass tunes."""

    READY_TIMEOUT: float = 60.0  # seconds: a test's checkpoint is small, but the machine may be busy
    POLL_SECONDS: float = 0.02  # each poll is a connection the agent answers: not too many of them
    STOP_TIMEOUT: float | None = 10.0  # then SIGKILL; None waits as long as the agent takes
    LOG_TAIL = 3000  # characters of a log file that make the message: it may hold earlier runs

    # A subclass that starts its own process sets `socket` and `proc`; these then keep their defaults.
    log_path: str | None = None
    _log_file: IO[str] | None = None

    def __init__(self, model: str, socket: str, *extra: str, env: Mapping[str, str] | None = None,
                 log_path: str | None = None, log_mode: str = "a") -> None:
        self.socket = socket
        self.log_path = log_path
        self.started = time.perf_counter()  # process start, for callers who time it from outside
        if log_path is None:
            stdout, stderr = subprocess.PIPE, subprocess.PIPE
        else:
            self._log_file = open(log_path, log_mode)
            stdout, stderr = subprocess.DEVNULL, self._log_file
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", socket,
             "--progress", "never", *extra],
            stdout=stdout, stderr=stderr, text=True, env=env,
        )

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """The agent's status once its phase is "ready". `AgentNotReady` when it exits first or
        `timeout` seconds (`READY_TIMEOUT` if None) pass."""
        limit = self.READY_TIMEOUT if timeout is None else timeout
        deadline = time.perf_counter() + limit
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise AgentNotReady(f"agent exited with {self.proc.returncode}: {self.exit_output()}")
            try:
                status = agent_status(self.socket)
                if status["phase"] == "ready":
                    return status
            except AgentUnavailable:
                pass
            time.sleep(self.POLL_SECONDS)
        raise AgentNotReady(f"agent not ready within {limit:g}s")

    def __enter__(self) -> AgentProcess:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def status(self) -> dict[str, Any]:
        return agent_status(self.socket)

    def exit_output(self) -> str:
        """What the agent wrote to stderr: all of the pipe (it blocks until the agent exits), or
        the last `LOG_TAIL` characters of the log file."""
        if self.log_path is None:
            return self.proc.stderr.read()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-self.LOG_TAIL:]

    def stderr(self) -> str:
        """`exit_output()` once the agent exited; "" while it runs (reading would block)."""
        return self.exit_output() if self.proc.poll() is not None else ""

    def torch_loaded(self) -> bool:
        return maps_libtorch(self.proc.pid)

    def stop(self, kill: bool = False) -> int:
        """Its exit status, once it exited: after SIGTERM (SIGKILL past `STOP_TIMEOUT`), or at once
        after SIGKILL with `kill`. The stderr pipe stays open for the caller to read."""
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(self.STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
        self.proc.wait()
        if self._log_file is not None:
            self._log_file.close()
        return self.proc.returncode
