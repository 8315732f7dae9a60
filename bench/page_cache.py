"""Cold reads for the benchmarks: drop a checkpoint from the page cache, and time a raw read of it.

A cold load is compared with the plainest read of the same files: one sequential pass of
64 MiB requests, nothing kept, just before the load and again just after it
(`between_raw_reads`), since a virtual disk's rate drifts by up to 10% within minutes and
one raw read before a load charges that drift to the load. Before each read and each load
the files leave the page cache (`posix_fadvise(DONTNEED)` per file, and the whole cache
through `/proc/sys/vm/drop_caches` where root may), so all start from disk.
Torch-free: the fresh-process benchmark imports it too.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")


def drop_cache(files: list[str]) -> None:
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass  # not root: the per-file advice above is what there is


def raw_read(files: list[str]) -> float:
    """Seconds to read `files` once, in order, with nothing else running."""
    view = memoryview(bytearray(64 << 20))
    t0 = time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while os.readv(fd, [view]):
            pass
        os.close(fd)
    return time.perf_counter() - t0


def between_raw_reads(files: list[str], loads: Iterable[Callable[[], T]]) -> Iterator[tuple[T, float, float]]:
    """Run each load from a dropped page cache, between raw reads of `files`: yields (what the
    load returned, seconds of the raw read just before it, of the one just after it). A raw
    read after one load is the one before the next."""
    drop_cache(files)
    after = raw_read(files)
    for load in loads:
        before = after
        drop_cache(files)
        loaded = load()
        drop_cache(files)
        after = raw_read(files)
        yield loaded, before, after
