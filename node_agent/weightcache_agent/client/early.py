"""The attach path prepared while an engine starts, without the engine asking: the state, no torch.

A first attach in a fresh process pays once-per-process costs (importing the attach path and
cuda-bindings, the driver's first VMM import and map, torch's first tensor over foreign device
memory) that `prepare()` moves to engine start. An engine whose environment names its agent
(`$WEIGHTCACHE_SOCKET`, or `$WEIGHTCACHE_SOCKET_DIR` with one device in `$WEIGHTCACHE_DEVICES`:
what the operator injects) gets the same without calling anything: `warmup.begin` starts, here,
a thread that asks the agent which device it serves and warms the attach path on that device
while the engine goes on importing and building its model; `attach` and `prepare` wait for it
(`wait`, `warmed`) and use what it did. This module holds that thread and its outcome, and is
torch-free so that the package can ask `wanted()` at its import.

It makes a CUDA context only on the GPU the agent serves, the one the attach maps, and it maps
no arena (that would hold the agent's memory in a process that may never attach; an explicit
`prepare(socket=...)` still does). `$WEIGHTCACHE_PREPARE=off` turns it off.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Callable

from .env import socket_to_prepare

log = logging.getLogger(__name__)

ENV_PREPARE = "WEIGHTCACHE_PREPARE"
_EXIT_WAIT = 10.0  # at interpreter exit: a thread inside the driver must not outlive the interpreter

# What the thread runs: the agent's socket -> (the device warmed, a CUDA ordinal or "cpu"; seconds per step).
Work = Callable[[str], "tuple[int | str, dict[str, float]]"]


class EarlyPrepare:
    """`work` for the agent at `socket`, on a thread of its own."""

    def __init__(self, socket: str, work: Work):
        self.socket = socket
        self.device: int | str | None = None
        self.took: dict[str, float] = {}
        self.error: str | None = None
        self._work = work
        self.thread = threading.Thread(target=self._run, name="weightcache-prepare", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.device, self.took = self._work(self.socket)
        except Exception as e:  # noqa: BLE001 (an absent agent, no GPU: the attach does it all and says what is wrong)
            self.error = f"{type(e).__name__}: {e}"
            log.debug("attach path not prepared at start for %s: %s", self.socket, self.error)


_current: EarlyPrepare | None = None
_lock = threading.Lock()


def enabled() -> bool:
    """False where `$WEIGHTCACHE_PREPARE` says off (or anything but auto/on: a value this code does not know)."""
    value = os.environ.get(ENV_PREPARE, "auto").strip().lower()
    if value in ("", "auto", "on", "1"):
        return True
    if value not in ("off", "0"):
        log.warning("$%s=%r is neither auto nor off: the attach path is not prepared at start", ENV_PREPARE,
                    os.environ[ENV_PREPARE])
    return False


def wanted() -> bool:
    """Whether `begin` without a socket would start anything (cheap: the environment only)."""
    return _current is None and enabled() and socket_to_prepare() is not None


def begin(work: Work, socket: str | None = None) -> bool:
    """Start `work` for the agent at `socket` (default: the one the environment names; nothing where
    it names none) on a thread. Once per process: True only for the call that started it."""
    global _current
    if _current is not None or not enabled():
        return False
    socket = socket or socket_to_prepare()
    if socket is None:
        return False
    with _lock:
        if _current is not None:
            return False
        _current = EarlyPrepare(socket, work)
    atexit.register(_current.thread.join, _EXIT_WAIT)
    return True


def wait(timeout: float = 30.0) -> EarlyPrepare | None:
    """The preparation `begin` started, once it is done; None where none was started (or it is
    still running after `timeout`, or this is its own thread)."""
    started = _current
    if started is None or started.thread is threading.current_thread():
        return None
    started.thread.join(timeout)
    return None if started.thread.is_alive() else started


def warmed(device: int | str) -> dict[str, float] | None:
    """What the preparation at start did for `device` (seconds per step), or None: not that device."""
    done = wait()
    return dict(done.took) if done is not None and done.device == device and done.took else None
