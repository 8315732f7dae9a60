"""The agent: hold one loaded cache and serve it to engines over a Unix socket.

This module is the façade: `Agent` composes the worker's parts and keeps the public face the
command (serve/agent_main.py), the tests and the benchmarks use -- `bind()`, `start()`,
`load()`, `close()`, `leases()`, `status()`, `switch()`. Each part has one job and is handed
what it needs downward; none imports this module or reaches back into the agent:

    sockets         the socket's path: the lock file, a dead agent's files (`remove_socket_files`)
    connections     accept, bounds per uid, handshake deadlines, the status thread, routing
    handlers        one handler per request type, in a table the transport routes by
    lease, lease_book   a lease (the connection is the lease), and the book of them: caps, groups
    promotion       a standby told it is primary when its primary goes, or on a switchover
    rank_group      every rank of a tensor-parallel replica promotes the same engine
    arena_holder    the arena: fill sources (adopt / peer copy / disk), lifecycle (phase.py), refill
    arena_guard     the arena's keyed digest and the scrub that keeps checking it
    restart_state   what one agent leaves beside its socket for the next: leases, digest, plan
    status          the status document and the counters behind it

Flow: `bind()` claims the socket path, `start()` runs the connection threads, `load()` fills
the arena. An attach waits until the cache is ready, checks the engine's fingerprint fields,
and is answered with the manifest plus the arena fd; from then on the connection is the lease.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from ..arena.devices import Device
from ..load.prefetch import Prefetch
from ..spec import CacheSpec
from .access import SocketPolicy, bind_socket
from .arena_holder import ArenaHolder
from .connections import HANDSHAKE_TIMEOUT, Connections, Limits, Throttled
from .fill_sources import read_free_bytes
from .handlers import Handlers
from .integrity import SCRUB_INTERVAL
from .lease import Lease
from .lease_book import LeaseBook
from .phase import Phase
from .pod_identity import PodVerifier
from .promotion import Promotion
from .rank_group import RankGroup
from .restart_state import RestartState
from .sidecar import sidecar_path
from .sockets import claim_path, remove_socket_files, shutdown
from .status import FREE_BYTES_TTL, AttachStats, Sampled, status_document

__all__ = ["Agent", "Lease", "Sampled", "remove_socket_files", "sidecar_path", "HANDSHAKE_TIMEOUT", "MAX_LEASES",
           "MAX_PENDING"]

log = logging.getLogger(__name__)

MAX_LEASES = 256  # engines per GPU; far above any real deployment, low enough to keep status small
MAX_PENDING = 64  # connections still in their first request; past it the oldest is dropped


class Agent:
    def __init__(self, spec: CacheSpec, socket_path: str, show_progress: bool = False,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, device: Device | None = None, adopt_wait: float = 3.0,
                 policy: SocketPolicy | None = None, max_leases: int = MAX_LEASES, max_pending: int = MAX_PENDING,
                 on_promote: Callable[[Lease], None] | None = None, peer: str | None = None,
                 max_leases_per_uid: int | None = None, max_pending_per_uid: int | None = None,
                 max_connections_per_uid: int | None = None, scrub_interval: float = SCRUB_INTERVAL,
                 read_ahead: Prefetch | None = None, pod_verifier: PodVerifier | None = None,
                 rank_sockets: list[str] | None = None):
        self.spec = spec
        self.socket_path = os.path.abspath(socket_path)
        self.device = device or Device("cpu", f"cpu-{spec.tp_rank}", spec.tp_rank)
        self.policy = policy or SocketPolicy()
        # In a cluster: the API server proves which pod an engine is (serve/pod_identity.py).
        # Without one, a lease's pod is the client's word, and groups follow uids alone.
        self.pod_verifier = pod_verifier
        # Per uid (what the kernel says a peer is): no one identity can take every lease, every
        # pending slot or every connection and lock the others out.
        per_uid = max_leases_per_uid or max(1, max_leases // 2)
        pending_per_uid = max_pending_per_uid or max(1, max_pending // 4)
        limits = Limits(max_pending, pending_per_uid, max_connections_per_uid or per_uid + pending_per_uid,
                        handshake_timeout)
        self._closed = threading.Event()
        self._lock_fd: int | None = None
        self._listener: Any = None
        self.state = RestartState(self.socket_path, self.device, lambda: self.holder.prepared)
        self.book = LeaseBook(self.state, max_leases, per_uid, clustered=pod_verifier is not None)
        self.holder = ArenaHolder(spec, self.device, self.socket_path, self.state, self.book, scrub_interval,
                                  peer=peer, read_ahead=read_ahead, adopt_wait=adopt_wait,
                                  show_progress=show_progress)
        self.promotion = Promotion(self.book, self._closed, on_promote)
        # Tensor parallel on one node: the sockets of every rank of this replica, so that all ranks
        # promote the same engine (serve/rank_group.py). None: this agent decides roles alone.
        self.ranks = RankGroup(rank_sockets, spec.tp_rank, switch=self.promotion.switch,
                               leases=lambda: [lease.to_json() for lease in self.book.sorted()]) \
            if rank_sockets and len(rank_sockets) > 1 else None
        if self.ranks is not None:
            self.promotion.lost = self.ranks.lost
        self.stats = AttachStats()
        refusals = Throttled()
        self.handlers = Handlers(spec, self.holder, self.book, self.state, self.promotion, self.stats, refusals,
                                 verifier=pod_verifier, ranks=self.ranks)
        self.connections = Connections(self.policy, limits, self.handlers.routes(), self.handlers.lease_messages(),
                                       self.status, self.promotion.end_lease, self._closed, refusals)
        self._free_bytes = Sampled(lambda: read_free_bytes(self.device), FREE_BYTES_TTL)

    # -- lifecycle -------------------------------------------------------------------------------

    def bind(self) -> None:
        """Claim the socket path; `AccessError` (one line) when path, directory or lock say no."""
        self._lock_fd = claim_path(self.socket_path, self.policy)
        self.state.read_predecessor()
        self._listener = bind_socket(self.socket_path, self.policy)
        log.info("listening on %s (allowed: %s)", self.socket_path, self.policy.describe())

    def start(self) -> None:
        self.connections.start(self._listener)

    def load(self) -> None:
        """Prepare from headers, then adopt an arena an engine hands back, copy a replica's, or read the disk."""
        self.holder.load()

    def close(self) -> None:
        """Stop serving: remove the socket, drop every connection. Engines keep their mappings."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.connections.stop()
        if self._listener is not None:
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
            self._listener.close()
        leases = self.book.drain()
        if not leases:  # nobody holds the arena: a successor has nothing to adopt
            self.state.clear()
        for lease in leases:
            shutdown(lease.conn)
        self.holder.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- what callers ask ------------------------------------------------------------------------

    def leases(self) -> list[Lease]:
        return self.book.sorted()

    def status(self) -> dict[str, Any]:
        return status_document(
            self.spec, self.socket_path, self.holder, self.stats, self._free_bytes,
            [lease.to_json() for lease in self.book.snapshot()], dict(self.connections.refused),
            self.pod_verifier.reviews if self.pod_verifier is not None else None)

    def switch(self, group: str, to_pod: str | None = None, to_pid: int | None = None,
               to_engine: str | None = None, owner: int | None = None) -> dict[str, Any]:
        """Promote the named standby and demote the group's primary, in one step (serve/promotion.py)."""
        return self.promotion.switch(group, to_pod, to_pid, to_engine, owner)

    # Read-only views of the parts, for tests and tools that look inside a running agent.

    @property
    def phase(self) -> Phase:
        """Compares equal to its name as a string ("ready")."""
        return self.holder.phase

    @property
    def error(self) -> str | None:
        return self.holder.error

    @property
    def cache(self) -> Any:
        return self.holder.cache

    @property
    def tampered(self) -> int:
        return self.holder.guard.tampered

    @property
    def refills(self) -> int:
        return self.holder.guard.refills

    @property
    def _scrubber(self) -> Any:
        return self.holder.guard.scrubber
