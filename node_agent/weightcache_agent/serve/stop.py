"""A stop request that a signal handler can raise safely: a self-pipe, not a `threading.Event`.

A Python signal handler runs on the main thread between bytecodes. If the main thread is
inside `Event.wait()` at that moment it holds the Event's internal lock, and a handler that
calls `Event.set()` waits for that same lock: the process ignores the signal for good. Here
the handler only writes one byte to a non-blocking pipe (no lock involved), and `wait()`
selects on the pipe's read end, so a signal that lands before, during or after the wait is
seen at once. `set()` works from any thread too; `is_set()` never blocks.

Used by every long-running entry point: the agent worker, the node supervisor, the engine.
"""
from __future__ import annotations

import os
import select
import signal
import time
from typing import Any


class StopFlag:
    """Duck-compatible with the parts of `threading.Event` the main loops use: set, is_set, wait."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._set = False
        self.signal: int | None = None  # the signal that asked for the stop, if one did

    def set(self) -> None:
        self._set = True
        try:
            os.write(self._write, b"x")
        except BlockingIOError:  # the pipe is full of earlier wake-ups: one is enough
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False after `timeout` seconds otherwise."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            readable, _, _ = select.select([self._read], [], [], left)
            if readable:
                try:
                    while os.read(self._read, 512):
                        pass
                except BlockingIOError:
                    pass
        return True

    def on_signals(self, *signums: int) -> "StopFlag":
        """Make each of `signums` set this flag; returns self."""
        for signum in signums or (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handler)
        return self

    def _handler(self, signum: int, _frame: Any) -> None:
        self.signal = signum
        self.set()

    def close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
