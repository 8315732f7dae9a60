"""A lease: one engine's connection to the agent, and the terms an engine may ask for one with.

The connection *is* the lease: when it drops, the agent knows the engine is gone. A lease
names its role in a group; in a cluster the pod it names is proven by the engine pod's token
(serve/pod_identity.py) and a group's name carries its namespace; off Kubernetes a group is
keyed by uid and name, so that engines of another uid naming the same group form a group of
their own and can neither squat nor join it (`Lease.key`).

The checks of a request's lease fields (`check_lease_terms`, `engine_id`, `pod_identity`)
live here beside the type they fill; the book of leases is `serve/lease_book.py`, the
handlers that make leases are `serve/handlers.py`.
"""
from __future__ import annotations

import hashlib
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import protocol
from ..errors import ProtocolError

log = logging.getLogger(__name__)

GROUP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,252}")  # Kubernetes-style names, bounded
ROLES = ("primary", "standby", "auto")
MAX_TOKEN_CHARS = 128
POD_FIELDS = ("namespace", "name", "uid")
# Kubernetes' own bounds: a namespace is a DNS label, a pod name a DNS subdomain, a uid a UUID
# (with room). They bound every status reply: max_leases times one lease's worth.
POD_FIELD_LIMITS = {"namespace": 63, "name": 253, "uid": 64}


@dataclass
class Lease:
    id: int
    conn: socket.socket
    pid: int | None  # from the kernel (SO_PEERCRED), never from the request
    role: str
    group: str | None
    uid: int = -1
    # Off Kubernetes the uid whose group this is (the group is keyed by uid and name); in a cluster
    # None: the name carries the pod's namespace, proven by its token.
    owner: int | None = None
    token_hash: str = ""  # sha256 of the rejoin token handed to this engine
    pod: dict[str, str] | None = None  # the engine's pod (labels follow roles by it)
    # The engine across ranks (serve/rank_group.py): its pod's uid, else the id the client sent.
    engine: str | None = None
    verified: bool = False  # pod proven by a token the API server vouched for (else the client's word)
    since: float = field(default_factory=time.time)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    # Set while a promotion is told but not yet acknowledged: the engine is not serving as
    # primary yet, so nothing may route to it (status says "promoting").
    promoting: threading.Event = field(default_factory=threading.Event)
    acknowledged: threading.Event = field(default_factory=threading.Event)
    # Set while a planned switchover has made this primary a standby in the books but has not
    # told its engine yet (that comes once the successor serves): the engine still serves as
    # primary, and status says so, so no reader ever sees a group without one.
    demoting: threading.Event = field(default_factory=threading.Event)
    ended: bool = False  # the connection is gone (set once, under the lease book's lock)

    @property
    def key(self) -> tuple[int | None, str | None]:
        """Which group this lease is in: (owner, name)."""
        return self.owner, self.group

    @property
    def serving(self) -> bool:
        """Still its group's primary: a promotion that has not been undone since."""
        return not self.ended and self.role == "primary"

    def to_json(self) -> dict[str, Any]:
        role = "promoting" if self.promoting.is_set() else "primary" if self.demoting.is_set() else self.role
        return {"id": self.id, "pid": self.pid, "uid": self.uid, "role": role, "group": self.group, "pod": self.pod,
                "engine": self.engine, "verified": self.verified, "attached_at": self.since}

    def record(self) -> dict[str, Any]:
        """What the state file keeps of this lease: enough to recognise its engine after a restart."""
        return {"pid": self.pid, "uid": self.uid, "token": self.token_hash}

    def send(self, message: dict[str, Any], fds: list[int] | tuple[int, ...] = (),
             encoded: dict[str, bytes] | None = None, payload: bytes | None = None) -> None:
        # One writer at a time: a promotion from another thread must not interleave with a reply.
        with self.send_lock:
            protocol.send_message(self.conn, message, fds, encoded, payload)

    def try_send(self, message: dict[str, Any]) -> None:
        """Send, and only log a failure: the lease's own connection loop notices a dead engine."""
        try:
            self.send(message)
        except OSError as e:
            log.warning("could not tell pid=%s %s: %s", self.pid, message.get("type"), e)


def check_lease_terms(kind: str, role: Any, group: Any) -> None:
    """A request's role and group, or a `ProtocolError` that shows them (bounded)."""
    if role not in ROLES or not (group is None or (isinstance(group, str) and GROUP_RE.fullmatch(group))):
        shown = group if not isinstance(group, str) or len(group) <= 64 else group[:64] + "..."
        raise ProtocolError(f"{kind} needs role in {ROLES} and group null or a name of letters, digits and ._:/- "
                            f"(at most 253); got role={str(role)[:32]!r} group={shown!r}")


def engine_id(value: Any) -> str | None:
    """The `engine` field of an attach: null, or an id of the same characters and bounds as a group."""
    if value is None:
        return None
    if not isinstance(value, str) or not GROUP_RE.fullmatch(value):
        raise ProtocolError("engine must be null or an id of letters, digits and ._:/- (at most 253)")
    return value


def pod_identity(value: Any) -> dict[str, str] | None:
    """The `pod` field of an attach: null, or namespace/name/uid strings of Kubernetes' lengths."""
    if value is None:
        return None
    if not (isinstance(value, dict) and all(
            isinstance(value.get(k), str) and 0 < len(value[k]) <= limit for k, limit in POD_FIELD_LIMITS.items())):
        limits = ", ".join(f"{k} (at most {n} characters)" for k, n in POD_FIELD_LIMITS.items())
        raise ProtocolError(f"pod must be null or an object with the strings {limits}")
    return {k: value[k] for k in POD_FIELDS}


def hash_token(token: str) -> str:
    """What the state file keeps of a rejoin token: its hash, never the token."""
    return hashlib.sha256(token.encode()).hexdigest()
