"""The agent: hold one loaded cache and serve it to engines over a Unix socket.

Flow: `bind()` claims the socket path (a lock file makes two agents on one path
impossible; a stale socket from a dead agent is replaced, a live one never), `start()`
accepts connections on a thread, `load()` runs the cold path. The accept thread checks
each peer's credentials against the socket policy (serve/access.py), hands a status
request already waiting to the status thread, which answers it at once, and gives every
other connection a thread of its own; an attach waits until the cache is ready, checks
the engine's fingerprint fields, and replies with the manifest plus the arena fd. From
then on the connection *is* the lease: when it drops, the agent knows the engine is
gone, and if it was a group's primary, the oldest standby of that group is promoted on
its own socket at once. In a cluster the pod a lease names is proven by the engine pod's
projected token (serve/pod_identity.py), never taken from the request, and a group's name
carries its namespace; off Kubernetes a group is keyed by uid and name, so that engines of
another uid naming the same group form a group of their own and can neither squat nor join
it (`Lease.key`). A bad client -- garbage, wrong version, oversize frame, silence, a frame
trickled byte by byte, death mid-handshake -- is logged and dropped within one request
deadline; nobody else notices.

Re-adoption is where a client could otherwise hand the agent bytes of its own, so it takes
proof. Each lease gets a random token in its manifest reply; the agent records the token's
hash with the peer's uid and pid in its state file (0600, written before the
manifest goes out). A restarted agent reads that file once, and adopts an arena only from
a peer that presents a recorded token with matching credentials, offering exactly one fd
of exactly the layout's size, whose bytes digest (with the key the predecessor recorded)
to what it loaded. Anyone else's rejoin is refused without saying why.

The arena's integrity: every fill is digested with a secret key before anyone gets the
handle, re-checked on a paced schedule and on demand (serve/integrity.py), and an arena
found changed is no longer handed out but replaced by a fresh fill.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import itertools
import json
import logging
import os
import queue
import re
import resource
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .. import protocol
from ..errors import ProtocolError, WeightCacheError
from ..load.fingerprint import RevisionRequired, differences, fields_for_request, same_spec_fields
from ..arena.cpu import CpuArena, available_memory, new_cpu_arena
from ..arena.devices import Device
from ..arena.digest import ArenaDigest, new_key
from ..load.prefetch import Prefetch, lead_for, shard_paths
from ..load.signature import file_signature
from ..logs import Phases
from ..load.progress import LoadProgress
from ..load.layout import NAMINGS
from ..packed_rows import EncodedManifests
from ..spec import CacheSpec
from .access import (AccessError, SocketPolicy, bind_socket, check_not_a_file, check_socket_path, peer_groups, prepare_dir,
                     read_private, write_private)
from .integrity import SCRUB_INTERVAL, Scrubber
from .pod_identity import IdentityRefused, PodVerifier, group_namespace
from .rank_group import RankGroup
from .prepared_record import RecordedCache, read_record, write_record
from .sidecar import sidecar_path

if TYPE_CHECKING:  # the loader's modules: imported when a load from disk needs them (see `load`)
    from ..load.peer_copy import PeerArena
    from ..load.loader import LoadedCache, PreparedCache

log = logging.getLogger(__name__)

FREE_BYTES_TTL = 1.0  # seconds a reading of free memory is served before it is read again
HANDSHAKE_TIMEOUT = 10.0  # seconds for a connection's whole first request, however slowly it arrives
MAX_LEASES = 256  # engines per GPU; far above any real deployment, low enough to keep status small
MAX_PENDING = 64  # connections still in their first request; past it the oldest is dropped
# The status thread reads a request already whole (it was peeked at accept) and never waits to
# send: the connection's send buffer is made big enough for one reply, which goes out at once
# or the client (who left earlier replies unread) is dropped.
STATUS_SEND_TIMEOUT = 0.5
GRANT_TTL = 60.0  # seconds an engine that was handed the arena ahead of its attach has to attach
PARSE_SLOTS = 4  # large request frames parsed at once (see protocol.recv_message's parse_gate)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)  # root may exceed the system's cap on a send buffer
MAX_HANDED = 1024  # who received the arena's handle, remembered for the log line of a mismatch
GROUP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,252}")  # Kubernetes-style names, bounded
MAX_TOKEN_CHARS = 128
ATTACH_SAMPLES_IN_STATUS = 256  # bounded: status is polled every second or so
ROLES = ("primary", "standby", "auto")
PROMOTE_ACK_TIMEOUT = 1.0  # an engine answers `promote` with `promoted` once it serves as primary
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
    ended: bool = False  # the connection is gone (set once, under the agent's lock)

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
        with self.send_lock:
            protocol.send_message(self.conn, message, fds, encoded, payload)


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
        # Tensor parallel on one node: the sockets of every rank of this replica, so that all ranks
        # promote the same engine (serve/rank_group.py). None: this agent decides roles alone.
        self.ranks = RankGroup(self, rank_sockets, spec.tp_rank) if rank_sockets and len(rank_sockets) > 1 else None
        # In a cluster: the API server proves which pod an engine is (serve/pod_identity.py).
        # Without one, a lease's pod is the client's word, and groups follow uids alone.
        self.pod_verifier = pod_verifier
        self.peer = peer  # another replica's socket for this rank: copy its arena instead of reading the disk
        self._read_ahead = read_ahead  # the checkpoint read into the page cache since the process started
        self.startup = Phases()  # the load's steps, seconds since the process started
        self.filled_from = "disk"
        self.planned_from = "checkpoint"  # or "record" (a predecessor's), "peer" (another replica's record)
        # Called (on the thread that promoted) right after a standby is told it is primary:
        # the node-side label write that makes the cluster follow.
        self.on_promote = on_promote
        self.policy = policy or SocketPolicy()
        self.max_leases = max_leases
        self.max_pending = max_pending
        # Per uid (what the kernel says a peer is): no one identity can take every lease, every
        # pending slot or every connection and lock the others out.
        self.max_leases_per_uid = max_leases_per_uid or max(1, max_leases // 2)
        self.max_pending_per_uid = max_pending_per_uid or max(1, max_pending // 4)
        self.max_connections_per_uid = max_connections_per_uid or self.max_leases_per_uid + self.max_pending_per_uid
        self._connections: Counter = Counter()  # uid -> its open connections (under _pending_lock)
        self._pending: dict[int, tuple[socket.socket, int]] = {}  # connection id -> (socket, uid), oldest first
        # Its own lock: the accept loop must never wait behind `_lock`, which attaches hold across
        # a state-file write (a status request would queue behind every attach in flight).
        self._pending_lock = threading.Lock()
        self._previous: dict[str, Any] | None = None  # the predecessor's state file, read once at bind
        self._claimed: set[str] = set()  # token hashes of the predecessor's leases already rejoined
        self._waiting = 0  # attaches waiting for the load to finish
        self.handshake_timeout = handshake_timeout
        self.device = device or Device("cpu", f"cpu-{spec.tp_rank}", spec.tp_rank)
        self.adopt_wait = adopt_wait
        self.adopted = False
        self.prepared: PreparedCache | None = None
        self._prepared = threading.Event()
        self._adoption = threading.Event()
        self._adopted_arena: Any = None
        self._adoptable = False
        self.socket_path = os.path.abspath(socket_path)
        self.show_progress = show_progress
        self.phase = "starting"
        self.error: str | None = None
        self.progress = LoadProgress()
        self.cache: LoadedCache | None = None
        # Names this agent's arena in every manifest and "arena" reply: an engine that mapped the
        # arena while it started (`prepare(socket=...)`) uses that mapping only for the same arena.
        self._arena_id = secrets.token_hex(16)
        self._manifests: EncodedManifests | None = None  # the rows under each naming, once loaded
        # engine fields per distinct request: every engine of a deployment sends the same one
        self._engine_fields: dict[str, dict[str, Any]] = {}
        self.timings: dict[str, float] = {}  # where the load's seconds went: prepare, allocate, fill
        self.attach_seconds: list[float] = []  # bounded sample, newest last
        self.attaches = 0
        self.misses = 0  # attaches refused because this cache cannot serve what was asked (fingerprint, failed load)
        self.prefetched = 0  # checkpoint bytes read into the page cache ahead of the fill (load/prefetch.py)
        self._ready = threading.Event()
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._free_bytes = Sampled(self._read_free_bytes, FREE_BYTES_TTL)
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._lock_fd: int | None = None
        self._closed = threading.Event()
        # Accepted connections, (conn, key, pid, uid), on their way to a thread: see _accept_loop.
        self._status_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._client_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting_slots = threading.BoundedSemaphore(max_pending)
        self._parse_gate = threading.BoundedSemaphore(PARSE_SLOTS)
        self._refusals = _Throttled()
        self._forbidden = _Throttled()  # peers the socket policy refuses: one line a second at most
        # Connections refused at accept, by reason (the accept thread alone writes them); status and metrics show them.
        self.refused_connections: Counter = Counter({"forbidden": 0, "too_many_connections": 0})
        # Who was handed the arena's handle ahead of an attach: (uid, pid) -> until when it counts
        # against the uid's lease cap. And everyone who received the handle since the fill
        # (`_handed`), for the log line that reports a changed arena.
        self._grants: dict[tuple[int, int | None], float] = {}
        self._handed: dict[tuple[int, int | None], float] = {}
        # The arena's integrity: the secret key, the digest made when it was filled (or checked
        # when it was adopted), and the scrubber that keeps checking it (serve/integrity.py).
        self.scrub_interval = scrub_interval
        self._key: bytes | None = None
        self._digest: ArenaDigest | None = None
        self._scrubber: Scrubber | None = None
        self._integrity_error: str | None = None
        self._previous_digest: Any = None  # the predecessor's digest file, read once at bind
        self._adopt_lock = threading.Lock()  # one offered arena checked at a time
        self._quarantined = False  # the served arena was found changed: nothing hands it out
        self.tampered = 0  # arenas found changed
        self.refills = 0
        self._device_mark_value: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def bind(self) -> None:
        """Claim the socket path; `AccessError` (one line) when path, directory or lock say no."""
        check_socket_path(self.socket_path)
        check_not_a_file(self.socket_path)
        prepare_dir(os.path.dirname(self.socket_path), self.policy)
        lock_path = sidecar_path(self.socket_path, "lock")
        try:
            self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise AccessError(f"cannot open lock file {lock_path}: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise WeightCacheError(f"another agent is already serving {self.socket_path}") from None
        if os.path.lexists(self.socket_path):
            # We hold the lock, so its agent should be gone -- unless the lock file was removed
            # under a live agent: a socket that still answers is never taken over.
            if _answers(self.socket_path):
                os.close(self._lock_fd)
                self._lock_fd = None
                raise WeightCacheError(f"another agent is already serving {self.socket_path}")
            os.unlink(self.socket_path)
        # Before any lease of ours rewrites it: the predecessor's leases are what a rejoin must match.
        self._previous = read_private(self._state_path)
        self._previous_digest = read_private(self._digest_path)
        self._listener = bind_socket(self.socket_path, self.policy)
        log.info("listening on %s (allowed: %s)", self.socket_path, self.policy.describe())

    def start(self) -> None:
        for target, name in ((self._accept_loop, "accept"), (self._status_loop, "status"),
                             (self._client_loop, "clients")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def load(self) -> None:
        """Prepare from headers, then adopt an arena an engine hands back, or load from disk.

        With engines to adopt from, the plan comes from the predecessor's record when it still
        holds (prepared_record.py): no torch, no header read, until a load from disk needs them.
        """
        self.phase = "preparing"
        prefetch = None
        adopting = self.adopt_wait > 0 and isinstance(self._previous, dict) and bool(self._previous.get("leases"))
        if self.spec.tp_size == 1 and not adopting and not self.peer:
            # A load from disk is coming: keep the disk busy while CUDA and the plan start up.
            # (One rank reads every byte; a tensor-parallel rank reads only its shards, so whole files would waste the disk.)
            paths = shard_paths(os.path.abspath(self.spec.model))
            lead = lead_for(paths, self.device.backend == "cpu")
            prefetch = self._read_ahead or Prefetch(paths, lead=lead)
            prefetch.follow(lambda: self.progress.bytes_done, lead)
        elif self._read_ahead is not None:
            self._read_ahead.stop()
        self._read_ahead = None
        peer = None
        try:
            # Device start-up (a CUDA context: ~0.2 s) is the process's, not the load's: keep it out of load_seconds.
            device_mark = self._device_mark_value = self._device_mark()
            self.startup.mark("device ready")
            t0 = time.monotonic()
            recorded = None
            if adopting:
                recorded = read_record(self._record_path, self.spec, device_mark)
                self.planned_from = "record" if recorded else "checkpoint"
            elif self.peer:
                # Another replica loads these very bytes: wait for it, then plan from its record.
                self.phase = "loading"
                peer = self._open_peer()
                if peer is not None:
                    recorded = read_record(sidecar_path(self.peer, "prepared"), self.spec, device_mark)
                self.planned_from = "peer" if recorded else "checkpoint"
            self.prepared = recorded or _prepare(self.spec, device_mark)
            self.timings["prepare"] = time.monotonic() - t0 - (peer.wait_seconds if peer else 0.0)
            self.startup.mark("planned")
            self._adoptable = self.adopt_wait > 0 and bool(self._previous_leases())
            self._prepared.set()
            if self._adoptable:
                self.phase = "adopting"
                log.info("an earlier agent served this cache with engines attached: waiting up to %.1fs for one to "
                         "hand the arena back", self.adopt_wait)
                self._adoption.wait(self.adopt_wait)
                with self._adopt_lock, self._lock:  # an offer being checked is finished first
                    self._adoptable = False
                if self._adopted_arena is not None:
                    if recorded is not None:
                        self.cache = recorded.loaded(self._adopted_arena, time.monotonic() - t0)
                    else:
                        from ..load.loader import loaded_from

                        self.cache = loaded_from(self.prepared, self._adopted_arena, time.monotonic() - t0)
                    self.adopted = True
                    log.info("re-adopted the arena from an engine in %.1fms; nothing read from disk",
                             self.cache.load_seconds * 1e3)
            if self.cache is None and self.peer:
                peer = peer or self._open_peer()
                if peer is not None:
                    self.cache = self._fill_from_peer(peer, t0)
            if self.cache is None:
                from ..load.loader import fill_cache

                if recorded is not None:  # no arena handed back or copied: plan from the checkpoint after all
                    self.prepared = _prepare(self.spec, device_mark)
                    self.planned_from = "checkpoint"
                self.phase = "loading"
                t1 = time.monotonic()
                arena = self._new_arena(self.prepared.layout.size)
                t2 = time.monotonic()
                self.startup.mark("arena allocated")
                self.cache = fill_cache(self.prepared, arena, self.progress, show_bar=self.show_progress, started=t0,
                                        read_ahead=prefetch)
                self.timings.update(allocate=t2 - t1, fill=time.monotonic() - t2)
                self.startup.mark("filled")
                recorded = None
        except BaseException as e:
            self.phase, self.error = "failed", str(e)
            self._prepared.set()
            self._ready.set()  # wake waiting attaches so they get the error
            raise
        finally:
            if prefetch is not None:
                prefetch.stop()
                self.prefetched = prefetch.read
                self.timings["prefetch"] = prefetch.seconds  # from its first request until its last byte (or stop)
                if prefetch.read:
                    self.startup.mark("read-ahead: first request", prefetch.began)
                    self.startup.mark("read-ahead: last byte", prefetch.finished)
            if peer is not None:
                peer.close()
        self._guard_arena(self.cache.arena, fresh=not self.adopted)
        self._manifests = EncodedManifests(self.cache.layout)
        if self.leases():  # engines that rejoined during the load hold the arena too
            with self._lock:
                try:
                    self._write_state()
                except OSError as e:
                    log.warning("cannot record the engines that rejoined in %s: %s", self._state_path, e)
        if recorded is None or self.planned_from == "peer":
            # What a successor or another replica may plan from. Before ready: a replica waiting
            # on this agent reads it as soon as its attach is answered.
            try:
                write_record(self._record_path, self.prepared)
            except OSError as e:  # a restart then plans from the checkpoint: slower, not wrong
                log.warning("cannot record the prepared cache in %s: %s", self._record_path, e.strerror or e)
        self.startup.mark("ready")
        self.phase = "ready"
        self._ready.set()

    def _open_peer(self) -> "PeerArena | None":
        """The other replica's arena, once its load is done; None (logged): read the disk instead."""
        from ..load.peer_copy import PeerArena

        try:
            return PeerArena(self.peer, self.spec)
        except (WeightCacheError, OSError) as e:
            log.warning("no arena to copy from the replica at %s (%s); reading the checkpoint instead", self.peer, e)
            return None

    def _fill_from_peer(self, peer: "PeerArena", t0: float) -> Any:
        """This rank's arena copied from another replica's (load/peer_copy), or None: read the disk."""
        assert self.prepared is not None
        self.phase = "loading"
        t1 = time.monotonic()
        arena = self._new_arena(self.prepared.layout.size)
        t2 = time.monotonic()
        try:
            info = peer.copy_into(self.prepared, arena)
            arena.seal()
        except (WeightCacheError, OSError, RuntimeError) as e:
            arena.close()
            log.warning("could not copy the arena from the replica at %s (%s); reading the checkpoint instead",
                        self.peer, e)
            return None
        self.filled_from = "peer"
        # fill: what this replica spent on its bytes, the wait for the source's own load left out
        self.timings.update(allocate=t2 - t1, peer_wait=info["wait_seconds"], peer_copy=info["copy_seconds"],
                            fill=time.monotonic() - t2)
        seconds = time.monotonic() - t0 - info["wait_seconds"]
        if isinstance(self.prepared, RecordedCache):
            return self.prepared.loaded(arena, seconds)
        from ..load.loader import loaded_from

        return loaded_from(self.prepared, arena, seconds)

    def _read_free_bytes(self) -> int | None:
        try:
            if self.device.backend == "cpu":
                return available_memory()
            from ..arena.cuda import free_memory

            return free_memory(self.device.ordinal)
        except (WeightCacheError, OSError) as e:
            log.debug("cannot read the free memory of %s: %s", self.device.uuid, e)
            return None

    def _device_mark(self) -> str:
        if self.device.backend == "cpu":
            return "cpu"
        from ..arena.cuda import device_mark

        return device_mark(self.device.ordinal)  # through the driver: makes the primary context, imports no torch

    def _new_arena(self, size: int, fd: int | None = None) -> Any:
        """A fresh arena for the prepared layout, or (with `fd`) one handed back by an engine."""
        if self.device.backend == "cuda":
            from ..arena.cuda import CudaArena

            return CudaArena(size, self.device.ordinal, self.device.uuid, fd=fd)
        if fd is not None:
            return CpuArena.adopt(fd, size)
        return new_cpu_arena(size, self.spec, name=f"weightcache:{os.path.basename(self.socket_path)}")

    # -- integrity of the served arena -------------------------------------------------------

    def _guard_arena(self, arena: Any, fresh: bool) -> None:
        """Digest a freshly filled arena where its bytes are (before anyone gets its handle) and record
        the digest beside the socket; then keep checking it (an adopted arena's digest was checked
        against the recorded one already). A digest that cannot be made is logged as an error and
        reported in status ("unavailable"); the arena is served regardless."""
        started = time.monotonic()
        try:
            if fresh:
                self._key = new_key()
                self._digest = arena.digest(self._key)
                self._write_digest()
        except Exception as e:  # noqa: BLE001 -- a driver or compiler failure: loud, not fatal
            self._key = self._digest = None
            self._integrity_error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log.error("cannot digest the arena (%s): its content is not checked, and a restarted agent will "
                      "not adopt it", self._integrity_error)
            return
        self.timings["digest"] = time.monotonic() - started
        if self._key is not None and self._digest is not None:
            self._scrubber = Scrubber(arena, self._key, self._digest, self._on_tamper, interval=self.scrub_interval)
            self._scrubber.start()

    def _write_digest(self) -> None:
        prepared = self.prepared
        try:
            write_private(self._digest_path, {
                "key": self._key.hex(), "digest": self._digest.to_json(), "fingerprint": prepared.fingerprint,
                "layout_hash": prepared.layout.layout_hash, "backend": self.device.backend,
                "device": self.device.uuid})
        except OSError as e:  # a restart then loads from disk instead of adopting: slower, not wrong
            log.warning("cannot record the arena's digest in %s: %s", self._digest_path, e.strerror or e)

    def _recorded_digest(self, size: int) -> tuple[bytes, ArenaDigest] | None:
        """The predecessor's key and digest, if they describe what this agent prepared."""
        doc, prepared = self._previous_digest, self.prepared
        if not isinstance(doc, dict) or prepared is None:
            return None
        expected = {"fingerprint": prepared.fingerprint, "layout_hash": prepared.layout.layout_hash,
                    "backend": self.device.backend, "device": self.device.uuid}
        if any(doc.get(k) != v for k, v in expected.items()):
            return None
        digest = ArenaDigest.from_json(doc.get("digest"))
        try:
            key = bytes.fromhex(str(doc.get("key")))
        except ValueError:
            return None
        return (key, digest) if digest is not None and digest.size == size and len(key) >= 32 else None

    def _content_is_ours(self, arena: Any, pid: int | None, uid: int) -> bool:
        """Whether an offered arena holds exactly what the predecessor loaded (its keyed digest); on
        success this agent takes over key and digest."""
        recorded = self._recorded_digest(arena.size)
        if recorded is None:
            log.warning("not adopting the arena offered by pid=%s uid=%s: no recorded digest to check it against",
                        pid, uid)
            return False
        key, digest = recorded
        started = time.monotonic()
        try:
            values = arena.digest(key).values
        except Exception as e:  # noqa: BLE001 -- the offer is refused; the disk is the way
            log.warning("not adopting the arena offered by pid=%s uid=%s: cannot digest it (%s)", pid, uid, e)
            return False
        if values != digest.values:
            changed = next(i for i, (a, b) in enumerate(zip(values, digest.values)) if a != b)
            log.warning("refused to adopt the arena offered by pid=%s uid=%s: its bytes are not the ones this "
                        "agent loaded (segment %d differs from the recorded digest)", pid, uid, changed)
            return False
        self._key, self._digest = key, digest
        self.timings["digest"] = time.monotonic() - started
        return True

    def _on_tamper(self, segment: int) -> None:
        """The served arena changed: stop handing it out, say so once, fill a fresh one."""
        with self._lock:
            if self._quarantined:
                return
            self._quarantined = True
            self._ready.clear()
            self.phase = "refilling"
            self.tampered += 1
            holders = sorted({(lease.uid, lease.pid) for lease in self._leases.values()} | set(self._handed),
                             key=lambda h: (h[0], h[1] or 0))
        shown = ", ".join(f"uid={u} pid={p}" for u, p in holders[:32]) + (" ..." if len(holders) > 32 else "")
        log.error("arena %s changed since this agent filled it (segment %d of %d differs from its keyed digest): "
                  "no longer handing it out, filling a fresh one; engines that map it serve changed weights; it was "
                  "handed to: %s", self._arena_id, segment, len(self._digest.values) if self._digest else 0,
                  shown or "nobody")
        threading.Thread(target=self._refill, name="refill", daemon=True).start()

    def _refill(self) -> None:
        """A fresh arena from the checkpoint, in place of one found changed. Attaches wait meanwhile;
        if it fails, they are refused (never given the changed arena)."""
        old = self.cache
        try:
            from ..load.loader import fill_cache

            if not hasattr(self.prepared, "plan"):  # planned from a record: the checkpoint is needed now
                self.prepared = _prepare(self.spec, self._device_mark_value or self._device_mark())
                self.planned_from = "checkpoint"
            arena = self._new_arena(self.prepared.layout.size)
            self.progress = LoadProgress()
            cache = fill_cache(self.prepared, arena, self.progress, show_bar=False)
            self._guard_arena(arena, fresh=True)
        except Exception as e:  # noqa: BLE001 -- reported as the agent's failure: attaches are refused
            with self._lock:
                self.cache, self.phase = None, "failed"
                self.error = f"the arena was found changed and refilling it failed: {e}"
            log.error("refilling the changed arena failed: %s; refusing attaches", e)
            self._ready.set()
            return
        with self._lock:
            self.cache, self._arena_id, self.adopted, self.filled_from = cache, secrets.token_hex(16), False, "disk"
            self._handed.clear()
            self._grants.clear()
            self._quarantined = False
            self.refills += 1
            self.phase = "ready"
        self._ready.set()
        log.info("serving a fresh arena %s in place of the changed one (filled in %.2fs)", self._arena_id,
                 cache.load_seconds)
        if old is not None:
            old.arena.close()  # engines that still map it keep it alive; the agent holds none of it

    def _verify(self, conn: socket.socket) -> None:
        """A whole check of the arena now (privileged peers: it costs a pass of device time)."""
        _pid, uid, _gid = protocol.peer_credentials(conn)
        if uid not in (0, os.geteuid()):
            raise ProtocolError(f"verify needs a privileged peer; uid {uid} is not")
        scrubber = self._scrubber
        if not self._ready.is_set() or scrubber is None:
            protocol.send_message(conn, protocol.error_message(
                "not_verifiable", self._integrity_error or f"the agent has no verified arena now (phase {self.phase})"))
            return
        result = scrubber.verify()
        protocol.send_message(conn, {"type": "verified", **result, "integrity": self._integrity()})

    def _integrity(self) -> dict[str, Any]:
        scrubber = self._scrubber
        out: dict[str, Any] = scrubber.to_json() if scrubber is not None else {
            "state": "unavailable" if self._integrity_error else "unverified"}
        if self._quarantined:
            out["state"] = "tampered"
        out.update(tampered=self.tampered, refills=self.refills)
        if self._integrity_error:
            out["error"] = self._integrity_error
        return out

    # -- state kept for a restarted agent ------------------------------------------------------

    @property
    def _state_path(self) -> str:
        return sidecar_path(self.socket_path, "state")

    @property
    def _digest_path(self) -> str:
        return sidecar_path(self.socket_path, "digest")

    @property
    def _record_path(self) -> str:
        return sidecar_path(self.socket_path, "prepared")

    def _state(self) -> dict[str, Any] | None:
        if self.prepared is None:
            return None
        return {"fingerprint": self.prepared.fingerprint, "layout_hash": self.prepared.layout.layout_hash,
                "backend": self.device.backend, "device": self.device.uuid}

    def _previous_leases(self) -> list[dict[str, Any]]:
        """The predecessor's lease records, if it served exactly what this agent prepared."""
        previous, state = self._previous, self._state()
        if not isinstance(previous, dict) or state is None:
            return []
        if any(previous.get(key) != value for key, value in state.items()):
            return []
        leases = previous.get("leases")
        return [r for r in leases if isinstance(r, dict)] if isinstance(leases, list) else []

    def _write_state(self) -> None:
        """Record what engines hold, so a successor knows to wait for one to hand the arena back.

        The file exists exactly while engines are attached: an agent restarted after its
        last engine left loads from disk at once instead of waiting for nobody. Call with
        `_lock` held; raises OSError when the file cannot be written.
        """
        state = self._state()
        if state is None:
            return
        # The predecessor's engines that have not rejoined yet keep their records (a second restart
        # still lets them in); a token already used is gone from the file before its rejoin is answered.
        unclaimed = [r for r in self._previous_leases() if r.get("token") not in self._claimed]
        state["leases"] = [lease.record() for lease in self._leases.values()] + unclaimed
        write_private(self._state_path, state)

    def _clear_state(self) -> None:
        try:
            os.unlink(self._state_path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Stop serving: remove the socket, drop every connection. Engines keep their mappings."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._status_queue.put(None)
        self._client_queue.put(None)
        if self._listener is not None:
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
            self._listener.close()
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        if not leases:  # nobody holds the arena: a successor has nothing to adopt
            self._clear_state()
        for lease in leases:
            _shutdown(lease.conn)
        if self._scrubber is not None:
            self._scrubber.stop()
        if self.cache is not None:
            self.cache.arena.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- status ------------------------------------------------------------------------------

    def leases(self) -> list[Lease]:
        with self._lock:
            return sorted(self._leases.values(), key=lambda lease: lease.since)

    def status(self) -> dict[str, Any]:
        cache = self.cache
        out: dict[str, Any] = {
            "type": "status",
            "phase": self.phase,
            "error": self.error,
            "pid": os.getpid(),
            "socket": self.socket_path,
            "model": os.path.abspath(self.spec.model),
            "revision": self.spec.revision,
            "spec": self.spec.to_json(),
            "backend": self.device.backend,
            "device": self.device.uuid,
            "adopted": self.adopted,
            "filled_from": "adopted" if self.adopted else self.filled_from,
            "planned_from": self.planned_from,
            "progress": self.progress.to_json(),
            "fingerprint": cache.fingerprint if cache else None,
            "fields": cache.fields if cache else None,
            "layout_hash": cache.layout.layout_hash if cache else None,
            "bytes": cache.layout.nbytes if cache else 0,
            "arena_bytes": cache.layout.size if cache else 0,
            # Room for a second arena beside this one (a new model revision loading while engines
            # still map this one): the operator checks it before it starts such a transition.
            "free_bytes": self._free_bytes.get(),
            "tensors": len(cache.layout.slots) if cache else 0,
            "load_seconds": cache.load_seconds if cache else None,
            "load_breakdown": self.timings,
            "startup": self.startup.as_dict(),
            "prefetched_bytes": self.prefetched,
            # The agent's own high-water mark (a cold load's staging, a manifest), not the arena's memory.
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "attaches": self.attaches,
            "misses": self.misses,
            "refused_connections": dict(self.refused_connections),
            # Whether the served arena still holds what was loaded: state verified / tampered /
            # unverified / unavailable / error, the scrub's schedule and cost, arenas found changed.
            "integrity": self._integrity(),
            # TokenReviews sent to prove engines' pods (null off Kubernetes): repeats are cached.
            "identity_reviews": self.pod_verifier.reviews if self.pod_verifier is not None else None,
            # Recent latencies, newest last: the node supervisor feeds the ones it has not
            # seen (by the change in `attaches`) into its Prometheus histogram.
            "attach_seconds": self.attach_seconds[-ATTACH_SAMPLES_IN_STATUS:],
            # Without the lock, which attaches hold across a state-file write: status must answer
            # at once while dozens of engines attach. Copying a dict's values is atomic under the GIL.
            "clients": [lease.to_json() for lease in sorted(list(self._leases.values()), key=lambda lease: lease.since)],
        }
        return out

    # -- connections -------------------------------------------------------------------------
    #
    # The accept thread never waits on a client: `Thread.start()` returns only once the new
    # thread runs, which under the GIL of dozens of attaching engines took 3-6 ms, and a status
    # request behind them waited for every one of those starts. The accept thread routes each
    # connection instead: a status request whose bytes are already there goes to the status
    # thread, which answers it at once; anything else to the thread that starts a thread per
    # client. At most `max_pending` connections wait for their thread (a status connection
    # waits for one too, for whatever it asks next); past that the accept thread waits, and
    # the kernel's backlog holds the rest, as it did before.

    def _accept_loop(self) -> None:
        assert self._listener is not None
        ids = itertools.count()
        while not self._closed.is_set():
            if not self._waiting_slots.acquire(timeout=0.5):
                continue  # too many wait for a thread: leave the next in the backlog a while
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                self._waiting_slots.release()
                if self._closed.is_set():
                    return
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    log.warning("accept failed: %s; dropping the oldest pending connection", e.strerror)
                    self._drop_oldest_pending()
                else:
                    log.warning("accept failed: %s", e)
                time.sleep(0.05)
                continue
            pid, uid, gid = protocol.peer_credentials(conn)
            if not self.policy.allows(uid, gid, peer_groups(conn) if self.policy.gid is not None else ()):
                self._waiting_slots.release()
                # Counted each, logged at most once a second: a flood of refused connects must not fill the disk.
                self.refused_connections["forbidden"] += 1
                self._forbidden.warn(f"refused pid={pid} uid={uid} gid={gid}: not allowed on this socket (allowed: "
                                     f"{self.policy.describe()})")
                conn.setblocking(False)
                _try_send(conn, protocol.error_message("forbidden", "this uid may not use the agent's socket"))
                conn.close()
                continue
            with self._pending_lock:
                crowded = self._connections[uid] >= self.max_connections_per_uid
                if not crowded:
                    self._connections[uid] += 1
            if crowded:
                self._waiting_slots.release()
                self.refused_connections["too_many_connections"] += 1
                self._refusals.warn(f"uid {uid} holds its cap of {self.max_connections_per_uid} connections: "
                                    "refusing more")
                conn.setblocking(False)
                _try_send(conn, protocol.error_message(
                    "too_many_connections", f"this uid holds its cap of {self.max_connections_per_uid} connections"))
                conn.close()
                continue
            client = (conn, next(ids), pid, uid)  # holds its waiting slot until it has a thread
            if protocol.waiting_status_request(conn):
                self._status_queue.put(client)
            else:
                self._client_queue.put(client)

    def _client_loop(self) -> None:
        for client in iter(self._client_queue.get, None):
            try:
                threading.Thread(target=self._serve, args=client, name="client", daemon=True).start()
            except RuntimeError as e:  # out of threads: this client goes, the agent keeps serving
                log.warning("client pid=%s dropped: %s", client[2], e)
                self._close(client[0], client[3])
            finally:
                self._waiting_slots.release()

    def _status_loop(self) -> None:
        """Answer the status request waiting on each connection, then hand the connection on
        for whatever the client asks next."""
        for client in iter(self._status_queue.get, None):
            conn, pid = client[0], client[2]
            try:
                conn.settimeout(STATUS_SEND_TIMEOUT)
                _, fds = protocol.recv_message(conn, protocol.MAX_REQUEST_BYTES, max_fds=protocol.MAX_REQUEST_FDS)
                _refuse_fds("status", fds)
                self._send_status(conn)
            except BlockingIOError:
                self._refusals.warn("a client left status replies unread: dropped")
            except ProtocolError as e:
                log.warning("client pid=%s dropped: %s", pid, e)
                _try_send(conn, protocol.error_message("protocol", str(e)))
            except (OSError, EOFError) as e:
                log.warning("client pid=%s dropped: %s", pid, e)
            except Exception:
                log.exception("client pid=%s dropped after an internal error", pid)
            else:
                self._client_queue.put(client)
                continue
            self._close(conn, client[3])
            self._waiting_slots.release()

    def _send_status(self, conn: socket.socket) -> None:
        """The status reply, sent without waiting: the send buffer is made to hold the whole reply, so it
        goes out at once to a client that reads; `BlockingIOError` for one that left replies unread."""
        data = protocol.encode_message(self.status())
        try:
            conn.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 2 * len(data) + (64 << 10))
        except OSError:  # not root: as much as the system allows
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * len(data) + (64 << 10))
        timeout = conn.gettimeout()
        conn.setblocking(False)
        try:
            if conn.send(data) < len(data):
                raise BlockingIOError("status reply sent in part")
        finally:
            conn.settimeout(timeout)

    def _close(self, conn: socket.socket, uid: int) -> None:
        conn.close()
        with self._pending_lock:
            self._connections[uid] -= 1
            if self._connections[uid] <= 0:
                del self._connections[uid]

    def _drop_oldest_pending(self, uid: int | None = None) -> None:
        """Make room: a connection still sending its first request is dropped, oldest first (of `uid`'s
        when it holds more than its share)."""
        with self._pending_lock:
            key = next((k for k, (_, u) in self._pending.items() if uid is None or u == uid), None)
            if key is None:
                return
            conn, _ = self._pending.pop(key)
        if uid is None:
            log.warning("too many connections still in their first request (cap %d): dropping the oldest",
                        self.max_pending)
        else:
            self._refusals.warn(f"uid {uid} holds more than its {self.max_pending_per_uid} connections still in "
                                "their first request: dropping the oldest of them")
        _shutdown(conn)

    def _serve(self, conn: socket.socket, key: int, peer: int | None, uid: int) -> None:
        lease: Lease | None = None
        with self._pending_lock:
            self._pending[key] = (conn, uid)
            over = len(self._pending) > self.max_pending
            own = sum(1 for _, u in self._pending.values() if u == uid) > self.max_pending_per_uid
        if own:
            self._drop_oldest_pending(uid)
        elif over:
            self._drop_oldest_pending()
        try:
            deadline = time.monotonic() + self.handshake_timeout
            while lease is None:
                message, fds = protocol.recv_message(conn, protocol.MAX_REQUEST_BYTES, max_fds=protocol.MAX_REQUEST_FDS,
                                                     deadline=deadline, max_items=protocol.MAX_REQUEST_ITEMS,
                                                     parse_gate=self._parse_gate)
                kind = message["type"]
                if kind != "rejoin":
                    _refuse_fds(kind, fds)
                if kind == "status":
                    self._send_status(conn)
                    deadline = time.monotonic() + self.handshake_timeout  # a new request, a new deadline
                elif kind == "arena":
                    conn.settimeout(self.handshake_timeout)
                    self._send_arena(conn, message, peer, uid)
                    deadline = time.monotonic() + self.handshake_timeout
                elif kind == "verify":
                    self._done_pending(key)
                    conn.settimeout(self.handshake_timeout)
                    self._verify(conn)
                    return
                elif kind == "attach":
                    self._done_pending(key)
                    conn.settimeout(self.handshake_timeout)
                    lease = self._attach(conn, message, peer, uid)
                    if lease is None:
                        return
                elif kind == "rejoin":
                    self._done_pending(key)
                    conn.settimeout(self.handshake_timeout)
                    lease = self._rejoin(conn, message, fds, peer, uid)
                    fds = []
                    if lease is None:
                        return
                elif kind == "switchover":
                    self._done_pending(key)
                    conn.settimeout(self.handshake_timeout)
                    self._switchover(conn, message)
                    return
                elif kind in ("group_claim", "group_lost"):
                    self._done_pending(key)
                    self._rank_group_request(conn, message)
                    return
                else:
                    raise ProtocolError(f"unexpected message type {kind!r} before attach")
            conn.settimeout(None)
            while True:
                message, _ = protocol.recv_message(conn, protocol.MAX_REQUEST_BYTES, max_items=protocol.MAX_REQUEST_ITEMS,
                                                   parse_gate=self._parse_gate)
                if message["type"] == "detach":
                    return
                if message["type"] == "promoted":
                    lease.acknowledged.set()
                    continue
                raise ProtocolError(f"unexpected message type {message['type']!r} on a lease")
        except EOFError:
            pass
        except BlockingIOError:
            self._refusals.warn("a client left status replies unread: dropped")
        except socket.timeout:
            log.warning("client pid=%s dropped: no complete request within %.1fs", peer, self.handshake_timeout)
        except ProtocolError as e:
            log.warning("client pid=%s dropped: %s", peer, e)
            _try_send(conn, protocol.error_message("protocol", str(e)))
        except OSError as e:
            log.warning("client pid=%s dropped: %s", peer, e.strerror or e)
        except (RecursionError, MemoryError) as e:
            log.warning("client pid=%s dropped: request too complex (%s)", peer, type(e).__name__)
        except Exception:
            log.exception("client pid=%s dropped after an internal error", peer)
        finally:
            self._done_pending(key)
            if lease is not None:
                self._end_lease(lease)
            self._close(conn, uid)

    def _done_pending(self, key: int) -> None:
        with self._pending_lock:
            self._pending.pop(key, None)

    def _attach(self, conn: socket.socket, message: dict[str, Any], peer: int | None, uid: int) -> Lease | None:
        started = time.perf_counter()
        role, group, request = message.get("role", "primary"), message.get("group"), message.get("request")
        _check_lease_terms("attach", role, group)
        if not isinstance(request, dict) or not isinstance(request.get("spec"), dict):
            raise ProtocolError(f"attach needs request, an object with a spec; got {type(request).__name__}")
        names = message.get("names", "checkpoint")
        if names not in NAMINGS:
            raise ProtocolError(f"attach's names must be one of {', '.join(NAMINGS)}, got {str(names)[:40]!r}")
        identity = self._identify(conn, message, group, peer, uid)
        if identity is None:
            return None
        if not self._ready.is_set():
            with self._lock:
                crowded = self._waiting >= self.max_leases
                self._waiting += not crowded
            if crowded:  # each waiter holds a thread and a socket until the load ends: bounded like leases
                protocol.send_message(conn, protocol.error_message(
                    "too_many_leases", f"{self.max_leases} attaches already wait for the load; try again later"))
                return None
            try:
                self._ready.wait()
            finally:
                with self._lock:
                    self._waiting -= 1
        served = self._serving()
        if served is None:
            with self._lock:
                self.misses += 1
            protocol.send_message(conn, self._load_failed())
            return None
        cache, arenas = served
        replaced = self._replaced_files(cache, request)
        if replaced is not None:
            # The files this arena was read from are no longer the ones at the model path: a named miss,
            # whatever the engine's headers say (other weights may hide under the same headers).
            with self._lock:
                self.misses += 1
            log.warning("refused attach from pid=%s: the checkpoint at %s changed since it was loaded (files "
                        "signature %s, now %s): restart this agent to load the new files", peer, self.spec.model,
                        *replaced)
            protocol.send_message(conn, protocol.error_message(
                "fingerprint_mismatch", "the checkpoint's files changed since the agent loaded them",
                fields={"files": f"as loaded (signature {replaced[0]})"},
                engine_fields={"files": f"replaced or rewritten since the agent loaded them (signature {replaced[1]})"},
                model=os.path.abspath(self.spec.model)))
            return None
        try:
            fields = self._fields_for(request)
        except RevisionRequired:
            protocol.send_message(conn, protocol.error_message(
                "revision_required", "the engine's checkpoint files differ from the ones loaded (name, size, mtime "
                                     "or inode): send their content identity"))
            return None
        except (KeyError, TypeError, ValueError) as e:
            # Only what the client sent is named: these come from checking its own values.
            what = f"missing {e}" if isinstance(e, KeyError) else str(e).splitlines()[0][:300]
            protocol.send_message(conn, protocol.error_message("bad_request", f"cannot evaluate the engine's spec: {what}"))
            return None
        except WeightCacheError as e:
            log.warning("cannot evaluate the spec of pid=%s: %s", peer, e)
            protocol.send_message(conn, protocol.error_message(
                "bad_request", "cannot evaluate the engine's spec against this agent's checkpoint; see the agent's log"))
            return None
        diff = differences(cache.fields, fields)
        if diff:
            with self._lock:
                self.misses += 1
            log.warning("refused attach from pid=%s: fingerprint differs in %s", peer,
                        ", ".join(f"{k} (cache={c} engine={e})" for k, (c, e) in diff.items()))
            protocol.send_message(conn, protocol.error_message(
                "fingerprint_mismatch", "fingerprint differs", fields=cache.fields, engine_fields=fields,
                model=os.path.abspath(self.spec.model)))  # as status says it: named, never part of the fingerprint
            return None
        token = secrets.token_hex(32)
        lease = self._register(conn, peer, uid, role, group, _hash_token(token), *identity,
                               engine=_engine_id(message.get("engine")))
        if lease is None:
            return None
        reply = {
            "type": "manifest",
            "lease": lease.id,
            "role": lease.role,
            "backend": cache.arena.backend,
            "fingerprint": cache.fingerprint,
            "fields": cache.fields,
            "layout_hash": cache.layout.layout_hash,
            "bytes": cache.layout.nbytes,
            "arenas": arenas,
            "rejoin_token": token,  # the proof this engine offers a restarted agent; recorded only as a hash
        }
        try:
            columns, (header, payload) = self._manifests.get(names)
            if message.get("manifest") == "packed":
                lease.send(reply, [cache.arena.fd], encoded={"tensors": header}, payload=payload)
            else:
                lease.send(reply, [cache.arena.fd], encoded={"tensors": columns})
        except BaseException:
            self._end_lease(lease)
            raise
        seconds = time.perf_counter() - started
        # Sample before count: a status read in between then misses one sample, never pairs
        # a new count with an old sample.
        self.attach_seconds = (self.attach_seconds + [seconds])[-1000:]
        self.attaches += 1
        log.info("attached pid=%s role=%s group=%s lease=%d in %.2fms", peer, lease.role, group, lease.id,
                 seconds * 1e3)
        return lease

    def _load_failed(self) -> dict[str, Any]:
        """What an attach or an arena request is told when the load failed (an engine may fall back)."""
        return protocol.error_message("load_failed", f"agent failed to load: {self.error}")

    def _serving(self) -> tuple[Any, list[dict[str, Any]]] | None:
        """The cache to hand out and its arenas' description, once ready and not found changed (a
        refill in progress is waited for); None when there is none (the load or the refill failed)."""
        while True:
            self._ready.wait()
            with self._lock:
                if not self._quarantined and self._ready.is_set():
                    cache = self.cache
                    if cache is None:
                        return None
                    return cache, [{"index": 0, "size": cache.arena.size, "backend": cache.arena.backend,
                                    "device": self.device.uuid, "id": self._arena_id}]

    def _handing(self, uid: int, pid: int | None) -> None:
        """Remember who gets the arena's handle (under `_lock`), bounded: a mismatch names them."""
        self._handed.pop((uid, pid), None)
        self._handed[(uid, pid)] = time.time()
        while len(self._handed) > MAX_HANDED:
            self._handed.pop(next(iter(self._handed)))

    def _send_arena(self, conn: socket.socket, message: dict[str, Any], peer: int | None, uid: int) -> None:
        """The arena's fd and what it is, ahead of an attach: an engine maps it while it starts, and its
        attach then only binds. Handed out under the rules of an attach -- the socket's policy, the
        group's owner, the uid's lease cap, which an unused hand-out counts against for `GRANT_TTL`
        seconds -- and never while the arena is being replaced. No waiting for a load: an engine
        that asks too early is told so and maps at its attach."""
        group = message.get("group")
        _check_lease_terms("arena", message.get("role", "auto"), group)
        if not self._ready.is_set():
            protocol.send_message(conn, protocol.error_message("not_ready", f"the cache is {self.phase}"))
            return
        served = self._serving()
        if served is None:
            protocol.send_message(conn, self._load_failed())
            return
        cache, arenas = served
        with self._lock:
            refusal = self._admission(uid, peer, group)
            if refusal is None:
                self._grants[(uid, peer)] = time.monotonic() + GRANT_TTL
                self._handing(uid, peer)
        if refusal is not None:
            protocol.send_message(conn, refusal)
            return
        protocol.send_message(conn, {"type": "arena", "backend": cache.arena.backend, "arenas": arenas},
                              [cache.arena.fd])
        log.debug("sent the arena to pid=%s uid=%s ahead of its attach", peer, uid)

    def _admission(self, uid: int, pid: int | None, group: str | None) -> dict[str, Any] | None:
        """The refusal of a new lease (or hand-out) for `uid`, or None. Call with `_lock` held."""
        now = time.monotonic()
        for holder in [h for h, until in self._grants.items() if until < now]:
            del self._grants[holder]
        held = sum(1 for lease in self._leases.values() if lease.uid == uid) + sum(
            1 for (u, p) in self._grants if u == uid and p != pid)
        if len(self._leases) >= self.max_leases:
            return protocol.error_message("too_many_leases", f"this agent holds its cap of {self.max_leases} "
                                                             "leases; try again later")
        if held >= self.max_leases_per_uid:
            return protocol.error_message("too_many_leases", f"uid {uid} holds its cap of {self.max_leases_per_uid} "
                                                             "leases (and arenas handed out ahead of an attach)")
        owner = self._group_owner(self._group_key(uid, group)) if group is not None and uid != 0 else None
        if owner is not None and owner != uid:
            return protocol.error_message("group_taken", f"group {group!r} belongs to another user")
        return None

    def _group_key(self, uid: int, group: str | None) -> tuple[int | None, str | None]:
        """The `Lease.key` of a lease of `uid` in `group`: off Kubernetes the uid's own group of that name."""
        return (None if self.pod_verifier is not None else uid), group

    def _group_owner(self, key: tuple[int | None, str | None]) -> int | None:
        """The uid a group belongs to while it has leases: its first non-root claimant's (root may join
        any group as a guest without taking it over), else root's when only root holds it. Another
        uid can neither squat a role in it nor take it over. (Off Kubernetes every member is the
        key's uid.) Call with `_lock` held."""
        members = [lease for lease in self._leases.values() if lease.key == key]
        if not members:
            return None
        users = [lease for lease in members if lease.uid != 0]
        return min(users, key=lambda lease: lease.since).uid if users else 0

    def _replaced_files(self, cache: Any, request: dict[str, Any]) -> tuple[str, str] | None:
        """(signature loaded, signature now) when the engine's files are not the ones loaded and this
        agent's own model directory no longer holds them either; else None. Stats the agent's own
        model path only (never a path the client names), and only when the engine's signature differs."""
        loaded = cache.signature if isinstance(cache, RecordedCache) else cache.checkpoint.signature
        if not loaded or request.get("files") == loaded:
            return None
        try:
            now = file_signature(os.path.abspath(self.spec.model))
        except WeightCacheError:
            now = "unreadable"
        return None if now == loaded else (loaded, now)

    def _fields_for(self, request: dict[str, Any]) -> dict[str, Any]:
        key = json.dumps(request, sort_keys=True)
        fields = self._engine_fields.get(key)
        if fields is None:
            cache = self.cache
            if isinstance(cache, RecordedCache):
                signature, revision = cache.signature, cache.revision
            else:
                signature, revision = cache.checkpoint.signature, cache.checkpoint.revision
            fields = same_spec_fields(request, self.spec, cache.fields, signature, revision)
            if fields is None:  # another spec: derive its fields from the checkpoint itself
                fields = fields_for_request(request, self._checkpoint())
            if len(self._engine_fields) < 64:  # bounded: a stream of odd requests must not grow it
                self._engine_fields[key] = fields
        return dict(fields)

    def _checkpoint(self) -> Any:
        """The parsed checkpoint; after a re-adoption from the record, parsed on first need."""
        if self.cache.checkpoint is None:
            from ..load.checkpoint import open_checkpoint

            self.cache.checkpoint = open_checkpoint(self.spec.model)
        return self.cache.checkpoint

    def _identify(self, conn: socket.socket, message: dict[str, Any], group: str | None, peer: int | None,
                  uid: int) -> tuple[dict[str, str] | None, bool] | None:
        """The lease's pod and whether it is proven, or None after telling the client why not.

        Without a verifier (off Kubernetes) the pod is what the client says. With one, an attach
        or rejoin that names a pod or a group must present its pod's token: the pod the API
        server names replaces the client's fields, and a group is claimable only by pods of its
        namespace (`<namespace>/...`, as EngineSets name them).
        """
        claimed = _pod_identity(message.get("pod"))
        token = message.get("identity_token")
        if self.pod_verifier is None:
            return claimed, False
        if token is None:
            if claimed is None and group is None:
                return None, False  # no pod, no group: nothing that moves traffic
            refusal = ("this agent runs in a cluster: an engine that names a pod or a group must present its pod's "
                       "weightcache.io token ($WEIGHTCACHE_IDENTITY_TOKEN names the file)")
        else:
            try:
                identity = self.pod_verifier.verify(token)
            except IdentityRefused as e:
                refusal = str(e)
            else:
                if group is None or group_namespace(group) == identity.namespace:
                    return identity.pod(), True
                self._refusals.warn(f"refused pid={peer} uid={uid} (pod {identity.namespace}/{identity.name}): "
                                    f"group {group[:64]!r} is not of its namespace")
                protocol.send_message(conn, protocol.error_message(
                    "group_forbidden", f"pod {identity.namespace}/{identity.name} may only join groups of its "
                                       f"namespace ({identity.namespace}/...)"))
                return None
        self._refusals.warn(f"refused pid={peer} uid={uid}: {refusal}")  # a flood is a line a second
        protocol.send_message(conn, protocol.error_message("identity_refused", refusal))
        return None

    def _register(self, conn: socket.socket, pid: int | None, uid: int, role: str, group: str | None,
                  token_hash: str, pod: dict[str, str] | None = None, verified: bool = False,
                  engine: str | None = None) -> Lease | None:
        """A new lease, recorded in the state file, or None (after telling the client why not).

        Role "auto" is decided here, under the lock: primary when the group has none, else standby.
        Across the ranks of a tensor-parallel replica, rank 0's agent decides it for the engine.
        """
        refusal = None
        engine = (pod or {}).get("uid") or engine
        key = self._group_key(uid, group)
        if role == "auto" and self.ranks is not None and group is not None and engine is not None:
            try:
                role = self.ranks.claim(group, engine, key[0])
            except WeightCacheError as e:
                log.error("cannot decide the role of pid=%s in group %r: %s", pid, group, e)
                protocol.send_message(conn, protocol.error_message(
                    "coordinator_unavailable", "rank 0's agent, which decides roles for every rank, does not answer; "
                                               "try again"))
                return None
        with self._lock:
            has_primary = group is not None and any(
                lease.role == "primary" and lease.key == key for lease in self._leases.values())
            if role == "auto":
                role = "standby" if has_primary else "primary"
            if role == "standby" and group is None:  # no primary's departure could ever promote it
                refusal = protocol.error_message("standby_without_group", "a standby needs a group: name the group "
                                                 "whose primary it takes over from")
            else:
                refusal = self._admission(uid, pid, group)
            if refusal is None and role == "primary" and has_primary:
                refusal = protocol.error_message("primary_exists",
                                                 f"group {group!r} already has a primary; attach as a standby")
            if refusal is None:
                if role == "standby" and not has_primary:  # engines start in any order: said, not refused
                    log.warning("standby pid=%s joined group %r, which has no primary on this agent yet: it is "
                                "promoted only when a primary of that group attaches and then goes", pid, group)
                lease = Lease(next(self._ids), conn, pid, role, group, uid, key[0], token_hash, pod=pod,
                              engine=engine, verified=verified)
                self._leases[lease.id] = lease
                self._grants.pop((uid, pid), None)  # a hand-out ahead of this attach is used up
                self._handing(uid, pid)
                try:
                    self._write_state()
                except OSError as e:
                    # A lease the state file does not know would be a ghost after a restart: roll it back.
                    del self._leases[lease.id]
                    log.error("cannot record a lease in %s: %s; refusing the attach", self._state_path,
                              e.strerror or e)
                    refusal = protocol.error_message("state_unwritable",
                                                     "the agent cannot record the lease; see its log")
        if refusal is not None:
            protocol.send_message(conn, refusal)
            return None
        return lease

    def _proven(self, message: dict[str, Any], pid: int | None, uid: int) -> dict[str, Any] | None:
        """The predecessor's lease record this rejoin proves it held, or None."""
        token = message.get("token")
        if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN_CHARS:
            return None
        digest = _hash_token(token)
        for record in self._previous_leases():
            if not hmac.compare_digest(str(record.get("token", "")), digest):
                continue
            if record.get("uid") != uid:
                return None
            # A pid is known on both sides only within one PID namespace; where it is, it must be the same process.
            if isinstance(record.get("pid"), int) and pid is not None and record["pid"] != pid:
                return None
            return record
        return None

    def _rejoin(self, conn: socket.socket, message: dict[str, Any], fds: list[int], peer: int | None,
                uid: int) -> Lease | None:
        """An engine that outlived its agent reconnects, offering the arena it still maps.

        Refusals say no more than "refused": the client learns nothing it did not send.
        """
        adopt = False
        try:
            role, group = message.get("role"), message.get("group")
            _check_lease_terms("rejoin", role, group)
            identity = self._identify(conn, message, group, peer, uid)
            if identity is None:
                return None
            self._prepared.wait()
            prepared = self.prepared
            if prepared is None:
                protocol.send_message(conn, protocol.error_message("load_failed", "the agent failed to load"))
                return None
            record = self._proven(message, peer, uid)
            unrecorded = False
            with self._lock:
                claimed = record is not None and record["token"] in self._claimed
                if record is not None and not claimed:
                    # Used once, across restarts too: the token leaves the state file before anything
                    # else happens, so that neither this agent nor a successor accepts it again.
                    self._claimed.add(record["token"])
                    try:
                        self._write_state()
                    except OSError as e:
                        unrecorded = True
                        log.error("cannot record a used rejoin token in %s: %s; refusing the rejoin",
                                  self._state_path, e.strerror or e)
            if record is None or claimed or unrecorded:
                log.warning("refused a rejoin from pid=%s uid=%s: it proves no lease of this agent's predecessor",
                            peer, uid)
                protocol.send_message(conn, protocol.error_message(
                    "rejoin_refused", "rejoin refused; keep the weights you have"))
                return None
            fields = message.get("fields")
            if not isinstance(fields, dict) or differences(prepared.fields, fields):
                protocol.send_message(conn, protocol.error_message(
                    "fingerprint_mismatch", "this agent serves different weights; keep yours"))
                return None
            arenas = message.get("arenas")
            if (len(fds) == 1 and isinstance(arenas, list) and len(arenas) == 1 and isinstance(arenas[0], dict)
                    and message.get("layout_hash") == prepared.layout.layout_hash
                    and arenas[0].get("backend") == self.device.backend):
                adopt = self._adopt(prepared.layout.size, fds[0], peer, uid)
                fds = []  # closed by `_adopt` or owned by the adopted arena
        finally:
            for fd in fds:
                os.close(fd)
        # A fresh token for the next restart: the one just used is spent.
        token = secrets.token_hex(32)
        lease = self._register(conn, peer, uid, role, group, _hash_token(token), *identity,
                               engine=_engine_id(message.get("engine")))
        if lease is None:
            return None
        lease.send({"type": "rejoined", "lease": lease.id, "role": lease.role, "adopted": adopt,
                    "rejoin_token": token})
        log.info("rejoined pid=%s role=%s group=%s lease=%d%s", peer, lease.role, group, lease.id,
                 " (its arena adopted)" if adopt else "")
        return lease

    def _adopt(self, size: int, fd: int, peer: int | None, uid: int) -> bool:
        """Take the arena an engine offers (fd) as this agent's, where the adoption window is open and
        its bytes digest to what the predecessor recorded. Owns `fd` either way."""
        arena = None
        with self._adopt_lock:
            try:
                with self._lock:
                    open_window = self._adoptable and self._adopted_arena is None
                if not open_window:
                    return False
                # The layout's own size, never the client's: an arena of any other size is refused;
                # a memfd must carry every seal the agent puts on its own.
                arena = self._new_arena(size, fd=fd)
                fd = -1  # the arena owns it now
                if not self._content_is_ours(arena, peer, uid):
                    return False
                with self._lock:
                    self._adopted_arena, arena = arena, None
                self._adoption.set()
                return True
            except (OSError, WeightCacheError, ValueError) as e:
                log.warning("could not adopt the arena offered by pid=%s uid=%s: %s", peer, uid, e)
                return False
            finally:
                if arena is not None:
                    arena.close()
                elif fd >= 0:
                    os.close(fd)

    def _end_lease(self, lease: Lease) -> None:
        with self._lock:
            if self._leases.pop(lease.id, None) is None:
                return
            lease.ended = True
            if not self._closed.is_set():
                if not self._leases:
                    self._clear_state()
                else:
                    try:
                        self._write_state()
                    except OSError as e:  # a stale record only lets its departed engine rejoin
                        log.warning("cannot update %s: %s", self._state_path, e.strerror or e)
            successor = None
            coordinated = self.ranks is not None and lease.engine is not None
            if lease.role == "primary" and lease.group is not None and not coordinated:
                standbys = [s for s in self._leases.values() if s.key == lease.key and s.role == "standby"]
                if standbys:
                    successor = min(standbys, key=lambda s: s.since)
                    successor.role = "primary"
        log.info("detached pid=%s role=%s group=%s lease=%d", lease.pid, lease.role, lease.group, lease.id)
        if coordinated and lease.role == "primary" and lease.group is not None and not self._closed.is_set():
            self.ranks.lost(lease.group, lease.engine, lease.owner)  # every rank promotes the same engine
        if successor is not None:
            self._promote(successor, {"type": "promote", "group": lease.group, "previous_pid": lease.pid})

    def _promote(self, lease: Lease, message: dict[str, Any]) -> bool:
        """Tell a lease (already primary in our books) that it is, wait until the engine says it
        serves as one, then let the cluster follow: traffic never reaches a primary that does
        not know it is one yet."""
        lease.acknowledged.clear()
        lease.promoting.set()
        try:
            lease.send(message)
        except OSError as e:
            lease.promoting.clear()
            log.warning("promotion of pid=%s failed (%s); trying the next standby", lease.pid, e)
            _shutdown(lease.conn)  # its lease ends, and the next standby is promoted
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

    def _switchover(self, conn: socket.socket, message: dict[str, Any]) -> None:
        """A planned handover asked on the socket (see `switch`). Only a privileged peer (root, or the
        agent's own uid: the node's tooling, the other ranks' agents) may ask; an engine cannot take
        the primary role from another by asking."""
        self._privileged(conn, "switchover")
        group, to_pod, to_pid, to_engine, owner = (message.get(k) for k in ("group", "to_pod", "to_pid", "to_engine",
                                                                              "owner"))
        if not isinstance(group, str) or not (to_pod is None or isinstance(to_pod, str)) or \
                not (to_pid is None or isinstance(to_pid, int)) or not (to_engine is None or isinstance(to_engine, str)) \
                or not (owner is None or isinstance(owner, int)):
            raise ProtocolError("switchover needs group (a string), and to_pod (a pod name), to_pid (an int), "
                                "to_engine (an engine key) or none of them (demote only); owner: null or a uid")
        protocol.send_message(conn, self.switch(group, to_pod, to_pid, to_engine, owner))

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
        with self._lock:
            members = [lease for lease in self._leases.values()
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
        if target is None and not demote_only:
            return protocol.error_message("no_such_standby", f"group {group!r} has no standby "
                                                             f"{to_pod or to_pid or to_engine!r} on this agent")
        promoted = target is None or self._promote(target, {
            "type": "promote", "group": group, "planned": True, "previous_pid": old[0].pid if old else None})
        for lease in old:  # after the promotion: make before break
            _try_lease_send(lease, {"type": "demote", "group": group, "successor_pid": target.pid if target else None})
            lease.demoting.clear()
        seconds = time.perf_counter() - started
        log.info("switchover of group %s to %s in %.2fms", group,
                 f"pid={target.pid}" if target else "another agent's engine", seconds * 1e3)
        return {"type": "switched", "group": group, "ok": promoted, "primary": target.to_json() if target else None,
                "demoted": [lease.to_json() for lease in old], "seconds": seconds}

    def _privileged(self, conn: socket.socket, kind: str) -> None:
        _pid, uid, _gid = protocol.peer_credentials(conn)
        if uid not in (0, os.geteuid()):
            raise ProtocolError(f"{kind} needs a privileged peer; uid {uid} is not")

    def _rank_group_request(self, conn: socket.socket, message: dict[str, Any]) -> None:
        """Another rank's agent asks the coordinator (rank 0) to decide a role or promote its group."""
        self._privileged(conn, message["type"])
        group, engine, owner = message.get("group"), _engine_id(message.get("engine")), message.get("owner")
        if self.ranks is None or not self.ranks.coordinator:
            raise ProtocolError(f"{message['type']} goes to rank 0's agent of a tensor-parallel replica")
        _check_lease_terms(message["type"], "auto", group)
        if engine is None or group is None or not (owner is None or isinstance(owner, int)):
            raise ProtocolError(f"{message['type']} needs a group, an engine, and owner null or a uid")
        if message["type"] == "group_claim":
            protocol.send_message(conn, {"type": "group_role", "role": self.ranks.decide_claim(group, engine, owner)})
        else:
            done = self.ranks.decide_lost(group, engine, owner)
            protocol.send_message(conn, {"type": "group_promoted", "engine": done["to"] if done else None})


def _engine_id(value: Any) -> str | None:
    """The `engine` field of an attach: null, or an id of the same characters and bounds as a group."""
    if value is None:
        return None
    if not isinstance(value, str) or not GROUP_RE.fullmatch(value):
        raise ProtocolError("engine must be null or an id of letters, digits and ._:/- (at most 253)")
    return value


def _pod_identity(value: Any) -> dict[str, str] | None:
    """The `pod` field of an attach: null, or namespace/name/uid strings of Kubernetes' lengths."""
    if value is None:
        return None
    if not (isinstance(value, dict) and all(
            isinstance(value.get(k), str) and 0 < len(value[k]) <= limit for k, limit in POD_FIELD_LIMITS.items())):
        limits = ", ".join(f"{k} (at most {n} characters)" for k, n in POD_FIELD_LIMITS.items())
        raise ProtocolError(f"pod must be null or an object with the strings {limits}")
    return {k: value[k] for k in POD_FIELDS}


class _Throttled:
    """A warning said at most once a second, with how many were held back: a flood is one line a
    second in the log, not one per connection."""

    def __init__(self, every: float = 1.0):
        self._every, self._last, self._held = every, 0.0, 0
        self._lock = threading.Lock()

    def warn(self, message: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self._every:
                self._held += 1
                return
            held, self._held, self._last = self._held, 0, now
        log.warning("%s%s", message, f" (and {held} more such since the last line)" if held else "")


def _try_lease_send(lease: Lease, message: dict[str, Any]) -> None:
    try:
        lease.send(message)
    except OSError as e:
        log.warning("could not tell pid=%s %s: %s", lease.pid, message.get("type"), e)


def _check_lease_terms(kind: str, role: Any, group: Any) -> None:
    if role not in ROLES or not (group is None or (isinstance(group, str) and GROUP_RE.fullmatch(group))):
        shown = group if not isinstance(group, str) or len(group) <= 64 else group[:64] + "..."
        raise ProtocolError(f"{kind} needs role in {ROLES} and group null or a name of letters, digits and ._:/- "
                            f"(at most 253); got role={str(role)[:32]!r} group={shown!r}")


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _answers(path: str) -> bool:
    """True when something accepts connections at `path` (a live agent whose lock file was removed)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class Sampled:
    """A reading kept off the request path: `get()` answers the last one at once and, once it is older
    than `ttl`, has one background thread read it again. Free device memory is read this way:
    cuMemGetInfo waits in the driver while engines map arenas, and `status` must answer at once
    while dozens of them attach."""

    def __init__(self, read: Callable[[], Any], ttl: float):
        self._read, self._ttl = read, ttl
        self._value: Any = None
        self._at: float | None = None
        self._reading = threading.Lock()

    def get(self) -> Any:
        if self._at is None:  # the first reading is waited for: there is no earlier one to answer
            with self._reading:
                if self._at is None:
                    self._refresh()
        elif time.monotonic() - self._at > self._ttl and self._reading.acquire(blocking=False):
            threading.Thread(target=self._refresh_then_release, name="sampled", daemon=True).start()
        return self._value

    def _refresh(self) -> None:
        try:
            self._value = self._read()
        finally:
            self._at = time.monotonic()

    def _refresh_then_release(self) -> None:
        try:
            self._refresh()
        finally:
            self._reading.release()


def remove_socket_files(socket_path: str) -> bool:
    """What a killed agent leaves behind: its socket and lock file -- removed only while nobody
    serves the path. Another agent's live socket is never touched: when its lock is held, or
    something still accepts connections there (its lock file was removed), nothing is removed
    and False is returned. The state file stays on purpose: it tells the next agent that
    engines may still hold the arena."""
    lock_path = sidecar_path(socket_path, "lock")
    try:
        lock_fd: int | None = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        lock_fd = None
    except OSError:
        return False  # a link or something else not an agent's lock file: not ours to remove
    try:
        if lock_fd is not None:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # a live agent holds the path
        if os.path.lexists(socket_path) and _answers(socket_path):
            return False
        # Holding the lock: an agent starting this instant is told the path is served and retries.
        for path in (socket_path, lock_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return True
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def _refuse_fds(kind: str, fds: list[int]) -> None:
    """Only a rejoin carries fds: any sent with another request are closed, and it is refused."""
    for fd in fds:
        os.close(fd)
    if fds:
        raise ProtocolError(f"file descriptors sent with a {kind!r} message")


def _try_send(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        protocol.send_message(conn, message)
    except OSError:
        pass


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _prepare(spec: CacheSpec, device_mark: str) -> "PreparedCache":
    from ..load.loader import prepare_cache  # headers and plan: torch-free, but a restart that adopts skips them

    return prepare_cache(spec, device=device_mark)
