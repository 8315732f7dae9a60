"""How much of a file range is in the page cache (mincore), without touching it or importing torch.

The fill pipeline asks it to choose direct or buffered reads per job; the start-up
prefetcher asks it to skip what is cached already (reading cached bytes would only copy).
"""
from __future__ import annotations

import ctypes
import mmap

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_MAP_FAILED = ctypes.c_void_p(-1).value


def cached_share(fd: int, start: int, length: int) -> float:
    """Share of the pages of file bytes [start, start + length) that are in the page cache.

    mincore on a mapping of the range that is never touched reports the file's page cache
    (every kernel; cachestat would need 6.5). 0 where it cannot tell: the caller then reads
    as if cold.
    """
    page = mmap.PAGESIZE
    lo = start // page * page
    size = -(-(start + length - lo) // page) * page
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
    if addr is None or addr == _MAP_FAILED:
        return 0.0
    try:
        vec = ctypes.create_string_buffer(size // page)
        if _libc.mincore(addr, size, vec) != 0:
            return 0.0
        raw = vec.raw
        return (len(raw) - raw.count(0)) / len(raw)
    finally:
        _libc.munmap(addr, size)
