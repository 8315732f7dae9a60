"""What identifies a checkpoint directory's files, without torch: their signature and content identity.

The file signature (one stat per file) is what an engine sends with every attach and what
an agent checks its record of a prepared cache against; the content identity (the shards'
raw headers and config.json, hashed) decides when the signatures differ. Both live apart
from `checkpoint` (which needs torch for its dtypes) so that the agent's re-adoption path
and a replica copying another's arena identify the files without importing torch.
"""
from __future__ import annotations

import hashlib
import json
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
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return digest.hexdigest()[:16]


def open_regular(path: str) -> Any:
    """`path` opened for binary reading, or `CheckpointError` when it is not a regular file.

    Opened non-blocking first: a FIFO or device in place of a shard is refused at once
    instead of hanging the load on its first read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _read_index(index_path: str) -> dict[str, str]:
    try:
        with open_regular(index_path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index_path}: cannot read index: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: no 'weight_map' object of tensor name -> shard file")
    return weight_map


def _shard_files(directory: str) -> tuple[list[str], dict[str, str] | None]:
    """The checkpoint's safetensors files (sorted names) and, when sharded, the index's weight map."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: model directory does not exist")
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index_path):
        expected = _read_index(index_path)
        files = sorted(set(expected.values()))
        for fname in files:
            if not os.path.isfile(os.path.join(directory, fname)):
                raise CheckpointError(f"{index_path}: names shard {fname!r}, which is missing from {directory}")
        return files, expected
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files and no {INDEX_FILE}")
    return files, None


def _identity(directory: str, headers: list[tuple[str, int, bytes]]) -> str:
    """Hash of (name, size, raw header) of every shard plus config.json: what decides the bytes served."""
    digest = hashlib.sha256()
    for fname, size, raw in headers:
        digest.update(f"{fname}\0{size}\0{len(raw)}\0".encode())
        digest.update(raw)
    try:
        with open_regular(os.path.join(directory, "config.json")) as f:
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
            with open_regular(path) as f:
                (length,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
                headers.append((fname, os.fstat(f.fileno()).st_size, f.read(min(length, MAX_HEADER_BYTES))))
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    return _identity(directory, headers)
