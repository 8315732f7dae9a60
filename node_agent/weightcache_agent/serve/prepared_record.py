"""What a restarted agent needs to serve a re-adopted arena without planning the load again.

Planning (headers, sharding, quantization, layout) parses every header, and an agent that
re-adopts needs none of it: start-up spent before the first status answer. After a load, the agent writes
a record of its prepared cache beside its socket (0600, like the state file): the spec,
the checkpoint's file signature and content identity, the fingerprint fields, and the
layout as its manifest columns, its fused groups and each slot's kind. A restarted agent with engines to
re-adopt from reads it back and serves from it -- status, rejoins, attaches -- with no
torch and no header read, provided everything that decides the bytes is unchanged: the
same spec, the same files (by signature), the same device and torch (the fields'
environment marks), the same package and layout version, and a layout whose recomputed
hash is the one recorded. Anything else, and the agent plans from the checkpoint as usual.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .. import __version__
from ..load.fingerprint import LAYOUT_VERSION, environment_fields
from ..load.layout import check_names, fuse_columns, hash_rows
from ..load.signature import file_signature
from ..spec import CacheSpec
from .access import read_private, write_private

log = logging.getLogger(__name__)

RECORD_VERSION = 2
MAX_RECORD_BYTES = 512 << 20  # a manifest of several hundred thousand tensors


@dataclass(frozen=True)
class RecordedLayout:
    """The served side of an `ArenaLayout`: sizes, hash and manifest, without torch dtypes."""

    size: int
    nbytes: int
    layout_hash: str
    manifest: dict[str, list]  # the checkpoint's names
    kinds: list[str]
    groups: list[list[Any]]

    @property
    def slots(self) -> list[str]:  # what `len(layout.slots)` counts
        return self.manifest["name"]

    def to_manifest(self, names: str = "checkpoint") -> dict[str, list]:
        return self.manifest if check_names(names) == "checkpoint" else fuse_columns(self.manifest, self.groups)


@dataclass
class RecordedCache:
    """A prepared cache read back from a record; `arena` and `load_seconds` once an arena is adopted."""

    spec: CacheSpec
    layout: RecordedLayout
    fields: dict[str, Any]
    fingerprint: str
    signature: str
    revision: str
    checkpoint: Any = None  # never parsed: an agent that needs it plans from the checkpoint
    arena: Any = None
    load_seconds: float = 0.0

    def loaded(self, arena: Any, seconds: float) -> "RecordedCache":
        return RecordedCache(self.spec, self.layout, self.fields, self.fingerprint, self.signature, self.revision,
                             arena=arena, load_seconds=seconds)


def write_record(path: str, prepared: Any) -> None:
    """Record `prepared`: a `PreparedCache` whose checkpoint was just read, or another replica's
    `RecordedCache` this agent served from. Raises OSError."""
    layout = prepared.layout
    if isinstance(prepared, RecordedCache):
        signature, revision, kinds = prepared.signature, prepared.revision, layout.kinds
    else:
        signature, revision = prepared.checkpoint.signature, prepared.checkpoint.revision
        kinds = [slot.kind for slot in layout.slots]
    write_private(path, {
        "version": RECORD_VERSION, "package": __version__, "layout_version": LAYOUT_VERSION,
        "spec": prepared.spec.to_json(), "signature": signature, "revision": revision,
        "fields": prepared.fields, "fingerprint": prepared.fingerprint,
        "size": layout.size, "nbytes": layout.nbytes, "layout_hash": layout.layout_hash,
        "manifest": layout.to_manifest(), "kinds": kinds, "groups": [[f, list(p)] for f, p in layout.groups],
    })


def read_record(path: str, spec: CacheSpec, device_mark: str) -> RecordedCache | None:
    """The recorded cache for `spec` on this device, or None (with the reason logged) when there is
    none or anything that decides the bytes may have changed since it was written."""
    doc = read_private(path, MAX_RECORD_BYTES)
    if not isinstance(doc, dict):
        return None
    try:
        why = _stale(doc, spec, device_mark)
        if why is None:
            layout = _layout(doc)
            return RecordedCache(spec, layout, doc["fields"], doc["fingerprint"], doc["signature"], doc["revision"])
    except (KeyError, TypeError, ValueError, IndexError, OSError) as e:
        why = f"unreadable ({type(e).__name__}: {e})"
    log.info("not serving from the recorded plan in %s: %s; planning from the checkpoint", path, why)
    return None


def _stale(doc: dict[str, Any], spec: CacheSpec, device_mark: str) -> str | None:
    if (doc.get("version"), doc.get("package"), doc.get("layout_version")) != (
            RECORD_VERSION, __version__, LAYOUT_VERSION):
        return "written by another version"
    if doc.get("spec") != spec.to_json():
        return "recorded for another spec"
    fields = doc["fields"]
    expected = environment_fields(device_mark)
    if any(fields.get(key) != value for key, value in expected.items()):
        return "recorded for another device or torch"
    if file_signature(spec.model) != doc["signature"]:
        return "the checkpoint's files changed"
    return None


def _layout(doc: dict[str, Any]) -> RecordedLayout:
    manifest, kinds, groups, size = doc["manifest"], doc["kinds"], doc["groups"], int(doc["size"])
    names, offsets, forms, index = manifest["name"], manifest["offset"], manifest["forms"], manifest["form"]
    if not len(names) == len(offsets) == len(index) == len(kinds):
        raise ValueError("manifest columns differ in length")
    rows = []
    for name, offset, form, kind in zip(names, offsets, index, kinds):
        dtype, shape, stride = forms[form]
        rows.append([name, offset, shape, stride, dtype, kind])
    if hash_rows(size, rows, groups) != doc["layout_hash"]:
        raise ValueError("the layout does not hash to the recorded layout hash")
    fuse_columns(manifest, groups)  # what an engine asking for fused names gets: checked before it is served
    return RecordedLayout(size, int(doc["nbytes"]), doc["layout_hash"], manifest, kinds, groups)

