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

Why O_DIRECT: a buffered read costs the reading thread CPU for every byte -- allocating
page-cache pages, readahead bookkeeping, the copy out of the cache, and later reclaiming
those pages (the weights would sit in memory twice: cache and arena). Measured on a
2-core VM, sequential reads of a 4.45 GiB checkpoint: buffered ~0.5-2 core-s/GB (it
swings with the host), O_DIRECT in 16 MiB requests 0.05-0.1. With O_DIRECT the readers
only issue requests: each large read puts many requests in the disk queue at once, and
the reader is back for the next job as soon as the DMA lands, so the disk is not left
idle while a reader copies. The one copy left (staging -> arena, which also allocates
the arena's pages) happens on the workers, in parallel with the next reads. The price:
a direct load leaves the checkpoint out of the page cache, so loading the same files
again reads the disk again.

O_DIRECT wants file offsets, lengths and buffer addresses aligned (`ALIGN`); tensors
start at arbitrary bytes. A job whose bytes are one range of the file (a whole tensor,
a row slice) is read as its aligned superset straight into the (page-aligned) staging
buffer, and the worker uses the slice at the returned offset: no extra copy. A job of
several ranges (a column slice under tensor parallelism: part of every row) is read in
aligned extents, through holes below `MAX_GAP`, into the reader's bounce buffer and
gathered into staging, one strided copy per run of like ranges. Bytes the direct read
did not deliver (the end of the file) are read buffered, which also finds where a
truncated file ends, so its error is the one the buffered path gives.

`WEIGHTCACHE_DIRECT_IO` (`direct_io_mode`): `off` reads buffered; `on` reads with
O_DIRECT wherever the filesystem accepts it; `auto` (default) as `on`, for files on a
block device only (network and FUSE filesystems keep the kernel's readahead), and only
for jobs whose pages are not already in the page cache (`mincore`): re-reading cached
bytes from the disk would be slower than copying them. A filesystem that refuses
O_DIRECT (EINVAL, on open or on a read) is read buffered, logged at debug.

Why several readers: with buffered reads each read is partly CPU work on the reading
thread; with one reader the disk idles while that thread is in the kernel copying; with
a few readers taking consecutive jobs in file order, one request is always in flight
while another thread copies, and the disk still sees one nearly sequential stream.
With direct reads, two readers already keep a request in flight while the other hands
its buffer over and takes the next one.

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
buffer (workers copy direct reads into it) and workers write through it, with
`reserve(offset, length)` -- when given -- allocating pages on its own thread ahead of
the writers (`_Reservations`).

Only the segments of this rank's shard are read (see `sharding.Shard.segments`).
The GPU path (cuda_fill.py) takes the same jobs (`_JobFeed`) with the same readers and
descriptors (`_Reader`, `_Files`, direct or buffered as here); only the sink differs.
"""
from __future__ import annotations

import bisect
import errno
import logging
import mmap
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import fp8
from ..errors import CheckpointError, OutOfMemory
from .layout import ArenaLayout, TensorSlot
from .pagecache import cached_share as _cached_share
from .plan import LoadProgress, PlannedTensor
from .sharding import Segment

log = logging.getLogger(__name__)

STAGING_BYTES = 32 * 1024 * 1024
READ_CHUNK = 64 * 1024 * 1024  # most bytes one preadv / sendfile call asks for
JOB_BYTES = 16 * 1024 * 1024  # a plain tensor is handed to readers in jobs of this size
RESERVE_CHUNK = 64 * 1024 * 1024
MAX_READERS = 4

DIRECT_IO_ENV = "WEIGHTCACHE_DIRECT_IO"
DIRECT_IO_MODES = ("auto", "on", "off")
# O_DIRECT alignment of file offsets, lengths and buffer addresses: a page covers every
# common logical block size (512, 4096), and mmap'd buffers are page-aligned
ALIGN = 4096
# a direct read of a column slice reads through holes this small between its ranges: one
# large request beats one request per row, and the disk reads the hole's sectors anyway
MAX_GAP = 1024 * 1024
# auto: a job with more than this share of its pages in the page cache is read buffered
CACHED_SHARE = 1 / 8


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
    """What a reader hands a worker: rows [lo, hi) of a tensor to transform, or (`plain`) shard
    bytes [lo, hi) of a plain tensor read with O_DIRECT, at `skip` in `staging`."""

    item: "PlannedTensor"
    lo: int
    hi: int
    staging: Any  # mmap the bytes were read into
    skip: int = 0
    plain: bool = False


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


class _JobFeed:
    """The plan's jobs (`_jobs`), handed to reader threads one at a time in file order, and each
    tensor counted done on `progress` when the last of its jobs is finished."""

    def __init__(self, plan: list["PlannedTensor"], slots: dict[str, TensorSlot], staging_bytes: int,
                 progress: _LockedProgress):
        self.jobs = _jobs(plan, slots, staging_bytes)
        self.progress = progress
        self.remaining: dict[str, int] = {}
        self.lock = threading.Lock()

    def next(self) -> _Job | None:
        with self.lock:  # the generator is walked by one thread at a time
            job = next(self.jobs, None)
            if job is not None and job.lo == 0:
                self.remaining[job.item.name] = job.count
            return job

    def finish(self, item: "PlannedTensor") -> None:
        with self.lock:
            self.remaining[item.name] -= 1
            last = self.remaining[item.name] == 0
        if last:
            self.progress.advance(0, tensors=1)


def direct_io_mode() -> str:
    """`WEIGHTCACHE_DIRECT_IO`: auto (default), on or off (see the module docstring)."""
    mode = os.environ.get(DIRECT_IO_ENV, "").strip().lower() or "auto"
    if mode not in DIRECT_IO_MODES:
        raise ValueError(f"{DIRECT_IO_ENV}={mode!r}: expected one of {', '.join(DIRECT_IO_MODES)}")
    return mode


def _down(n: int) -> int:
    return n // ALIGN * ALIGN


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _on_block_device(path: str) -> bool:
    """Whether `path` lives on a local block device (not NFS, FUSE, tmpfs, overlay: anonymous devices)."""
    dev = os.stat(path).st_dev
    return os.path.exists(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")


class _Refused(Exception):
    """The filesystem accepted O_DIRECT on open but refused an aligned read (EINVAL)."""


class _Files:
    """The checkpoint files' descriptors, shared by all readers and closed by `close`.

    One buffered descriptor per file: positional reads need no shared position, and one
    readahead state sees the readers' consecutive jobs as the one sequential stream they
    are. One O_DIRECT descriptor per file, opened when a job first asks for it (`direct`):
    None where the mode, the filesystem or a refused read says to read the file buffered.
    """

    def __init__(self, mode: str = "off", gate: Any = None):
        self.mode = mode
        self.gate = gate  # gate(path, end): returns once buffered bytes of path below end may be read
        self.buffered: dict[str, int] = {}
        self.direct_fds: dict[str, int | None] = {}
        self.opened: list[int] = []
        self.lock = threading.Lock()

    @classmethod
    def for_fill(cls, read_ahead: Any = None) -> "_Files":
        """Direct or buffered as `direct_io_mode()` says; behind a read-ahead (an object with
        `wait_past(path, end)`) buffered, each read after the read-ahead passed its bytes: the
        pages are then cached or in flight, and O_DIRECT would read them from the disk again."""
        if read_ahead is None:
            return cls(direct_io_mode())
        return cls("off", read_ahead.wait_past)

    def fd(self, path: str) -> int:
        fd = self.buffered.get(path)
        if fd is None:
            with self.lock:
                fd = self.buffered.get(path)
                if fd is None:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    self.buffered[path] = fd
        return fd

    def direct(self, path: str, start: int, end: int) -> int | None:
        """The O_DIRECT descriptor to read file bytes [start, end) of `path` with, or None: read them buffered."""
        if self.mode == "off":
            return None
        if path not in self.direct_fds:
            with self.lock:
                if path not in self.direct_fds:
                    self.direct_fds[path] = self._open_direct(path)
        fd = self.direct_fds[path]
        if fd is None or self.mode == "on":
            return fd
        return None if _cached_share(self.fd(path), start, end - start) > CACHED_SHARE else fd

    def _open_direct(self, path: str) -> int | None:
        try:
            if self.mode == "auto" and not _on_block_device(path):
                log.debug("%s: not on a block device: read buffered", path)
                return None
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as e:  # EINVAL: the filesystem refuses O_DIRECT; others: the buffered open reports them
            log.debug("%s: no O_DIRECT (%s): read buffered", path, e.strerror)
            return None
        self.opened.append(fd)
        return fd

    def refuse(self, path: str, e: OSError) -> None:
        log.debug("%s: O_DIRECT read refused (%s): read buffered from now on", path, e.strerror)
        self.direct_fds[path] = None  # its descriptor stays open: another reader may be using it

    def close(self) -> None:
        for fd in [*self.buffered.values(), *self.opened]:
            os.close(fd)
        self.buffered.clear()
        self.direct_fds.clear()
        self.opened.clear()


class _Reader:
    """Reads of shard segments (preadv into memory, buffered or O_DIRECT, or sendfile into an
    fd), with the truncation check.

    `files`, when given, is shared with other readers and closed by the caller. `bounce_bytes`:
    the buffer that direct reads of several ranges go through. `direct_bytes` /
    `buffered_bytes` count what this reader read each way.
    """

    def __init__(self, progress: Any, files: _Files | None = None, bounce_bytes: int = STAGING_BYTES + 2 * ALIGN):
        self.progress = progress
        self.owns = files is None
        self.files = _Files() if files is None else files
        self.bounce_bytes = bounce_bytes
        self.bounce: mmap.mmap | None = None  # made on the first job of several ranges
        self.direct_bytes = 0
        self.buffered_bytes = 0

    def fd(self, path: str) -> int:
        return self.files.fd(path)

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
        """Read bytes [lo, hi) of the shard (source dtype, slot order) into `dest[0 : hi - lo]`, buffered."""
        fd = self.fd(item.source.file)
        for pos, at, length in self._ranges(segments, lo, hi):
            if self.files.gate is not None:
                self.files.gate(item.source.file, pos + length)
            out = dest[at : at + length]
            done = 0
            while done < length:
                n = os.preadv(fd, [out[done : done + READ_CHUNK]], pos + done)
                if n <= 0:
                    raise self._truncated(item, pos + done)
                done += n
            self.progress.advance(length)
            self.buffered_bytes += length

    def direct(self, item: "PlannedTensor", segments: list[Segment], lo: int, hi: int) -> int | None:
        """The O_DIRECT descriptor to read shard bytes [lo, hi) with, or None: read them buffered."""
        if self.files.mode == "off":
            return None
        ranges = list(self._ranges(segments, lo, hi))
        if not ranges:
            return None
        (first, _, _), (last, _, length) = ranges[0], ranges[-1]
        return self.files.direct(item.source.file, first, last + length)

    def read_direct(self, fd: int, item: "PlannedTensor", segments: list[Segment], lo: int, hi: int,
                    staging: mmap.mmap) -> int:
        """Read shard bytes [lo, hi) into `staging` (page-aligned, `_up(hi - lo) + ALIGN` bytes or
        more) with the O_DIRECT descriptor `fd`; returns the offset in `staging` of byte lo.

        One range: its aligned superset straight into `staging`. Several: aligned extents
        through the bounce buffer, gathered to offset 0 (module docstring). If the
        filesystem refuses the read after all, the job is read buffered to offset 0.
        """
        ranges = list(self._ranges(segments, lo, hi))
        try:
            if len(ranges) == 1:
                pos, _, _ = ranges[0]
                self._extent(fd, item, ranges, memoryview(staging), _down(pos))
                skip = pos - _down(pos)
            else:
                if self.bounce is None:
                    self.bounce = mmap.mmap(-1, self.bounce_bytes)
                src = torch.frombuffer(self.bounce, dtype=torch.uint8)
                dest = torch.frombuffer(staging, dtype=torch.uint8, count=hi - lo)
                for extent in _extents(ranges, len(self.bounce)):
                    start = _down(extent[0][0])
                    self._extent(fd, item, extent, memoryview(self.bounce), start)
                    _gather(src, start, extent, dest)
                skip = 0
        except _Refused as e:
            self.files.refuse(item.source.file, e.__cause__)
            self.read(item, segments, lo, hi, memoryview(staging)[: hi - lo])
            return 0
        self.progress.advance(hi - lo)
        self.direct_bytes += hi - lo
        return skip

    def _extent(self, fd: int, item: "PlannedTensor", ranges: list[tuple[int, int, int]], buf: memoryview,
                start: int) -> None:
        """File bytes [start, end of the last range) into `buf`, with O_DIRECT from the aligned
        `start`; what that leaves out (the end of the file) buffered, which finds a truncation."""
        last, _, length = ranges[-1]
        need = last + length - start
        got = 0
        try:
            while got < need:
                n = os.preadv(fd, [buf[got : min(_up(need), got + READ_CHUNK)]], start + got)
                got += max(n, 0)
                if n <= 0 or n % ALIGN:  # a partial block comes only at the end of the file (and
                    break  # a read from there would be unaligned)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            raise _Refused() from e
        if got >= need:
            return
        plain = self.fd(item.source.file)
        while got < need:
            n = os.preadv(plain, [buf[got:need]], start + got)
            if n <= 0:
                # where the buffered reads of the ranges would have stopped: the first range
                # the file does not hold, at its start or at the end of the file
                end = start + got
                raise self._truncated(item, next(max(p, end) for p, _, k in ranges if p + k > end))
            got += n

    def send(self, item: "PlannedTensor", segments: list[Segment], lo: int, hi: int, out_fd: int, out_at: int) -> None:
        """Copy bytes [lo, hi) of the shard into `out_fd` at `out_at`, inside the kernel (sendfile).

        `out_fd` must be this thread's own open file: sendfile writes at its file position.
        """
        fd = self.fd(item.source.file)
        for pos, at, length in self._ranges(segments, lo, hi):
            if self.files.gate is not None:
                self.files.gate(item.source.file, pos + length)
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
            self.buffered_bytes += length

    def close(self) -> None:
        if self.bounce is not None:
            _close(self.bounce)
            self.bounce = None
        if self.owns:
            self.files.close()


def _extents(ranges: list[tuple[int, int, int]], cap: int) -> Iterator[list[tuple[int, int, int]]]:
    """`ranges` grouped into direct reads of at most `cap` aligned bytes, each spanning holes of
    at most MAX_GAP; a range too long for one read is cut into several. A shard's ranges come in
    file order (`Shard.segments`), so an extent is the span from its first range to its last."""
    most = cap - 2 * ALIGN  # a range this long fits `cap` from any start, once aligned at both ends
    extent: list[tuple[int, int, int]] = []
    start = 0
    for pos, at, length in ranges:
        for off in range(0, length, most):
            p, n = pos + off, min(most, length - off)
            if extent and (p - (extent[-1][0] + extent[-1][2]) > MAX_GAP or _up(p + n) - start > cap):
                yield extent
                extent = []
            if not extent:
                start = _down(p)
            extent.append((p, at + off, n))
    if extent:
        yield extent


def _gather(src: torch.Tensor, start: int, ranges: list[tuple[int, int, int]], dest: torch.Tensor) -> None:
    """Copy each range (file position, offset in dest, length) out of `src` (file bytes from
    `start`) into `dest`: one strided copy per run of equal ranges at a constant stride (the
    rows of a column slice), so the reader holds the GIL for a few calls, not one per row."""
    i = 0
    while i < len(ranges):
        pos, at, length = ranges[i]
        stride = ranges[i + 1][0] - pos if i + 1 < len(ranges) else length
        j = i + 1
        while j < len(ranges) and ranges[j][2] == length and ranges[j][0] - ranges[j - 1][0] == stride:
            j += 1
        n = j - i
        dest[at : at + n * length].view(n, length).copy_(src.as_strided((n, length), (stride, 1), pos - start))
        i = j


def _close(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # still viewed from the traceback of a failed read: freed with it
        pass


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
    slots = {slot.name: slot for slot in layout.slots}
    workers = workers or default_workers()
    readers = max(1, readers or default_readers())
    files = _Files.for_fill(read_ahead)
    if fd is not None:
        try:
            os.close(_own_fd(fd))
        except OSError:  # no /proc: write through the mapping instead
            fd = None
    if fd is not None:
        reserve = None
    progress_ = _LockedProgress(progress)
    # room for an O_DIRECT read's aligned superset of staging_bytes from any file offset
    pooled = _up(staging_bytes) + ALIGN
    pool: queue.Queue = queue.Queue()
    # one per worker, one per reader being read into, one spare so readers run ahead
    for _ in range(workers + readers + 1):
        pool.put(mmap.mmap(-1, pooled))
    work: queue.Queue = queue.Queue()
    errors: list[BaseException] = []
    reserved = _Reservations(reserve, layout.size)
    feed = _JobFeed(plan, slots, staging_bytes, progress_)
    all_readers: list[_Reader] = []  # for the count of bytes read each way

    def read_loop() -> None:
        reader = _Reader(progress_, files, pooled)
        all_readers.append(reader)
        out_fd = _own_fd(fd) if fd is not None else None
        try:
            while not errors:
                job = feed.next()
                if job is None:
                    return
                reserved.wait(job.end)
                row_bytes = _rows(job.item)[0] if job.piece else 1
                lo, hi = job.lo * row_bytes, job.hi * row_bytes
                direct = reader.direct(job.item, job.segments, lo, hi)
                if direct is None and not job.piece:
                    if out_fd is not None:
                        reader.send(job.item, job.segments, lo, hi, out_fd, job.slot.offset + lo)
                    else:
                        reader.read(job.item, job.segments, lo, hi, buffer[job.slot.offset + lo : job.slot.offset + hi])
                    feed.finish(job.item)
                    continue
                staging = pool.get() if hi - lo <= staging_bytes else mmap.mmap(-1, _up(hi - lo) + ALIGN)
                try:
                    if errors:  # a worker failed while we waited: stop reading
                        raise _Stop
                    if direct is None:
                        reader.read(job.item, job.segments, lo, hi, memoryview(staging)[: hi - lo])
                        skip = 0
                    else:
                        skip = reader.read_direct(direct, job.item, job.segments, lo, hi, staging)
                except BaseException:
                    if len(staging) == pooled:
                        pool.put(staging)
                    raise
                work.put(_Piece(job.item, job.lo, job.hi, staging, skip, not job.piece))
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
                    if piece.plain:
                        _store(piece, buffer, slots, fd)
                    else:
                        _transform(piece, buffer, slots, fd, scratch)
                    feed.finish(piece.item)
            except BaseException as e:  # handed to the readers, which stop; re-raised below
                errors.append(e)
            finally:
                if len(piece.staging) == pooled:  # one-off oversized buffers are just dropped
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
        files.close()
        while not pool.empty():
            _close(pool.get())
    if errors:
        raise errors[0]
    log.debug("read %d bytes with O_DIRECT, %d buffered (%s=%s)", sum(r.direct_bytes for r in all_readers),
              sum(r.buffered_bytes for r in all_readers), DIRECT_IO_ENV, files.mode)


class _Stop(Exception):
    """A reader stops because another thread failed."""


def _jobs(plan: list["PlannedTensor"], slots: dict[str, TensorSlot], staging_bytes: int) -> Iterator[_Job]:
    """The plan as reader jobs, in file order (plain tensors in JOB_BYTES, or less to fit a
    staging buffer for a direct read; others in staging-sized pieces of whole rows)."""
    job_bytes = min(JOB_BYTES, staging_bytes)
    for item in plan:
        if item.source is None:  # made by a worker (fp8 scales)
            continue
        segments = item.shard.segments()
        slot = slots[item.name]
        end = slot.offset + slot.nbytes
        if item.transform == "read" or item.shard.nbytes == 0:
            total = item.shard.nbytes
            bounds = list(range(0, total, job_bytes)) or [0]
            for lo in bounds:
                hi = min(total, lo + job_bytes)
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


def _store(piece: _Piece, buffer: memoryview, slots: dict[str, TensorSlot], fd: int | None) -> None:
    """Put the bytes of a plain piece into its slot: pwrite into the memfd, or copy through `buffer`."""
    item = piece.item
    at = slots[item.name].offset + piece.lo
    n = piece.hi - piece.lo
    if fd is not None:
        _pwrite(fd, memoryview(piece.staging)[piece.skip : piece.skip + n], at, item)
    else:  # a torch copy: releases the GIL, where a memoryview assignment would hold it
        torch.frombuffer(buffer, dtype=torch.uint8, count=n, offset=at).copy_(
            torch.frombuffer(piece.staging, dtype=torch.uint8, count=n, offset=piece.skip))


def _transform(piece: _Piece, buffer: memoryview, slots: dict[str, TensorSlot], fd: int | None = None,
               scratch: _Scratch | None = None) -> None:
    """Turn one piece into its final bytes: into `buffer` directly, or (with `fd`) into
    `scratch` and then pwrite into the memfd (no page faults, no zeroing; module docstring)."""
    item = piece.item
    slot = slots[item.name]
    row_bytes, _ = _rows(item)
    n = piece.hi - piece.lo
    src_bytes = n * row_bytes
    src = torch.frombuffer(piece.staging, dtype=item.source.dtype, count=src_bytes // item.source.dtype.itemsize,
                           offset=piece.skip)
    out_row = row_bytes // item.source.dtype.itemsize * item.dtype.itemsize
    lo = slot.offset + piece.lo * out_row
    out_bytes = n * out_row
    if item.transform == "fp8":
        scale_slot = slots[fp8.scale_name(item.name)]
        s_cols = scale_slot.shape[1]
        s_row0, s_rows = piece.lo // fp8.BLOCK, -(-n // fp8.BLOCK)
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
