"""Cold reads for the benchmarks: drop a checkpoint from the page cache, and time a raw read of it.

A cold load is compared with the plainest read of the same files just before: one
sequential pass of 64 MiB requests, nothing kept. Between the two, and before each,
the files leave the page cache (`posix_fadvise(DONTNEED)` per file, and the whole
cache through `/proc/sys/vm/drop_caches` where root may), so both start from disk.
Torch-free: the fresh-process benchmark imports it too.
"""
from __future__ import annotations

import os
import time


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
