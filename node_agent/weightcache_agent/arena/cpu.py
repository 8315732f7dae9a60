"""The cpu backend: an arena is a sealed memfd, shared by passing its fd.

The agent creates a memfd, reserves its pages up front (so running out of memory is an
error at plan time, not a SIGBUS mid-load), fills it through a writable mapping, then
drops that mapping and seals the memfd against writes, growth and shrinking. From then
on nobody -- not the agent, not a buggy engine holding the fd -- can change the bytes:
engines map it PROT_READ and a write through a tensor faults in that engine alone (or,
mapped copy-on-write with `map_private`, gets that engine a private copy of the page).
The memory lives as long as any process holds the fd or a mapping, so engines keep
serving if the agent dies.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from typing import TYPE_CHECKING

from ..errors import OutOfMemory
from .digest import CPU_ALGORITHM, CPU_SEGMENT_BYTES, ArenaDigest, cpu_segment, digest_all, segment_count, segment_range

# madvise(MADV_POPULATE_WRITE), Linux 5.14+: fault a range in writable without touching it.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
if TYPE_CHECKING:  # imported where a mapping is made: the agent itself never needs torch for a memfd
    import torch

    from ..spec import CacheSpec

# Caps the memory an arena may take below what the kernel reports (an operator's budget;
# tests use it to force the out-of-memory refusal). Bytes, or with a K/M/G suffix.
MEMORY_LIMIT_ENV = "WEIGHTCACHE_MEMORY_LIMIT"

_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def available_memory() -> int:
    """Bytes this process may still allocate: MemAvailable, capped by the cgroup limit."""
    avail = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            avail = min(avail or 0, int(limit) - used)
    except OSError:
        pass
    return avail if avail is not None else 1 << 62


def memory_budget() -> tuple[int, str]:
    """Bytes an arena may take, and where that number comes from (for the error message)."""
    avail, source = available_memory(), "available host memory (MemAvailable / cgroup)"
    raw = os.environ.get(MEMORY_LIMIT_ENV)
    if raw:
        limit = _parse_bytes(raw)
        if limit < avail:
            avail, source = limit, f"{MEMORY_LIMIT_ENV}={raw}"
    return avail, source


def _parse_bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    try:
        return int(float(text.rstrip("KMGT")) * mult)
    except ValueError:
        raise ValueError(f"{MEMORY_LIMIT_ENV}={text!r} is not a byte count") from None


def new_cpu_arena(size: int, spec: "CacheSpec", name: str = "weightcache") -> "CpuArena":
    """A memfd arena of `size` bytes for `spec`, refused with the numbers before allocating when memory is short."""
    budget, source = memory_budget()
    if size > budget:
        raise OutOfMemory(
            f"{spec.model}: the arena for tp_rank {spec.tp_rank}/{spec.tp_size} needs {size} bytes "
            f"({size / 2**30:.2f} GiB) but {source} allows {budget} bytes ({budget / 2**30:.2f} GiB)"
        )
    return CpuArena(size, name=name, reserve=False)  # pages allocated by the fill's writes, as it reads


class CpuArena:
    """A memfd-backed arena owned by the agent (or by an `off`-mode engine)."""

    backend = "cpu"

    def __init__(self, size: int, name: str = "weightcache", fd: int | None = None, reserve: bool = True):
        """`reserve=False`: pages are allocated as they are written. The loader writes with
        sendfile / pwrite into the memfd, which allocate a page and fill it in one step;
        reserving first would allocate the same pages on another thread and, once they are
        faulted in through the mapping, zero each one before the copy overwrites it. A
        writer that stores through `writable()` instead calls `reserve()` on a range first."""
        self.size = size
        self.reserved_upfront = reserve or fd is not None
        self._mapping: mmap.mmap | None = None
        self._reader: mmap.mmap | None = None  # read-only, for digests once sealed
        if fd is not None:  # an arena handed back by an engine
            self.fd = fd
            return
        avail = available_memory()
        if size > avail:
            raise OutOfMemory(
                f"arena of {size / 2**30:.2f} GiB does not fit: {avail / 2**30:.2f} GiB of host memory available"
            )
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            if reserve:
                os.posix_fallocate(self.fd, 0, size)
        except OSError as e:
            os.close(self.fd)
            raise OutOfMemory(f"cannot reserve an arena of {size / 2**30:.2f} GiB: {e.strerror}") from None

    @classmethod
    def adopt(cls, fd: int, size: int) -> "CpuArena":
        """Take over an arena an engine hands back: sealed as the agent seals its own (write, grow,
        shrink and the seals themselves: a memfd sealed against writes alone can still be truncated
        to zeroes) and of the layout's size. Its content is the caller's to verify (`digest`)."""
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & _SEALS != _SEALS:
            raise ValueError(f"offered memfd is not sealed against writes, growth, shrinking and new seals "
                             f"(seals {seals:#x}): its bytes cannot be trusted")
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ValueError(f"offered memfd holds {actual} bytes, the layout needs {size}")
        return cls(size, fd=fd)

    def reserve(self, offset: int, length: int) -> None:
        """Allocate the pages of [offset, offset+length) now (an error here, not a SIGBUS later) and,
        when mapped, fault them in writable so the writer does not take one fault per page.

        For writers through the mapping only: faulting in zeroes every page, which a write into
        the fd (sendfile, pwrite) does not need (see load/pipeline.py)."""
        try:
            os.posix_fallocate(self.fd, offset, length)
        except OSError as e:
            raise OutOfMemory(f"cannot reserve {length} bytes at offset {offset} of an arena of "
                              f"{self.size / 2**30:.2f} GiB: {e.strerror}") from None
        if self._mapping is not None:
            try:
                self._mapping.madvise(MADV_POPULATE_WRITE, offset, length)
            except OSError:
                pass  # older kernel: pages fault in on first write instead

    def writable(self, populate: bool = True) -> memoryview:
        """A writable view of the whole arena, valid until `seal()`."""
        if self._mapping is None:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self._mapping = mmap.mmap(self.fd, self.size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        return memoryview(self._mapping)

    def copy_from(self, fd: int, nbytes: int) -> None:
        """Fill the first `nbytes` from another arena's memfd `fd` (a replica's): one memory copy, no torch."""
        if os.fstat(fd).st_size < nbytes:
            raise OSError(f"the source arena holds {os.fstat(fd).st_size} bytes, fewer than {nbytes}")
        source = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            with memoryview(source) as src, self.writable(populate=True) as dest:
                dest[:nbytes] = src
        finally:
            source.close()

    def seal(self) -> None:
        """Drop the writable mapping and forbid every future write to the memfd."""
        if self._mapping is not None:
            self._mapping.close()  # raises BufferError if a view of it is still alive: a loader bug
            self._mapping = None
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)

    segment_bytes = CPU_SEGMENT_BYTES

    def segments(self) -> int:
        return segment_count(self.size, self.segment_bytes)

    def _read_mapping(self) -> mmap.mmap:
        if self._reader is None:
            self._reader = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        return self._reader

    def digest_segment(self, key: bytes, index: int) -> str:
        """Keyed digest of one segment, read through a read-only mapping (the memfd is sealed by then)."""
        self._read_mapping()
        offset, length = segment_range(self.size, self.segment_bytes, index)
        with memoryview(self._reader) as view:
            return cpu_segment(view[offset:offset + length], key, index)

    def digest(self, key: bytes) -> ArenaDigest:
        """Every segment's keyed digest, hashed on several threads."""
        self._read_mapping()  # made once, before the threads share it
        values = digest_all(lambda i: self.digest_segment(key, i), self.segments())
        return ArenaDigest(CPU_ALGORITHM, self.size, self.segment_bytes, values)

    def close(self) -> None:
        if self._reader is not None:
            try:
                self._reader.close()
            except BufferError:  # a digest in flight on another thread: the mapping goes with the process
                pass
            self._reader = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_readonly(fd: int, size: int) -> "torch.Tensor":
    """Map an arena fd read-only and return it as one uint8 tensor (no copy)."""
    import torch

    actual = os.fstat(fd).st_size
    if actual < size:
        raise OSError(f"arena fd holds {actual} bytes but the manifest says {size}")
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


def map_private(fd: int, size: int) -> "torch.Tensor":
    """Map an arena fd copy-on-write (MAP_PRIVATE, writable) as one uint8 tensor.

    Reads share the arena's pages with every other engine; the first write to a page gives
    this process a private copy of that page (4 KiB), so a caller that rewrites every weight
    pays the arena's size again in its own memory. The arena never changes: it is sealed
    against writes, which forbids shared writable mappings, not private ones.
    """
    import torch

    actual = os.fstat(fd).st_size
    if actual < size:
        raise OSError(f"arena fd holds {actual} bytes but the manifest says {size}")
    return torch.frombuffer(mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE), dtype=torch.uint8)
