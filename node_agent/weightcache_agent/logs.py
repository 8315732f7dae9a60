"""Logging set-up shared by the agent and the operator: text for people, JSON for collectors; and
the steps of a process's start-up as seconds since it started, which agents and engines report.

A process has one stderr handler for its whole life. It writes each record as one whole line
under `TERMINAL_LOCK`, the lock a progress bar (`load.progress`) draws under too; while a bar
is drawn the handler clears it, writes the line from column 0 and draws the bar again below.
Nothing swaps handlers while threads log, so no line can land inside another line or a bar."""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


# Held for every write to the terminal: a log line, or a progress bar's drawing (tqdm is told to
# use it). Reentrant, because a bar redrawn after a line is drawn while the line's write holds it.
TERMINAL_LOCK = threading.RLock()
_bar_class: Any = None  # tqdm, once a progress bar may be drawn in this process


def share_terminal_with_bars(bar_class: Any) -> None:
    """Make progress bars of `bar_class` (tqdm) draw under `TERMINAL_LOCK`, and every log line
    clear them before it is written and draw them again after. Call before the first bar."""
    global _bar_class
    with TERMINAL_LOCK:
        bar_class.set_lock(TERMINAL_LOCK)
        _bar_class = bar_class


class LineHandler(logging.StreamHandler):
    """A stream handler that writes each record whole (one write, newline included) under
    `TERMINAL_LOCK`, clearing any progress bar on the same terminal first and redrawing it after."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
            with TERMINAL_LOCK:
                if _bar_class is None:
                    self._write(line)
                else:
                    with _bar_class.external_write_mode(file=self.stream, nolock=True):
                        self._write(line)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def _write(self, line: str) -> None:
        self.stream.write(line)
        self.stream.flush()


def configure(fmt: str = "text", level: int = logging.INFO) -> None:
    handler = LineHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def process_start_time() -> float:
    """This process's start as a `time.time()` value (from /proc; now, where there is none)."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # field 22 (starttime, in clock ticks after boot); after_name starts at field 3
        return time.time() - uptime + int(after_name[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class Phases:
    """Steps of this process's start-up, each as seconds since the process started (the kernel's
    record of the start, so the interpreter's own start-up counts)."""

    def __init__(self) -> None:
        self.started = process_start_time()
        self.at: dict[str, float] = {}
        self._lock = threading.Lock()

    def mark(self, step: str, when: float | None = None) -> float:
        """Record `step` as done now (or at `when`, a `time.time()` value); its seconds since start."""
        seconds = round((time.time() if when is None else when) - self.started, 4)
        with self._lock:
            self.at[step] = seconds
        return seconds

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return dict(sorted(self.at.items(), key=lambda kv: kv[1]))
