"""What one agent leaves beside its socket for the next, and how the next reads it.

Three private files (0600, serve/access.py), named in serve/sidecar.py:
  state     the leases engines hold (uid, pid, the hash of each rejoin token), written before
            a manifest goes out and present exactly while engines are attached;
  digest    the secret key and keyed digest of the arena as it was filled;
  prepared  the prepared cache (prepared_record.py): a successor that adopts plans from it.

A restarted agent reads state and digest once, at bind (`read_predecessor`), before any lease
of its own rewrites them. A rejoin then proves a recorded lease with its token
(`proven`, each token used once: `claimed`), and an offered arena is checked against the
recorded digest (`recorded_digest`). The lease book (serve/lease_book.py) writes the state
file; the arena holder writes the other two.
"""
from __future__ import annotations

import hmac
import logging
import os
from typing import TYPE_CHECKING, Any, Callable

from ..arena.devices import Device
from ..arena.digest import ArenaDigest
from ..spec import CacheSpec
from .access import read_private, write_private
from .lease import MAX_TOKEN_CHARS, hash_token
from .prepared_record import RecordedCache, read_record, write_record
from .sidecar import sidecar_path

if TYPE_CHECKING:
    from ..load.loader import PreparedCache

log = logging.getLogger(__name__)


class RestartState:
    """The sidecar files of one socket; `plan()` answers what this agent prepared (None before)."""

    def __init__(self, socket_path: str, device: Device, plan: Callable[[], "PreparedCache | None"]):
        self.socket_path, self.device, self._plan = socket_path, device, plan
        self.previous: Any = None  # the predecessor's state file, read once at bind
        self.previous_digest: Any = None  # the predecessor's digest file, read once at bind
        self.claimed: set[str] = set()  # token hashes of the predecessor's leases already rejoined

    @property
    def state_path(self) -> str:
        return sidecar_path(self.socket_path, "state")

    @property
    def digest_path(self) -> str:
        return sidecar_path(self.socket_path, "digest")

    @property
    def record_path(self) -> str:
        return sidecar_path(self.socket_path, "prepared")

    def read_predecessor(self) -> None:
        """Before any lease of ours rewrites them: the predecessor's leases are what a rejoin must match."""
        self.previous = read_private(self.state_path)
        self.previous_digest = read_private(self.digest_path)

    def engines_may_hold_arena(self) -> bool:
        """The predecessor left leases: an engine may hand its arena back (known before any plan)."""
        return isinstance(self.previous, dict) and bool(self.previous.get("leases"))

    # -- leases --------------------------------------------------------------------------------

    def identity(self) -> dict[str, Any] | None:
        """What the files must agree on with this agent: the prepared cache's identity and the device."""
        prepared = self._plan()
        if prepared is None:
            return None
        return {"fingerprint": prepared.fingerprint, "layout_hash": prepared.layout.layout_hash,
                "backend": self.device.backend, "device": self.device.uuid}

    def previous_leases(self) -> list[dict[str, Any]]:
        """The predecessor's lease records, if it served exactly what this agent prepared."""
        previous, state = self.previous, self.identity()
        if not isinstance(previous, dict) or state is None:
            return []
        if any(previous.get(key) != value for key, value in state.items()):
            return []
        leases = previous.get("leases")
        return [r for r in leases if isinstance(r, dict)] if isinstance(leases, list) else []

    def write(self, records: list[dict[str, Any]]) -> None:
        """Record what engines hold, so a successor knows to wait for one to hand the arena back.

        The file exists exactly while engines are attached: an agent restarted after its last
        engine left loads from disk at once instead of waiting for nobody. The caller holds the
        lease book's lock; raises OSError when the file cannot be written.
        """
        state = self.identity()
        if state is None:
            return
        # The predecessor's engines that have not rejoined yet keep their records (a second restart
        # still lets them in); a token already used is gone from the file before its rejoin is answered.
        unclaimed = [r for r in self.previous_leases() if r.get("token") not in self.claimed]
        state["leases"] = records + unclaimed
        write_private(self.state_path, state)

    def clear(self) -> None:
        try:
            os.unlink(self.state_path)
        except FileNotFoundError:
            pass

    def proven(self, token: Any, pid: int | None, uid: int) -> dict[str, Any] | None:
        """The predecessor's lease record a rejoin's `token` proves it held, or None."""
        if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN_CHARS:
            return None
        digest = hash_token(token)
        for record in self.previous_leases():
            if not hmac.compare_digest(str(record.get("token", "")), digest):
                continue
            if record.get("uid") != uid:
                return None
            # A pid is known on both sides only within one PID namespace; where it is, it must be the same process.
            if isinstance(record.get("pid"), int) and pid is not None and record["pid"] != pid:
                return None
            return record
        return None

    # -- the arena's digest --------------------------------------------------------------------

    def write_digest(self, key: bytes, digest: ArenaDigest) -> None:
        prepared = self._plan()
        try:
            write_private(self.digest_path, {
                "key": key.hex(), "digest": digest.to_json(), "fingerprint": prepared.fingerprint,
                "layout_hash": prepared.layout.layout_hash, "backend": self.device.backend,
                "device": self.device.uuid})
        except OSError as e:  # a restart then loads from disk instead of adopting: slower, not wrong
            log.warning("cannot record the arena's digest in %s: %s", self.digest_path, e.strerror or e)

    def recorded_digest(self, size: int) -> tuple[bytes, ArenaDigest] | None:
        """The predecessor's key and digest, if they describe what this agent prepared."""
        doc, expected = self.previous_digest, self.identity()
        if not isinstance(doc, dict) or expected is None:
            return None
        if any(doc.get(k) != v for k, v in expected.items()):
            return None
        digest = ArenaDigest.from_json(doc.get("digest"))
        try:
            key = bytes.fromhex(str(doc.get("key")))
        except ValueError:
            return None
        return (key, digest) if digest is not None and digest.size == size and len(key) >= 32 else None

    # -- the prepared cache --------------------------------------------------------------------

    def read_record(self, spec: CacheSpec, device_mark: str, socket_path: str | None = None) -> RecordedCache | None:
        """The prepared cache recorded beside `socket_path` (default: ours), if it still holds."""
        path = self.record_path if socket_path is None else sidecar_path(socket_path, "prepared")
        return read_record(path, spec, device_mark)

    def write_record(self, prepared: Any) -> None:
        """What a successor or another replica may plan from."""
        try:
            write_record(self.record_path, prepared)
        except OSError as e:  # a restart then plans from the checkpoint: slower, not wrong
            log.warning("cannot record the prepared cache in %s: %s", self.record_path, e.strerror or e)
