"""How far a load has got: counters the loader advances and the agent's status reads.

Kept apart from the plan types (which need torch) so that an agent serving a re-adopted
arena reports its progress without importing torch.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoadProgress:
    """Counters the loader advances and `status` reads (plain ints: safe to read racily)."""

    bytes_total: int = 0
    tensors_total: int = 0
    bytes_done: int = 0
    tensors_done: int = 0
    started: float = field(default_factory=time.monotonic)
    _bar: Any = None

    def start(self, bytes_total: int, tensors_total: int, show_bar: bool) -> None:
        self.bytes_total, self.tensors_total = bytes_total, tensors_total
        self.started = time.monotonic()
        if show_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=bytes_total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading", file=sys.stderr)

    def advance(self, nbytes: int, tensors: int = 0) -> None:
        self.bytes_done += nbytes
        self.tensors_done += tensors
        if self._bar is not None:
            self._bar.update(nbytes)
            if tensors:
                self._bar.set_postfix_str(f"{self.tensors_done}/{self.tensors_total} tensors", refresh=False)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def to_json(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self.started
        rate = self.bytes_done / elapsed if elapsed > 0 else 0.0
        remaining = self.bytes_total - self.bytes_done
        return {
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "tensors_done": self.tensors_done,
            "tensors_total": self.tensors_total,
            "fraction": self.bytes_done / self.bytes_total if self.bytes_total else 0.0,
            "bytes_per_second": rate,
            "eta_seconds": remaining / rate if rate > 0 else None,
        }
