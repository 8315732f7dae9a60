"""Promotion: when a group's primary goes, or is handed over, tell the next engine it is primary.

Three ways in, one way out:
  a primary's lease ends      `end_lease`: the oldest standby of its group is promoted at once
                              (or, for an engine across tensor-parallel ranks, rank 0's agent
                              picks one engine for every rank: serve/rank_group.py);
  a planned switchover        `switch`: the named standby promoted, then the old primary demoted
                              (make before break);
  rank 0 decided for a group  the rank group calls `switch` with the engine it chose.
Each promotion is told on the standby's own lease (`promote`), waited on until the engine says
it serves (`promoted`, or `PROMOTE_ACK_TIMEOUT`), and only then handed to `on_promote` (the
node-side label write that moves traffic): traffic never reaches a primary that does not know
it is one yet.

The roles themselves change in the lease book (serve/lease_book.py), under its lock.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .. import protocol
from .lease import Lease
from .lease_book import LeaseBook
from .sockets import shutdown

log = logging.getLogger(__name__)

PROMOTE_ACK_TIMEOUT = 1.0  # an engine answers `promote` with `promoted` once it serves as primary

# A rank group's report that this rank's primary engine left: (group, engine, owner).
LostReport = Callable[[str, str, "int | None"], None]


class Promotion:
    def __init__(self, book: LeaseBook, closed: threading.Event,
                 on_promote: Callable[[Lease], None] | None = None, lost: LostReport | None = None):
        self.book, self.closed = book, closed
        # Called (on the thread that promoted) right after a standby is told it is primary:
        # the node-side label write that makes the cluster follow.
        self.on_promote = on_promote
        # Set where ranks of one replica decide together: a primary engine's loss goes to rank 0.
        self.lost = lost

    def end_lease(self, lease: Lease) -> None:
        """A lease's connection is gone: out of the book, and its group gets a primary if it lost one."""
        coordinated = self.lost is not None and lease.engine is not None
        removed, successor = self.book.end(lease, self.closed.is_set(), coordinated)
        if not removed:
            return
        log.info("detached pid=%s role=%s group=%s lease=%d", lease.pid, lease.role, lease.group, lease.id)
        if coordinated and lease.role == "primary" and lease.group is not None and not self.closed.is_set():
            self.lost(lease.group, lease.engine, lease.owner)  # every rank promotes the same engine
        if successor is not None:
            self.promote(successor, {"type": "promote", "group": lease.group, "previous_pid": lease.pid})

    def promote(self, lease: Lease, message: dict[str, Any]) -> bool:
        """Tell a lease (already primary in the book) that it is, wait until the engine says it
        serves as one, then let the cluster follow."""
        lease.acknowledged.clear()
        lease.promoting.set()
        try:
            lease.send(message)
        except OSError as e:
            lease.promoting.clear()
            log.warning("promotion of pid=%s failed (%s); trying the next standby", lease.pid, e)
            shutdown(lease.conn)  # its lease ends, and the next standby is promoted
            return False
        if not lease.acknowledged.wait(PROMOTE_ACK_TIMEOUT):
            log.warning("pid=%s did not acknowledge its promotion within %.1fs; counting it primary",
                        lease.pid, PROMOTE_ACK_TIMEOUT)
        lease.promoting.clear()
        log.info("promoted pid=%s to primary of group %s", lease.pid, lease.group)
        if self.on_promote is not None:
            try:
                self.on_promote(lease)
            except Exception:  # the engine is primary either way; the operator's reconcile catches up
                log.exception("after promoting pid=%s: the promotion hook failed", lease.pid)
        return True

    def switch(self, group: str, to_pod: str | None = None, to_pid: int | None = None,
               to_engine: str | None = None, owner: int | None = None) -> dict[str, Any]:
        """Promote the named standby and demote the group's primary, in one step; the `switched` reply.

        With no standby named, only the primary is demoted: the new primary is an engine of
        another agent (a new revision's, during an upgrade), promoted there first. Off
        Kubernetes, `owner` (a uid) says whose group of that name; the named standby's group is
        the one switched either way.
        """
        started = time.perf_counter()
        demote_only = to_pod is None and to_pid is None and to_engine is None
        target, old = self._switch_roles(group, to_pod, to_pid, to_engine, owner, demote_only)
        if target is None and not demote_only:
            return protocol.error_message("no_such_standby", f"group {group!r} has no standby "
                                                             f"{to_pod or to_pid or to_engine!r} on this agent")
        promoted = target is None or self.promote(target, {
            "type": "promote", "group": group, "planned": True, "previous_pid": old[0].pid if old else None})
        for lease in old:  # after the promotion: make before break
            lease.try_send({"type": "demote", "group": group, "successor_pid": target.pid if target else None})
            lease.demoting.clear()
        seconds = time.perf_counter() - started
        log.info("switchover of group %s to %s in %.2fms", group,
                 f"pid={target.pid}" if target else "another agent's engine", seconds * 1e3)
        return {"type": "switched", "group": group, "ok": promoted, "primary": target.to_json() if target else None,
                "demoted": [lease.to_json() for lease in old], "seconds": seconds}

    def _switch_roles(self, group: str, to_pod: str | None, to_pid: int | None, to_engine: str | None,
                      owner: int | None, demote_only: bool) -> tuple[Lease | None, list[Lease]]:
        """In the book: the named standby made primary, the group's primaries marked demoting standbys."""
        with self.book.lock:
            members = [lease for lease in self.book.leases.values()
                       if lease.group == group and (owner is None or lease.owner == owner)]
            target = None if demote_only else next((lease for lease in members if lease.role == "standby" and (
                (to_pid is not None and lease.pid == to_pid) or
                (to_engine is not None and lease.engine == to_engine) or
                (to_pod is not None and (lease.pod or {}).get("name") == to_pod))), None)
            if target is not None:
                members = [lease for lease in members if lease.key == target.key]
            old = [lease for lease in members if lease.role == "primary"]
            if target is not None or demote_only:
                if target is not None:
                    target.role = "primary"
                for lease in old:
                    lease.demoting.set()
                    lease.role = "standby"
        return target, old
