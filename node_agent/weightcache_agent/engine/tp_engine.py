"""The processes of a tensor-parallel reference engine: rank 0 serves HTTP, ranks 1..N-1 follow.

`weightcache engine --tp-size N --tp-rank R --dist-init tcp://HOST:PORT` runs one rank.
Each rank attaches its own shard through its own GPU's socket (with its own lease, role
and group), then the ranks meet twice: on the rank link (HOST:PORT+1, engine.tensor_parallel)
and in the collectives' process group (HOST:PORT). Rank 0 (`TensorParallelLeader`, inside
`server.Engine`) takes requests and sends each one to the others before running it;
a follower (`follow`) runs what rank 0 sends and reports its lease's role changes.

Set-up order, the same on every rank, so no rank waits forever on another: once its GPU is
known, a rank starts joining the process group on a thread of its own (NCCL's set-up runs
while it attaches and warms its kernels up, `engine.startup`); rank 0 listens on the link,
attaches, waits for every hello (bounded), then for the process group; a follower attaches,
connects, says hello, then waits for the process group. A rank that fails before the
process group is made exits at once (`abandon_pending`); its peers' waits are bounded.
`WEIGHTCACHE_ENGINE_START=sequential` joins the process group only after the hellos.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Callable

from .startup import PHASES, overlapped, warm_local
from .tensor_parallel import (LINK_CONNECT_SECONDS, Collectives, FollowerLink, LeaderLink, PendingCollectives,
                              group_role, parallelize, parse_init, rank_device, retire, start_collectives)

log = logging.getLogger("weightcache.engine")


def check_tp_options(options: Any) -> None:
    """Refuse what cannot make a consistent tensor-parallel engine (ValueError, one line)."""
    if not 0 <= options.tp_rank < options.tp_size:
        raise ValueError(f"--tp-rank {options.tp_rank} is outside [0, {options.tp_size})")
    if not options.dist_init:
        raise ValueError("--tp-size > 1 needs --dist-init tcp://HOST:PORT, the same on every rank of the engine")
    parse_init(options.dist_init)


class LeaderStart:
    """Rank 0's half-made engine, begun before the attach: the rank link listens (the other ranks
    may connect while rank 0 attaches) and, overlapped, the collectives are being set up."""

    def __init__(self, options: Any, device: Any):
        host, port = parse_init(options.dist_init)
        self.link = LeaderLink(host, port + 1, options.tp_size)
        self.pending: PendingCollectives | None = None
        if overlapped():
            try:
                self.pending = start_collectives(0, options.tp_size, options.dist_init, device)
            except BaseException:
                self.link.close()
                raise

    def close(self) -> None:
        self.link.close()


def _joined(pending: "PendingCollectives | None", rank: int, options: Any, model: Any) -> Collectives:
    """The collectives begun earlier (on the device the weights turned out to be on), or made now."""
    device = rank_device(model)
    if pending is None:
        return Collectives(rank, options.tp_size, options.dist_init, device)
    comm = pending.result()
    if comm.device != device:
        comm.close()
        raise ValueError(f"rank {rank}: the weights are on {device}, the collectives were set up on {comm.device} "
                         "(the agent's device); a disk fallback cannot join a GPU engine")
    return comm


def abandon_pending(pending: "PendingCollectives | None", code: int) -> None:
    """Exit at once when a set-up of the collectives is still waiting on its peers: its thread
    sits in NCCL's rendezvous, which an orderly interpreter shutdown could wait on."""
    if pending is not None and not pending.done:
        log.error("leaving while the collectives' set-up still waits for the other ranks")
        logging.shutdown()
        os._exit(code)


class TensorParallelLeader:
    """Rank 0's view of its engine: the link to the other ranks and the collectives."""

    def __init__(self, model: Any, attachment: Any, options: Any, on_change: Callable[[], None],
                 start: LeaderStart | None = None):
        self.size, self.attachment = options.tp_size, attachment
        self._closing = False
        start = start or LeaderStart(options, rank_device(model))
        self.link = start.link
        try:
            self.link.accept_all(LINK_CONNECT_SECONDS)
            PHASES.mark("ranks said hello")
            self.comm = _joined(start.pending, 0, options, model)
        except BaseException:
            self.link.close()
            raise
        PHASES.mark("collectives ready")
        parallelize(model, self.comm)
        self.link.watch(lambda rank, role: on_change(), self._lost)
        log.info("tensor-parallel engine: %d ranks joined (%s); ranks' roles %s", self.size, self.comm.backend,
                 {0: attachment.role, **self.link.roles})

    def role(self) -> str:
        return group_role(self.attachment.role, self.link.roles, self.size)

    def _lost(self, reason: str) -> None:
        if not self._closing:
            retire(reason, self.attachment)

    def close(self) -> None:
        self._closing = True
        self.link.close()
        self.comm.close()


def _valid_run(order: dict[str, Any]) -> tuple[list[int], int] | None:
    tokens, max_tokens = order.get("tokens"), order.get("max_tokens")
    if (isinstance(tokens, list) and tokens and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
            and isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1):
        return tokens, max_tokens
    return None


def follow(options: Any, load_model: Callable[..., Any], prepare_device: Callable[[str], Any]) -> int:
    """Run rank `options.tp_rank` > 0 until rank 0 goes away (then retire: exit 0 after the lease ends).

    `load_model` and `prepare_device` are the engine's own (engine.server), passed in so this
    module, which the server imports, never imports it back. `prepare_device` returns the
    device the agent serves (its context made, the attach path warmed) or None.
    """
    import torch

    from ..client.env import socket_from_env

    check_tp_options(options)
    host, port = parse_init(options.dist_init)
    rank = options.tp_rank
    link: list[FollowerLink] = []  # filled once connected; a promotion before then rides on the hello

    def on_role(attachment: Any) -> None:
        log.warning("rank %d: lease is now %s (group %s)", rank, attachment.role, options.group)
        if link:
            link[0].report_role(attachment.role)

    device = None
    if options.mode != "off":
        try:
            device = prepare_device(options.socket or socket_from_env(rank))
        except ValueError:
            pass
    PHASES.mark("device ready")
    pending = start_collectives(rank, options.tp_size, options.dist_init, device or torch.device("cpu")) \
        if overlapped() else None
    try:
        model, attachment = load_model(options.spec(), mode=options.mode, socket=options.socket,
                                       fallback=options.fallback, role=options.role, group=options.group,
                                       on_promote=on_role, on_demote=on_role, engine=options.engine)
        PHASES.mark("attached")
        log.info("rank %d: attached %d tensors (%.1f MiB) from %s in %.2f ms, role=%s; phases %s", rank,
                 len(attachment.tensors), attachment.bytes / 2**20, attachment.source, attachment.seconds * 1e3,
                 attachment.role, {k: round(v * 1e3, 2) for k, v in attachment.phases.items()})
        if pending is not None:
            warm_local(model)
            PHASES.mark("local warm-up")
        said = attachment.role
        link.append(FollowerLink(host, port + 1, rank, said))
        PHASES.mark("said hello")
        if attachment.role != said:
            link[0].report_role(attachment.role)
        comm = _joined(pending, rank, options, model)
        PHASES.mark("collectives ready")
    except BaseException:
        abandon_pending(pending, 1)
        raise
    parallelize(model, comm)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
    runs = 0
    try:
        for order in link[0].orders():
            run = _valid_run(order) if order.get("type") == "run" else None
            if run is None:
                log.error("rank %d: ignoring an order it does not understand: %s", rank, str(order)[:120])
                continue
            model.generate(*run)
            runs += 1
            if runs == 1:
                PHASES.mark("first run (warm-up)")
                PHASES.log(f"rank {rank}")
    except SystemExit:
        log.info("rank %d: stopping on a signal after %d runs", rank, runs)
        attachment.close()
        comm.close()
        return 0
    retire(f"rank 0 left the tensor-parallel engine after {runs} runs", attachment)
    return 0  # not reached: retire exits
