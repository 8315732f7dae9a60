"""The book of leases: who holds the arena, in which group and role, and who may have more.

Every change of a lease goes through here under one lock (`lock`): registering one (roles,
per-uid caps, a group's owner), ending one (and choosing a single-rank successor), handing the
arena out ahead of an attach (`grant`). Each change is recorded in the state file
(serve/restart_state.py) before the engine is answered, so a restarted agent knows whom to
wait for. The lock is also the served arena's (serve/arena_holder.py takes it to swap a
refilled arena in): who was handed the old one and the swap change together.

Telling engines of promotions is serve/promotion.py's job; this module only keeps the books.
"""
from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from typing import Any

from .. import protocol
from .lease import Lease
from .restart_state import RestartState

log = logging.getLogger(__name__)

GRANT_TTL = 60.0  # seconds an engine that was handed the arena ahead of its attach has to attach
MAX_HANDED = 1024  # who received the arena's handle, remembered for the log line of a mismatch


class LeaseBook:
    def __init__(self, state: RestartState, max_leases: int, max_leases_per_uid: int, clustered: bool):
        self.state = state
        self.max_leases, self.max_leases_per_uid = max_leases, max_leases_per_uid
        # In a cluster a group's name carries its namespace; off Kubernetes a group is the uid's own.
        self.clustered = clustered
        self.lock = threading.Lock()
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        # Who was handed the arena's handle ahead of an attach: (uid, pid) -> until when it counts
        # against the uid's lease cap. And everyone who received the handle since the fill
        # (`handed`), for the log line that reports a changed arena.
        self.grants: dict[tuple[int, int | None], float] = {}
        self.handed: dict[tuple[int, int | None], float] = {}
        self.waiting = 0  # attaches waiting for the load to finish

    def sorted(self) -> list[Lease]:
        with self.lock:
            return sorted(self.leases.values(), key=lambda lease: lease.since)

    def snapshot(self) -> list[Lease]:
        """The leases, oldest first, without the lock, which attaches hold across a state-file write:
        status must answer at once while dozens of engines attach. Copying a dict's values is atomic
        under the GIL."""
        return sorted(list(self.leases.values()), key=lambda lease: lease.since)

    # -- admission ---------------------------------------------------------------------------

    def group_key(self, uid: int, group: str | None) -> tuple[int | None, str | None]:
        """The `Lease.key` of a lease of `uid` in `group`: off Kubernetes the uid's own group of that name."""
        return (None if self.clustered else uid), group

    def group_owner(self, key: tuple[int | None, str | None]) -> int | None:
        """The uid a group belongs to while it has leases: its first non-root claimant's (root may join
        any group as a guest without taking it over), else root's when only root holds it. Another
        uid can neither squat a role in it nor take it over. (Off Kubernetes every member is the
        key's uid.) Call with `lock` held."""
        members = [lease for lease in self.leases.values() if lease.key == key]
        if not members:
            return None
        users = [lease for lease in members if lease.uid != 0]
        return min(users, key=lambda lease: lease.since).uid if users else 0

    def admission(self, uid: int, pid: int | None, group: str | None) -> dict[str, Any] | None:
        """The refusal of a new lease (or hand-out) for `uid`, or None. Call with `lock` held."""
        now = time.monotonic()
        for holder in [h for h, until in self.grants.items() if until < now]:
            del self.grants[holder]
        held = sum(1 for lease in self.leases.values() if lease.uid == uid) + sum(
            1 for (u, p) in self.grants if u == uid and p != pid)
        if len(self.leases) >= self.max_leases:
            return protocol.error_message("too_many_leases", f"this agent holds its cap of {self.max_leases} "
                                                             "leases; try again later")
        if held >= self.max_leases_per_uid:
            return protocol.error_message("too_many_leases", f"uid {uid} holds its cap of {self.max_leases_per_uid} "
                                                             "leases (and arenas handed out ahead of an attach)")
        owner = self.group_owner(self.group_key(uid, group)) if group is not None and uid != 0 else None
        if owner is not None and owner != uid:
            return protocol.error_message("group_taken", f"group {group!r} belongs to another user")
        return None

    def grant(self, uid: int, pid: int | None, group: str | None) -> dict[str, Any] | None:
        """The arena handed out ahead of an attach, counted against the uid's cap for `GRANT_TTL`
        seconds; the refusal, or None when it may go."""
        with self.lock:
            refusal = self.admission(uid, pid, group)
            if refusal is None:
                self.grants[(uid, pid)] = time.monotonic() + GRANT_TTL
                self.handing(uid, pid)
        return refusal

    def handing(self, uid: int, pid: int | None) -> None:
        """Remember who gets the arena's handle (under `lock`), bounded: a mismatch names them."""
        self.handed.pop((uid, pid), None)
        self.handed[(uid, pid)] = time.time()
        while len(self.handed) > MAX_HANDED:
            self.handed.pop(next(iter(self.handed)))

    def holders(self) -> list[tuple[int, int | None]]:
        """(uid, pid) of everyone who holds or was handed the arena, sorted. Call with `lock` held."""
        return sorted({(lease.uid, lease.pid) for lease in self.leases.values()} | set(self.handed),
                      key=lambda h: (h[0], h[1] or 0))

    def forget_handouts(self) -> None:
        """A fresh arena: nobody holds its handle yet. Call with `lock` held."""
        self.handed.clear()
        self.grants.clear()

    # -- registering and ending ----------------------------------------------------------------

    def register(self, conn: socket.socket, pid: int | None, uid: int, role: str, group: str | None,
                 token_hash: str, pod: dict[str, str] | None, verified: bool,
                 engine: str | None) -> tuple[Lease | None, dict[str, Any] | None]:
        """(the new lease, None), recorded in the state file, or (None, the refusal to send).

        Role "auto" (one not decided across ranks already) is decided here, under the lock:
        primary when the group has none, else standby.
        """
        refusal = None
        lease = None
        key = self.group_key(uid, group)
        with self.lock:
            has_primary = group is not None and any(
                held.role == "primary" and held.key == key for held in self.leases.values())
            if role == "auto":
                role = "standby" if has_primary else "primary"
            if role == "standby" and group is None:  # no primary's departure could ever promote it
                refusal = protocol.error_message("standby_without_group", "a standby needs a group: name the group "
                                                 "whose primary it takes over from")
            else:
                refusal = self.admission(uid, pid, group)
            if refusal is None and role == "primary" and has_primary:
                refusal = protocol.error_message("primary_exists",
                                                 f"group {group!r} already has a primary; attach as a standby")
            if refusal is None:
                if role == "standby" and not has_primary:  # engines start in any order: said, not refused
                    log.warning("standby pid=%s joined group %r, which has no primary on this agent yet: it is "
                                "promoted only when a primary of that group attaches and then goes", pid, group)
                lease = Lease(next(self._ids), conn, pid, role, group, uid, key[0], token_hash, pod=pod,
                              engine=engine, verified=verified)
                self.leases[lease.id] = lease
                self.grants.pop((uid, pid), None)  # a hand-out ahead of this attach is used up
                self.handing(uid, pid)
                try:
                    self.persist()
                except OSError as e:
                    # A lease the state file does not know would be a ghost after a restart: roll it back.
                    del self.leases[lease.id]
                    lease = None
                    log.error("cannot record a lease in %s: %s; refusing the attach", self.state.state_path,
                              e.strerror or e)
                    refusal = protocol.error_message("state_unwritable",
                                                     "the agent cannot record the lease; see its log")
        return lease, refusal

    def persist(self) -> None:
        """The state file, from the book as it is now. Call with `lock` held; raises OSError."""
        self.state.write([lease.record() for lease in self.leases.values()])

    def persist_or_warn(self, what: str) -> None:
        """The state file rewritten, a failure only logged (`what` says what it would have recorded)."""
        with self.lock:
            try:
                self.persist()
            except OSError as e:
                log.warning("cannot record %s in %s: %s", what, self.state.state_path, e)

    def end(self, lease: Lease, closing: bool, coordinated: bool) -> tuple[bool, Lease | None]:
        """Take `lease` out of the book: (whether it was in it, the standby now primary in its place).

        The successor is chosen here only when no rank group decides (`coordinated`): the oldest
        standby of the same group, made primary in the book; telling it is the caller's job.
        """
        with self.lock:
            if self.leases.pop(lease.id, None) is None:
                return False, None
            lease.ended = True
            if not closing:
                if not self.leases:
                    self.state.clear()
                else:
                    try:
                        self.persist()
                    except OSError as e:  # a stale record only lets its departed engine rejoin
                        log.warning("cannot update %s: %s", self.state.state_path, e.strerror or e)
            successor = None
            if lease.role == "primary" and lease.group is not None and not coordinated:
                standbys = [s for s in self.leases.values() if s.key == lease.key and s.role == "standby"]
                if standbys:
                    successor = min(standbys, key=lambda s: s.since)
                    successor.role = "primary"
        return True, successor

    def drain(self) -> list[Lease]:
        """Every lease, taken out of the book (the agent is closing)."""
        with self.lock:
            leases = list(self.leases.values())
            self.leases.clear()
        return leases
