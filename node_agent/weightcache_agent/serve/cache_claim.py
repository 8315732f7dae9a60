"""Which cache a node agent's socket directory belongs to, recorded in the directory itself.

On Kubernetes every WeightCache gets a socket directory of its own, named from a hash of its
namespace and name. Were two caches ever to map to one directory, both DaemonSets would mount
the same host path and the engines of one would attach to whichever agent held the socket. So
the operator tells each agent which cache it serves (``--cache NAMESPACE/NAME[/UID]``), the
first agent records that in the directory (``.weightcache-cache``, ``0600``), and an agent of
any other cache that finds the record there refuses to serve, naming both. A cache deleted and
created again under the same name (a new uid) takes its directory back: only one object can
have that namespace and name at a time.
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
from dataclasses import dataclass

from .access import AccessError

log = logging.getLogger(__name__)

CLAIM_FILE = ".weightcache-cache"
CLAIM_MODE = 0o600
MAX_CLAIM_BYTES = 4096
# Kubernetes' own bounds: a namespace is a DNS label (63), a name a DNS subdomain (253), a uid 36.
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_UID = re.compile(r"^[A-Za-z0-9-]{1,64}$")


@dataclass(frozen=True)
class CacheIdentity:
    namespace: str
    name: str
    uid: str | None = None

    @classmethod
    def parse(cls, value: str) -> "CacheIdentity":
        """``NAMESPACE/NAME`` or ``NAMESPACE/NAME/UID``; ValueError naming what is wrong."""
        parts = value.split("/")
        if len(parts) not in (2, 3):
            raise ValueError(f"--cache {value!r} must be NAMESPACE/NAME or NAMESPACE/NAME/UID")
        namespace, name = parts[0], parts[1]
        uid = parts[2] if len(parts) == 3 else None
        if not _NAMESPACE.match(namespace):
            raise ValueError(f"--cache {value!r}: {namespace!r} is not a Kubernetes namespace name")
        if not _NAME.match(name):
            raise ValueError(f"--cache {value!r}: {name!r} is not a Kubernetes object name")
        if uid is not None and not _UID.match(uid):
            raise ValueError(f"--cache {value!r}: {uid!r} is not an object uid")
        return cls(namespace, name, uid)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" + (f" (uid {self.uid})" if self.uid else "")

    def record(self) -> bytes:
        return json.dumps({"namespace": self.namespace, "name": self.name, "uid": self.uid},
                          sort_keys=True).encode() + b"\n"


def _read_claim(path: str) -> CacheIdentity:
    """The identity recorded at `path`: a regular file of ours that nobody else may write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise AccessError(f"cannot read the cache record {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            raise AccessError(f"the cache record {path} is not a regular file of root's or the agent's that only "
                              "they may write: refusing the socket directory")
        raw = os.read(fd, MAX_CLAIM_BYTES + 1)
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw) if len(raw) <= MAX_CLAIM_BYTES else None
        return CacheIdentity(str(doc["namespace"]), str(doc["name"]), doc.get("uid"))
    except (ValueError, TypeError, KeyError):
        raise AccessError(f"the cache record {path} is not one an agent wrote: refusing the socket directory; "
                          "remove it if no agent of another cache uses this directory") from None


def _write_tmp(path: str, identity: CacheIdentity) -> str:
    """The record written whole to a new file beside `path`; that file's name."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp)  # a leftover of a killed agent of this pid, or a planted link (removed, never followed)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, CLAIM_MODE)
    try:
        os.write(fd, identity.record())
    finally:
        os.close(fd)
    return tmp


def _write_new(path: str, identity: CacheIdentity) -> bool:
    """Create the record at `path` only if none is there (link of a finished file: never half-written)."""
    tmp = _write_tmp(path, identity)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def claim_socket_dir(directory: str, identity: CacheIdentity) -> None:
    """Record that `directory` serves `identity`, or raise AccessError if another cache's agent has.

    Called once the directory has passed `prepare_dir` (root's or the agent's, not writable by
    others), before any worker binds a socket there."""
    path = os.path.join(directory, CLAIM_FILE)
    try:
        if _write_new(path, identity):
            log.info("socket directory %s claimed for WeightCache %s", directory, identity)
            return
    except OSError as e:
        raise AccessError(f"cannot record the cache in {path}: {e.strerror or e}") from None
    recorded = _read_claim(path)
    if (recorded.namespace, recorded.name) != (identity.namespace, identity.name):
        raise AccessError(
            f"socket directory {directory} belongs to WeightCache {recorded}, not {identity}: two caches map to "
            "one directory, and serving here would hand one cache's engines the other's weights; refusing to serve")
    if recorded.uid != identity.uid:
        # The same namespace and name, a new object: the cache was deleted and created again.
        try:
            os.replace(_write_tmp(path, identity), path)
        except OSError as e:
            raise AccessError(f"cannot record the cache in {path}: {e.strerror or e}") from None
        log.info("socket directory %s: WeightCache %s/%s was created again (uid %s, was %s)", directory,
                 identity.namespace, identity.name, identity.uid, recorded.uid)
