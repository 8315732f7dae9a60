"""How far a cold load has come: for the status API, a terminal's bar, and log lines.

The fill pipelines (`pipeline`, `cuda_fill`) advance one `LoadProgress` from their
threads; the agent's status reads its counters racily (plain ints). Where a person
watches a terminal, a tqdm bar draws them; where nobody does (`kubectl logs`, a log
file, a supervisor's worker) a ticker thread logs one line every few seconds instead, so
a load of minutes is never silent between "listening" and "loaded". The bar draws under the
lock the process's log handler writes under (`logs.TERMINAL_LOCK`), and that handler clears
the bar, writes its line from column 0 and draws the bar again, so neither overwrites the other.
Kept apart from the plan types (which need torch), and importing nothing heavy, so that an
agent serving a re-adopted arena reports its progress without importing torch.

Two sizes are kept apart and always named: what is *read* (the source tensors' bytes
this rank takes from disk, which the bar and the rate count) and what ends *resident*
(the arena's tensors after casting or quantization: fp8-block halves the bytes and adds
one scale tensor per weight). The start line, every progress line and the final
summary say both, with the quantization, in the same words.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Seconds between progress lines when no bar is drawn; 0 turns them off.
INTERVAL_ENV = "WEIGHTCACHE_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 5.0


def interval_problem() -> str | None:
    """Why `WEIGHTCACHE_PROGRESS_INTERVAL` is unusable, or None (for a command's start-up checks)."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return None
    try:
        if float(raw) >= 0:  # False for NaN too
            return None
    except ValueError:
        pass
    return f"${INTERVAL_ENV}={raw!r} is not a number of seconds: set it to one like 5 (0: no progress lines), or unset it"


def log_interval(default: float = DEFAULT_INTERVAL) -> float:
    """Seconds between progress lines, from `WEIGHTCACHE_PROGRESS_INTERVAL` (else `default`).

    An unusable value is logged and replaced by `default`: a load is never refused for how
    often it reports (commands check `interval_problem` at start-up instead).
    """
    problem = interval_problem()
    if problem:
        log.warning("%s; using %gs", problem, default)
        return default
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    return float(raw) if raw else default


def size_text(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1: a 3 MiB model is "3.2 MiB",
    never "0.00 GiB" (two decimals from GiB up, where a hundredth still matters)."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if abs(n) >= 1024**power:
            return f"{n / 1024**power:.{2 if power >= 3 else 1}f} {unit}"
    return f"{int(n)} B"


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{seconds:.0f}s" if seconds < 60 else f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"


def _rate(n: float) -> str:
    return f"{n / 2**30:.2f} GiB/s" if n >= 2**30 else f"{n / 2**20:.0f} MiB/s"


@dataclass
class LoadProgress:
    """Counters the loader advances and `status` reads (plain ints: safe to read racily)."""

    bytes_total: int = 0  # bytes to read from disk (this rank's shards of the source tensors)
    tensors_total: int = 0  # source tensors to read
    bytes_done: int = 0
    tensors_done: int = 0
    bytes_resident: int = 0  # bytes the arena's tensors take once loaded (after cast / quantization)
    tensors_resident: int = 0  # tensors in the arena (source tensors plus the scales quantization adds)
    quantization: str = "none"
    started: float = field(default_factory=time.monotonic)
    _bar: Any = None
    _stop: threading.Event | None = None
    _ticker: threading.Thread | None = None

    def start(self, bytes_total: int, tensors_total: int, show_bar: bool, *, bytes_resident: int = 0,
              tensors_resident: int = 0, quantization: str = "none", log_every: float = 0.0, what: str = "") -> None:
        """Begin counting. With `show_bar` a tqdm bar on stderr; else, with `log_every` > 0, a line that often."""
        self.bytes_total, self.tensors_total = bytes_total, tensors_total
        self.bytes_resident, self.tensors_resident = bytes_resident or bytes_total, tensors_resident or tensors_total
        self.quantization = quantization
        self.started = time.monotonic()
        if show_bar:
            from tqdm import tqdm

            from ..logs import TERMINAL_LOCK, share_terminal_with_bars

            share_terminal_with_bars(tqdm)
            # Held across the whole construction: tqdm draws the bar before it marks the bar started,
            # and a log line in between would not know to clear it.
            with TERMINAL_LOCK:
                self._bar = tqdm(total=bytes_total, unit="B", unit_scale=True, unit_divisor=1024, desc="reading",
                                 file=sys.stderr)
                self._bar.set_postfix_str(f"0/{tensors_total} source tensors", refresh=False)
        elif log_every > 0:
            self._stop = threading.Event()
            self._ticker = threading.Thread(target=self._tick, args=(self._stop, log_every, what), name="progress",
                                            daemon=True)
            self._ticker.start()

    def advance(self, nbytes: int, tensors: int = 0) -> None:
        self.bytes_done += nbytes
        self.tensors_done += tensors
        if self._bar is not None:
            self._bar.update(nbytes)
            if tensors:
                self._bar.set_postfix_str(f"{self.tensors_done}/{self.tensors_total} source tensors", refresh=False)

    def finish(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        if self._ticker is not None:  # a line being written now comes before the load's last line, never after
            self._ticker.join()
            self._ticker = None
        if self._bar is not None:
            from ..logs import TERMINAL_LOCK

            with TERMINAL_LOCK:  # tqdm forgets the bar before its last drawing: no line may come between
                self._bar.close()
            self._bar = None

    def _tick(self, stop: threading.Event, every: float, what: str) -> None:
        while not stop.wait(every):
            log.info("%s", self.line(what))

    def target(self) -> str:
        """What the load ends as: '355 tensors, 1.15 GiB resident (fp8-block)'."""
        quant = f" ({self.quantization})" if self.quantization != "none" else ""
        return f"{self.tensors_resident} tensors, {size_text(self.bytes_resident)} resident{quant}"

    def line(self, what: str = "") -> str:
        """One progress line: read bytes, percentage, rate, ETA, source tensors, and the resident target."""
        p = self.to_json()
        return (f"loading{' ' + what if what else ''}: read {size_text(self.bytes_done)} of "
                f"{size_text(self.bytes_total)} "
                f"({p['fraction']:.0%}), {_rate(p['bytes_per_second'])}, "
                f"ETA {_eta(p['eta_seconds'])}, {self.tensors_done}/{self.tensors_total} source "
                f"tensors -> {self.target()}")

    def to_json(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self.started
        rate = self.bytes_done / elapsed if elapsed > 0 else 0.0
        remaining = self.bytes_total - self.bytes_done
        return {
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "tensors_done": self.tensors_done,
            "tensors_total": self.tensors_total,
            "bytes_resident": self.bytes_resident,
            "tensors_resident": self.tensors_resident,
            "quantization": self.quantization,
            "fraction": self.bytes_done / self.bytes_total if self.bytes_total else 0.0,
            "bytes_per_second": rate,
            "eta_seconds": remaining / rate if rate > 0 else None,
        }
