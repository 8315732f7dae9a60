"""The plan types every stage of the cold path shares.

`loader.plan_tensors` turns a checkpoint and a spec into `PlannedTensor`s (what the arena
holds and how each tensor gets there); the fill pipelines (`pipeline` for host memory,
`cuda_fill` for the GPU) consume them and advance one `LoadProgress`, which the agent's
status reads while the load runs. Kept apart so that the loader and its pipelines
import these, never each other.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoint import TensorRecord
from .sharding import Shard


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: TensorRecord | None  # None: made by the loader (a quantization scale)
    kind: str = "weight"  # "weight" | "extra" (weight_scale_inv)
    shard: Shard | None = None  # which bytes of `source` this rank reads
    transform: str = "read"  # "read" (bytes as they are) | "cast" | "fp8"


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
