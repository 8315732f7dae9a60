"""Read and check a safetensors checkpoint's headers without reading its data.

Everything downstream (layout, fingerprint, loader) works from the `Checkpoint` this
module returns: one `TensorRecord` per tensor with the absolute file offset of its
bytes. Every inconsistency a header can carry -- a length beyond the file, offsets out
of range or overlapping, sizes that contradict shape and dtype, an index that names a
missing shard or tensor -- is refused here with the file and tensor named, before a
single byte of weights is read.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from .dtypes import DTYPES, DType
# also imported from here by engines and tests
from .signature import (INDEX_FILE, MAX_HEADER_BYTES, _identity, _shard_files, content_identity,  # noqa: F401
                        data_samples, file_signature, open_regular, parse_json)


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes are on disk."""

    name: str
    file: str
    dtype: DType
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in `file`
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Checkpoint:
    directory: str
    files: list[str]
    tensors: dict[str, TensorRecord]
    config: dict[str, Any] | None
    revision: str  # content identity of the headers and config.json (`content_identity`)
    signature: str = ""  # `file_signature` taken before the headers were read
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def floating_dtype(self) -> DType | None:
        """The floating dtype holding most bytes: what `dtype=auto` resolves to."""
        by_dtype: dict[DType, int] = {}
        for record in self.tensors.values():
            if record.dtype.is_floating_point and record.dtype.itemsize > 1:
                by_dtype[record.dtype] = by_dtype.get(record.dtype, 0) + record.nbytes
        return max(by_dtype, key=by_dtype.get) if by_dtype else None


def read_header(path: str, within: str | None = None,
                samples: list[bytes] | None = None) -> tuple[bytes, dict[str, TensorRecord], dict[str, str]]:
    """Parse and check one safetensors file's header; return (raw header, records, metadata).

    `within`: the model directory the file must resolve into (`open_regular`). No error quotes
    the file's leading bytes: a file that is not safetensors is called that, whatever it holds."""
    try:
        with open_regular(path, within=within) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated: {size} bytes, too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: not a safetensors file, or truncated: its header length field points beyond the file "
                    f"({size} bytes)"
                )
            raw = f.read(header_len)
            if samples is not None:  # the content identity's sample of the data, from the same open file
                samples.append(data_samples(f, 8 + header_len, size))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    header = parse_json(raw, path, "header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    data_size = size - data_start
    records: dict[str, TensorRecord] = {}
    for name, entry in header.items():
        if len(name) > MAX_NAME:  # sharding rules are matched against every name: bounded, as real names are
            raise CheckpointError(f"{path}: a tensor name of {len(name)} characters (at most {MAX_NAME}): "
                                  f"{_short(name)}")
        records[name] = _record(path, name, entry, data_start, data_size)
    spans = sorted((r.start, r.start + r.nbytes, r.name) for r in records.values() if r.nbytes)
    for (s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise CheckpointError(f"{path}: tensors {n0!r} and {n1!r} overlap in the data section")
    return raw, records, metadata


def _record(path: str, name: str, entry: Any, data_start: int, data_size: int) -> TensorRecord:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    code = entry.get("dtype")
    if code not in DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {_short(code)}; supported: {', '.join(DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {_short(shape)} is not a list of non-negative integers")
    # As safetensors and torch take a shape: at most 64 dimensions, and every count of elements a
    # stride or size is made of (the product of the non-zero dimensions) within int64. A zero
    # dimension makes the product 0 and would hide [0, 2**70] from the size check below.
    if len(shape) > MAX_DIMS or math.prod(d for d in shape if d) > INT64_MAX:
        raise CheckpointError(f"{where}: shape {_short(shape)} is beyond int64 elements or {MAX_DIMS} dimensions")
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{where}: data_offsets {_short(offsets)} are not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    dtype = DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{where}: header says {end - begin} bytes but shape {shape} of {code} needs {expected}"
        )
    if end > data_size:
        raise CheckpointError(
            f"{where}: data ends at byte {end} of the data section but the file holds only {data_size} "
            "(truncated file or a header that lies about sizes)"
        )
    return TensorRecord(name, path, dtype, tuple(shape), data_start + begin, end - begin)


MAX_DIMS = 64
INT64_MAX = 2**63 - 1
MAX_NAME = 512  # characters in a tensor name; real ones have fewer than 200


def _short(value: Any) -> str:
    """A header field for an error line, cut short: diagnostics, not a way to read a file back."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def open_checkpoint(directory: str) -> Checkpoint:
    """Index a checkpoint directory (single file or sharded with an index) from its headers."""
    directory = os.path.abspath(directory)
    signature = file_signature(directory)  # before reading: a file changed meanwhile then mismatches
    files, expected = _shard_files(directory)
    index_path = os.path.join(directory, INDEX_FILE)
    headers: list[tuple[str, int, bytes, bytes]] = []
    tensors: dict[str, TensorRecord] = {}
    metadata: dict[str, dict[str, str]] = {}
    for fname in files:
        path = os.path.join(directory, fname)
        samples: list[bytes] = []
        raw, records, meta = read_header(path, within=directory, samples=samples)
        headers.append((fname, os.path.getsize(path), raw, samples[0]))
        metadata[fname] = meta
        for name, record in records.items():
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name!r} also appears in {tensors[name].file}")
            tensors[name] = record
    if expected is not None:
        for name, fname in expected.items():
            record = tensors.get(name)
            if record is None or os.path.basename(record.file) != fname:
                raise CheckpointError(
                    f"{index_path}: lists tensor {name!r} in shard {fname!r}, but that shard does not contain it"
                )
    return Checkpoint(
        directory=directory,
        files=[os.path.join(directory, f) for f in files],
        tensors=tensors,
        config=_read_config(directory),
        revision=_identity(directory, headers),
        signature=signature,
        metadata=metadata,
    )


def _read_config(directory: str) -> dict[str, Any] | None:
    path = os.path.join(directory, "config.json")
    if not os.path.lexists(path):
        return None
    try:
        with open_regular(path, within=directory) as f:
            raw = f.read(MAX_HEADER_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read config: {e.strerror or e}") from None
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: config larger than {MAX_HEADER_BYTES} bytes")
    config = parse_json(raw, path, "config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config is not a JSON object")
    return config
