"""`weightcache agent` as a child process of a benchmark, timed from outside.

The benchmarks start the agent the way a user does (`python -m weightcache_agent agent`),
note the moment they did, and poll its status over the socket until it says ready:
the wall time from process start to serving comes back in the status as
`wall_seconds`. Its stderr goes to `<socket>.log`, whose tail is the message when it
exits early. Torch-free: a benchmark that measures fresh processes imports it too.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

from weightcache_agent import agent_status
from weightcache_agent.errors import AgentUnavailable


class AgentProcess:
    """One agent serving `model` on `sock` with `backend`; `extra` are further agent flags."""

    READY_TIMEOUT = 1800.0  # seconds; a cold load of a large checkpoint on a slow disk

    def __init__(self, model: str, sock: str, backend: str, *extra: str, env: dict[str, str] | None = None,
                 log_mode: str = "a"):
        self.sock = sock
        self.started = time.perf_counter()
        self.log = open(sock + ".log", log_mode)
        self.proc = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket",
                                      sock, "--backend", backend, "--progress", "never", *extra],
                                     stdout=subprocess.DEVNULL, stderr=self.log, env=env)

    def ready(self, timeout: float | None = None) -> dict[str, Any]:
        """The agent's status once it says ready, plus `wall_seconds` since the process started."""
        deadline = time.perf_counter() + (self.READY_TIMEOUT if timeout is None else timeout)
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                with open(self.sock + ".log") as f:
                    tail = f.read()[-3000:]
                raise SystemExit(f"agent exited {self.proc.returncode}: {tail}")
            try:
                status = agent_status(self.sock)
                if status["phase"] == "ready":
                    status["wall_seconds"] = time.perf_counter() - self.started
                    return status
            except AgentUnavailable:
                pass
            time.sleep(0.002)
        raise SystemExit("agent not ready in time")

    def torch_loaded(self) -> bool:
        """Whether libtorch is mapped into the agent process (Linux /proc)."""
        with open(f"/proc/{self.proc.pid}/maps") as f:
            return any("libtorch" in line for line in f)

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        self.proc.wait()
