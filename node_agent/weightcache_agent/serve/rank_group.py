"""Group promotion across ranks: every rank of a tensor-parallel replica agrees on one primary engine.

Why: a TP=N engine holds one lease on each of the N rank agents of a cache replica (one
socket per GPU). Left alone, each agent would decide roles by itself -- `auto` by what it
sees, a failover by its own oldest standby -- and the ranks of one engine could end up with
different roles, or two engines could each hold some of the primary ranks. Neither serves.

How: the workers of one replica know each other's sockets (`--rank-sockets`, rank order,
given by the node supervisor). Rank 0's agent is the group's coordinator; the others ask
it. An engine is identified across ranks by its *engine key*: its pod's uid when the lease
names a pod (an EngineSet pod runs every rank of its engine), else the `engine` id the
client sent (the reference engine sends its `--dist-init` address, the same on every rank
and unique on the node). Leases without a key are not coordinated: they keep the
single-rank rules.

    attach, role auto (any rank) --group_claim--> coordinator: primary when the group has no
        primary engine on any rank (or it is this one), else standby; the answer is kept as
        the group's elected primary until its leases show up.
    primary lease ends (any rank) --group_lost--> coordinator, under one lock: unless another
        engine is already primary, pick the oldest standby engine attached on EVERY rank and
        switch each rank to it (`switchover` with `to_engine`), last rank first and rank 0
        last: rank 0's promotion is what writes the pod's serving label, so the label moves
        only once the whole engine is primary. The other ranks' reports of the same loss find
        the new primary and do nothing.

Off Kubernetes a group is keyed by uid and name (serve/lease.py): every claim and loss names
the group's `owner` uid, and only leases of that uid count (None in a cluster: the name
carries the namespace). The coordinator reads the other ranks' leases from their status (one
request per rank); a rank that does not answer is retried for `PEER_WAIT` seconds, then the
promotion is given up with one line in the log (a standby attached on only some ranks is
never made primary: it could not serve).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .. import protocol
from ..errors import WeightCacheError
from .switchover import switch_rank

log = logging.getLogger(__name__)

ELECTION_GRACE = 30.0  # seconds an elected primary may take to attach its first rank
PEER_WAIT = 5.0  # seconds the coordinator retries a rank that does not answer
REQUEST_TIMEOUT = 5.0
PRIMARY_ROLES = ("primary", "promoting")

# This rank's own switchover (serve/promotion.py's `switch`): (group, to_engine=..., owner=...) -> reply.
Switch = Callable[..., dict[str, Any]]


class RankGroup:
    """This agent's place among the rank agents of one replica; the coordinator's state on rank 0."""

    def __init__(self, sockets: list[str], rank: int, switch: Switch,
                 leases: Callable[[], list[dict[str, Any]]]):
        """`switch` and `leases` are this rank's own agent's: its switchover, and its leases as status
        lists them (`clients`); the coordinator asks the other ranks over their sockets instead."""
        if not 0 <= rank < len(sockets):
            raise ValueError(f"rank {rank} has no socket among the {len(sockets)} rank sockets")
        self.sockets, self.rank = sockets, rank
        self._switch, self._leases = switch, leases
        self._lock = threading.Lock()  # the coordinator decides one claim or loss at a time
        # (owner, group) -> (engine, when), until its leases show
        self._elected: dict[tuple[int | None, str], tuple[str, float]] = {}

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    # -- any rank ----------------------------------------------------------------------------

    def claim(self, group: str, engine: str, owner: int | None = None) -> str:
        """The role an `auto` lease of `engine` in `group` gets; WeightCacheError when rank 0 does not answer."""
        if self.coordinator:
            return self.decide_claim(group, engine, owner)
        reply = protocol.agent_request(self.sockets[0], {"type": "group_claim", "group": group, "engine": engine,
                                                         "owner": owner}, REQUEST_TIMEOUT)
        role = reply.get("role")
        if role not in ("primary", "standby"):
            raise WeightCacheError(f"rank 0's agent answered a claim with {str(role)[:32]!r}")
        return role

    def lost(self, group: str, engine: str, owner: int | None = None) -> None:
        """The primary engine's lease on this rank ended: have rank 0 promote the group (on a thread)."""
        threading.Thread(target=self._report_lost, args=(group, engine, owner), name="group-lost",
                         daemon=True).start()

    def _report_lost(self, group: str, engine: str, owner: int | None) -> None:
        if self.coordinator:
            self.decide_lost(group, engine, owner)
            return
        deadline = time.monotonic() + ELECTION_GRACE
        while True:
            try:
                protocol.agent_request(self.sockets[0], {"type": "group_lost", "group": group, "engine": engine,
                                                         "owner": owner},
                                       REQUEST_TIMEOUT + PEER_WAIT * len(self.sockets))
                return
            except WeightCacheError as e:
                if time.monotonic() > deadline:
                    log.error("group %s lost its primary engine, and rank 0's agent did not answer (%s): no standby "
                              "is promoted", group, e)
                    return
                time.sleep(0.2)

    # -- the coordinator (rank 0) ------------------------------------------------------------

    def decide_claim(self, group: str, engine: str, owner: int | None = None) -> str:
        with self._lock:
            current = self._primary_engine(group, owner, self._leases_by_rank())
            if current is None:
                self._elected[owner, group] = (engine, time.monotonic())
                return "primary"
            return "primary" if current == engine else "standby"

    def decide_lost(self, group: str, engine: str, owner: int | None = None) -> dict[str, Any] | None:
        """Promote the group's next engine on every rank, unless one already is primary; what was done."""
        started = time.perf_counter()
        with self._lock:
            ranks = self._leases_by_rank()
            primaries = {lease.get("engine") for leases in ranks for lease in leases
                         if _member(lease, group, owner) and lease.get("role") in PRIMARY_ROLES} - {engine, None}
            if primaries:
                return None  # another engine is primary already (a report of a loss handled before)
            self._elected.pop((owner, group), None)
            successor = self._complete_standby(group, owner, ranks)
            if successor is None:
                log.warning("group %s lost its primary engine %s; no standby engine is attached on all %d ranks: "
                            "none promoted", group, engine, len(self.sockets))
                return None
            replies = []
            for rank in reversed(range(len(self.sockets))):  # rank 0 last: its promotion moves the label
                if rank == self.rank:
                    reply = self._switch(group, to_engine=successor, owner=owner)
                else:
                    try:
                        reply = switch_rank(self.sockets[rank], group, to_engine=successor, timeout=REQUEST_TIMEOUT,
                                            owner=owner)
                    except WeightCacheError as e:
                        reply = {"ok": False, "message": str(e)}
                replies.append({"rank": rank, "ok": bool(reply.get("ok")), "message": reply.get("message")})
            self._elected[owner, group] = (successor, time.monotonic())
        seconds = time.perf_counter() - started
        failed = [r for r in replies if not r["ok"]]
        done = {"group": group, "from": engine, "to": successor, "seconds": seconds, "ok": not failed}
        if failed:
            log.error("group %s: promoting engine %s failed on rank(s) %s: %s", group, successor,
                      ", ".join(str(r["rank"]) for r in failed), "; ".join(str(r["message"]) for r in failed))
        else:
            log.info("group %s: engine %s is primary on all %d ranks in %.2fms (engine %s gone)", group, successor,
                     len(self.sockets), seconds * 1e3, engine)
        return done

    def _leases_by_rank(self) -> list[list[dict[str, Any]]]:
        """Every rank's leases (status documents' `clients`), rank order; retried while a rank does not answer."""
        out = []
        for rank, path in enumerate(self.sockets):
            if rank == self.rank:
                out.append(self._leases())
                continue
            deadline = time.monotonic() + PEER_WAIT
            while True:
                try:
                    out.append(list(protocol.agent_status(path, timeout=REQUEST_TIMEOUT).get("clients") or []))
                    break
                except WeightCacheError as e:
                    if time.monotonic() > deadline:
                        raise WeightCacheError(f"rank {rank}'s agent at {path} does not answer: {e}") from None
                    time.sleep(0.1)
        return out

    def _primary_engine(self, group: str, owner: int | None, ranks: list[list[dict[str, Any]]]) -> str | None:
        for leases in ranks:
            for lease in leases:
                if _member(lease, group, owner) and lease.get("role") in PRIMARY_ROLES and lease.get("engine"):
                    return str(lease["engine"])
        elected = self._elected.get((owner, group))
        if elected is not None:
            engine, when = elected
            present = any(lease.get("engine") == engine for leases in ranks for lease in leases)
            if present or time.monotonic() - when < ELECTION_GRACE:
                return engine
            del self._elected[owner, group]
        return None

    @staticmethod
    def _complete_standby(group: str, owner: int | None, ranks: list[list[dict[str, Any]]]) -> str | None:
        """The oldest standby engine (by its rank-0 attach) with a standby lease on every rank."""
        per_rank = [{lease["engine"]: lease.get("attached_at") or 0.0 for lease in leases
                     if _member(lease, group, owner) and lease.get("role") == "standby" and lease.get("engine")}
                    for leases in ranks]
        complete = set(per_rank[0]).intersection(*per_rank[1:])
        return min(complete, key=lambda key: (per_rank[0][key], key)) if complete else None


def _member(lease: dict[str, Any], group: str, owner: int | None) -> bool:
    """A lease (a status document's `clients` entry) of the group `group` of `owner` (None: any uid)."""
    return lease.get("group") == group and (owner is None or lease.get("uid") == owner)
