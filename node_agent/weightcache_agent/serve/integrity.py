"""Keep proving that the arena an agent serves holds the bytes it loaded.

On the cuda backend any engine that holds the arena's handle can map it read-write (the
driver shares allocations, not read-only views), so the agent checks. After a fill (or an
adoption that passed the same check) the agent hands a `Scrubber` the arena, its secret key
and the digest it recorded (arena/digest.py). The scrubber's thread re-digests the arena one
segment at a time, sleeping after each so that its busy time stays under `DUTY` of the wall
clock, and starts a pass every `interval` seconds (at once when a paced pass took longer).
A write lands in a segment the next pass reads: it is caught within two pass periods,
max(interval, busy time of a pass / DUTY) each -- 10 s with the default 5 s interval for any
arena whose whole digest takes under 50 ms (a 100 GB arena at 2 TB/s). `verify()` runs one
whole pass now, unpaced (a privileged socket request; `weightcache status --verify`).

The first segment that differs calls `on_mismatch(index)` once and ends the scrubber: the
agent stops handing that arena out and fills a fresh one.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ..arena.digest import ArenaDigest

log = logging.getLogger(__name__)

SCRUB_INTERVAL = 5.0  # seconds between the starts of two passes (detection within two of them)
DUTY = 0.01  # the scrub's share of the device's (or one core's) time


class Scrubber:
    def __init__(self, arena: Any, key: bytes, digest: ArenaDigest, on_mismatch: Callable[[int], None],
                 interval: float = SCRUB_INTERVAL, duty: float = DUTY):
        self.arena, self.key, self.digest = arena, key, digest
        self.on_mismatch, self.interval, self.duty = on_mismatch, interval, duty
        self.state = "verified"  # the digest was just made from (or checked against) these bytes
        self.passes = 0
        self.last_verified_at = time.time()
        self.last_pass_seconds: float | None = None  # wall time of the last whole pass, pacing included
        self.busy_seconds = 0.0  # time spent digesting, all passes together
        self.mismatch: int | None = None  # the first segment found changed
        self._check_lock = threading.Lock()  # one segment digested at a time: the schedule's or a verify's
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="scrub", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def verify(self) -> dict[str, Any]:
        """One whole pass now, unpaced: {"ok", "seconds", "bytes"} (ok False once a segment differs)."""
        started = time.monotonic()
        ok = all(self._check(i) for i in range(len(self.digest.values)))
        if ok:
            self.last_verified_at = time.time()
        return {"ok": ok, "seconds": time.monotonic() - started, "bytes": self.digest.size}

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "algorithm": self.digest.algorithm, "interval_seconds": self.interval,
                "duty": self.duty, "passes": self.passes, "last_verified_at": self.last_verified_at,
                "last_pass_seconds": self.last_pass_seconds, "busy_seconds": round(self.busy_seconds, 6),
                "segments": len(self.digest.values)}

    def _run(self) -> None:
        errors = 0
        while not self._stopped.is_set():
            started = time.monotonic()
            try:
                for index in range(len(self.digest.values)):
                    t0 = time.monotonic()
                    if not self._check(index):
                        return
                    # Sleep so that this segment's work is `duty` of the time it took plus the sleep.
                    if self._stopped.wait((time.monotonic() - t0) * (1 / self.duty - 1)):
                        return
            except Exception as e:  # a driver error: say so once in a while, try again next pass
                errors += 1
                if errors == 1 or errors % 100 == 0:
                    log.warning("the arena scrub failed (%s: %s); retrying every %.0fs", type(e).__name__, e,
                                self.interval)
                self.state = "error"
            else:
                self.passes += 1
                self.last_verified_at = time.time()
                self.last_pass_seconds = time.monotonic() - started
                self.state = "verified"
            self._stopped.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def _check(self, index: int) -> bool:
        if self.mismatch is not None or self._stopped.is_set():
            return self.mismatch is None
        with self._check_lock:
            t0 = time.monotonic()
            value = self.arena.digest_segment(self.key, index)
            self.busy_seconds += time.monotonic() - t0
            if value == self.digest.values[index] or self.mismatch is not None:
                return self.mismatch is None
            self.mismatch, self.state = index, "tampered"
        self._stopped.set()
        self.on_mismatch(index)
        return False
