"""SIGTERM always stops a main loop: 500 signals, each landing at a random moment of the wait."""
from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time

import pytest

CHILD = os.path.join(os.path.dirname(__file__), "stop_child.py")
TRIALS = 500


class Lines:
    """Line reader over a pipe with a timeout per line (no buffering hides a line from select)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.buf = proc, b""

    def next(self, timeout: float) -> bytes | None:
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line


def test_500_sigterms_each_stop_the_wait(capsys):
    proc = subprocess.Popen([sys.executable, CHILD], stdout=subprocess.PIPE, bufsize=0)
    lines = Lines(proc)
    rng = random.Random(20261130)
    started = time.monotonic()
    stopped = 0
    try:
        for trial in range(TRIALS):
            assert lines.next(30 if trial == 0 else 5) == b"ready", f"trial {trial}: child not ready"
            time.sleep(rng.random() * 0.002)
            proc.send_signal(signal.SIGTERM)
            if lines.next(5) != b"stopped":
                pytest.fail(f"SIGTERM {trial + 1} of {TRIALS} was ignored for 5 s")
            stopped += 1
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    seconds = time.monotonic() - started
    with capsys.disabled():
        print(f"\nSIGTERM trials: {TRIALS} sent, {stopped} stopped the wait, {seconds:.1f}s")
    assert stopped == TRIALS
