"""Reading a checkpoint's bytes off the disk: jobs in file order, shared descriptors, readers.

Both fills -- into host memory (pipeline.py) and into GPU memory (cuda_fill.py) -- take
the same jobs (`JobFeed`: 16 MiB of a plain tensor, or a staging piece of whole 128-row
blocks of one to cast or quantize) with the same readers (`Reader`) over the same
descriptors (`Files`: O_DIRECT or buffered, one per file); only where the bytes go
differs. Nothing here imports torch (a column shard read with O_DIRECT, the one gather,
does when it happens), so a fill that copies bytes or quantizes bf16 runs without it. The
threads that read run at normal priority (`at_normal_priority`), below the agent's own.

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
"""
from __future__ import annotations

import bisect
import errno
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import fp8
from ..errors import CheckpointError, OutOfMemory
from .layout import TensorSlot
from .pagecache import cached_share as _cached_share
from .sharding import Segment

if TYPE_CHECKING:
    import torch

    from .plan import LoadProgress, PlannedTensor

log = logging.getLogger(__name__)

STAGING_BYTES = 32 * 1024 * 1024


READ_CHUNK = 64 * 1024 * 1024  # most bytes one preadv / sendfile call asks for


JOB_BYTES = 16 * 1024 * 1024  # a plain tensor is handed to readers in jobs of this size


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


class LockedProgress:
    """`LoadProgress.advance` from several threads: its counters are plain `+=` (and a tqdm bar)."""

    def __init__(self, progress: "LoadProgress"):
        self.progress = progress
        self.lock = threading.Lock()

    def advance(self, nbytes: int, tensors: int = 0) -> None:
        with self.lock:
            self.progress.advance(nbytes, tensors)


@dataclass
class Job:
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


class JobFeed:
    """The plan's jobs (`_jobs`), handed to reader threads one at a time in file order, and each
    tensor counted done on `progress` when the last of its jobs is finished."""

    def __init__(self, plan: list["PlannedTensor"], slots: dict[str, TensorSlot], staging_bytes: int,
                 progress: LockedProgress):
        self.jobs = _jobs(plan, slots, staging_bytes)
        self.progress = progress
        self.remaining: dict[str, int] = {}
        self.lock = threading.Lock()

    def next(self) -> Job | None:
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


def align_down(n: int) -> int:
    return n // ALIGN * ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _on_block_device(path: str) -> bool:
    """Whether `path` lives on a local block device (not NFS, FUSE, tmpfs, overlay: anonymous devices)."""
    dev = os.stat(path).st_dev
    return os.path.exists(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")


class _Refused(Exception):
    """The filesystem accepted O_DIRECT on open but refused an aligned read (EINVAL)."""


class Files:
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
    def for_fill(cls, read_ahead: Any = None) -> "Files":
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


class Reader:
    """Reads of shard segments (preadv into memory, buffered or O_DIRECT, or sendfile into an
    fd), with the truncation check.

    `files`, when given, is shared with other readers and closed by the caller. `bounce_bytes`:
    the buffer that direct reads of several ranges go through. `direct_bytes` /
    `buffered_bytes` count what this reader read each way.
    """

    def __init__(self, progress: Any, files: Files | None = None, bounce_bytes: int = STAGING_BYTES + 2 * ALIGN):
        self.progress = progress
        self.owns = files is None
        self.files = Files() if files is None else files
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
        """Read shard bytes [lo, hi) into `staging` (page-aligned, `align_up(hi - lo) + ALIGN` bytes or
        more) with the O_DIRECT descriptor `fd`; returns the offset in `staging` of byte lo.

        One range: its aligned superset straight into `staging`. Several: aligned extents
        through the bounce buffer, gathered to offset 0 (module docstring). If the
        filesystem refuses the read after all, the job is read buffered to offset 0.
        """
        ranges = list(self._ranges(segments, lo, hi))
        try:
            if len(ranges) == 1:
                pos, _, _ = ranges[0]
                self._extent(fd, item, ranges, memoryview(staging), align_down(pos))
                skip = pos - align_down(pos)
            else:
                if self.bounce is None:
                    self.bounce = mmap.mmap(-1, self.bounce_bytes)
                import torch  # a column shard read direct: the strided gather

                src = torch.frombuffer(self.bounce, dtype=torch.uint8)
                dest = torch.frombuffer(staging, dtype=torch.uint8, count=hi - lo)
                for extent in _extents(ranges, len(self.bounce)):
                    start = align_down(extent[0][0])
                    self._extent(fd, item, extent, memoryview(self.bounce), start)
                    gather(src, start, extent, dest)
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
                n = os.preadv(fd, [buf[got : min(align_up(need), got + READ_CHUNK)]], start + got)
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
                    raise write_error(e, item, length - done) from None
                if n <= 0:
                    raise self._truncated(item, pos + done)
                done += n
            self.progress.advance(length)
            self.buffered_bytes += length

    def close(self) -> None:
        if self.bounce is not None:
            close_buffer(self.bounce)
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
            if extent and (p - (extent[-1][0] + extent[-1][2]) > MAX_GAP or align_up(p + n) - start > cap):
                yield extent
                extent = []
            if not extent:
                start = align_down(p)
            extent.append((p, at + off, n))
    if extent:
        yield extent


def gather(src: torch.Tensor, start: int, ranges: list[tuple[int, int, int]], dest: torch.Tensor) -> None:
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


def _jobs(plan: list["PlannedTensor"], slots: dict[str, TensorSlot], staging_bytes: int) -> Iterator[Job]:
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
                yield Job(item, segments, slot, lo, hi, False, slot.offset + hi, len(bounds))
            continue
        if item.transform == "fp8":
            scale_slot = slots[fp8.scale_name(item.name)]
            end = max(end, scale_slot.offset + scale_slot.nbytes)
        row_bytes, rows = rows_of(item)
        step = _rows_per_piece(row_bytes, rows, staging_bytes, fp8.BLOCK if item.transform == "fp8" else 1)
        starts = list(range(0, rows, step))
        for r0 in starts:
            yield Job(item, segments, slot, r0, min(rows, r0 + step), True, end, len(starts))


def at_normal_priority() -> None:
    """Run this thread at nice 0 where the process runs higher (the agent raises its own, so that it
    answers promptly): a load is bulk work, and must not take cores from engines serving meanwhile.
    On Linux the nice value is per thread; lowering one's own priority needs no privilege."""
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < 0:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
    except OSError:
        pass


def default_readers() -> int:
    """Reader threads: two, so that a request is in flight while the other reader copies or
    quantizes. More made cold loads slower on the 16-core GPU hosts measured (bench/RESULTS.md:
    4 and 8 readers 1.41-1.47 GB/s, 2 readers 1.62-1.67 GB/s from the same disk): each reader's
    16-32 MiB request already keeps the disk's queue full, and more of them only interleave the
    stream. `WEIGHTCACHE_READERS` overrides it."""
    env = os.environ.get("WEIGHTCACHE_READERS")
    if env:
        return max(1, int(env))
    return 2


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def rows_of(item: "PlannedTensor") -> tuple[int, int]:
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


def close_buffer(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # still viewed from the traceback of a failed read: freed with it
        pass


def write_error(e: OSError, item: "PlannedTensor", nbytes: int) -> Exception:
    if e.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
        return OutOfMemory(f"tensor {item.name!r}: cannot allocate arena pages for {nbytes} more bytes: {e.strerror}")
    return OSError(e.errno, f"tensor {item.name!r} ({item.source.file if item.source else 'made on load'}): "
                            f"writing into the arena: {e.strerror}")
