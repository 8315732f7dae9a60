"""The cold path: checkpoint on disk -> planned tensors -> filled, sealed arena.

`plan_tensors` decides what the arena will hold (which tensors, in which dtype and
shape); `lay_out` places them; `fill_arena` reads each tensor's bytes straight from the
file into its slot (one copy, no intermediate buffer unless a dtype cast is needed);
the arena is then sealed. The agent and an engine in `off` mode run exactly this code,
which is what makes their weights bit-identical.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoint import Checkpoint, TensorRecord, dtype_from_name, open_checkpoint
from .cpu_arena import CpuArena
from .errors import CheckpointError
from .fingerprint import fingerprint, fingerprint_fields, resolved_dtype
from .layout import ArenaLayout, lay_out
from .spec import CacheSpec

log = logging.getLogger(__name__)

READ_CHUNK = 64 * 1024 * 1024


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: TensorRecord
    kind: str = "weight"


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


@dataclass
class LoadedCache:
    spec: CacheSpec
    checkpoint: Checkpoint
    arena: CpuArena
    layout: ArenaLayout
    fields: dict[str, Any]
    fingerprint: str
    load_seconds: float


def plan_tensors(checkpoint: Checkpoint, spec: CacheSpec) -> list[PlannedTensor]:
    """What the arena holds, in file order so the disk reads sequentially."""
    if spec.quantization != "none":
        raise CheckpointError(f"quantization {spec.quantization!r} is accepted but its loader is not built yet")
    if spec.tp_size != 1:
        raise CheckpointError(f"tensor parallelism (tp_size={spec.tp_size}) needs a sharding plan, not available yet")
    target = None if spec.dtype == "auto" else dtype_from_name(spec.dtype)
    planned = []
    for record in sorted(checkpoint.tensors.values(), key=lambda r: (r.file, r.start)):
        dtype = target if target is not None and record.dtype.is_floating_point else record.dtype
        planned.append(PlannedTensor(record.name, dtype, record.shape, record))
    return planned


def fill_arena(buffer: memoryview, layout: ArenaLayout, plan: list[PlannedTensor], progress: LoadProgress) -> None:
    """Read every planned tensor from disk into its slot of `buffer`."""
    slots = {slot.name: slot for slot in layout.slots}
    fds: dict[str, int] = {}
    try:
        for item in plan:
            src = item.source
            fd = fds.get(src.file)
            if fd is None:
                fd = fds[src.file] = os.open(src.file, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            slot = slots[item.name]
            dest = buffer[slot.offset : slot.offset + slot.nbytes]
            if item.dtype == src.dtype:
                _read_exact(fd, dest, src, progress)
            else:
                staging = bytearray(src.nbytes)
                _read_exact(fd, memoryview(staging), src, progress)
                out = torch.frombuffer(dest, dtype=item.dtype) if slot.nbytes else torch.empty(0, dtype=item.dtype)
                out.copy_(torch.frombuffer(staging, dtype=src.dtype) if src.nbytes else torch.empty(0, dtype=src.dtype))
                del out
            progress.advance(0, tensors=1)
    finally:
        for fd in fds.values():
            os.close(fd)


def _read_exact(fd: int, dest: memoryview, src: TensorRecord, progress: LoadProgress) -> None:
    done = 0
    while done < src.nbytes:
        n = os.preadv(fd, [dest[done : done + READ_CHUNK]], src.start + done)
        if n <= 0:
            raise CheckpointError(f"{src.file}: tensor {src.name!r}: file ended after {done} of {src.nbytes} bytes (truncated)")
        done += n
        progress.advance(n)


def load_cache(spec: CacheSpec, progress: LoadProgress | None = None, show_bar: bool = False, name: str = "weightcache") -> LoadedCache:
    """Run the whole cold path for `spec` and return a sealed arena with its layout."""
    t0 = time.monotonic()
    checkpoint = open_checkpoint(spec.model)
    plan = plan_tensors(checkpoint, spec)
    layout = lay_out((p.name, p.dtype, p.shape, p.kind) for p in plan)
    progress = progress or LoadProgress()
    progress.start(sum(p.source.nbytes for p in plan), len(plan), show_bar)
    arena = CpuArena(layout.size, name=name)
    try:
        buffer = arena.writable()
        try:
            fill_arena(buffer, layout, plan, progress)
        finally:
            buffer.release()
            progress.finish()
        arena.seal()
    except BaseException:
        arena.close()
        raise
    fields = fingerprint_fields(spec, checkpoint)
    seconds = time.monotonic() - t0
    log.info("loaded %s: %d tensors, %.2f GiB in %.2fs (dtype %s)", checkpoint.directory, len(plan),
             layout.nbytes / 2**30, seconds, resolved_dtype(spec, checkpoint))
    return LoadedCache(spec, checkpoint, arena, layout, fields, fingerprint(fields), seconds)
