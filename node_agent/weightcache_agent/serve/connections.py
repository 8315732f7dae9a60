"""The agent's connections: accept, bound, route each request to its handler, keep a lease's socket.

The accept thread checks each peer's credentials against the socket policy (serve/access.py)
and per-uid connection caps, and never waits on a client: `Thread.start()` returns only once
the new thread runs, which under the GIL of dozens of attaching engines took 3-6 ms, and a
status request behind them waited for every one of those starts. So the accept thread routes
each connection instead: a status request whose bytes are already there goes to the status
thread, which answers it at once; anything else to the thread that starts a thread per client.
At most `max_pending` connections wait for their thread (a status connection waits for one
too, for whatever it asks next); past that the accept thread waits, and the kernel's backlog
holds the rest.

A client thread reads requests under one deadline each (`handshake_timeout`) and looks each
up in the route table the handlers give (`Route`: what the connection does after it); a
request that opens a lease turns the connection into the lease, read until `detach` or EOF.
A bad client -- garbage, wrong version, oversize frame, silence, a frame trickled byte by
byte, death mid-handshake -- is logged and dropped within one request deadline; nobody else
notices.
"""
from __future__ import annotations

import enum
import errno
import itertools
import logging
import queue
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from .. import protocol
from ..errors import ProtocolError
from .access import SocketPolicy, peer_groups
from .lease import Lease
from .sockets import refuse_fds, shutdown, try_send

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0  # seconds for a connection's whole first request, however slowly it arrives
# The status thread reads a request already whole (it was peeked at accept) and never waits to
# send: the connection's send buffer is made big enough for one reply, which goes out at once
# or the client (who left earlier replies unread) is dropped.
STATUS_SEND_TIMEOUT = 0.5
PARSE_SLOTS = 4  # large request frames parsed at once (see protocol.recv_message's parse_gate)
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)  # root may exceed the system's cap on a send buffer


@dataclass
class Request:
    """One request as a handler sees it: the message, fds it carried (a rejoin's), the kernel's word
    on the peer, and the connection to answer on."""

    conn: socket.socket
    message: dict[str, Any]
    fds: list[int]
    pid: int | None
    uid: int

    def reply(self, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
        protocol.send_message(self.conn, message, fds)


class After(enum.Enum):
    """What a connection does once a request's handler returns."""

    ANSWERED = "answered"  # read the next request, under a new deadline
    DONE = "done"  # the connection ends
    LEASE = "lease"  # the handler returned a lease (or None: refused, the connection ends)


@dataclass(frozen=True)
class Route:
    handle: Callable[[Request], Any]
    after: After
    timed: bool = True  # the handler's sends are bounded by the handshake timeout
    takes_fds: bool = False  # only a rejoin carries fds; any others are closed and the request refused


class Throttled:
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


@dataclass
class Limits:
    """How many connections may wait, in all and per uid (what the kernel says a peer is): no one
    identity can take every pending slot or every connection and lock the others out."""

    max_pending: int
    max_pending_per_uid: int
    max_connections_per_uid: int
    handshake_timeout: float = HANDSHAKE_TIMEOUT


def send_status_now(conn: socket.socket, document: dict[str, Any]) -> None:
    """The status reply, sent without waiting: the send buffer is made to hold the whole reply, so it
    goes out at once to a client that reads; `BlockingIOError` for one that left replies unread."""
    data = protocol.encode_message(document)
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


class Connections:
    """The accept, status and client threads of one listening socket."""

    def __init__(self, policy: SocketPolicy, limits: Limits, routes: dict[str, Route],
                 on_lease: dict[str, Callable[[Lease], bool]], status: Callable[[], dict[str, Any]],
                 end_lease: Callable[[Lease], None], closed: threading.Event, refusals: Throttled):
        """`routes`: the requests before a lease; `on_lease`: the messages on one, each answering
        whether the lease goes on; `status`: the status document; `end_lease`: a lease's connection
        is gone."""
        self.policy, self.limits, self.on_lease = policy, limits, on_lease
        # Status is the transport's own: it is also answered at accept, by the status thread.
        self.routes = {"status": Route(self._answer_status, After.ANSWERED, timed=False), **routes}
        self.status, self.end_lease, self.closed, self.refusals = status, end_lease, closed, refusals
        self._listener: socket.socket | None = None
        self._connections: Counter = Counter()  # uid -> its open connections (under _pending_lock)
        self._pending: dict[int, tuple[socket.socket, int]] = {}  # connection id -> (socket, uid), oldest first
        # Its own lock, not the lease book's: attaches hold that across a state-file write, and
        # the accept loop must never wait behind them.
        self._pending_lock = threading.Lock()
        # Accepted connections, (conn, key, pid, uid), on their way to a thread: see _accept_loop.
        self._status_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._client_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting_slots = threading.BoundedSemaphore(limits.max_pending)
        self._parse_gate = threading.BoundedSemaphore(PARSE_SLOTS)
        self._forbidden = Throttled()  # peers the socket policy refuses: one line a second at most
        # Connections refused at accept, by reason (the accept thread alone writes them); status and metrics show them.
        self.refused: Counter = Counter({"forbidden": 0, "too_many_connections": 0})

    def start(self, listener: socket.socket) -> None:
        self._listener = listener
        for target, name in ((self._accept_loop, "accept"), (self._status_loop, "status"),
                             (self._client_loop, "clients")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def stop(self) -> None:
        """The status and client threads end (the accept thread ends when the listener closes)."""
        self._status_queue.put(None)
        self._client_queue.put(None)

    # -- accepting -------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        ids = itertools.count()
        while not self.closed.is_set():
            if not self._waiting_slots.acquire(timeout=0.5):
                continue  # too many wait for a thread: leave the next in the backlog a while
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                self._waiting_slots.release()
                if self.closed.is_set():
                    return
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    log.warning("accept failed: %s; dropping the oldest pending connection", e.strerror)
                    self._drop_oldest_pending()
                else:
                    log.warning("accept failed: %s", e)
                time.sleep(0.05)
                continue
            pid, uid, gid = protocol.peer_credentials(conn)
            if not self._admit(conn, pid, uid, gid):
                self._waiting_slots.release()
                conn.close()
                continue
            client = (conn, next(ids), pid, uid)  # holds its waiting slot until it has a thread
            if protocol.waiting_status_request(conn):
                self._status_queue.put(client)
            else:
                self._client_queue.put(client)

    def _admit(self, conn: socket.socket, pid: int | None, uid: int, gid: int) -> bool:
        """Whether the socket policy and the uid's connection cap let this peer in (it is told if not)."""
        if not self.policy.allows(uid, gid, peer_groups(conn) if self.policy.gid is not None else ()):
            # Counted each, logged at most once a second: a flood of refused connects must not fill the disk.
            self.refused["forbidden"] += 1
            self._forbidden.warn(f"refused pid={pid} uid={uid} gid={gid}: not allowed on this socket (allowed: "
                                 f"{self.policy.describe()})")
            conn.setblocking(False)
            try_send(conn, protocol.error_message("forbidden", "this uid may not use the agent's socket"))
            return False
        cap = self.limits.max_connections_per_uid
        with self._pending_lock:
            crowded = self._connections[uid] >= cap
            if not crowded:
                self._connections[uid] += 1
        if crowded:
            self.refused["too_many_connections"] += 1
            self.refusals.warn(f"uid {uid} holds its cap of {cap} connections: refusing more")
            conn.setblocking(False)
            try_send(conn, protocol.error_message("too_many_connections",
                                                  f"this uid holds its cap of {cap} connections"))
            return False
        return True

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
                refuse_fds("status", fds)
                send_status_now(conn, self.status())
            except BlockingIOError:
                self.refusals.warn("a client left status replies unread: dropped")
            except ProtocolError as e:
                log.warning("client pid=%s dropped: %s", pid, e)
                try_send(conn, protocol.error_message("protocol", str(e)))
            except (OSError, EOFError) as e:
                log.warning("client pid=%s dropped: %s", pid, e)
            except Exception:
                log.exception("client pid=%s dropped after an internal error", pid)
            else:
                self._client_queue.put(client)
                continue
            self._close(conn, client[3])
            self._waiting_slots.release()

    # -- bounds ----------------------------------------------------------------------------------

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
                        self.limits.max_pending)
        else:
            self.refusals.warn(f"uid {uid} holds more than its {self.limits.max_pending_per_uid} connections "
                               "still in their first request: dropping the oldest of them")
        shutdown(conn)

    def _pend(self, key: int, conn: socket.socket, uid: int) -> None:
        """A connection in its first request, counted against the bounds (the oldest dropped past them)."""
        with self._pending_lock:
            self._pending[key] = (conn, uid)
            over = len(self._pending) > self.limits.max_pending
            own = sum(1 for _, u in self._pending.values() if u == uid) > self.limits.max_pending_per_uid
        if own:
            self._drop_oldest_pending(uid)
        elif over:
            self._drop_oldest_pending()

    def _done_pending(self, key: int) -> None:
        with self._pending_lock:
            self._pending.pop(key, None)

    # -- one client ------------------------------------------------------------------------------

    def _serve(self, conn: socket.socket, key: int, peer: int | None, uid: int) -> None:
        lease: Lease | None = None
        self._pend(key, conn, uid)
        timeout = self.limits.handshake_timeout
        try:
            lease = self._requests(conn, key, peer, uid)
            if lease is not None:
                self._lease_messages(conn, lease)
        except EOFError:
            pass
        except BlockingIOError:
            self.refusals.warn("a client left status replies unread: dropped")
        except socket.timeout:
            log.warning("client pid=%s dropped: no complete request within %.1fs", peer, timeout)
        except ProtocolError as e:
            log.warning("client pid=%s dropped: %s", peer, e)
            try_send(conn, protocol.error_message("protocol", str(e)))
        except OSError as e:
            log.warning("client pid=%s dropped: %s", peer, e.strerror or e)
        except (RecursionError, MemoryError) as e:
            log.warning("client pid=%s dropped: request too complex (%s)", peer, type(e).__name__)
        except Exception:
            log.exception("client pid=%s dropped after an internal error", peer)
        finally:
            self._done_pending(key)
            if lease is not None:
                self.end_lease(lease)
            self._close(conn, uid)

    def _requests(self, conn: socket.socket, key: int, peer: int | None, uid: int) -> Lease | None:
        """Requests before a lease, each under its own deadline: the lease one opened, or None."""
        timeout = self.limits.handshake_timeout
        deadline = time.monotonic() + timeout
        while True:
            message, fds = protocol.recv_message(conn, protocol.MAX_REQUEST_BYTES, max_fds=protocol.MAX_REQUEST_FDS,
                                                 deadline=deadline, max_items=protocol.MAX_REQUEST_ITEMS,
                                                 parse_gate=self._parse_gate)
            kind = message["type"]
            route = self.routes.get(kind)
            if route is None or not route.takes_fds:
                refuse_fds(kind, fds)
                fds = []
            if route is None:
                raise ProtocolError(f"unexpected message type {kind!r} before attach")
            if route.after is not After.ANSWERED:
                self._done_pending(key)
            if route.timed:
                conn.settimeout(timeout)
            result = route.handle(Request(conn, message, fds, peer, uid))
            if route.after is After.ANSWERED:
                deadline = time.monotonic() + timeout  # a new request, a new deadline
                continue
            return result if route.after is After.LEASE else None

    def _answer_status(self, request: Request) -> None:
        send_status_now(request.conn, self.status())

    def _lease_messages(self, conn: socket.socket, lease: Lease) -> None:
        """The connection is the lease now: read what the engine says on it until it detaches."""
        conn.settimeout(None)
        while True:
            message, _ = protocol.recv_message(conn, protocol.MAX_REQUEST_BYTES, max_items=protocol.MAX_REQUEST_ITEMS,
                                               parse_gate=self._parse_gate)
            handle = self.on_lease.get(message["type"])
            if handle is None:
                raise ProtocolError(f"unexpected message type {message['type']!r} on a lease")
            if not handle(lease):
                return
