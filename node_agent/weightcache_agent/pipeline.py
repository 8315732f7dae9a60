"""Fill an arena from disk with reading and transforming overlapped, so the disk never waits.

Data flow:

    reader (calling thread, file order)
      plain tensor  --preadv of its segments-------------------------------> arena slot  (one copy)
      cast / fp8    --preadv into a staging buffer--> queue --> worker(s) --> arena slot(s)
                         ^                                        |
                         +---------- buffer back to the pool -----+

The reader walks the plan in file order and never transforms anything; a tensor that
needs a cast or FP8 quantization is read in pieces of whole 128-row blocks into one of
a few reusable staging buffers, and worker threads (torch kernels release the GIL)
turn each piece into its final bytes in the arena. The pool of staging buffers bounds
memory and is the back-pressure: the reader blocks only when every worker is behind.
Only the segments of this rank's shard are read (see `sharding.Shard.segments`).
"""
from __future__ import annotations

import bisect
import mmap
import os
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import fp8
from .errors import CheckpointError
from .layout import ArenaLayout, TensorSlot
from .sharding import Segment

if TYPE_CHECKING:
    from .loader import LoadProgress, PlannedTensor

STAGING_BYTES = 32 * 1024 * 1024
READ_CHUNK = 64 * 1024 * 1024
RESERVE_CHUNK = 64 * 1024 * 1024


class _Reservations:
    """Arena pages reserved on a thread, ahead of the writers, so allocation overlaps the disk.

    `reserve(offset, length)` (CpuArena.reserve) allocates and faults in a range; writers
    call `wait(end)` before touching bytes below `end`. Slots are laid out in plan order,
    so one pass from the start keeps ahead of the reader.
    """

    def __init__(self, reserve: Any, size: int):
        self.done = 0 if reserve is not None else size
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.stop = False
        if reserve is not None:
            self.thread = threading.Thread(target=self._run, args=(reserve, size), name="load-reserve", daemon=True)
            self.thread.start()

    def _run(self, reserve: Any, size: int) -> None:
        try:
            for offset in range(0, size, RESERVE_CHUNK):
                if self.stop:
                    return
                reserve(offset, min(RESERVE_CHUNK, size - offset))
                with self.cond:
                    self.done = min(size, offset + RESERVE_CHUNK)
                    self.cond.notify_all()
        except BaseException as e:
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def wait(self, end: int) -> None:
        if self.done >= end:
            return
        with self.cond:
            while self.done < end and self.error is None:
                self.cond.wait()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.stop = True
        if hasattr(self, "thread"):
            self.thread.join()


@dataclass
class _Piece:
    item: "PlannedTensor"
    row0: int
    row1: int
    staging: Any  # mmap the rows were read into


class _Reader:
    """preadv of shard segments into a destination, with the truncation check."""

    def __init__(self, progress: "LoadProgress"):
        self.progress = progress
        self.fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        fd = self.fds.get(path)
        if fd is None:
            fd = self.fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def read(self, item: "PlannedTensor", segments: list[Segment], lo: int, hi: int, dest: memoryview) -> None:
        """Read bytes [lo, hi) of the shard (source dtype, slot order) into `dest[0 : hi - lo]`."""
        src = item.source
        fd = self.fd(src.file)
        starts = [s.dest_offset for s in segments]
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while i < len(segments) and segments[i].dest_offset < hi:
            seg = segments[i]
            a, b = max(lo, seg.dest_offset), min(hi, seg.dest_offset + seg.nbytes)
            pos = seg.file_offset + (a - seg.dest_offset)
            out = dest[a - lo : b - lo]
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done : done + READ_CHUNK]], pos + done)
                if n <= 0:
                    raise CheckpointError(
                        f"{src.file}: tensor {src.name!r}: file ended at byte {pos + done} while reading it "
                        f"(shard of {item.shard.nbytes} bytes): truncated"
                    )
                done += n
            self.progress.advance(len(out))
            i += 1

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def fill_arena(buffer: memoryview, layout: ArenaLayout, plan: list["PlannedTensor"], progress: "LoadProgress",
               workers: int | None = None, staging_bytes: int = STAGING_BYTES, reserve: Any = None) -> None:
    """Read and transform every planned tensor into its slot of `buffer` (writable arena view).

    `reserve(offset, length)`, when given, allocates arena pages; it runs on its own thread
    ahead of the writers (see `_Reservations`).
    """
    slots = {slot.name: slot for slot in layout.slots}
    workers = workers or default_workers()
    pool: queue.Queue = queue.Queue()
    n_staging = workers + 2  # one per worker, one being read, one spare so the reader runs ahead
    for _ in range(n_staging):
        pool.put(mmap.mmap(-1, staging_bytes))
    work: queue.Queue = queue.Queue()
    errors: list[BaseException] = []
    remaining: dict[str, int] = {}
    lock = threading.Lock()
    reader = _Reader(progress)
    reserved = _Reservations(reserve, layout.size)

    def finish_piece(piece: _Piece) -> None:
        with lock:
            remaining[piece.item.name] -= 1
            last = remaining[piece.item.name] == 0
        if last:
            progress.advance(0, tensors=1)

    def work_loop() -> None:
        torch.set_num_threads(1)  # the workers are the parallelism; intra-op threads would fight them
        while True:
            piece = work.get()
            if piece is None:
                return
            try:
                if not errors:
                    _transform(piece, buffer, slots)
                    finish_piece(piece)
            except BaseException as e:  # handed to the reader, which stops and re-raises
                errors.append(e)
            finally:
                if len(piece.staging) == staging_bytes:  # one-off oversized buffers are just dropped
                    pool.put(piece.staging)

    threads = [threading.Thread(target=work_loop, name=f"load-worker-{k}", daemon=True) for k in range(workers)]
    for t in threads:
        t.start()
    try:
        for item in plan:
            if errors:
                break
            if item.source is None:  # made by a worker (fp8 scales)
                continue
            segments = item.shard.segments()
            slot = slots[item.name]
            end = slot.offset + slot.nbytes
            if item.transform == "fp8":
                scale_slot = slots[fp8.scale_name(item.name)]
                end = max(end, scale_slot.offset + scale_slot.nbytes)
            reserved.wait(end)
            if item.transform == "read" or item.shard.nbytes == 0:
                reader.read(item, segments, 0, item.shard.nbytes, buffer[slot.offset : slot.offset + slot.nbytes])
                progress.advance(0, tensors=1)
                continue
            row_bytes, rows = _rows(item)
            step = _rows_per_piece(row_bytes, rows, staging_bytes, fp8.BLOCK if item.transform == "fp8" else 1)
            with lock:
                remaining[item.name] = -(-rows // step)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                need = (r1 - r0) * row_bytes
                staging = pool.get() if need <= staging_bytes else mmap.mmap(-1, need)
                if errors:  # a worker failed while we waited: stop reading
                    pool.put(staging)
                    break
                reader.read(item, segments, r0 * row_bytes, r1 * row_bytes, memoryview(staging)[:need])
                work.put(_Piece(item, r0, r1, staging))
    except BaseException as e:
        errors.append(e)
    finally:
        for _ in threads:
            work.put(None)
        for t in threads:
            t.join()
        reader.close()
        reserved.close()
        while not pool.empty():
            pool.get().close()
    if errors:
        raise errors[0]


def default_workers() -> int:
    """One transform worker per core the process may use (the reader mostly waits in the kernel)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def _rows(item: "PlannedTensor") -> tuple[int, int]:
    """(bytes per row, rows) of the shard, in the source dtype; 0-D/1-D tensors are one row."""
    shape = item.shard.shape
    itemsize = item.source.dtype.itemsize
    if len(shape) < 2:
        return max(item.shard.nbytes, 1), 1
    row = 1
    for d in shape[1:]:
        row *= d
    return max(row * itemsize, 1), shape[0]


def _rows_per_piece(row_bytes: int, rows: int, staging_bytes: int, block: int) -> int:
    fit = staging_bytes // row_bytes // block * block
    return max(block, min(rows, fit)) if rows else 1


def _transform(piece: _Piece, buffer: memoryview, slots: dict[str, TensorSlot]) -> None:
    item = piece.item
    slot = slots[item.name]
    row_bytes, rows = _rows(item)
    n = piece.row1 - piece.row0
    src_bytes = n * row_bytes
    src = torch.frombuffer(piece.staging, dtype=item.source.dtype, count=src_bytes // item.source.dtype.itemsize)
    out_row = row_bytes // item.source.dtype.itemsize * item.dtype.itemsize
    lo = slot.offset + piece.row0 * out_row
    out = torch.frombuffer(buffer, dtype=item.dtype, count=n * out_row // item.dtype.itemsize, offset=lo)
    if item.transform == "cast":
        out.copy_(src)
        return
    # fp8: the piece is whole 128-row blocks, so its scales are whole rows of the scale slot
    cols = item.shard.shape[1]
    scale_slot = slots[fp8.scale_name(item.name)]
    s_cols = scale_slot.shape[1]
    s_row0, s_rows = piece.row0 // fp8.BLOCK, -(-n // fp8.BLOCK)
    scale = torch.frombuffer(buffer, dtype=torch.float32, count=s_rows * s_cols,
                             offset=scale_slot.offset + s_row0 * s_cols * 4)
    fp8.quantize_rows(src.view(n, cols), out.view(n, cols), scale.view(s_rows, s_cols), item.name)
