"""`weightcache agent` as a child process of a benchmark, timed from outside.

The process, its readiness and its stop are `weightcache_agent.testing.agent_process`'s,
as the tests use them; here they take a benchmark's terms. The backend is an argument of
its own. The wait allows a cold load of a large checkpoint, and polls often enough to time
a restart in milliseconds: the wall time from process start to serving comes back in the
status as `wall_seconds`. Its stderr goes to `<socket>.log`, whose tail is the message when
it exits early, as a `SystemExit`: the benchmark ends with that message, not a traceback.
Torch-free: a benchmark that measures fresh processes imports it too.
"""
from __future__ import annotations

import time
from typing import Any

from weightcache_agent.testing import agent_process as harness


class AgentProcess(harness.AgentProcess):
    """One agent serving `model` on `sock` with `backend`; `extra` are further agent flags."""

    READY_TIMEOUT = 1800.0  # seconds; a cold load of a large checkpoint on a slow disk
    POLL_SECONDS = 0.002  # a restart is timed in milliseconds: the poll must not add tens of them
    STOP_TIMEOUT = None  # a large arena takes its time to go; a benchmark waits rather than kill it

    def __init__(self, model: str, sock: str, backend: str, *extra: str, env: dict[str, str] | None = None,
                 log_mode: str = "a") -> None:
        super().__init__(model, sock, "--backend", backend, *extra, env=env, log_path=sock + ".log",
                         log_mode=log_mode)

    @property
    def sock(self) -> str:
        return self.socket

    def ready(self, timeout: float | None = None) -> dict[str, Any]:
        """The agent's status once it says ready, plus `wall_seconds` since the process started."""
        try:
            status = self.wait_ready(timeout)
        except harness.AgentNotReady as e:
            raise SystemExit(str(e)) from None
        status["wall_seconds"] = time.perf_counter() - self.started
        return status
