"""The agent's socket as a path on disk, and the few things every part does to a connection.

A path is claimed with a lock file beside it (`claim_path`): two agents on one path are
impossible, a stale socket from a dead agent is replaced, a live one never. The supervisor
and tests clean up after a killed agent with `remove_socket_files`, under the same rules.
The connection helpers (`shutdown`, `try_send`, `refuse_fds`) are shared by the transport
(serve/connections.py), the handlers and promotion, none of which owns the others.
"""
from __future__ import annotations

import fcntl
import os
import socket
from typing import Any

from .. import protocol
from ..errors import ProtocolError, WeightCacheError
from .access import AccessError, SocketPolicy, check_not_a_file, check_socket_path, prepare_dir
from .sidecar import sidecar_path


def claim_path(socket_path: str, policy: SocketPolicy) -> int:
    """The lock file's fd, held for as long as this agent serves `socket_path`; a stale socket is gone.

    `AccessError` (one line) when path, directory or lock file say no; `WeightCacheError` when
    another agent serves the path.
    """
    check_socket_path(socket_path)
    check_not_a_file(socket_path)
    prepare_dir(os.path.dirname(socket_path), policy)
    lock_path = sidecar_path(socket_path, "lock")
    try:
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise AccessError(f"cannot open lock file {lock_path}: {e.strerror or e}") from None
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise WeightCacheError(f"another agent is already serving {socket_path}") from None
    if os.path.lexists(socket_path):
        # We hold the lock, so its agent should be gone -- unless the lock file was removed
        # under a live agent: a socket that still answers is never taken over.
        if answers(socket_path):
            os.close(lock_fd)
            raise WeightCacheError(f"another agent is already serving {socket_path}")
        os.unlink(socket_path)
    return lock_fd


def answers(path: str) -> bool:
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
        if os.path.lexists(socket_path) and answers(socket_path):
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


def refuse_fds(kind: str, fds: list[int]) -> None:
    """Only a rejoin carries fds: any sent with another request are closed, and it is refused."""
    for fd in fds:
        os.close(fd)
    if fds:
        raise ProtocolError(f"file descriptors sent with a {kind!r} message")


def try_send(conn: socket.socket, message: dict[str, Any]) -> None:
    """A last word to a client being dropped: if it is not listening, nothing is lost."""
    try:
        protocol.send_message(conn, message)
    except OSError:
        pass


def shutdown(conn: socket.socket) -> None:
    """End a connection from any thread: its own thread's read returns, and it cleans up."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
