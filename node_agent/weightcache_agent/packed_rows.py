"""A manifest's rows as one binary payload: what an attach spends no time decoding.

A manifest lists every tensor of the arena: its name, its byte offset, and which of a
handful of forms (dtype, shape, stride) it has. As JSON, 2001 rows cost an engine ~0.5 ms
to parse into 2001 name strs and 4002 ints on every attach, before any of it is used. Packed,
the rows are four arrays in one frame after the manifest's JSON (`protocol.send_message`'s
payload), which the C bind loop reads where they lie; name strs are made only when someone
asks for them (the Python path, `Attachment.tensors`).

Layout, native byte order (agent and engine share the host), for `count` rows:
  offsets  int64[count]   byte offset of each tensor in the arena
  forms    uint32[count]  index into the manifest's list of forms
  ends     uint32[count]  where each name ends in `names`
  names    the names, UTF-8 (a lone surrogate passed through), one after another
Torch-free: the agent packs, the engine unpacks.
"""
from __future__ import annotations

import itertools
import json
from array import array
from typing import Any, Iterable

_OFFSET, _INDEX = "q", "I"
ROW_BYTES = array(_OFFSET).itemsize + 2 * array(_INDEX).itemsize
assert array(_OFFSET).itemsize == 8 and array(_INDEX).itemsize == 4, "the layout needs 8- and 4-byte arrays"


class PackedRows:
    """`count` manifest rows packed in `data`, with the `forms` they index."""

    def __init__(self, forms: list, count: int, data: bytes | bytearray | memoryview):
        if not isinstance(count, int) or count < 0 or len(data) < count * ROW_BYTES:
            raise ValueError(f"packed rows: {len(data)} bytes cannot hold {count!r} rows")
        self.forms, self.count, self.data = forms, count, data

    @classmethod
    def pack(cls, names: Iterable[str], offsets: Iterable[int], form_index: Iterable[int], forms: list) -> "PackedRows":
        encoded = [name.encode("utf-8", "surrogatepass") for name in names]
        ends = array(_INDEX, itertools.accumulate(map(len, encoded)))
        offsets, form_index = array(_OFFSET, offsets), array(_INDEX, form_index)
        if not len(offsets) == len(form_index) == len(encoded):
            raise ValueError(f"manifest columns differ in length: {len(encoded)} names, {len(form_index)} forms, "
                             f"{len(offsets)} offsets")
        data = b"".join((offsets.tobytes(), form_index.tobytes(), ends.tobytes(), *encoded))
        return cls(forms, len(encoded), data)

    @classmethod
    def from_columns(cls, columns: dict[str, list]) -> "PackedRows":
        """Columns as `ArenaLayout.to_manifest` gives them, packed."""
        return cls.pack(columns["name"], columns["offset"], columns["form"], columns["forms"])

    def arrays(self) -> tuple[memoryview, memoryview, memoryview, memoryview]:
        """(offsets, form indices, name ends, name bytes) as views of the data."""
        view, n = memoryview(self.data), self.count
        return (view[:8 * n].cast(_OFFSET), view[8 * n:12 * n].cast(_INDEX), view[12 * n:16 * n].cast(_INDEX),
                view[16 * n:])

    def names(self) -> list[str]:
        _, _, ends, text = self.arrays()
        if any(a > b for a, b in zip(ends, ends[1:])) or (self.count and ends[-1] != len(text)):
            raise ValueError("packed rows: the name ends do not step through the names")
        return [bytes(text[a:b]).decode("utf-8", "surrogatepass") for a, b in zip(itertools.chain((0,), ends), ends)]

    def columns(self) -> dict[str, list]:
        offsets, form_index, _, _ = self.arrays()
        return {"name": self.names(), "offset": offsets.tolist(), "form": form_index.tolist(), "forms": self.forms}

    def header(self) -> dict[str, Any]:
        """What the manifest's JSON says of these rows; `data` follows as the frame's payload."""
        return {"forms": self.forms, "count": self.count, "packed": len(self.data)}


class EncodedManifests:
    """A layout's manifest under each naming, encoded once when the arena is ready (a 100k-tensor
    manifest is megabytes of JSON, and no attach should pay for it): `get(names)` gives the JSON
    columns and the packed rows (header, payload)."""

    def __init__(self, layout: Any, namings: Iterable[str]):
        self._encoded = {names: self._encode(layout.to_manifest(names)) for names in namings}

    @staticmethod
    def _encode(columns: dict[str, list]) -> tuple[bytes, tuple[bytes, bytes]]:
        packed = PackedRows.from_columns(columns)
        return (json.dumps(columns, separators=(",", ":")).encode(),
                (json.dumps(packed.header(), separators=(",", ":")).encode(), bytes(packed.data)))

    def get(self, names: str) -> tuple[bytes, tuple[bytes, bytes]]:
        return self._encoded[names]


def columns_of(rows: dict[str, list] | PackedRows) -> dict[str, list]:
    """A manifest's rows as JSON columns (`ArenaLayout.to_manifest`), whichever way they came."""
    return rows.columns() if isinstance(rows, PackedRows) else rows
