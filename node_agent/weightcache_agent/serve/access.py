"""Who may reach an agent's socket, and the files beside it that only the agent may touch.

The socket is the trust boundary: whoever can connect can attach, and an attached engine
maps the weights. So the agent decides that itself instead of inheriting it from a umask:

- the socket directory is created 0750 (group: the socket group), any missing directory
  above it 0755 (whatever the umask), and the path is refused when someone other than root
  or the agent could rename or delete an entry in the socket directory or in any directory
  above it (as named and as resolved): that keeps the lock file and the state file beside
  the socket out of clients' reach, and stops anyone from renaming a directory of their own
  into the path, with an agent of their own behind it;
- the socket is bound under a umask that leaves it 0660, then set to exactly that, with the
  socket group as its group;
- every accepted peer's credentials (SO_PEERCRED, SO_PEERGROUPS) are checked again against
  the same policy: root, the agent's own uid, or a member of the socket group;
- the state file is written with `O_NOFOLLOW | O_EXCL`, 0600, and renamed into place
  (atomic against a crash of the agent, which is all it must survive: the arenas it
  describes die with the machine, so it is not fsynced), and read back only when it is a regular file the agent owns that nobody else can
  read or write.

`SocketPolicy.from_group` resolves the configured group (a name or a number); None means
no group: only root and the agent's uid may connect.
"""
from __future__ import annotations

import errno
import grp
import json
import logging
import os
import re
import socket
import stat
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import WeightCacheError
from ..path_owners import first_unsafe_directory

SOCKET_MODE = 0o660
DIR_MODE = 0o750
PARENT_MODE = 0o755
STATE_MODE = 0o600
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the terminating NUL
MAX_STATE_BYTES = 1 << 20

log = logging.getLogger(__name__)
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+


class AccessError(WeightCacheError):
    """The socket cannot be served safely: path, directory or group is not acceptable."""


@dataclass(frozen=True)
class SocketPolicy:
    """Root, the agent's own uid, and (when set) members of `gid` may connect."""

    gid: int | None = None

    @classmethod
    def from_group(cls, group: str | int | None) -> "SocketPolicy":
        if group is None or group == "":
            return cls(None)
        if isinstance(group, int) or str(group).isdigit():
            return cls(int(group))
        try:
            return cls(grp.getgrnam(str(group)).gr_gid)
        except KeyError:
            raise AccessError(f"socket group {group!r} does not exist on this host") from None

    def allows(self, uid: int, gid: int, groups: tuple[int, ...] = ()) -> bool:
        if uid in (0, os.geteuid()):
            return True
        return self.gid is not None and (gid == self.gid or self.gid in groups)

    def describe(self) -> str:
        return f"root, uid {os.geteuid()}" + (f" and group {self.gid}" if self.gid is not None else "")


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary groups as the kernel recorded them at connect time (empty if unknown)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 256)
    except OSError:
        return ()
    return struct.unpack(f"{len(raw) // 4}i", raw[: len(raw) - len(raw) % 4])


def check_socket_path(path: str) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise AccessError(f"socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow at most "
                          f"{MAX_SOCKET_PATH}: use a shorter --socket or --socket-dir")


def prepare_dir(directory: str, policy: SocketPolicy) -> None:
    """Create `directory` 0750 (group: the socket group) if missing; refuse one others could tamper with."""
    parent = os.path.dirname(directory.rstrip("/")) or "/"
    try:
        if not os.path.isdir(directory):
            if os.path.lexists(directory):
                raise AccessError(f"cannot create socket directory {directory}: a file is in the way; choose a "
                                  "socket path in a directory (or remove the file)")
            blocker = _file_in_the_way(parent)
            if blocker is not None:
                raise AccessError(f"cannot create socket directory {directory}: {blocker} is not a directory; choose "
                                  "a socket path in a directory")
            check_ancestors(parent)
            _make_dirs(directory)
            if policy.gid is not None:
                os.chown(directory, -1, policy.gid)
        check_ancestors(parent)
        st = os.stat(directory)
    except AccessError:
        raise
    except OSError as e:
        raise AccessError(f"cannot create socket directory {directory}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise AccessError(f"socket directory {directory} is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise AccessError(f"socket directory {directory} belongs to uid {st.st_uid}, who could replace the agent's "
                          "files: use a directory owned by root")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise AccessError(f"socket directory {directory} is writable by others (mode {stat.S_IMODE(st.st_mode):o}), "
                          "who could remove the agent's lock and state files: make it 0750")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise AccessError(f"socket directory {directory} is not writable by the agent")
    _narrow(directory, st, policy)


# What an agent keeps in its socket directory: sockets, their hidden lock/state/digest/record files
# and logs (all named after a `.sock`), and the record of which cache the directory serves.
_AGENT_FILES = re.compile(r"^(\.?[^/]*\.sock(\..*)?|\.weightcache-cache)$")


def _narrow(directory: str, st: os.stat_result, policy: SocketPolicy) -> None:
    """Make an existing socket directory 0750 (group: the socket group), as one the agent creates.

    The kubelet creates a hostPath `DirectoryOrCreate` 0755: every local user could then list the
    sockets and reach them (the socket's 0660 and the peer check still refuse them, but the
    directory should not be the weaker door). Changed only where the directory is the agent's
    own: not sticky (a shared directory like /tmp is left alone) and holding nothing but agent
    files; anywhere else the mode is left as it is and said once."""
    mode = stat.S_IMODE(st.st_mode)
    gid = policy.gid if policy.gid is not None else os.getegid()
    if (not mode & 0o007 and st.st_gid == gid) or mode & stat.S_ISVTX:
        return
    try:
        foreign = [n for n in os.listdir(directory) if not _AGENT_FILES.match(n)]
    except OSError:
        return
    if foreign:
        if mode & 0o007:
            log.warning("socket directory %s is mode %o and holds other files (%s): left as it is; every local user "
                        "may traverse it (the socket's own mode and peer check still refuse them)", directory, mode,
                        ", ".join(sorted(foreign)[:3]))
        return
    try:
        if st.st_gid != gid:
            os.chown(directory, -1, gid)
        os.chmod(directory, DIR_MODE)
    except OSError as e:
        raise AccessError(f"cannot make socket directory {directory} 0750: {e.strerror or e}") from None
    if mode != DIR_MODE:
        log.info("socket directory %s: mode %o -> %o (group %d)", directory, mode, DIR_MODE, gid)


def _make_dirs(directory: str) -> None:
    """`directory` 0750 and every missing one above it 0755, set explicitly: a umask of 000
    must not leave a directory on the socket's path writable by everyone."""
    missing = []
    path = os.path.abspath(directory)
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        try:
            os.mkdir(path, PARENT_MODE)
        except FileExistsError:
            if not os.path.isdir(path):
                raise
            continue  # made meanwhile by someone else: check_ancestors judges it
        os.chmod(path, DIR_MODE if path == missing[0] else PARENT_MODE)


def check_ancestors(directory: str) -> None:
    """Refuse when anyone but root or the agent could rename an entry of `directory` or of a
    directory above it, followed as named and as resolved: that person could move the socket
    directory aside and put one of their own in its place."""
    found = first_unsafe_directory(directory)
    if found is None:
        return
    path, st = found
    if st.st_uid not in (0, os.geteuid()):
        raise AccessError(f"{path}, on the socket's path, belongs to uid {st.st_uid}, who could rename the "
                          "socket directory and put another in its place: use a path owned by root")
    raise AccessError(f"{path}, on the socket's path, is writable by others (mode {stat.S_IMODE(st.st_mode):o}) "
                      "without the sticky bit: they could rename the socket directory and put another in its place; "
                      "make it 0755")


def _file_in_the_way(path: str) -> str | None:
    """The nearest existing ancestor of `path` (itself included) when it is not a directory."""
    while path and path != "/":
        if os.path.lexists(path):
            return None if os.path.isdir(path) else path
        path = os.path.dirname(path)
    return None


def check_socket_place(path: str) -> None:
    """Every check on a socket path that changes nothing on disk: length, what is there, what is above it."""
    check_socket_path(path)
    check_not_a_file(path)
    directory = os.path.dirname(path) or "."
    blocker = _file_in_the_way(directory)
    if blocker is not None:
        what = "a file is in the way" if blocker == directory else f"{blocker} is not a directory"
        raise AccessError(f"cannot create socket directory {directory}: {what}; choose a socket path in a directory")


def check_not_a_file(path: str) -> None:
    """Refuse a socket path where something other than a socket already is: never unlink a user's file."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there; a file above it is prepare_dir's to name
        return
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
        raise AccessError(f"socket path {path} is {kind}, not a socket: choose another --socket (or remove it)")


def bind_socket(path: str, policy: SocketPolicy, backlog: int = 128) -> socket.socket:
    """A listening Unix socket at `path`, 0660, group the socket group; never wider, not even briefly."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)  # the socket's mode comes from the umask at bind: 0600 until set below
    try:
        listener.bind(path)
    except OSError as e:
        listener.close()
        raise AccessError(f"cannot bind socket {path}: {e.strerror or e}") from None
    finally:
        os.umask(old)
    try:
        if policy.gid is not None:
            os.chown(path, -1, policy.gid)
        os.chmod(path, SOCKET_MODE)
    except OSError as e:
        listener.close()
        raise AccessError(f"cannot set the mode of socket {path}: {e.strerror or e}") from None
    listener.listen(backlog)
    return listener


def write_private(path: str, doc: Any) -> None:
    """Replace `path` atomically with JSON readable by the agent alone; links at the temporary name are not followed.

    Atomic for every reader and against the death of this process (write, then rename);
    not fsynced: what it records (leases on GPU or memfd memory, a plan of this boot's
    files) means nothing after the machine restarts, and an fsync would put a disk flush
    (about a millisecond) into every attach."""
    tmp = path + ".tmp"
    try:
        os.unlink(tmp)  # a leftover, or a link someone planted: unlink removes the link, never its target
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, STATE_MODE)
    try:
        data = json.dumps(doc, separators=(",", ":")).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


def _read_all(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_private(path: str, limit: int = MAX_STATE_BYTES) -> Any:
    """JSON from `path`, or None unless it is a regular file of ours, at most `limit` bytes, that nobody
    else can read or write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ELOOP):
            raise
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077
                or st.st_size > limit):
            return None
        raw = _read_all(fd, st.st_size)
    finally:
        os.close(fd)
    try:
        return json.loads(raw)
    except ValueError:
        return None
