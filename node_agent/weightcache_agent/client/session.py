"""The engine side: attach a meta-device module to cached weights, zero-copy.

`attach()` is the one call an engine makes. In `client` mode it connects to the agent,
sends its spec, its checkpoint's file signature and its role, walks the module while the
agent answers (`rebind.survey`), receives the manifest and the arena fd, maps the arena
read-only and binds the module's own parameters to one strided view per tensor
(`rebind.bind_manifest`).
The connection stays open as the lease; a background thread waits on it for a
`promote` or `demote` message (hot standby, planned switchover) or for the agent to go
away (the weights stay mapped, the engine keeps serving). In a pod that an EngineSet
runs, everything but the model and the spec comes from the environment the operator
injects: the socket of this rank's GPU (by UUID), the group, the role and the pod. `off` mode runs the agent's own loader in-process; `daemon`
mode starts an agent when none answers. Imports torch, never kopf or kubernetes.
"""
from __future__ import annotations

import errno
import logging
import os
import queue
import socket as socketlib
import stat
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from .. import protocol
from ..arena.cuda import CudaError
from ..errors import AgentUnavailable, AttachError, FingerprintMismatch, ProtocolError, UntrustedAgent, WeightCacheError
from ..load.fingerprint import differences, engine_request, model_name
from ..load.layout import check_names
from ..load.loader import load_cache
from ..packed_rows import PackedRows, columns_of
from ..path_owners import first_unsafe_directory
from . import early
from .env import (ENV_DEVICES, ENV_ENGINE, ENV_GROUP, ENV_POD, ENV_ROLE, ENV_SOCKET, ENV_SOCKET_DIR,  # noqa: F401 (re-exported)
                  identity_token_from_env, pod_from_env, socket_from_env)
from .materialize import Adjust, Materialize, Pending, bind as bind_adjusted
from .rebind import bind_manifest, survey
from .mapping import map_arena, map_arena_meanwhile, map_cpu, take as take_premapped  # noqa: F401 (map_arena re-exported)
from ..spec import CacheSpec

log = logging.getLogger(__name__)

MODES = ("client", "daemon", "off")
# What a manifest reply must carry, checked before any of it is used: garbage is a ProtocolError.
_MANIFEST_MEMBERS = (("fingerprint", str), ("fields", dict), ("bytes", int), ("layout_hash", str), ("role", str))


class _LeaseThreads:
    """One thread per attachment watches its lease. Starting a thread costs its starter 0.1-0.3 ms
    (it waits until the thread runs), so `prepare()` starts one that waits idle: an attach hands
    its watch to it, and that thread, before it watches, starts the next idle one. Each thread
    runs one watch and ends, so `Attachment.close` can join it. Without an idle thread (no
    `prepare()`, or a forked child, where it is gone) an attach starts its own."""

    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._idle: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self, watch: Callable[[], None]) -> threading.Thread:
        """A thread running `watch`."""
        with self._lock:
            idle, self._idle = self._idle, None
        if idle is not None and idle.is_alive():
            self._jobs.put(watch)
            return idle
        thread = threading.Thread(target=watch, name="weightcache-lease", daemon=True)
        thread.start()
        return thread

    def keep_one_idle(self) -> None:
        with self._lock:
            if self._idle is not None and self._idle.is_alive():
                return
            self._idle = threading.Thread(target=self._wait_for_watch, name="weightcache-lease", daemon=True)
            self._idle.start()

    def _wait_for_watch(self) -> None:
        watch = self._jobs.get()
        try:
            self.keep_one_idle()
        except RuntimeError:  # out of threads: the next attach starts its own, this watch still runs
            pass
        watch()


lease_threads = _LeaseThreads()


class Attachment:
    """What `attach` returns: where the weights came from, and the lease on them.

    While attached to an agent, a thread watches the connection. A `promote` message
    makes this engine its group's primary (and calls `on_promote`); a `demote` message (a
    planned switchover handed the role to another engine) makes it a standby again and
    calls `on_demote`, whose job is to stop taking new requests and finish the ones in flight. If the agent goes
    away, the weights stay mapped and the thread keeps knocking on the socket: a
    restarted agent gets a `rejoin` with this engine's arena fds, which it may adopt
    instead of reading the disk again.
    """

    computed: Sequence[str] = ()  # what attach's `materialize` filled instead of binding (see client.materialize)
    cast: Sequence[str] = ()  # small tensors cast to the model's dtype (cast_small=True), "name: from -> to"

    def __init__(self, *, source: str, fingerprint: str, fields: dict[str, Any], nbytes: int,
                 tensors: Mapping[str, torch.Tensor],
                 seconds: float, layout_hash: str, role: str = "primary", group: str | None = None,
                 conn: socketlib.socket | None = None, fds: list[int] | None = None, arenas: list[dict] | None = None,
                 on_promote: Callable[["Attachment"], None] | None = None,
                 on_demote: Callable[["Attachment"], None] | None = None, pod: dict[str, str] | None = None,
                 rejoin_token: str | None = None, phases: dict[str, float] | None = None, engine: str | None = None):
        self.source = source  # "agent" or "disk"
        # Why the weights came from disk although an agent was asked (attach with fallback=True); None otherwise.
        self.fallback_reason: str | None = None
        # Where `seconds` went (request, round trip, map, bind): what a first attach pays shows here.
        self.phases = phases or {}
        self.fingerprint = fingerprint
        self.fields = fields
        self.bytes = nbytes
        self.tensors = tensors
        self.seconds = seconds
        self.layout_hash = layout_hash
        self.role = role
        self.group = group
        self.agent_alive = conn is not None
        self.rejoins = 0
        self._conn = conn
        self._socket = conn.getpeername() if conn is not None else None
        self._fds = fds or []
        self._arenas = arenas or []
        self._on_promote = on_promote
        self._rejoin_token = rejoin_token  # proves to a restarted agent that this engine held a lease
        self._on_demote = on_demote
        self.pod = pod
        self.engine = engine
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        if conn is not None:
            self._watcher = lease_threads.start(self._watch)

    def __repr__(self) -> str:
        return (f"Attachment(source={self.source!r}, role={self.role!r}, tensors={len(self.tensors)}, "
                f"bytes={self.bytes}, seconds={self.seconds:.4f}, fingerprint={self.fingerprint[:12]!r})")

    def _watch(self) -> None:
        while not self._closed.is_set():
            conn = self._conn
            try:
                while True:
                    message, _ = protocol.recv_message(conn, protocol.MAX_REQUEST_BYTES)
                    if message["type"] == "promote":
                        self.role = "primary"
                        log.info("promoted to primary of group %s", message.get("group"))
                        if self._on_promote is not None:
                            self._on_promote(self)
                        # After the engine serves as primary: only now may traffic come.
                        protocol.send_message(conn, {"type": "promoted", "group": message.get("group")})
                    elif message["type"] == "demote":
                        self.role = "standby"
                        log.info("demoted to standby of group %s (planned switchover)", message.get("group"))
                        if self._on_demote is not None:
                            self._on_demote(self)
            except (EOFError, OSError, ProtocolError) as e:
                if self._closed.is_set():
                    return
                self.agent_alive = False
                log.warning("lost the agent connection (%s); weights stay mapped, waiting for an agent to rejoin", e)
            conn.close()
            if not self._rejoin():
                return

    def _rejoin(self) -> bool:
        """Reconnect to a (restarted) agent and offer it our arenas. False: stop trying."""
        delay = 0.005
        while not self._closed.wait(delay):
            delay = min(delay * 2, 0.05)  # connecting to an absent socket is cheap; a quick rejoin is not
            try:
                conn = protocol.connect(self._socket)
            except AgentUnavailable:
                continue
            try:
                conn.settimeout(30)
                identity = identity_token_from_env()
                protocol.send_message(conn, {"type": "rejoin", "pid": os.getpid(), "role": self.role, "group": self.group,
                                             "pod": self.pod, "engine": self.engine, "token": self._rejoin_token,
                                             **({"identity_token": identity} if identity else {}),
                                             "fields": self.fields, "fingerprint": self.fingerprint,
                                             "layout_hash": self.layout_hash, "arenas": self._arenas}, self._fds)
                reply, _ = protocol.recv_message(conn, protocol.MAX_REQUEST_BYTES)
            except (EOFError, OSError, ProtocolError, ValueError):
                conn.close()
                continue
            if reply["type"] != "rejoined":
                conn.close()
                log.warning("agent at %s refused our rejoin (%s); keeping the weights we have", self._socket,
                            reply.get("message"))
                return False
            conn.settimeout(None)
            self._conn, self.agent_alive, self.role = conn, True, reply.get("role", self.role)
            if isinstance(reply.get("rejoin_token"), str):  # the one just used is spent
                self._rejoin_token = reply["rejoin_token"]
            self.rejoins += 1
            log.info("rejoined the agent at %s as %s (arena adopted: %s)", self._socket, self.role, reply.get("adopted"))
            return True
        return False

    def close(self) -> None:
        """End the lease. Tensors already handed out stay valid while referenced."""
        if self._closed.is_set():
            return
        self._closed.set()
        conn = self._conn
        if conn is not None:
            try:
                protocol.send_message(conn, {"type": "detach"})
                conn.shutdown(socketlib.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        # The watcher holds this attachment, and so possibly the last reference to its weights:
        # let it finish here, not during interpreter shutdown, where freeing a CUDA mapping from
        # a daemon thread aborts the process.
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5)

    def __enter__(self) -> "Attachment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach(module: nn.Module, spec: CacheSpec, socket: str | None = None, mode: str = "client", fallback: bool = False,
           role: str | None = None, group: str | None = None, on_promote: Callable[[Attachment], None] | None = None,
           strict: bool = True, timeout: float = 600.0,
           on_demote: Callable[[Attachment], None] | None = None, copy_on_write: bool = False,
           materialize: Materialize | Callable[[nn.Module, Pending], None] | None = None,
           cast_small: bool = False, engine: str | None = None, names: str = "checkpoint") -> Attachment:
    """Rebind `module` (built on the meta device) to the weights `spec` names.

    Every parameter and buffer of `module` ends up a read-only view into the agent's
    arena, zero-copy; the module's own `Parameter` objects take the storage in place.
    Returns the `Attachment`: keep it referenced while the model serves (it is the lease).

    module: the model, built under `torch.device("meta")` with the checkpoint's tensor
        names and the cache's dtypes. Cache tensors it does not declare (an FP8 layer's
        `weight_scale_inv`) become buffers. Anything left on meta, or a shape or dtype
        that differs from the cache's, raises `AttachError` naming each tensor, and then
        nothing has been swapped.
    spec: what to attach (`CacheSpec`): model directory, parallelism and rank,
        quantization, dtype, sharding, revision. The agent must hold exactly this:
        otherwise `FingerprintMismatch` names every differing field.
    socket: the agent's Unix socket. Default `$WEIGHTCACHE_SOCKET`, else the socket of
        this rank's GPU, `$WEIGHTCACHE_SOCKET_DIR/<UUID>.sock` with the UUID the rank's
        entry of `$WEIGHTCACHE_DEVICES` (what the operator injects into engine pods).
    mode: "client" (default) attaches to a running agent; "daemon" starts one first if
        none answers (`weightcache agent` with this spec, logging to `<socket>.log`, left
        running); "off" loads from disk in-process with the agent's own loader (the
        same bytes, no sharing).
    fallback: when True, an agent that is missing, mismatched, silent, gone mid-answer or
        answering garbage means a disk load, with the reason logged as a warning, instead
        of an error. `Attachment.source` then says "disk".
    role: "primary" (serves), "standby" (attached and warm; promoted when the group's
        primary goes), or "auto" (primary when the group has none). Default
        `$WEIGHTCACHE_ROLE`, else "primary". A second primary in a group is refused.
    group: the hot-standby group this engine belongs to; standbys of a group take over
        from its primary. Default `$WEIGHTCACHE_GROUP`, else none (no failover).
    engine: names this engine across its tensor-parallel ranks, the same on every rank and unique
        among the engines of the node (default `$WEIGHTCACHE_ENGINE_ID`; ignored where the
        engine names its pod, whose uid is used): the ranks' agents then promote the same
        engine on every rank.
    on_promote: called as `on_promote(attachment)` on the lease's thread when the agent
        promotes this standby to primary, before the agent tells anyone it serves: start
        taking requests here. Keep it short and let nothing escape it: the agent waits
        for it to return.
    strict: when False, cache tensors that have nowhere to go in `module` are ignored
        instead of refused. Shape or dtype disagreements and tensors left on meta are
        refused either way.
    timeout: seconds to wait for the agent's answer (default 600: an attach waits for a
        load in progress) and, in "daemon" mode, for a started agent to answer.
    on_demote: called as `on_demote(attachment)` when a planned switchover hands this
        primary's role to another engine of its group: stop taking new requests and
        finish the ones in flight.
    copy_on_write: the weights are read-only: a write to one kills the process with a
        message naming the cause. True (cpu backend) maps them privately instead, for
        engines that change weights in place: each page written costs a private 4 KiB
        copy (up to the whole model's size again); untouched pages stay shared.
    materialize: fills what the cache does not hold (see `client.materialize`): with it,
        non-persistent buffers (rotary tables) are computed instead of refused, and a
        `Materialize` may also assemble declared places from cache tensors it claims. A
        missing persistent weight is still refused by name.
    cast_small: when True, 1-D tensors (biases, norms) that the model declares in another
        float dtype than the cache holds are cast (small copies; never a weight matrix).
        The attachment's `computed` and `cast` name what was filled and what was cast.
    names: "checkpoint" (default): `module` names q/k/v and gate/up apart, as the checkpoint
        does; "fused": as one `qkv_proj` / `gate_up_proj` (vLLM, SGLang). Views either way.

    Raises `AgentUnavailable`, `FingerprintMismatch`, `AttachError`, `ProtocolError` (all
    `WeightCacheError`), `TimeoutError`, or `ValueError` for a bad `mode`, a standby without a
    group, or a socket that neither the argument nor the environment gives.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "off":
        early.wait()  # the attach path warmed while the engine started: done before the timer matters
    check_names(names)
    adjust = Adjust.of(materialize, cast_small)
    attachment = _attach(module, spec, socket, mode, fallback, role, group, on_promote, strict, timeout, on_demote,
                         copy_on_write, adjust, engine or os.environ.get(ENV_ENGINE) or None, names)
    if adjust is not None:
        attachment.computed, attachment.cast = adjust.computed, adjust.cast
    return attachment


def _attach(module: nn.Module, spec: CacheSpec, socket: str | None, mode: str, fallback: bool, role: str | None,
            group: str | None, on_promote: Callable[[Attachment], None] | None, strict: bool, timeout: float,
            on_demote: Callable[[Attachment], None] | None, copy_on_write: bool, adjust: Adjust | None,
            engine: str | None = None, names: str = "checkpoint") -> Attachment:
    if mode == "off":
        return _attach_from_disk(module, spec, strict, copy_on_write, adjust, names)
    socket = socket or socket_from_env(spec.tp_rank)
    role = role or os.environ.get(ENV_ROLE) or "primary"
    group = group or os.environ.get(ENV_GROUP) or None
    if role == "standby" and group is None:
        raise ValueError(f"role 'standby' needs a group (argument or ${ENV_GROUP}): a standby takes over only from "
                         "the primary of its group")
    try:
        if mode == "daemon":
            conn = _connect_or_start(socket, spec, timeout)
        else:
            conn = protocol.connect(socket)
        return _attach_over(conn, module, spec, role, group, on_promote, strict, timeout, on_demote, copy_on_write,
                            adjust, engine, names)
    except (AgentUnavailable, FingerprintMismatch, ProtocolError, TimeoutError, EOFError, ConnectionError) as e:
        if not fallback:
            raise
        reason = f"{type(e).__name__}: {e or 'no detail'}"
        # A miss costs a full disk load: say so where engines' logs are read, not only on a terminal.
        log.warning("cache miss for %s: attach through %s failed (%s); loading from disk instead (fallback=True)",
                    model_name(spec.model), socket, reason)
        att = _attach_from_disk(module, spec, strict, copy_on_write, adjust, names)
        att.fallback_reason = reason
        return att


def _connect_or_start(path: str, spec: CacheSpec, timeout: float) -> socketlib.socket:
    """Connect to the agent at `path`, starting one first when nothing listens there.

    A listener of an untrusted uid is refused at once, by name (`UntrustedAgent`): starting an
    agent of our own would only see the path taken and exit, and the engine would wait out its
    whole timeout. The agent's log, `<socket>.log`, is opened only once the directory has passed
    the agent's own checks, with O_NOFOLLOW, and must be a plain file of ours: in a directory
    others may write, a link or a hard link planted there would have this process (often root)
    append to a file of someone else's choosing."""
    try:
        return protocol.connect(path)
    except UntrustedAgent:
        raise
    except AgentUnavailable:
        pass
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _check_daemon_dir(directory)
    log_path = path + ".log"
    log_fd = _open_daemon_log(log_path)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightcache_agent", "agent", *spec.agent_args(), "--socket", path, "--progress", "never"],
            stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, start_new_session=True,
        )
    finally:
        os.close(log_fd)
    log.info("started agent pid=%d for %s (log: %s)", proc.pid, path, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return protocol.connect(path)
        except UntrustedAgent:
            raise  # someone else's listener holds the path: our agent will never get it
        except AgentUnavailable:
            code = proc.poll()
            if code not in (None, 3):  # 3: another agent won the race to this socket; wait for it
                raise AgentUnavailable(f"agent for {path} exited with status {code}: {_tail(log_path)}") from None
            time.sleep(0.02)
    raise AgentUnavailable(f"agent for {path} did not answer within {timeout:.0f}s (log: {log_path})")


def _check_daemon_dir(directory: str) -> None:
    """The agent's own rule for its socket's place (`path_owners`), checked before anything is
    opened there: the directory and every one above it belong to root or this uid and nobody else
    may rename entries in them (others' write access only with the sticky bit)."""
    found = first_unsafe_directory(directory)
    if found is not None:
        path, st = found
        raise AgentUnavailable(f"not starting an agent for a socket in {directory}: {path} belongs to uid "
                               f"{st.st_uid} (mode {stat.S_IMODE(st.st_mode):o}), who could put files or an "
                               "agent of their own in its place; use a directory owned by root or this uid")


def _open_daemon_log(log_path: str) -> int:
    """`<socket>.log` for appending, refused unless it is (or is created as) a regular file of ours
    with one link: never through a symlink, never another file hard-linked into the directory."""
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600)
    except OSError as e:
        # The kernel may answer a planted link with EACCES (protected_regular) before ELOOP: name it either way.
        why = "it is a symbolic link" if e.errno == errno.ELOOP or os.path.islink(log_path) else (e.strerror or str(e))
        raise AgentUnavailable(f"not starting an agent: cannot open its log {log_path}: {why}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise AgentUnavailable(f"not starting an agent: its log {log_path} is not a plain file of uid {os.geteuid()} "
                               f"(owner uid {st.st_uid}, {st.st_nlink} links): someone else put it there")
    os.set_blocking(fd, True)
    return fd


def _attach_over(conn: socketlib.socket, module: nn.Module, spec: CacheSpec, role: str, group: str | None,
                 on_promote: Callable[[Attachment], None] | None, strict: bool, timeout: float,
                 on_demote: Callable[[Attachment], None] | None = None, copy_on_write: bool = False,
                 adjust: Adjust | None = None, engine: str | None = None, names: str = "checkpoint") -> Attachment:
    started = time.perf_counter()
    fds: list[int] = []
    pod = pod_from_env()
    phases: dict[str, float] = {}
    try:
        conn.settimeout(timeout)
        request = engine_request(spec)
        phases["request"] = time.perf_counter() - started
        _send_attach(conn, role, group, pod, request, engine, names)
        # The module as the bind will find it, walked while the agent prepares its answer.
        surveyed = survey(module) if adjust is None else None
        reply, fds = _manifest_reply(conn)
        if reply.get("type") == "error" and reply.get("code") == "revision_required":
            # Our files are not the very ones the agent read (a copy, another mount): compare content.
            path = conn.getpeername()
            conn.close()
            conn = protocol.connect(path)
            conn.settimeout(timeout)
            _send_attach(conn, role, group, pod, engine_request(spec, with_revision=True), engine, names)
            reply, fds = _manifest_reply(conn)
        if reply.get("type") == "error" and reply.get("code") == "fingerprint_mismatch":
            raise FingerprintMismatch(differences(reply.get("fields") or {}, reply.get("engine_fields") or {}),
                                      model=model_name(spec.model), held=reply)
        protocol.raise_on_error(reply, conn.getpeername())
        arenas = reply.get("arenas")
        if reply["type"] != "manifest" or not isinstance(arenas, list) or len(fds) != len(arenas) or not all(
                isinstance(reply.get(key), kind) for key, kind in _MANIFEST_MEMBERS):
            raise ProtocolError(f"expected a manifest with one fd per arena, got {str(reply['type'])[:40]!r} with "
                                f"{len(fds)} fd(s)")
        phases["round trip"] = time.perf_counter() - started - phases["request"]
        premapped = take_premapped(conn.getpeername(), reply)  # taken either way: no longer held for later
        if copy_on_write:  # a private mapping of its own
            premapped = None
        tensors = _bind_over(reply, fds, module, strict, copy_on_write, adjust, phases, surveyed, premapped)
        conn.settimeout(None)
    except BaseException:
        conn.close()
        for fd in fds:
            os.close(fd)
        raise
    return Attachment(source="agent", fingerprint=reply["fingerprint"], fields=reply["fields"],
                      nbytes=reply["bytes"], tensors=tensors,
                      seconds=time.perf_counter() - started, layout_hash=reply["layout_hash"], role=reply["role"],
                      group=group, conn=conn, fds=fds, arenas=reply["arenas"], on_promote=on_promote,
                      on_demote=on_demote, pod=pod, rejoin_token=reply.get("rejoin_token"), phases=phases,
                      engine=engine)


def _send_attach(conn: socketlib.socket, role: str, group: str | None, pod: dict[str, str] | None,
                 request: dict[str, Any], engine: str | None = None, names: str = "checkpoint") -> None:
    message = {"type": "attach", "pid": os.getpid(), "role": role, "group": group, "pod": pod, "request": request,
               "manifest": "packed", "engine": engine, "names": names}
    identity = identity_token_from_env()  # in a pod: the proof of which pod this is (never sent off Kubernetes)
    if identity:
        message["identity_token"] = identity
    protocol.send_message(conn, message)


def _manifest_reply(conn: socketlib.socket) -> tuple[dict, list[int]]:
    """The agent's answer; a manifest's rows arrive packed (`PackedRows`) from an agent that packs
    them, as JSON columns from one that does not."""
    reply, fds = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS, max_depth=None)
    try:
        rows = reply.get("tensors") if reply.get("type") == "manifest" else None
        if isinstance(rows, dict) and "packed" in rows:
            length = rows["packed"]
            if not isinstance(length, int) or not 0 <= length <= protocol.MAX_REPLY_BYTES:
                raise ProtocolError(f"a manifest announced {str(length)[:40]} bytes of packed rows")
            try:
                reply["tensors"] = PackedRows(rows.get("forms"), rows.get("count"),
                                              protocol.recv_payload(conn, length))
            except ValueError as e:
                raise ProtocolError(f"malformed manifest: {e}") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return reply, fds


def _bind_over(manifest: dict[str, Any], fds: list[int], module: nn.Module, strict: bool,
               copy_on_write: bool = False, adjust: Adjust | None = None,
               phases: dict[str, float] | None = None, surveyed: object | None = None,
               premapped: tuple[torch.Tensor, Callable[[], None]] | None = None) -> Mapping[str, torch.Tensor]:
    """Map the agent's arena read-only (unless `prepare` mapped it: `premapped`) and bind `module`
    to it, row by manifest row."""
    t0 = time.perf_counter()
    base, granted = premapped or map_arena_meanwhile(manifest, fds, copy_on_write)
    t1 = time.perf_counter()
    try:
        if adjust is None:
            tensors = bind_manifest(module, base, manifest["tensors"], strict, surveyed=surveyed, before_swap=granted)
        else:
            granted()
            tensors = bind_adjusted(module, base, columns_of(manifest["tensors"]), strict, adjust)
        if phases is not None:
            phases.update(map=t1 - t0, bind=time.perf_counter() - t1)
        return tensors
    except (AttachError, CudaError):  # the driver's refusal is no malformed manifest
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, WeightCacheError) as e:
        raise ProtocolError(f"malformed manifest: {e}") from None
    finally:
        granted()  # also when the bind failed: the mapping must not go while its access is being set


def _attach_from_disk(module: nn.Module, spec: CacheSpec, strict: bool, copy_on_write: bool = False,
                      adjust: Adjust | None = None, names: str = "checkpoint") -> Attachment:
    started = time.perf_counter()
    loaded = load_cache(spec, name="weightcache:in-process")
    try:
        base = map_cpu(loaded.arena.fd, loaded.layout.size, copy_on_write)
        tensors = bind_adjusted(module, base, loaded.layout.to_manifest(names), strict, adjust)
    finally:
        loaded.arena.close()  # the mapping keeps the memory
    return Attachment(source="disk", fingerprint=loaded.fingerprint, fields=loaded.fields, nbytes=loaded.layout.nbytes,
                      tensors=tensors, seconds=time.perf_counter() - started, layout_hash=loaded.layout.layout_hash)


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"
