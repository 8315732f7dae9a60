"""Fill an arena from disk with reading and transforming overlapped, so the disk never waits.

Data flow (cpu backend, the arena a memfd), with direct reads (the default for a cold file):

    jobs, in file order --> reader threads (2-4), each takes the next job
      any job  --O_DIRECT preadv (disk -> staging buffer, DMA)--> queue --> worker(s)
                                                                             |  plain: pwrite
                          ^                                                  |  cast / fp8: compute, pwrite
                          +--------------- buffer back to the pool ----------+--> arena slot(s)

and with buffered reads (`WEIGHTCACHE_DIRECT_IO=off`, a file already in the page cache, a
filesystem that refuses O_DIRECT):

      plain bytes  --sendfile: checkpoint page cache -> memfd pages, in the kernel----> arena slot
      cast / fp8   --preadv into a staging buffer--> queue --> worker(s) --pwrite--> arena slot(s)

Why O_DIRECT, and why several readers: see reading.py, which both fills share.

Why sendfile / pwrite into the memfd rather than writes through its mapping: a store
through a mapping faults each fresh shmem page in, and the kernel zeroes it before the
copy lands on it. A write into the file (sendfile, pwrite) allocates the page and fills
it without zeroing or faulting -- about half the kernel work per byte, measured on a
2-core VM (see bench/RESULTS.md). So the arena's pages are allocated by the writes
themselves; nothing reserves them ahead (reserving costs the same allocation on another
thread, plus a zeroing pass when it also faults them in). Memory is checked against the
budget before the arena is made, and a write that still cannot get a page fails with an
error that names the tensor, not a SIGBUS.

A tensor that needs a cast or FP8 quantization is read in pieces of whole 128-row
blocks into one of a pool of reusable staging buffers; worker threads (torch kernels
release the GIL) compute each piece into a private scratch buffer and pwrite it into
its slot (and its scale rows into the scale slot). The pool bounds memory and is the
back-pressure: readers block only when every worker is behind. bf16 -> FP8 runs in the
C quantizer (`fp8.quantize_bf16_at`, no GIL); torch is imported only for a cast or FP8
from another dtype, so an agent loading bytes as they are, or quantizing bf16, starts
filling at once instead of seconds later.

Without an fd (a plain writable buffer, or `fd=None`), readers preadv straight into the
buffer (workers copy direct reads into it) and workers write through it, with
`reserve(offset, length)` -- when given -- allocating pages on its own thread ahead of
the writers (`_Reservations`).

Only the segments of this rank's shard are read (see `sharding.Shard.segments`).
The GPU path (cuda_fill.py) takes the same jobs (`JobFeed`) with the same readers and
descriptors (`Reader`, `Files`, direct or buffered as here); only the sink differs.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

from . import fp8
from .dtypes import torch_dtype
from .layout import ArenaLayout, TensorSlot
from .plan import LoadProgress, PlannedTensor
from .reading import (ALIGN, DIRECT_IO_ENV, STAGING_BYTES, Files, JobFeed, LockedProgress, Reader, align_up,
                      at_normal_priority, close_buffer, default_readers, rows_of, usable_cores, write_error)

log = logging.getLogger(__name__)

RESERVE_CHUNK = 64 * 1024 * 1024


class _Reservations:
    """Arena pages reserved on a thread, ahead of the writers, so allocation overlaps the disk.

    Only for writes through a mapping (the fallback without an fd): `reserve(offset,
    length)` (CpuArena.reserve) allocates and faults in a range; writers call `wait(end)`
    before touching bytes below `end`. Slots are laid out in plan order, so one pass from
    the start keeps ahead of the readers.
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
    """What a reader hands a worker: rows [lo, hi) of a tensor to transform, or (`plain`) shard
    bytes [lo, hi) of a plain tensor read with O_DIRECT, at `skip` in `staging`."""

    item: "PlannedTensor"
    lo: int
    hi: int
    staging: Any  # mmap the bytes were read into
    skip: int = 0
    plain: bool = False


def _own_fd(fd: int) -> int:
    """A new open file description of the memfd `fd` (its own file position, for sendfile)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC)


def fill_arena(buffer: memoryview, layout: ArenaLayout, plan: list["PlannedTensor"], progress: "LoadProgress",
               workers: int | None = None, staging_bytes: int = STAGING_BYTES, reserve: Any = None,
               fd: int | None = None, readers: int | None = None, read_ahead: Any = None) -> None:
    """Read and transform every planned tensor into its slot of the arena.

    `fd`: the arena's memfd (writable); when given, bytes go in with sendfile / pwrite and
    `buffer` is not written (see the module docstring); `reserve` is then not used: the
    writes allocate the pages. Without it, `buffer` (a writable view of the whole arena)
    is written directly, and `reserve(offset, length)`, when given, allocates its pages on
    a thread ahead of the writers. `readers`: reader threads (default `default_readers()`).
    Reads are direct or buffered as `direct_io_mode()` says; behind a `read_ahead` (load/prefetch.py:
    it reads the files into the page cache) buffered, each waiting for it to pass its bytes.
    """
    files = Files.for_fill(read_ahead)
    if fd is not None:
        try:
            os.close(_own_fd(fd))
        except OSError:  # no /proc: write through the mapping instead
            fd = None
    if fd is not None:
        reserve = None
    fill = _Fill(buffer, layout, plan, LockedProgress(progress), staging_bytes, fd, files,
                 workers or default_workers(), max(1, readers or default_readers()), reserve)
    fill.run()
    log.debug("read %d bytes with O_DIRECT, %d buffered (%s=%s)", sum(r.direct_bytes for r in fill.readers),
              sum(r.buffered_bytes for r in fill.readers), DIRECT_IO_ENV, files.mode)


class _Fill:
    """One fill's threads and what they share: readers turn jobs into staged pieces (or write plain
    bytes straight into the arena), workers store or transform the pieces; the first error any
    thread meets stops the others and is raised by `run`."""

    def __init__(self, buffer: memoryview, layout: ArenaLayout, plan: list["PlannedTensor"], progress: LockedProgress,
                 staging_bytes: int, fd: int | None, files: Files, workers: int, readers: int, reserve: Any):
        self.buffer, self.fd, self.files, self.progress = buffer, fd, files, progress
        self.staging_bytes, self.workers, self.reader_count = staging_bytes, workers, readers
        self.slots = {slot.name: slot for slot in layout.slots}
        # room for an O_DIRECT read's aligned superset of staging_bytes from any file offset
        self.pooled = align_up(staging_bytes) + ALIGN
        self.pool: queue.Queue = queue.Queue()
        # one per worker, one per reader being read into, one spare so readers run ahead
        for _ in range(workers + readers + 1):
            self.pool.put(mmap.mmap(-1, self.pooled))
        self.work: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        self.reserved = _Reservations(reserve, layout.size)
        self.feed = JobFeed(plan, self.slots, staging_bytes, progress)
        self.readers: list[Reader] = []  # for the count of bytes read each way

    def run(self) -> None:
        worker_threads = [threading.Thread(target=self.work_loop, name=f"load-worker-{k}", daemon=True)
                          for k in range(self.workers)]
        reader_threads = [threading.Thread(target=self.read_loop, name=f"load-reader-{k}", daemon=True)
                          for k in range(self.reader_count)]
        try:
            for t in worker_threads + reader_threads:
                t.start()
        except BaseException as e:
            self.errors.append(e)
        finally:
            for t in reader_threads:
                if t.ident is not None:
                    t.join()
            for _ in worker_threads:
                self.work.put(None)
            for t in worker_threads:
                if t.ident is not None:
                    t.join()
            self.reserved.close()
            self.files.close()
            while not self.pool.empty():
                close_buffer(self.pool.get())
        if self.errors:
            raise self.errors[0]

    def read_loop(self) -> None:
        at_normal_priority()
        reader = Reader(self.progress, self.files, self.pooled)
        self.readers.append(reader)
        out_fd = _own_fd(self.fd) if self.fd is not None else None
        try:
            while not self.errors:
                job = self.feed.next()
                if job is None:
                    return
                self._read(reader, job, out_fd)
        except _Stop:
            pass
        except BaseException as e:  # the other threads see it and stop; re-raised by `run`
            self.errors.append(e)
        finally:
            reader.close()
            if out_fd is not None:
                os.close(out_fd)

    def _read(self, reader: Reader, job: Any, out_fd: int | None) -> None:
        """One job: plain bytes straight into the arena, anything else staged for a worker."""
        self.reserved.wait(job.end)
        row_bytes = rows_of(job.item)[0] if job.piece else 1
        lo, hi = job.lo * row_bytes, job.hi * row_bytes
        direct = reader.direct(job.item, job.segments, lo, hi)
        if direct is None and not job.piece:
            if out_fd is not None:
                reader.send(job.item, job.segments, lo, hi, out_fd, job.slot.offset + lo)
            else:
                reader.read(job.item, job.segments, lo, hi, self.buffer[job.slot.offset + lo : job.slot.offset + hi])
            self.feed.finish(job.item)
            return
        staging = self.pool.get() if hi - lo <= self.staging_bytes else mmap.mmap(-1, align_up(hi - lo) + ALIGN)
        try:
            if self.errors:  # a worker failed while we waited: stop reading
                raise _Stop
            if direct is None:
                reader.read(job.item, job.segments, lo, hi, memoryview(staging)[: hi - lo])
                skip = 0
            else:
                skip = reader.read_direct(direct, job.item, job.segments, lo, hi, staging)
        except BaseException:
            if len(staging) == self.pooled:
                self.pool.put(staging)
            raise
        self.work.put(_Piece(job.item, job.lo, job.hi, staging, skip, not job.piece))

    def work_loop(self) -> None:
        at_normal_priority()
        scratch = _Scratch()
        while True:
            piece = self.work.get()
            if piece is None:
                return
            try:
                if not self.errors:
                    if piece.plain:
                        _store(piece, self.buffer, self.slots, self.fd)
                    else:
                        _transform(piece, self.buffer, self.slots, self.fd, scratch)
                    self.feed.finish(piece.item)
            except BaseException as e:  # handed to the readers, which stop; re-raised by `run`
                self.errors.append(e)
            finally:
                if len(piece.staging) == self.pooled:  # one-off oversized buffers are just dropped
                    self.pool.put(piece.staging)


class _Stop(Exception):
    """A reader stops because another thread failed."""


def default_workers() -> int:
    """One transform worker per core the process may use (the readers mostly wait in the kernel)."""
    return max(1, min(usable_cores(), 8))


class _Scratch:
    """A worker's reusable output buffer: faulted in once, then written over piece after piece."""

    def __init__(self) -> None:
        self.buf = bytearray(0)

    def get(self, nbytes: int) -> memoryview:
        if len(self.buf) < nbytes:
            self.buf = bytearray(nbytes)
        return memoryview(self.buf)[:nbytes]


def _pwrite(fd: int, data: memoryview, offset: int, item: "PlannedTensor") -> None:
    done = 0
    while done < len(data):
        try:
            done += os.pwrite(fd, data[done:], offset + done)
        except OSError as e:
            raise write_error(e, item, len(data) - done) from None


def _store(piece: _Piece, buffer: memoryview, slots: dict[str, TensorSlot], fd: int | None) -> None:
    """Put the bytes of a plain piece into its slot: pwrite into the memfd, or copy through `buffer`."""
    item = piece.item
    at = slots[item.name].offset + piece.lo
    n = piece.hi - piece.lo
    if fd is not None:
        _pwrite(fd, memoryview(piece.staging)[piece.skip : piece.skip + n], at, item)
    else:  # a torch copy: releases the GIL, where a memoryview assignment would hold it
        import torch

        torch.frombuffer(buffer, dtype=torch.uint8, count=n, offset=at).copy_(
            torch.frombuffer(piece.staging, dtype=torch.uint8, count=n, offset=piece.skip))


def _transform(piece: _Piece, buffer: memoryview, slots: dict[str, TensorSlot], fd: int | None = None,
               scratch: _Scratch | None = None) -> None:
    """Turn one piece into its final bytes: into `buffer` directly, or (with `fd`) into
    `scratch` and then pwrite into the memfd (no page faults, no zeroing; module docstring).
    bf16 -> FP8 runs in the C quantizer, on addresses; a cast, or FP8 from another dtype, in torch."""
    item = piece.item
    slot = slots[item.name]
    row_bytes, _ = rows_of(item)
    n = piece.hi - piece.lo
    out_row = row_bytes // item.source.dtype.itemsize * item.dtype.itemsize
    lo = slot.offset + piece.lo * out_row
    out_bytes = n * out_row
    cols = item.shard.shape[1] if item.transform == "fp8" else 0
    s_lo, scale_rows, scale_cols = (fp8.scale_rows(slots[fp8.scale_name(item.name)], piece.lo, n)
                                    if item.transform == "fp8" else (0, 0, 0))
    s_bytes = scale_rows * scale_cols * 4
    if fd is None:
        out, out_at, scale_at = buffer, lo, s_lo
    else:
        scale_at = -(-out_bytes // 64) * 64  # the scales after the weight, aligned
        out, out_at = scratch.get(scale_at + s_bytes if item.transform == "fp8" else out_bytes), 0
    if fp8.quantized_natively(item):
        at = _address(out)
        fp8.quantize_bf16_at(_address(piece.staging) + piece.skip, at + out_at, at + scale_at, n, cols, item.name)
    else:
        import torch

        _one_intra_op_thread()
        src = torch.frombuffer(piece.staging, dtype=torch_dtype(item.source.dtype),
                               count=n * row_bytes // item.source.dtype.itemsize, offset=piece.skip)
        dest = torch.frombuffer(out, dtype=torch_dtype(item.dtype), count=out_bytes // item.dtype.itemsize, offset=out_at)
        if item.transform == "cast":
            dest.copy_(src)
        else:
            scale = torch.frombuffer(out, dtype=torch.float32, count=scale_rows * scale_cols, offset=scale_at)
            fp8.quantize_rows(src.view(n, cols), dest.view(n, cols), scale.view(scale_rows, scale_cols), item.name)
    if fd is not None:
        _pwrite(fd, out[:out_bytes], lo, item)
        if item.transform == "fp8":
            _pwrite(fd, out[scale_at : scale_at + s_bytes], s_lo, item)


def _address(buf: Any) -> int:
    """Where a writable buffer's first byte is (an mmap, a writable memoryview)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


_worker = threading.local()


def _one_intra_op_thread() -> None:
    """Before a worker thread's first torch kernel (a plan that copies bytes, or quantizes bf16, never
    runs one): its intra-op threads cut to one, as the workers are the parallelism."""
    import torch

    if not getattr(_worker, "single_threaded", False):
        torch.set_num_threads(1)
        _worker.single_threaded = True
