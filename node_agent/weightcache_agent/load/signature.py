"""What identifies a checkpoint directory's files, without torch: their signature and content identity.

The file signature (one stat per file) is what an engine sends with every attach and what
an agent checks its record of a prepared cache against; the content identity (the shards'
raw headers, sampled blocks of their data and config.json, hashed) decides when the signatures differ. Both live apart
from `checkpoint` (which needs torch for its dtypes) so that the agent's re-adoption path
and a replica copying another's arena identify the files without importing torch.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import struct
from typing import Any

from ..errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
# safetensors' own cap on the JSON header: a larger length is corruption, not a model.
MAX_HEADER_BYTES = 100 * 1024 * 1024


def file_signature(directory: str) -> str:
    """Hash of (name, size, mtime, inode) of the directory's safetensors and JSON files.

    One stat per file, no read: what an engine sends so that an agent that loaded these very
    files can vouch for their content identity. Bind mounts keep size, mtime and inode, so a
    pod sees the signature the agent saw; a copy or an edit changes it, and then the content
    identity decides (`content_identity`).
    """
    try:
        entries = sorted((e.name, e.stat()) for e in os.scandir(directory)
                         if e.name.endswith((".safetensors", ".json")))
    except OSError as e:
        raise CheckpointError(f"{directory}: cannot list: {e.strerror}") from None
    digest = hashlib.sha256()
    for name, st in entries:
        # ctime too: a rewrite that restores size and mtime (touch -r) still moves it, and no user can set it.
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_ctime_ns}\n".encode())
    return digest.hexdigest()[:16]


# The content identity reads, besides every header, SAMPLES blocks of SAMPLE_BYTES spread evenly
# over each shard's data (the first and last included): 1 MiB per shard, a few ms, so an engine
# can afford it at every start. Other weights under the same headers are a miss when they differ
# anywhere in those blocks; a change confined to the bytes between them is not seen by the
# identity -- only by the file identity (`file_signature`) of the files the agent loaded.
SAMPLES = 64
SAMPLE_BYTES = 16384


# Samples are read with O_DIRECT where the filesystem takes it: a buffered 16 KiB read pulls the
# kernel's read-ahead window into the page cache with it, 64 times per shard, and pages left there
# make the load that follows read them buffered and keep a copy of the weights in host memory.
_ALIGN = 4096


def data_samples(f: Any, data_start: int, size: int) -> bytes:
    """SHA-256 of SAMPLES blocks of the data section [data_start, size) of the open shard `f`."""
    digest = hashlib.sha256()
    span = max(size - data_start, 0)
    if span <= SAMPLES * SAMPLE_BYTES:
        offsets = [data_start]
        length = span
    else:
        step = (span - SAMPLE_BYTES) // (SAMPLES - 1)
        offsets = [data_start + i * step for i in range(SAMPLES)]
        length = SAMPLE_BYTES
    with _SampleReader(f.fileno(), length) as read:
        for offset in offsets:
            digest.update(read(offset))
    return digest.digest()


class _SampleReader:
    """Reads `length` bytes at an offset of the file open as `fd`: with O_DIRECT through a second
    descriptor (reopened through /proc: the very file, not its name) where the filesystem takes
    aligned direct reads, else buffered."""

    def __init__(self, fd: int, length: int):
        self.fd, self.length, self.direct = fd, length, -1
        self.buffer = mmap.mmap(-1, -(-(length + _ALIGN) // _ALIGN) * _ALIGN)  # page-aligned, as O_DIRECT wants
        try:
            self.direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            self(0)  # tmpfs refuses O_DIRECT at open; some filesystems only at the first read
        except OSError:
            self.close()

    def __call__(self, offset: int) -> bytes:
        if self.direct < 0:
            return os.pread(self.fd, self.length, offset)
        start = offset - offset % _ALIGN
        got = os.preadv(self.direct, [self.buffer], start)
        return self.buffer[offset - start:min(offset - start + self.length, got)]

    def close(self) -> None:
        if self.direct >= 0:
            os.close(self.direct)
            self.direct = -1

    def __enter__(self) -> "_SampleReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.buffer.close()


def open_regular(path: str, within: str | None = None) -> Any:
    """`path` opened for binary reading, or `CheckpointError` when it is not a regular file.

    Opened non-blocking first: a FIFO or device in place of a shard is refused at once
    instead of hanging the load on its first read. With `within` (a directory), the file
    opened must lie inside it once every link is resolved: checked on the descriptor itself
    (`/proc/self/fd`), so a link swapped in after a check of the name cannot lead outside.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if within is not None:
            check_within(path, os.readlink(f"/proc/self/fd/{fd}"), within)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def check_within(path: str, real: str, directory: str) -> None:
    """Refuse `path` (resolved: `real`) unless it lies inside `directory` (resolved too).

    The model directory is the one place a checkpoint may name: a shard, index or config
    that is a link out of it would have the agent (root) read, and serve, a file the
    checkpoint's author chose anywhere on the node."""
    root = os.path.realpath(directory)
    if not real.startswith(root.rstrip(os.sep) + os.sep):
        raise CheckpointError(f"{path}: resolves to {real}, outside the model directory {root}: refused")


def shard_name_ok(name: Any) -> bool:
    """Whether an index's shard name is a plain file name: no directory part, not absolute, not `..`."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and "\0" not in name
            and name not in (".", ".."))


def parse_json(raw: bytes, path: str, what: str) -> Any:
    """`raw` parsed as JSON, or `CheckpointError` naming `path`. Nothing of `raw` is quoted back:
    an error says where and what is wrong, never which bytes are there (a file named by a hostile
    index must not leak into a status message).

    Refused: text that is not UTF-8, nesting deeper than the parser's recursion bound (it stops
    there: no stack grows past it), integers too long to convert, and an object with the same
    key twice (safetensors refuses such a header; json would keep the last one silently)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: {what} is not UTF-8 (at byte {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise CheckpointError(f"{path}: {what} has the key {e.key[:200]!r} more than once") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # an integer beyond Python's digit limit
        kind = "nested too deeply" if isinstance(e, RecursionError) else "holds a number too long to convert"
        raise CheckpointError(f"{path}: {what} {kind}") from None


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _read_index(index_path: str) -> dict[str, str]:
    directory = os.path.dirname(index_path)
    try:
        with open_regular(index_path, within=directory) as f:
            raw = f.read(MAX_HEADER_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{index_path}: cannot read index: {e.strerror or e}") from None
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(f"{index_path}: index larger than {MAX_HEADER_BYTES} bytes")
    index = parse_json(raw, index_path, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: no 'weight_map' object of tensor name -> shard file")
    for tensor, fname in weight_map.items():
        if not shard_name_ok(fname):
            raise CheckpointError(f"{index_path}: tensor {tensor[:200]!r}: shard {fname[:200]!r} is not a file name "
                                  "in the model directory (absolute, with a directory part, or '..'): refused")
    return weight_map


def _shard_files(directory: str) -> tuple[list[str], dict[str, str] | None]:
    """The checkpoint's safetensors files (sorted names) and, when sharded, the index's weight map.

    Every name is a file of the model directory, and stays in it when its links are resolved."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: model directory does not exist")
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.lexists(index_path):
        expected = _read_index(index_path)
        files = sorted(set(expected.values()))
        for fname in files:
            path = os.path.join(directory, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"{index_path}: names shard {fname!r}, which is missing from {directory}")
            check_within(path, os.path.realpath(path), directory)
        return files, expected
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files and no {INDEX_FILE}")
    for fname in files:
        path = os.path.join(directory, fname)
        check_within(path, os.path.realpath(path), directory)
    return files, None


def _identity(directory: str, headers: list[tuple[str, int, bytes, bytes]]) -> str:
    """Hash of (name, size, raw header, sampled data) of every shard plus config.json: what decides the bytes served."""
    digest = hashlib.sha256()
    for fname, size, raw, samples in headers:
        digest.update(f"{fname}\0{size}\0{len(raw)}\0".encode())
        digest.update(raw)
        digest.update(samples)
    try:
        with open_regular(os.path.join(directory, "config.json"), within=directory) as f:
            digest.update(b"config.json\0" + f.read())
    except FileNotFoundError:
        pass
    return digest.hexdigest()[:16]


def content_identity(directory: str) -> str:
    """`Checkpoint.revision` without parsing or checking headers: cheap enough for every engine start."""
    directory = os.path.abspath(directory)
    files, _ = _shard_files(directory)
    headers = []
    for fname in files:
        path = os.path.join(directory, fname)
        try:
            with open_regular(path, within=directory) as f:
                (length,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
                size = os.fstat(f.fileno()).st_size
                raw = f.read(min(length, MAX_HEADER_BYTES))
                headers.append((fname, size, raw, data_samples(f, 8 + len(raw), size)))
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    return _identity(directory, headers)
