"""Framing for the agent's Unix socket: versioned, length-prefixed JSON, fds alongside.

A frame is a 12-byte header -- magic `WCAP`, protocol version (u16), reserved (u16),
body length (u32), network order -- then a UTF-8 JSON object with a "type". Arena fds
ride on the header bytes as SCM_RIGHTS ancillary data, so they arrive with the first
`recvmsg` of the frame. Each side caps what it accepts: requests are small, a reply may
carry a large manifest. Anything else raises `ProtocolError` naming what was wrong.

A binary frame (magic `WCAB`, same header) carries bytes a JSON frame just before it announced.

Messages (client -> agent):
  {"type": "status"}                                   -> {"type": "status", ...}
  {"type": "attach", "pid", "role", "group", "pod", "identity_token"?, "request"} -> {"type": "manifest", ...}
      + fds, then the connection is the lease; the agent may later send {"type": "promote"} or
      {"type": "demote"}. role "auto": primary when the group has none, else standby. pod:
      {namespace, name, uid} or null. engine: null or an id naming the engine across its
      tensor-parallel ranks (the pod's uid is used instead when a pod is named). identity_token: the engine pod's projected service-account
      token (audience weightcache.io); an agent in a cluster takes the pod from it, not from "pod".
      With "manifest": "packed", the manifest's "tensors" is {"forms", "count", "packed": n} and its
      rows follow in a binary frame of n bytes (`packed_rows`); without, they are JSON columns.
      "names": "checkpoint" (default: q_proj, k_proj, ... each its own row) or "fused" (each
      group back to back in the arena as one row: qkv_proj, gate_up_proj); one arena serves both.
  {"type": "arena", "role"?, "group"?}                 -> {"type": "arena", "backend", "arenas"} + fds: the
      arena ahead of a lease, for an engine to map while it starts (`prepare`); each arena's "id"
      (also in every manifest) tells its attach whether that mapping is of the same arena. Admitted
      as an attach is (socket policy, group owner, the uid's lease cap, which a hand-out counts
      against until that pid attaches or a minute passes). An agent still loading answers
      {"type": "error", "code": "not_ready"}; one replacing a changed arena waits for the new one.
  {"type": "verify"}                                   -> {"type": "verified", "ok", "seconds", "bytes",
      "integrity"}: the arena checked against its keyed digest now (privileged peers only).
  {"type": "detach"}                                   -> the lease ends cleanly
  {"type": "promoted"}                                 on a lease: the answer to "promote", sent once
      the engine serves as primary; until then the agent reports the lease as "promoting".
  {"type": "switchover", "group", "to_pod" | "to_pid"} -> {"type": "switched", ...}: a planned handover
      (privileged peers only): that standby is promoted and the group's primary demoted in one
      step; they get {"type": "promote"} and {"type": "demote"} on their leases. With neither
      to_pod nor to_pid, the primary is only demoted (another agent's engine took over). "to_engine"
      names the standby by its engine key (what group promotion across ranks sends).
  {"type": "group_claim", "group", "engine"} -> {"type": "group_role", "role"};
  {"type": "group_lost", "group", "engine"}  -> {"type": "group_promoted", "engine"}: one rank's agent
      asks rank 0's agent of its tensor-parallel replica (privileged peers only) to decide an auto
      role, or to promote the group's next engine on every rank (serve/rank_group.py).
  {"type": "rejoin", "role", "group", "pod", "token", "fields", "fingerprint", "layout_hash", "arenas"} + fds
      -> {"type": "rejoined", "adopted": bool, "rejoin_token"}: an engine that outlived its agent
      reconnects and offers the arena it still maps; a restarted agent adopts it instead of reading
      the disk -- only when `token` is the `rejoin_token` its predecessor gave this engine (each is
      used once; the reply carries the next) and the arena digests to what the predecessor recorded.
Errors: {"type": "error", "code": str, "message": str, ...}.
An attach's request may carry "sharding_identity" (the plan identity of an engine's own rules
file): the agent compares identities and never opens a path a client names. A "pid" in a
request is informational; the agent takes the peer's pid from the kernel.

The agent reads a request under one deadline for the whole frame and accepts fds only on
its first bytes (`MAX_REQUEST_FDS`); deep nesting and over-long integers are protocol errors.

`connect` and `agent_status` are the smallest client: the status request that the CLI,
the node supervisor and the engine all make, with nothing of attach behind it. `connect`
checks who serves the socket before a byte is sent: the kernel's credentials of the
listening process (SO_PEERCRED) must be root's or the trusted agent uid's
(`$WEIGHTCACHE_AGENT_UID`, else the client's own): an agent someone else runs in a
directory renamed into the path is refused.
"""
from __future__ import annotations

import array
import json
import os
import socket
import struct
import time
from typing import Any

from .errors import AgentUnavailable, ProtocolError, UntrustedAgent, WeightCacheError

MAGIC = b"WCAP"
PAYLOAD_MAGIC = b"WCAB"  # a binary frame: the bytes a JSON frame before it announced
PROTOCOL_VERSION = 2  # 2: manifest forms table, file signature in attach requests
HEADER = struct.Struct("!4sHHI")
MAX_REQUEST_BYTES = 1 << 20  # what the agent accepts from a client
MAX_REPLY_BYTES = 256 << 20  # what a client accepts from the agent (manifests of 100k+ tensors)
MAX_FDS = 64  # what a client accepts with a manifest
# What the agent accepts with a request: only a `rejoin` carries fds (one per arena), and
# only on the first segment of its frame; anything more is closed by the kernel or by us.
MAX_REQUEST_FDS = 4
ENV_AGENT_UID = "WEIGHTCACHE_AGENT_UID"  # the uid a client trusts to serve the socket, besides root
MAX_JSON_DEPTH = 32  # far deeper than any message of ours nests
# What one request may build, counted before it is parsed: every '{', '[' and ',' of the body
# (each at most one container or one element). A real request has a few dozen; a 1 MiB body of
# `[{},{},...]` has 350 000 and would build ~50 MB of objects. Brackets and commas inside strings
# count too: the count is an upper bound, cheap because it runs at C speed over the bytes.
MAX_REQUEST_ITEMS = 4096


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = (),
                 encoded: dict[str, bytes] | None = None, payload: bytes | None = None) -> None:
    """Send one frame. `encoded` adds members already serialised to JSON (a cached manifest);
    `payload` follows as a binary frame (see `recv_payload`), in the same system call."""
    data = encode_message(message, encoded, payload)
    sent = socket.send_fds(sock, [data], list(fds)) if fds else 0  # fds ride on the first bytes
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def encode_message(message: dict[str, Any], encoded: dict[str, bytes] | None = None,
                   payload: bytes | None = None) -> bytes:
    """One frame's bytes (and the binary frame of `payload` after it), as `send_message` sends them."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if encoded:
        body = body[:-1] + b"".join(b',"%s":%s' % (key.encode(), value) for key, value in encoded.items()) + b"}"
    parts = [HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(body)), body]
    if payload is not None:
        parts += [HEADER.pack(PAYLOAD_MAGIC, PROTOCOL_VERSION, 0, len(payload)), payload]
    return b"".join(parts)


def recv_payload(sock: socket.socket, length: int, deadline: float | None = None) -> bytearray:
    """The binary frame of `length` bytes that a message announced (a manifest's packed rows)."""
    header = _recv_exact(sock, HEADER.size, deadline)
    magic, version, _reserved, announced = HEADER.unpack(header)
    if magic != PAYLOAD_MAGIC or version != PROTOCOL_VERSION or announced != length:
        raise ProtocolError(f"expected a binary frame of {length} bytes, got magic {bytes(magic)!r} version {version} "
                            f"length {announced}")
    return _recv_exact(sock, length, deadline)


def recv_message(sock: socket.socket, max_bytes: int, max_fds: int = 0, deadline: float | None = None,
                 max_depth: int | None = MAX_JSON_DEPTH, max_items: int | None = None,
                 parse_gate: Any = None) -> tuple[dict[str, Any], list[int]]:
    """Read one frame. Returns (message, fds); the caller owns the fds.

    fds are taken only with the first bytes of a frame: a peer that attaches more to later
    segments gets a `ProtocolError` and every fd it sent is closed. `deadline` (a
    `time.monotonic()` value) bounds the whole frame, however slowly its bytes arrive;
    past it, `socket.timeout` is raised. `max_depth`, `max_items`: see `parse_json`.
    `parse_gate` (a semaphore, or anything usable in `with`) is held while the body is parsed:
    the agent bounds how many frames build their objects at once.
    """
    header = bytearray()
    fds: list[int] = []
    try:
        while len(header) < HEADER.size:
            _arm(sock, deadline)
            data, new_fds = _recv_with_fds(sock, HEADER.size - len(header), max_fds if not header else 0)
            fds += new_fds
            if not data:
                if header:
                    raise ProtocolError(f"connection closed inside a frame header ({len(header)} of {HEADER.size} bytes)")
                raise EOFError("peer closed the connection")
            header += data
        magic, version, _reserved, length = HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r}: not a weightcache frame (expected {MAGIC!r})")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})")
        if length > max_bytes:
            raise ProtocolError(f"frame of {length} bytes exceeds the cap of {max_bytes} bytes")
        body = _recv_exact(sock, length, deadline)
        if parse_gate is None:
            message = decode_body(body, max_depth, max_items)
        else:
            with parse_gate:
                message = decode_body(body, max_depth, max_items)
        return message, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def parse_json(body: bytes, max_depth: int | None = MAX_JSON_DEPTH, max_items: int | None = None) -> Any:
    """JSON from a peer, or `ValueError` with one line saying why not ("is not valid JSON: ...").

    Nesting deeper than `max_depth` and integers too long to convert are refused like any
    other malformed body, so that no peer can turn a request into a traceback. The depth is
    ours, not the parser's: how deep `json` goes before giving up differs between interpreter
    versions (3.11 stops near 1000 levels, 3.12 goes past 5000). None skips the check, for a
    manifest from the agent: walking its thousands of rows would cost every attach a
    millisecond, and a client trusts the agent with its weights anyway.

    `max_items` bounds what the parse may build, checked before anything is built: the body's
    '{', '[' and ',' bytes counted together (an upper bound on its containers and elements).
    """
    if max_items is not None:
        items = body.count(b"{") + body.count(b"[") + body.count(b",")
        if items > max_items:
            raise ValueError(f"has too many elements ({items} brackets and commas; at most {max_items})")
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("nests too deeply") from None
    except ValueError as e:  # integers beyond the interpreter's digit limit
        raise ValueError(f"is not acceptable JSON: {str(e).splitlines()[0][:120]}") from None
    # Fewer brackets than the limit cannot nest past it: the walk runs only for bodies with many.
    if max_depth is not None and body.count(b"[") + body.count(b"{") > max_depth \
            and _nesting(value, max_depth) > max_depth:
        raise ValueError(f"nests too deeply (more than {max_depth} levels)")
    return value


def _nesting(value: Any, limit: int) -> int:
    """How deep lists and objects nest in `value`, counted up to just past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= limit:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def decode_body(body: bytes, max_depth: int | None = MAX_JSON_DEPTH,
                max_items: int | None = None) -> dict[str, Any]:
    """A frame body as a JSON object with a string "type", or `ProtocolError` saying why not."""
    try:
        message = parse_json(body, max_depth, max_items)
    except ValueError as e:
        raise ProtocolError(f"frame body {e}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("frame body is not a JSON object with a string 'type'")
    return message


def _arm(sock: socket.socket, deadline: float | None) -> None:
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("request deadline passed")
    sock.settimeout(left)


def _recv_with_fds(sock: socket.socket, nbytes: int, max_fds: int) -> tuple[bytes, list[int]]:
    if max_fds == 0:
        # Still read ancillary space so fds a peer pushes at us are received and closed, not leaked.
        max_fds = 1
        want = False
    else:
        want = True
    fds = array.array("i")
    data, ancdata, flags, _addr = sock.recvmsg(nbytes, socket.CMSG_SPACE(max_fds * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    received = list(fds)
    if flags & socket.MSG_CTRUNC or not want:
        for fd in received:
            os.close(fd)
        if received or flags & socket.MSG_CTRUNC:
            raise ProtocolError("peer sent file descriptors that were not asked for")
        return data, []
    return data, received


def _recv_exact(sock: socket.socket, length: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(length)
    view = memoryview(buf)
    got = 0
    space = socket.CMSG_SPACE(struct.calcsize("i"))
    while got < length:
        _arm(sock, deadline)
        # recvmsg_into, not recv_into: fds riding on body bytes must be seen to be closed.
        n, ancdata, flags, _addr = sock.recvmsg_into([view[got:]], space)
        if ancdata or flags & socket.MSG_CTRUNC:
            _close_ancillary(ancdata)
            raise ProtocolError("peer sent file descriptors inside a frame body")
        if n == 0:
            raise ProtocolError(f"connection closed inside a frame body ({got} of {length} bytes)")
        got += n
    return buf


_STATUS_PEEK = HEADER.size + 64  # {"type":"status"} with room to spare


def waiting_status_request(sock: socket.socket) -> bool:
    """Whether the whole first frame already waiting on `sock` is a status request; reads
    nothing and never blocks (a peek), so a caller may route the connection by it."""
    try:
        data = sock.recv(_STATUS_PEEK, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False
    if len(data) < HEADER.size:
        return False
    magic, version, _reserved, length = HEADER.unpack_from(data)
    if magic != MAGIC or version != PROTOCOL_VERSION or len(data) < HEADER.size + length:
        return False
    try:
        return decode_body(data[HEADER.size:HEADER.size + length])["type"] == "status"
    except ProtocolError:
        return False


def _close_ancillary(ancdata: list[tuple[int, int, bytes]]) -> None:
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    for fd in fds:
        os.close(fd)


def error_message(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message, **extra}


def peer_credentials(sock: socket.socket) -> tuple[int | None, int | None, int | None]:
    """(pid, uid, gid) of the peer as the kernel saw them at connect time; pid None when it
    lives in a PID namespace we cannot see, all None when the kernel will not say."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None, None, None
    pid, uid, gid = struct.unpack("3i", creds)
    return pid or None, uid, gid


def peer_pid(sock: socket.socket) -> int | None:
    return peer_credentials(sock)[0]


def trusted_agent_uids(agent_uid: int | None = None) -> tuple[int, ...]:
    """Who may serve an agent socket to this process: root, and `agent_uid`, else
    `$WEIGHTCACHE_AGENT_UID`, else this process's own uid."""
    if agent_uid is None:
        raw = os.environ.get(ENV_AGENT_UID, "").strip()
        if raw:
            if not raw.isdigit():
                raise ValueError(f"${ENV_AGENT_UID}={raw!r} is not a uid: set it to the number the agent runs as")
            agent_uid = int(raw)
        else:
            agent_uid = os.geteuid()
    return (0, agent_uid)


def connect(path: str, agent_uid: int | None = None) -> socket.socket:
    """A connection to the agent at `path`, or `AgentUnavailable` saying why not; `UntrustedAgent`
    when the process serving it runs as a uid other than root or the trusted one
    (`trusted_agent_uids`)."""
    trusted = trusted_agent_uids(agent_uid)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        conn.connect(path)
    except OSError as e:
        conn.close()
        raise AgentUnavailable(f"no agent answers at {path}: {e.strerror or e}") from None
    pid, uid, _gid = peer_credentials(conn)
    if uid not in trusted:
        conn.close()
        raise UntrustedAgent(f"refusing the agent at {path}: it runs as uid {uid} (pid {pid}), and only "
                             f"{' or '.join(f'uid {u}' for u in sorted(set(trusted)))} may serve weights to this "
                             f"process; set ${ENV_AGENT_UID} if the agent runs as another uid")
    return conn


def raise_on_error(reply: dict[str, Any], where: object) -> None:
    if reply.get("type") == "error":
        raise (AgentUnavailable if reply.get("code") == "load_failed" else WeightCacheError)(
            f"agent at {where}: {reply.get('message')}")


def agent_status(path: str, timeout: float = 10.0) -> dict[str, Any]:
    """The agent's status document (phase, fingerprint, bytes, tensors, clients, ...)."""
    return agent_request(path, {"type": "status"}, timeout)


def agent_request(path: str, message: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """One request without fds on a fresh connection, and its reply; an error reply raised."""
    conn = connect(path)
    try:
        conn.settimeout(timeout)
        send_message(conn, message)
        reply, _ = recv_message(conn, MAX_REPLY_BYTES)
        raise_on_error(reply, path)
        return reply
    except OSError as e:
        raise AgentUnavailable(f"agent at {path} stopped answering: {e}") from None
    finally:
        conn.close()
