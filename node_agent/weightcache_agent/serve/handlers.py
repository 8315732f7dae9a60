"""One handler per request an agent answers, and the table that routes each type to its handler.

The transport (serve/connections.py) reads a request, looks its type up in `routes()` and
calls the handler with a `Request`; the handler checks the request, asks the parts that own
the answer, and replies on the request. No handler reads a socket or keeps a connection: a
handler that opens a lease returns it, and the transport then reads the lease's messages
(`lease_messages()`) until it ends.

    arena       the arena's fd ahead of an attach           (arena holder, lease book's grant)
    attach      manifest + fd; the connection is the lease   (engine check, lease book, arena holder)
    rejoin      an engine that outlived its agent, proven    (restart state, arena holder's adoption)
    verify      a whole check of the arena now               (arena guard)          privileged
    switchover  a planned handover of a group's primary      (promotion)            privileged
    group_claim, group_lost   another rank's agent asks rank 0 (rank group)         privileged
    on a lease: detach (it ends), promoted (the engine serves as primary now)

Re-adoption is where a client could otherwise hand the agent bytes of its own, so it takes
proof: each lease gets a random token in its manifest reply, recorded only as a hash with the
peer's uid and pid (serve/restart_state.py); a rejoin must present a recorded token, once,
with matching credentials, and offer exactly one fd of exactly the layout's size whose bytes
digest to what the predecessor loaded. Anyone else's rejoin is refused without saying why.
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any, Callable

from .. import protocol
from ..errors import ProtocolError, WeightCacheError
from ..load.layout import NAMINGS
from ..load.fingerprint import RevisionRequired, differences
from ..spec import CacheSpec
from .arena_holder import ArenaHolder
from .connections import After, Request, Route, Throttled
from .engine_check import EngineCheck, Refusal, identify
from .lease import Lease, check_lease_terms, engine_id, hash_token
from .lease_book import LeaseBook
from .pod_identity import PodVerifier
from .promotion import Promotion
from .rank_group import RankGroup
from .restart_state import RestartState
from .status import AttachStats

log = logging.getLogger(__name__)


class Handlers:
    def __init__(self, spec: CacheSpec, holder: ArenaHolder, book: LeaseBook, state: RestartState,
                 promotion: Promotion, stats: AttachStats, refusals: Throttled,
                 verifier: PodVerifier | None = None, ranks: RankGroup | None = None):
        self.spec, self.holder, self.book, self.state = spec, holder, book, state
        self.promotion, self.stats, self.refusals = promotion, stats, refusals
        self.verifier, self.ranks = verifier, ranks
        self.check = EngineCheck(spec, lambda: holder.cache)

    def routes(self) -> dict[str, Route]:
        """Requests before a lease, by type."""
        return {
            "arena": Route(self.handle_arena, After.ANSWERED),
            "verify": Route(self.handle_verify, After.DONE),
            "attach": Route(self.handle_attach, After.LEASE),
            "rejoin": Route(self.handle_rejoin, After.LEASE, takes_fds=True),
            "switchover": Route(self.handle_switchover, After.DONE),
            "group_claim": Route(self.handle_group_request, After.DONE, timed=False),
            "group_lost": Route(self.handle_group_request, After.DONE, timed=False),
        }

    def lease_messages(self) -> dict[str, Callable[[Lease], bool]]:
        """Messages on a lease, by type: each says whether the lease goes on."""
        return {"detach": lambda lease: False, "promoted": self.handle_promoted}

    # -- before a lease ----------------------------------------------------------------------

    def handle_arena(self, req: Request) -> None:
        """The arena's fd and what it is, ahead of an attach: an engine maps it while it starts, and its
        attach then only binds. Handed out under the rules of an attach -- the socket's policy, the
        group's owner, the uid's lease cap, which an unused hand-out counts against for a minute
        (serve/lease_book.py) -- and never while the arena is being replaced. No waiting for a load:
        an engine that asks too early is told so and maps at its attach."""
        group = req.message.get("group")
        check_lease_terms("arena", req.message.get("role", "auto"), group)
        if not self.holder.ready.is_set():
            req.reply(protocol.error_message("not_ready", f"the cache is {self.holder.phase}"))
            return
        served = self.holder.serving()
        if served is None:
            req.reply(self._load_failed())
            return
        cache, arenas = served
        refusal = self.book.grant(req.uid, req.pid, group)
        if refusal is not None:
            req.reply(refusal)
            return
        req.reply({"type": "arena", "backend": cache.arena.backend, "arenas": arenas}, [cache.arena.fd])
        log.debug("sent the arena to pid=%s uid=%s ahead of its attach", req.pid, req.uid)

    def handle_verify(self, req: Request) -> None:
        """A whole check of the arena now (privileged peers: it costs a pass of device time)."""
        self._privileged(req, "verify")
        guard = self.holder.guard
        scrubber = guard.scrubber
        if not self.holder.ready.is_set() or scrubber is None:
            req.reply(protocol.error_message(
                "not_verifiable", guard.error or f"the agent has no verified arena now (phase {self.holder.phase})"))
            return
        result = scrubber.verify()
        req.reply({"type": "verified", **result, "integrity": guard.to_json()})

    def handle_attach(self, req: Request) -> Lease | None:
        started = time.perf_counter()
        message = req.message
        role, group, request = message.get("role", "primary"), message.get("group"), message.get("request")
        check_lease_terms("attach", role, group)
        if not isinstance(request, dict) or not isinstance(request.get("spec"), dict):
            raise ProtocolError(f"attach needs request, an object with a spec; got {type(request).__name__}")
        names = message.get("names", "checkpoint")
        if names not in NAMINGS:
            raise ProtocolError(f"attach's names must be one of {', '.join(NAMINGS)}, got {str(names)[:40]!r}")
        identity = self._identify(req, group)
        if identity is None or not self._wait_for_load(req):
            return None
        served = self.holder.serving()
        if served is None:
            self.stats.missed()
            req.reply(self._load_failed())
            return None
        cache, arenas = served
        if not self._same_bytes(req, cache, request):
            return None
        token = secrets.token_hex(32)
        lease = self._register(req, role, group, hash_token(token), identity, engine_id(message.get("engine")))
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
            columns, (header, payload) = self.holder.manifests.get(names)
            if message.get("manifest") == "packed":
                lease.send(reply, [cache.arena.fd], encoded={"tensors": header}, payload=payload)
            else:
                lease.send(reply, [cache.arena.fd], encoded={"tensors": columns})
        except BaseException:
            self.promotion.end_lease(lease)
            raise
        seconds = time.perf_counter() - started
        self.stats.attached(seconds)
        log.info("attached pid=%s role=%s group=%s lease=%d in %.2fms", req.pid, lease.role, group, lease.id,
                 seconds * 1e3)
        return lease

    def handle_rejoin(self, req: Request) -> Lease | None:
        """An engine that outlived its agent reconnects, offering the arena it still maps.

        Refusals say no more than "refused": the client learns nothing it did not send.
        """
        fds, adopt = req.fds, False
        message = req.message
        try:
            role, group = message.get("role"), message.get("group")
            check_lease_terms("rejoin", role, group)
            identity = self._identify(req, group)
            if identity is None:
                return None
            self.holder.planned.wait()
            prepared = self.holder.prepared
            if prepared is None:
                req.reply(protocol.error_message("load_failed", "the agent failed to load"))
                return None
            if not self._spend_token(req):
                return None
            fields = message.get("fields")
            if not isinstance(fields, dict) or differences(prepared.fields, fields):
                req.reply(protocol.error_message("fingerprint_mismatch",
                                                 "this agent serves different weights; keep yours"))
                return None
            arenas = message.get("arenas")
            if (len(fds) == 1 and isinstance(arenas, list) and len(arenas) == 1 and isinstance(arenas[0], dict)
                    and message.get("layout_hash") == prepared.layout.layout_hash
                    and arenas[0].get("backend") == self.holder.device.backend):
                adopt = self.holder.offer(prepared.layout.size, fds[0], req.pid, req.uid)
                fds = []  # closed by `offer` or owned by the adopted arena
        finally:
            for fd in fds:
                os.close(fd)
        # A fresh token for the next restart: the one just used is spent.
        token = secrets.token_hex(32)
        lease = self._register(req, role, group, hash_token(token), identity, engine_id(message.get("engine")))
        if lease is None:
            return None
        lease.send({"type": "rejoined", "lease": lease.id, "role": lease.role, "adopted": adopt,
                    "rejoin_token": token})
        log.info("rejoined pid=%s role=%s group=%s lease=%d%s", req.pid, lease.role, group, lease.id,
                 " (its arena adopted)" if adopt else "")
        return lease

    def handle_switchover(self, req: Request) -> None:
        """A planned handover asked on the socket (see `Promotion.switch`). Only a privileged peer (root,
        or the agent's own uid: the node's tooling, the other ranks' agents) may ask; an engine
        cannot take the primary role from another by asking."""
        self._privileged(req, "switchover")
        group, to_pod, to_pid, to_engine, owner = (req.message.get(k) for k in (
            "group", "to_pod", "to_pid", "to_engine", "owner"))
        if not isinstance(group, str) or not (to_pod is None or isinstance(to_pod, str)) or \
                not (to_pid is None or isinstance(to_pid, int)) or not (to_engine is None or isinstance(to_engine, str)) \
                or not (owner is None or isinstance(owner, int)):
            raise ProtocolError("switchover needs group (a string), and to_pod (a pod name), to_pid (an int), "
                                "to_engine (an engine key) or none of them (demote only); owner: null or a uid")
        req.reply(self.promotion.switch(group, to_pod, to_pid, to_engine, owner))

    def handle_group_request(self, req: Request) -> None:
        """Another rank's agent asks the coordinator (rank 0) to decide a role or promote its group."""
        kind = req.message["type"]
        self._privileged(req, kind)
        group, engine, owner = req.message.get("group"), engine_id(req.message.get("engine")), req.message.get("owner")
        if self.ranks is None or not self.ranks.coordinator:
            raise ProtocolError(f"{kind} goes to rank 0's agent of a tensor-parallel replica")
        check_lease_terms(kind, "auto", group)
        if engine is None or group is None or not (owner is None or isinstance(owner, int)):
            raise ProtocolError(f"{kind} needs a group, an engine, and owner null or a uid")
        if kind == "group_claim":
            req.reply({"type": "group_role", "role": self.ranks.decide_claim(group, engine, owner)})
        else:
            done = self.ranks.decide_lost(group, engine, owner)
            req.reply({"type": "group_promoted", "engine": done["to"] if done else None})

    # -- on a lease --------------------------------------------------------------------------

    @staticmethod
    def handle_promoted(lease: Lease) -> bool:
        lease.acknowledged.set()
        return True

    # -- shared steps ------------------------------------------------------------------------

    def _load_failed(self) -> dict[str, Any]:
        """What an attach or an arena request is told when the load failed (an engine may fall back)."""
        return protocol.error_message("load_failed", f"agent failed to load: {self.holder.error}")

    @staticmethod
    def _privileged(req: Request, kind: str) -> None:
        _pid, uid, _gid = protocol.peer_credentials(req.conn)
        if uid not in (0, os.geteuid()):
            raise ProtocolError(f"{kind} needs a privileged peer; uid {uid} is not")

    def _identify(self, req: Request, group: str | None) -> tuple[dict[str, str] | None, bool] | None:
        """The lease's pod and whether it is proven, or None after telling the client why not."""
        found = identify(self.verifier, req.message, group, req.pid, req.uid)
        if isinstance(found, Refusal):
            self.refusals.warn(found.warning)  # a flood is a line a second
            req.reply(found.reply)
            return None
        return found

    def _wait_for_load(self, req: Request) -> bool:
        """Wait until the load is over; False (the client told) when too many attaches wait already."""
        if self.holder.ready.is_set():
            return True
        book = self.book
        with book.lock:
            crowded = book.waiting >= book.max_leases
            book.waiting += not crowded
        if crowded:  # each waiter holds a thread and a socket until the load ends: bounded like leases
            req.reply(protocol.error_message(
                "too_many_leases", f"{book.max_leases} attaches already wait for the load; try again later"))
            return False
        try:
            self.holder.ready.wait()
        finally:
            with book.lock:
                book.waiting -= 1
        return True

    def _same_bytes(self, req: Request, cache: Any, request: dict[str, Any]) -> bool:
        """Whether the engine asks for the bytes this cache holds; if not, the client is told why."""
        model = os.path.abspath(self.spec.model)
        replaced = self.check.replaced_files(cache, request)
        if replaced is not None:
            # The files this arena was read from are no longer the ones at the model path: a named miss,
            # whatever the engine's headers say (other weights may hide under the same headers).
            self.stats.missed()
            log.warning("refused attach from pid=%s: the checkpoint at %s changed since it was loaded (files "
                        "signature %s, now %s): restart this agent to load the new files", req.pid, self.spec.model,
                        *replaced)
            req.reply(protocol.error_message(
                "fingerprint_mismatch", "the checkpoint's files changed since the agent loaded them",
                fields={"files": f"as loaded (signature {replaced[0]})"},
                engine_fields={"files": f"replaced or rewritten since the agent loaded them (signature {replaced[1]})"},
                model=model))
            return False
        try:
            fields = self.check.fields_for(request)
        except RevisionRequired:
            req.reply(protocol.error_message(
                "revision_required", "the engine's checkpoint files differ from the ones loaded (name, size, mtime "
                                     "or inode): send their content identity"))
            return False
        except (KeyError, TypeError, ValueError) as e:
            # Only what the client sent is named: these come from checking its own values.
            what = f"missing {e}" if isinstance(e, KeyError) else str(e).splitlines()[0][:300]
            req.reply(protocol.error_message("bad_request", f"cannot evaluate the engine's spec: {what}"))
            return False
        except WeightCacheError as e:
            log.warning("cannot evaluate the spec of pid=%s: %s", req.pid, e)
            req.reply(protocol.error_message(
                "bad_request", "cannot evaluate the engine's spec against this agent's checkpoint; see the agent's log"))
            return False
        diff = differences(cache.fields, fields)
        if diff:
            self.stats.missed()
            log.warning("refused attach from pid=%s: fingerprint differs in %s", req.pid,
                        ", ".join(f"{k} (cache={c} engine={e})" for k, (c, e) in diff.items()))
            req.reply(protocol.error_message(
                "fingerprint_mismatch", "fingerprint differs", fields=cache.fields, engine_fields=fields,
                model=model))  # as status says it: named, never part of the fingerprint
            return False
        return True

    def _register(self, req: Request, role: str, group: str | None, token_hash: str,
                  identity: tuple[dict[str, str] | None, bool], engine: str | None) -> Lease | None:
        """A new lease, recorded in the state file, or None (after telling the client why not).

        Across the ranks of a tensor-parallel replica, rank 0's agent decides an "auto" role for the
        engine; otherwise the lease book decides it.
        """
        pod, verified = identity
        engine = (pod or {}).get("uid") or engine
        if role == "auto" and self.ranks is not None and group is not None and engine is not None:
            try:
                role = self.ranks.claim(group, engine, self.book.group_key(req.uid, group)[0])
            except WeightCacheError as e:
                log.error("cannot decide the role of pid=%s in group %r: %s", req.pid, group, e)
                req.reply(protocol.error_message(
                    "coordinator_unavailable", "rank 0's agent, which decides roles for every rank, does not answer; "
                                               "try again"))
                return None
        lease, refusal = self.book.register(req.conn, req.pid, req.uid, role, group, token_hash, pod, verified,
                                            engine)
        if refusal is not None:
            req.reply(refusal)
            return None
        return lease

    def _spend_token(self, req: Request) -> bool:
        """Whether the rejoin proves a lease of the predecessor's, its token now used up (in the state
        file before anything else happens); if not, the client is told only "refused"."""
        record = self.state.proven(req.message.get("token"), req.pid, req.uid)
        unrecorded = False
        with self.book.lock:
            claimed = record is not None and record["token"] in self.state.claimed
            if record is not None and not claimed:
                # Used once, across restarts too: neither this agent nor a successor accepts it again.
                self.state.claimed.add(record["token"])
                try:
                    self.book.persist()
                except OSError as e:
                    unrecorded = True
                    log.error("cannot record a used rejoin token in %s: %s; refusing the rejoin",
                              self.state.state_path, e.strerror or e)
        if record is None or claimed or unrecorded:
            log.warning("refused a rejoin from pid=%s uid=%s: it proves no lease of this agent's predecessor",
                        req.pid, req.uid)
            req.reply(protocol.error_message("rejoin_refused", "rejoin refused; keep the weights you have"))
            return False
        return True
