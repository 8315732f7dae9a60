"""The served arena's integrity: its secret key, its keyed digest, and the scrub that keeps checking it.

Every fill is digested with a fresh secret key before anyone gets the handle (`guard`), the
key and digest are recorded beside the socket (serve/restart_state.py) for a successor, and a
`Scrubber` (serve/integrity.py) re-checks the bytes on a paced schedule and on demand
(`verify`). An arena an engine offers back after a restart is adopted only when it digests,
with the recorded key, to the recorded digest (`check_offer`).

When the scrub finds a segment changed it calls `on_tamper` (the arena holder's: it stops
handing the arena out and fills a fresh one, serve/arena_holder.py); the counters and the
quarantine flag kept here are what status reports under "integrity".
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..arena.digest import ArenaDigest, new_key
from .integrity import Scrubber
from .restart_state import RestartState

log = logging.getLogger(__name__)


class ArenaGuard:
    def __init__(self, state: RestartState, scrub_interval: float, on_tamper: Callable[[int], None]):
        self.state, self.scrub_interval, self.on_tamper = state, scrub_interval, on_tamper
        self.key: bytes | None = None
        self.digest: ArenaDigest | None = None
        self.scrubber: Scrubber | None = None
        self.error: str | None = None  # why no digest could be made: the arena is served unchecked
        # Written under the lease book's lock by the arena holder, which quarantines and refills.
        self.quarantined = False  # the served arena was found changed: nothing hands it out
        self.tampered = 0  # arenas found changed
        self.refills = 0

    def guard(self, arena: Any, fresh: bool) -> float | None:
        """Digest a freshly filled arena where its bytes are (before anyone gets its handle) and record
        the digest beside the socket; then keep checking it (an adopted arena's digest was checked
        against the recorded one already). The seconds it took, or None: a digest that cannot be
        made is logged as an error and reported in status ("unavailable"); the arena is served
        regardless."""
        started = time.monotonic()
        try:
            if fresh:
                self.key = new_key()
                self.digest = arena.digest(self.key)
                self.state.write_digest(self.key, self.digest)
        except Exception as e:  # noqa: BLE001 -- a driver or compiler failure: loud, not fatal
            self.key = self.digest = None
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log.error("cannot digest the arena (%s): its content is not checked, and a restarted agent will "
                      "not adopt it", self.error)
            return None
        seconds = time.monotonic() - started
        if self.key is not None and self.digest is not None:
            self.scrubber = Scrubber(arena, self.key, self.digest, self.on_tamper, interval=self.scrub_interval)
            self.scrubber.start()
        return seconds

    def check_offer(self, arena: Any, pid: int | None, uid: int) -> float | None:
        """Whether an offered arena holds exactly what the predecessor loaded (its keyed digest): the
        seconds the check took, or None (logged). On success this guard takes over key and digest."""
        recorded = self.state.recorded_digest(arena.size)
        if recorded is None:
            log.warning("not adopting the arena offered by pid=%s uid=%s: no recorded digest to check it against",
                        pid, uid)
            return None
        key, digest = recorded
        started = time.monotonic()
        try:
            values = arena.digest(key).values
        except Exception as e:  # noqa: BLE001 -- the offer is refused; the disk is the way
            log.warning("not adopting the arena offered by pid=%s uid=%s: cannot digest it (%s)", pid, uid, e)
            return None
        if values != digest.values:
            changed = next(i for i, (a, b) in enumerate(zip(values, digest.values)) if a != b)
            log.warning("refused to adopt the arena offered by pid=%s uid=%s: its bytes are not the ones this "
                        "agent loaded (segment %d differs from the recorded digest)", pid, uid, changed)
            return None
        self.key, self.digest = key, digest
        return time.monotonic() - started

    def segments(self) -> int:
        return len(self.digest.values) if self.digest else 0

    def stop(self) -> None:
        if self.scrubber is not None:
            self.scrubber.stop()

    def to_json(self) -> dict[str, Any]:
        """Whether the served arena still holds what was loaded: state verified / tampered / unverified
        / unavailable / error, the scrub's schedule and cost, arenas found changed."""
        scrubber = self.scrubber
        out: dict[str, Any] = scrubber.to_json() if scrubber is not None else {
            "state": "unavailable" if self.error else "unverified"}
        if self.quarantined:
            out["state"] = "tampered"
        out.update(tampered=self.tampered, refills=self.refills)
        if self.error:
            out["error"] = self.error
        return out
