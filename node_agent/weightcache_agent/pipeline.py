"""Fill an arena from disk with reading and transforming overlapped, so the disk never waits.

Data flow (cpu backend, the arena a memfd):

    jobs, in file order --> reader threads (2-4), each takes the next job
      plain bytes  --sendfile: checkpoint page cache -> memfd pages, in the kernel----> arena slot
      cast / fp8   --preadv into a staging buffer--> queue --> worker(s) --pwrite--> arena slot(s)
                          ^                                      |
                          +-------- buffer back to the pool -----+

Why several readers: each read is partly CPU work on the reading thread (the page-cache
copy, allocating the destination pages, readahead bookkeeping). With one reader the disk
idles while that thread is in the kernel copying; with a few readers taking consecutive
jobs in file order, one request is always in flight while another thread copies, and the
disk still sees one nearly sequential stream.

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
back-pressure: readers block only when every worker is behind.

Without an fd (a plain writable buffer, or `fd=None`), readers preadv straight into the
buffer and workers write through it, with `reserve(offset, length)` -- when given --
allocating pages on its own thread ahead of the writers (`_Reservations`).

Only the segments of this rank's shard are read (see `sharding.Shard.segments`).
The GPU path (cuda_fill.py) uses `_Reader.read`, `_rows`, `_rows_per_piece` and
`STAGING_BYTES` from here with one reader thread of its own.
"""
from __future__ import annotations

import bisect
import errno
import mmap
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import fp8
from .errors import CheckpointError, OutOfMemory
from .layout import ArenaLayout, TensorSlot
from .sharding import Segment

if TYPE_CHECKING:
    from .loader import LoadProgress, PlannedTensor

STAGING_BYTES = 32 * 1024 * 1024
READ_CHUNK = 64 * 1024 * 1024  # most bytes one preadv / sendfile call asks for
JOB_BYTES = 16 * 1024 * 1024  # a plain tensor is handed to readers in jobs of this size
RESERVE_CHUNK = 64 * 1024 * 1024
MAX_READERS = 4


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


class _LockedProgress:
    """`LoadProgress.advance` from several threads: its counters are plain `+=` (and a tqdm bar)."""

    def __init__(self, progress: "LoadProgress"):
        self.progress = progress
        self.lock = threading.Lock()

    def advance(self, nbytes: int, tensors: int = 0) -> None:
        with self.lock:
            self.progress.advance(nbytes, tensors)


@dataclass
class _Piece:
    item: "PlannedTensor"
    row0: int
    row1: int
    staging: Any  # mmap the rows were read into


@dataclass
class _Job:
    """One reader's unit of work, in file order: shard bytes [lo, hi) of a plain tensor, or
    rows [lo, hi) of a tensor to transform (read into staging, then a worker)."""

    item: "PlannedTensor"
    segments: list[Segment]
    slot: TensorSlot
    lo: int
    hi: int
    piece: bool
    end: int  # arena bytes below this must be reserved before the job's bytes are written
    count: int  # jobs of this tensor (to count it done when its last one is)


class _Reader:
    """Reads of shard segments (preadv into memory, or sendfile into an fd), with the truncation check.

    `fds` (path -> descriptor), when given, is shared with other readers and closed by
    the caller; `lock` then guards opening.
    """

    def __init__(self, progress: Any, fds: dict[str, int] | None = None, lock: Any = None):
        self.progress = progress
        self.owns = fds is None
        self.fds: dict[str, int] = {} if fds is None else fds
        self.lock = lock or threading.Lock()

    def fd(self, path: str) -> int:
        fd = self.fds.get(path)
        if fd is None:
            with self.lock:
                fd = self.fds.get(path)
                if fd is None:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    self.fds[path] = fd
        return fd

    def _ranges(self, segments: list[Segment], lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """(file position, offset from lo, length) of the shard bytes [lo, hi), segment by segment."""
        starts = [s.dest_offset for s in segments]
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while i < len(segments) and segments[i].dest_offset < hi:
            seg = segments[i]
            a, b = max(lo, seg.dest_offset), min(hi, seg.dest_offset + seg.nbytes)
            if b > a:
                yield seg.file_offset + (a - seg.dest_offset), a - lo, b - a
            i += 1

    def _truncated(self, item: "PlannedTensor", pos: int) -> CheckpointError:
        src = item.source
        return CheckpointError(
            f"{src.file}: tensor {src.name!r}: file ended at byte {pos} while reading it "
            f"(shard of {item.shard.nbytes} bytes): truncated"
        )

    def read(self, item: "PlannedTensor", segments: list[Segment], lo: int, hi: int, dest: memoryview) -> None:
        """Read bytes [lo, hi) of the shard (source dtype, slot order) into `dest[0 : hi - lo]`."""
        fd = self.fd(item.source.file)
        for pos, at, length in self._ranges(segments, lo, hi):
            out = dest[at : at + length]
            done = 0
            while done < length:
                n = os.preadv(fd, [out[done : done + READ_CHUNK]], pos + done)
                if n <= 0:
                    raise self._truncated(item, pos + done)
                done += n
            self.progress.advance(length)

    def send(self, item: "PlannedTensor", segments: list[Segment], lo: int, hi: int, out_fd: int, out_at: int) -> None:
        """Copy bytes [lo, hi) of the shard into `out_fd` at `out_at`, inside the kernel (sendfile).

        `out_fd` must be this thread's own open file: sendfile writes at its file position.
        """
        fd = self.fd(item.source.file)
        for pos, at, length in self._ranges(segments, lo, hi):
            os.lseek(out_fd, out_at + at, os.SEEK_SET)
            done = 0
            while done < length:
                try:
                    n = os.sendfile(out_fd, fd, pos + done, min(length - done, READ_CHUNK))
                except OSError as e:
                    raise _write_error(e, item, length - done) from None
                if n <= 0:
                    raise self._truncated(item, pos + done)
                done += n
            self.progress.advance(length)

    def close(self) -> None:
        if not self.owns:
            return
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _write_error(e: OSError, item: "PlannedTensor", nbytes: int) -> Exception:
    if e.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
        return OutOfMemory(f"tensor {item.name!r}: cannot allocate arena pages for {nbytes} more bytes: {e.strerror}")
    return OSError(e.errno, f"tensor {item.name!r} ({item.source.file if item.source else 'made on load'}): "
                            f"writing into the arena: {e.strerror}")


def _own_fd(fd: int) -> int:
    """A new open file description of the memfd `fd` (its own file position, for sendfile)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC)


def fill_arena(buffer: memoryview, layout: ArenaLayout, plan: list["PlannedTensor"], progress: "LoadProgress",
               workers: int | None = None, staging_bytes: int = STAGING_BYTES, reserve: Any = None,
               fd: int | None = None, readers: int | None = None) -> None:
    """Read and transform every planned tensor into its slot of the arena.

    `fd`: the arena's memfd (writable); when given, bytes go in with sendfile / pwrite and
    `buffer` is not written (see the module docstring); `reserve` is then not used: the
    writes allocate the pages. Without it, `buffer` (a writable view of the whole arena)
    is written directly, and `reserve(offset, length)`, when given, allocates its pages on
    a thread ahead of the writers. `readers`: reader threads (default `default_readers()`).
    """
    slots = {slot.name: slot for slot in layout.slots}
    workers = workers or default_workers()
    readers = max(1, readers or default_readers())
    if fd is not None:
        try:
            os.close(_own_fd(fd))
        except OSError:  # no /proc: write through the mapping instead
            fd = None
    if fd is not None:
        reserve = None
    progress_ = _LockedProgress(progress)
    pool: queue.Queue = queue.Queue()
    # one per worker, one per reader being read into, one spare so readers run ahead
    for _ in range(workers + readers + 1):
        pool.put(mmap.mmap(-1, staging_bytes))
    work: queue.Queue = queue.Queue()
    errors: list[BaseException] = []
    remaining: dict[str, int] = {}
    lock = threading.Lock()
    reserved = _Reservations(reserve, layout.size)
    jobs = _jobs(plan, slots, staging_bytes)
    # one descriptor per checkpoint file for all readers (opened under `lock`): positional reads
    # need no shared position, and one readahead state per file sees the readers' consecutive
    # jobs as the one sequential stream they are, so the kernel keeps reading ahead of them all
    shared_fds: dict[str, int] = {}

    def finish(item: "PlannedTensor") -> None:
        with lock:
            remaining[item.name] -= 1
            last = remaining[item.name] == 0
        if last:
            progress_.advance(0, tensors=1)

    def next_job() -> _Job | None:
        with lock:  # the generator is walked by one thread at a time: jobs go out in file order
            job = next(jobs, None)
            if job is not None and job.lo == 0:
                remaining[job.item.name] = job.count
            return job

    def read_loop() -> None:
        reader = _Reader(progress_, shared_fds, lock)
        out_fd = _own_fd(fd) if fd is not None else None
        try:
            while not errors:
                job = next_job()
                if job is None:
                    return
                reserved.wait(job.end)
                if not job.piece:
                    if out_fd is not None:
                        reader.send(job.item, job.segments, job.lo, job.hi, out_fd, job.slot.offset + job.lo)
                    else:
                        dest = buffer[job.slot.offset + job.lo : job.slot.offset + job.hi]
                        reader.read(job.item, job.segments, job.lo, job.hi, dest)
                    finish(job.item)
                    continue
                row_bytes, _ = _rows(job.item)
                need = (job.hi - job.lo) * row_bytes
                staging = pool.get() if need <= staging_bytes else mmap.mmap(-1, need)
                try:
                    if errors:  # a worker failed while we waited: stop reading
                        raise _Stop
                    reader.read(job.item, job.segments, job.lo * row_bytes, job.hi * row_bytes,
                                memoryview(staging)[:need])
                except BaseException:
                    if len(staging) == staging_bytes:
                        pool.put(staging)
                    raise
                work.put(_Piece(job.item, job.lo, job.hi, staging))
        except _Stop:
            pass
        except BaseException as e:  # the other threads see it and stop; re-raised below
            errors.append(e)
        finally:
            reader.close()
            if out_fd is not None:
                os.close(out_fd)

    def work_loop() -> None:
        torch.set_num_threads(1)  # the workers are the parallelism; intra-op threads would fight them
        scratch = _Scratch()
        while True:
            piece = work.get()
            if piece is None:
                return
            try:
                if not errors:
                    _transform(piece, buffer, slots, fd, scratch)
                    finish(piece.item)
            except BaseException as e:  # handed to the readers, which stop; re-raised below
                errors.append(e)
            finally:
                if len(piece.staging) == staging_bytes:  # one-off oversized buffers are just dropped
                    pool.put(piece.staging)

    worker_threads = [threading.Thread(target=work_loop, name=f"load-worker-{k}", daemon=True) for k in range(workers)]
    reader_threads = [threading.Thread(target=read_loop, name=f"load-reader-{k}", daemon=True) for k in range(readers)]
    try:
        for t in worker_threads + reader_threads:
            t.start()
    except BaseException as e:
        errors.append(e)
    finally:
        for t in reader_threads:
            if t.ident is not None:
                t.join()
        for _ in worker_threads:
            work.put(None)
        for t in worker_threads:
            if t.ident is not None:
                t.join()
        reserved.close()
        for shared in shared_fds.values():
            os.close(shared)
        while not pool.empty():
            pool.get().close()
    if errors:
        raise errors[0]


class _Stop(Exception):
    """A reader stops because another thread failed."""


def _jobs(plan: list["PlannedTensor"], slots: dict[str, TensorSlot], staging_bytes: int) -> Iterator[_Job]:
    """The plan as reader jobs, in file order (plain tensors in JOB_BYTES, others in staging-sized
    pieces of whole rows)."""
    for item in plan:
        if item.source is None:  # made by a worker (fp8 scales)
            continue
        segments = item.shard.segments()
        slot = slots[item.name]
        end = slot.offset + slot.nbytes
        if item.transform == "read" or item.shard.nbytes == 0:
            total = item.shard.nbytes
            bounds = list(range(0, total, JOB_BYTES)) or [0]
            for lo in bounds:
                hi = min(total, lo + JOB_BYTES)
                yield _Job(item, segments, slot, lo, hi, False, slot.offset + hi, len(bounds))
            continue
        if item.transform == "fp8":
            scale_slot = slots[fp8.scale_name(item.name)]
            end = max(end, scale_slot.offset + scale_slot.nbytes)
        row_bytes, rows = _rows(item)
        step = _rows_per_piece(row_bytes, rows, staging_bytes, fp8.BLOCK if item.transform == "fp8" else 1)
        starts = list(range(0, rows, step))
        for r0 in starts:
            yield _Job(item, segments, slot, r0, min(rows, r0 + step), True, end, len(starts))


def default_workers() -> int:
    """One transform worker per core the process may use (the readers mostly wait in the kernel)."""
    return max(1, min(_cores(), 8))


def default_readers() -> int:
    """Reader threads: enough that a request is in flight while another reader copies (2), more
    on a big host where one thread's kernel copy rate is below the disk's; capped at 4 so the
    disk still sees a nearly sequential stream. `WEIGHTCACHE_READERS` overrides it."""
    env = os.environ.get("WEIGHTCACHE_READERS")
    if env:
        return max(1, int(env))
    return max(2, min(MAX_READERS, _cores() // 4))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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
            raise _write_error(e, item, len(data) - done) from None


def _transform(piece: _Piece, buffer: memoryview, slots: dict[str, TensorSlot], fd: int | None = None,
               scratch: _Scratch | None = None) -> None:
    """Turn one piece into its final bytes: into `buffer` directly, or (with `fd`) into
    `scratch` and then pwrite into the memfd (no page faults, no zeroing; module docstring)."""
    item = piece.item
    slot = slots[item.name]
    row_bytes, _ = _rows(item)
    n = piece.row1 - piece.row0
    src_bytes = n * row_bytes
    src = torch.frombuffer(piece.staging, dtype=item.source.dtype, count=src_bytes // item.source.dtype.itemsize)
    out_row = row_bytes // item.source.dtype.itemsize * item.dtype.itemsize
    lo = slot.offset + piece.row0 * out_row
    out_bytes = n * out_row
    if item.transform == "fp8":
        scale_slot = slots[fp8.scale_name(item.name)]
        s_cols = scale_slot.shape[1]
        s_row0, s_rows = piece.row0 // fp8.BLOCK, -(-n // fp8.BLOCK)
        s_lo, s_bytes = scale_slot.offset + s_row0 * s_cols * 4, s_rows * s_cols * 4
    if fd is None:
        out = torch.frombuffer(buffer, dtype=item.dtype, count=out_bytes // item.dtype.itemsize, offset=lo)
    else:
        s_at = -(-out_bytes // 64) * 64  # the scales after the weight, aligned
        space = scratch.get(s_at + s_bytes if item.transform == "fp8" else out_bytes)
        out = torch.frombuffer(space, dtype=item.dtype, count=out_bytes // item.dtype.itemsize)
    if item.transform == "cast":
        out.copy_(src)
    else:
        # fp8: the piece is whole 128-row blocks, so its scales are whole rows of the scale slot
        cols = item.shard.shape[1]
        if fd is None:
            scale = torch.frombuffer(buffer, dtype=torch.float32, count=s_rows * s_cols, offset=s_lo)
        else:
            scale = torch.frombuffer(space, dtype=torch.float32, count=s_rows * s_cols, offset=s_at)
        fp8.quantize_rows(src.view(n, cols), out.view(n, cols), scale.view(s_rows, s_cols), item.name)
    if fd is not None:
        _pwrite(fd, space[:out_bytes], lo, item)
        if item.transform == "fp8":
            _pwrite(fd, space[s_at : s_at + s_bytes], s_lo, item)
