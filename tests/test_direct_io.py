"""O_DIRECT reads (WEIGHTCACHE_DIRECT_IO) put the same bytes in the arena as buffered reads, and
fail with the same errors.

The checkpoints sit on a filesystem that accepts O_DIRECT on a block device (tmp_path, the
repo's folder or /var/tmp; skipped where none does). Tensor sizes and file offsets are not
multiples of 4096, so every read needs its aligned superset; a small staging size makes many
jobs, pieces and bounce-buffer extents out of a small checkpoint.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import mmap
import os
import re
import resource
import shutil
import tempfile

import pytest
import torch

from weightcache_agent.arena.cpu import map_readonly
from weightcache_agent.errors import CheckpointError, OutOfMemory
from weightcache_agent.load.loader import LoadProgress, new_cpu_arena, prepare_cache
from weightcache_agent.load.pipeline import fill_arena
from weightcache_agent.load.reading import gather
from weightcache_agent.spec import CacheSpec
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

# hidden 328: rows of 656 bytes, q_proj 215168 bytes, k/v 53792: nothing a multiple of 4096;
# tp=2 splits o_proj / down_proj by columns, so every row of the rank's slice is its own range
SHAPE = LlamaShape(hidden_size=328, intermediate_size=1000, num_attention_heads=8, num_key_value_heads=2,
                   vocab_size=1000, num_hidden_layers=2)
SMALL_STAGING = 300_000  # not aligned; fp8 pieces of 384 rows, some pieces a one-off oversized buffer
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def accepts_direct(directory: str) -> bool:
    """Whether files in `directory` are on a block device and can be read with O_DIRECT."""
    dev = os.stat(directory).st_dev
    if not os.path.exists(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"):
        return False  # tmpfs, overlay, network: O_DIRECT there (if accepted) is not a disk read
    fd, path = tempfile.mkstemp(dir=directory)
    try:
        os.write(fd, b"\1" * 8192)
        os.fsync(fd)
        probe = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(probe, [mmap.mmap(-1, 4096)], 4096) == 4096
        finally:
            os.close(probe)
    except OSError:
        return False
    finally:
        os.close(fd)
        os.remove(path)


@pytest.fixture
def disk_dir(tmp_path):
    """A fresh directory on a filesystem that accepts O_DIRECT."""
    if accepts_direct(str(tmp_path)):
        yield str(tmp_path)
        return
    for base in (REPO, "/var/tmp"):
        if os.access(base, os.W_OK) and accepts_direct(base):
            path = tempfile.mkdtemp(prefix="weightcache-direct-io-", dir=base)
            try:
                yield path
            finally:
                shutil.rmtree(path)
            return
    pytest.skip("no writable directory on a filesystem that accepts O_DIRECT")


@pytest.fixture
def model(disk_dir) -> str:
    return write_llama_checkpoint(os.path.join(disk_dir, "m"), SHAPE, shards=2)


def files(model: str) -> list[str]:
    return sorted(glob.glob(os.path.join(model, "*.safetensors")))


def drop_page_cache(model: str) -> None:
    for path in files(model):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


def cached_share(model: str) -> float:
    """Share of the checkpoint's pages in the page cache, by cachestat(2) (Linux 6.5+)."""
    libc = ctypes.CDLL(None, use_errno=True)
    cached = pages = 0
    for path in files(model):
        stat = _Cachestat()
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.syscall(451, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(stat), 0) != 0:
                pytest.skip(f"cachestat: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
        cached += stat.cache
        pages += -(-os.path.getsize(path) // mmap.PAGESIZE)
    return cached / pages


def fill(model: str, mode: str, monkeypatch, staging_bytes: int = SMALL_STAGING, readers: int = 2,
         workers: int = 2, memfd: bool = True, **spec) -> torch.Tensor:
    """The whole arena, as bytes, after filling it with WEIGHTCACHE_DIRECT_IO=`mode`."""
    monkeypatch.setenv("WEIGHTCACHE_DIRECT_IO", mode)
    prepared = prepare_cache(CacheSpec(model, **spec))
    args = dict(workers=workers, staging_bytes=staging_bytes, readers=readers)
    if not memfd:  # the fallback without an fd: readers and workers write through the buffer
        buffer = mmap.mmap(-1, prepared.layout.size)
        fill_arena(memoryview(buffer), prepared.layout, prepared.plan, LoadProgress(), **args)
        return torch.frombuffer(buffer, dtype=torch.uint8).clone()
    arena = new_cpu_arena(prepared.layout.size, prepared.spec, "test")
    try:
        view = arena.writable(populate=False)
        try:
            fill_arena(view, prepared.layout, prepared.plan, LoadProgress(), fd=arena.fd, **args)
        finally:
            view.release()
        arena.seal()
        return map_readonly(arena.fd, prepared.layout.size).clone()
    finally:
        arena.close()


def read_counts(caplog) -> tuple[int, int]:
    """(direct, buffered) bytes of the last fill, from the pipeline's debug line."""
    lines = [r.getMessage() for r in caplog.records if r.name == "weightcache_agent.load.pipeline"]
    found = [re.match(r"read (\d+) bytes with O_DIRECT, (\d+) buffered", m) for m in lines]
    direct, buffered = [m for m in found if m][-1].groups()
    return int(direct), int(buffered)


def shard_bytes(model: str, **spec) -> int:
    return sum(p.shard.nbytes for p in prepare_cache(CacheSpec(model, **spec)).plan if p.shard is not None)


@pytest.mark.parametrize("quantization", ["none", "fp8-block"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_direct_reads_give_the_same_arena(model, monkeypatch, caplog, quantization, tp_size):
    caplog.set_level(logging.DEBUG, logger="weightcache_agent.load.pipeline")
    for rank in range(tp_size):
        spec = dict(quantization=quantization, tp_size=tp_size, tp_rank=rank)
        buffered = fill(model, "off", monkeypatch, **spec)
        assert read_counts(caplog) == (0, shard_bytes(model, **spec))
        direct = fill(model, "on", monkeypatch, **spec)
        assert read_counts(caplog) == (shard_bytes(model, **spec), 0)  # every byte through O_DIRECT
        assert buffered.count_nonzero() > buffered.numel() // 2
        assert torch.equal(direct, buffered), f"tp_rank {rank}/{tp_size}"
        # the default staging size: whole tensors in one direct read each
        assert torch.equal(fill(model, "on", monkeypatch, staging_bytes=32 << 20, readers=4, **spec), buffered)


def test_direct_reads_without_a_memfd(model, monkeypatch):
    for quantization in ("none", "fp8-block"):
        spec = dict(quantization=quantization, tp_size=2, tp_rank=1)
        assert torch.equal(fill(model, "on", monkeypatch, memfd=False, **spec),
                           fill(model, "off", monkeypatch, memfd=False, **spec))


def test_direct_reads_bypass_the_page_cache_and_auto_uses_what_is_cached(model, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="weightcache_agent.load.pipeline")
    total = shard_bytes(model)
    drop_page_cache(model)
    reference = fill(model, "on", monkeypatch)
    assert cached_share(model) < 0.1  # the data went disk -> staging; only the headers were read buffered
    drop_page_cache(model)
    assert torch.equal(fill(model, "auto", monkeypatch), reference)
    assert read_counts(caplog) == (total, 0)  # cold and on a block device: all direct
    assert cached_share(model) < 0.1
    assert torch.equal(fill(model, "off", monkeypatch), reference)
    assert cached_share(model) > 0.9
    assert torch.equal(fill(model, "auto", monkeypatch), reference)
    assert read_counts(caplog) == (0, total)  # all in the page cache: copied from there, not read again


def test_tmpfs_loads_the_same(monkeypatch):
    """tmpfs refuses O_DIRECT before Linux 6.6 (read buffered, silently) and serves it from its pages after."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    directory = tempfile.mkdtemp(prefix="weightcache-direct-io-", dir="/dev/shm")
    try:
        model = write_llama_checkpoint(os.path.join(directory, "m"), SHAPE, shards=2)
        for mode in ("on", "auto"):
            assert torch.equal(fill(model, mode, monkeypatch, quantization="fp8-block"),
                               fill(model, "off", monkeypatch, quantization="fp8-block"))
    finally:
        shutil.rmtree(directory)


@pytest.mark.parametrize("quantization", ["none", "fp8-block"])
@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("into", [1000, 4096 * 20 + 1])
def test_truncated_file_same_error(model, monkeypatch, quantization, tp_rank, into):
    # down_proj of the last layer: [328, 1000] split by columns under tp=2, the file's last big tensor
    name = "model.layers.1.mlp.down_proj.weight"
    spec = CacheSpec(model, quantization=quantization, tp_size=2, tp_rank=tp_rank)
    record = prepare_cache(spec).checkpoint.tensors[name]
    with open(record.file, "rb") as f:
        original = f.read()
    messages = []
    for mode in ("off", "on"):
        monkeypatch.setenv("WEIGHTCACHE_DIRECT_IO", mode)
        with open(record.file, "wb") as f:
            f.write(original)
        # planned first, cut after: a file that shrinks once its header was read, which only the read finds
        prepared = prepare_cache(spec)
        os.truncate(record.file, record.start + into)
        arena = new_cpu_arena(prepared.layout.size, prepared.spec, "test")
        view = arena.writable(populate=False)
        try:
            with pytest.raises(CheckpointError) as e:
                # one reader: the first job past the end of the file is the one that fails
                fill_arena(view, prepared.layout, prepared.plan, LoadProgress(), fd=arena.fd, readers=1,
                           staging_bytes=SMALL_STAGING)
        finally:
            view.release()
            arena.close()
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    assert messages[1].startswith(f"{record.file}: tensor {name!r}: file ended at byte ") and "truncated" in messages[1]


@pytest.mark.parametrize("quantization", ["none", "fp8-block"])
def test_arena_write_failure_same_error(model, monkeypatch, quantization):
    """A write that cannot get its page (here: RLIMIT_FSIZE halfway into the memfd) names the tensor."""
    messages = []
    for mode in ("off", "on"):
        monkeypatch.setenv("WEIGHTCACHE_DIRECT_IO", mode)
        prepared = prepare_cache(CacheSpec(model, quantization=quantization))
        arena = new_cpu_arena(prepared.layout.size, prepared.spec, "test")
        view = arena.writable(populate=False)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (prepared.layout.size // 2 + 1000, hard))
        try:
            with pytest.raises(OutOfMemory) as e:
                fill_arena(view, prepared.layout, prepared.plan, LoadProgress(), fd=arena.fd, readers=1, workers=1,
                           staging_bytes=SMALL_STAGING)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            view.release()
            arena.close()
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    assert re.match(r"tensor '[\w.]+': cannot allocate arena pages for \d+ more bytes", messages[1])


def test_unknown_mode_is_refused(model, monkeypatch):
    with pytest.raises(ValueError, match=r"WEIGHTCACHE_DIRECT_IO='sometimes': expected one of auto, on, off"):
        fill(model, "sometimes", monkeypatch)


def test_gather_takes_runs_apart_where_the_stride_changes():
    """Ranges of equal length at changing strides (two fused parts per row) are not one strided run."""
    src = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    ranges, at = [], 0
    for row in range(4):
        for pos in (row * 50 + 3, row * 50 + 20):
            ranges.append((100 + pos, at, 7))
            at += 7
    dest = torch.zeros(at, dtype=torch.uint8)
    gather(src, 100, ranges, dest)
    assert dest.tolist() == [(row * 50 + c + k) % 256 for row in range(4) for c in (3, 20) for k in range(7)]
