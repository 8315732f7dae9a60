"""Tensor-parallel serving for the reference engine: one process per rank, one model.

A tensor-parallel cache holds each rank's shard in that rank's arena, on that rank's GPU.
An engine made of one process per rank maps each shard where it lives (the rank's
socket names its GPU by UUID, whatever CUDA_VISIBLE_DEVICES says) and computes the
forward with collectives: the row-parallel projections (o_proj, down_proj) are summed
over ranks, the vocab-parallel embedding is summed (each rank looks up the ids it holds),
and the vocab-parallel logits are gathered. torch.distributed carries them: NCCL on
GPUs, gloo on CPUs.

Data flow:

    rank 0 (HTTP) --RankLink: {"type": "run", tokens, max_tokens}--> ranks 1..N-1
    every rank:   model.generate(...) in lockstep (the same greedy tokens everywhere,
                  since every rank sees the same gathered logits)
    ranks 1..N-1 --RankLink: {"type": "role", rank, role}--> rank 0 (at hello, and when
                  its agent promotes it)

The link is plain TCP next to the collectives' rendezvous (port + 1); like that rendezvous
it trusts whoever reaches it, so HOST is a loopback or pod-local address. It doubles as
the group's liveness: a closed link is a dead rank, and every remaining rank of the
engine retires at once (it ends its lease and exits 0). Their agents then promote the
standby engine's ranks, one per GPU; the standby's rank 0 serves only when every one of
its ranks holds the primary lease. So a group never serves with one rank of each engine.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("weightcache.engine")

MAX_LINK_FRAME = 1 << 20  # a run request: a prompt of token ids, bounded like an HTTP body
LINK_CONNECT_SECONDS = 300.0  # how long a rank waits for rank 0 to listen (rank 0 may load later)
HELLO_SECONDS = 10.0  # a rank that connected sends its hello at once
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)  # an idle standby must not be timed out by the watchdog


def parse_init(init: str) -> tuple[str, int]:
    """(host, port) of a `tcp://HOST:PORT` rendezvous; ValueError (one line) otherwise."""
    rest = init.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if not init.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"--dist-init must be tcp://HOST:PORT (PORT below 65535, PORT+1 free for the rank link), "
                         f"got {init!r}")
    return host.strip("[]"), int(port)


# -- collectives ------------------------------------------------------------------------------------


class Collectives:
    """This rank's place in the engine's process group."""

    def __init__(self, rank: int, size: int, init: str, device: torch.device):
        import torch.distributed as dist

        self.rank, self.size, self.device, self._dist = rank, size, device, dist
        if device.type == "cuda":
            # NVLink multicast (NVLS) can take shared GPUs out of service; never let NCCL pick it.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            backend = "nccl"
        else:
            backend = "gloo"
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                                **kwargs)
        self.backend = backend

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in fp32 (partial products of a row-parallel matmul are summed at full precision)."""
        y = x.to(torch.float32)
        self._dist.all_reduce(y)
        return y.to(x.dtype)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        try:
            self._dist.destroy_process_group()
        except Exception:  # a peer already gone: nothing left to tear down cleanly
            pass


class PendingCollectives:
    """`Collectives` being made on a thread of their own (NCCL's rendezvous and communicator take
    a while), so that the attach and the first kernels run meanwhile; `result` waits for them.

    The thread also runs one tiny sum and one gather: NCCL connects the ranks at a collective's
    first use, and this way that happens here too. Every rank runs the same two, in the same
    order, and nothing else uses the group before `result` returns.
    """

    def __init__(self, rank: int, size: int, init: str, device: torch.device):
        self.device = device
        self._comm: Collectives | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(rank, size, init), name="weightcache-collectives", daemon=True).start()

    def _run(self, rank: int, size: int, init: str) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            comm = Collectives(rank, size, init, self.device)
            comm.all_reduce(torch.zeros(1, device=self.device))
            comm.all_gather_last(torch.zeros(1, 1, device=self.device))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._comm = comm
        except BaseException as e:  # noqa: BLE001 (re-raised by result, on the caller's thread)
            self._error = e
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float = LINK_CONNECT_SECONDS) -> Collectives:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the collectives' process group was not set up within {timeout:.0f}s")
        if self._error is not None:
            raise self._error
        assert self._comm is not None
        return self._comm


def start_collectives(rank: int, size: int, init: str, device: torch.device) -> PendingCollectives:
    """Begin joining the engine's process group on `device` (returns at once)."""
    return PendingCollectives(rank, size, init, device)


class RowParallel(nn.Module):
    """A row-parallel projection: each rank multiplies its slice of the inputs; the sum is the output."""

    def __init__(self, inner: nn.Module, comm: Collectives):
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [rank*n, (rank+1)*n) of the embedding: ids held elsewhere look up zeros, the sum fills them in."""

    def __init__(self, inner: nn.Embedding, comm: Collectives):
        super().__init__()
        self.inner, self.comm = inner, comm
        self.rows = inner.weight.shape[0]
        self.start = comm.rank * self.rows

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        held = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.inner.weight) * held.unsqueeze(-1).to(self.inner.weight.dtype)
        return self.comm.all_reduce(out)


class GatheredLogits(nn.Module):
    """The vocab-parallel lm_head: each rank computes its slice of the logits; all ranks see them all."""

    def __init__(self, inner: nn.Module, comm: Collectives):
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(self.inner(x))


def parallelize(model: nn.Module, comm: Collectives) -> nn.Module:
    """Wrap an attached rank's model so its forward computes the whole model's with its peers.

    Called after attach and prepare: the wrappers hold the already-bound modules, so the
    manifest's names never see them.
    """
    cfg = model.config
    if cfg.tp_size != comm.size:
        raise ValueError(f"the model was built for tp_size={cfg.tp_size}, the process group has {comm.size} ranks")
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, comm)
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, comm)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, comm)
    model.lm_head = GatheredLogits(model.lm_head, comm)
    model.tensor_parallel = True
    return model


def rank_device(model: nn.Module) -> torch.device:
    """Where this rank's weights live: its collectives run there."""
    return model.model.embed_tokens.weight.device


# -- the rank link ----------------------------------------------------------------------------------


class _Peer:
    """One framed JSON connection (4-byte length, then UTF-8 JSON); sends are serialised."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._send_lock = threading.Lock()
        self.rank: int | None = None

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        with self._send_lock:
            self.sock.sendall(len(data).to_bytes(4, "big") + data)

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None once the peer is gone (EOF, reset, or a frame out of bounds)."""
        try:
            head = self._exact(4)
            if head is None:
                return None
            n = int.from_bytes(head, "big")
            if n > MAX_LINK_FRAME:
                log.error("rank link: a frame of %d bytes exceeds %d; dropping the peer", n, MAX_LINK_FRAME)
                return None
            body = self._exact(n)
            if body is None:
                return None
            message = json.loads(body)
        except (OSError, ValueError):
            return None
        return message if isinstance(message, dict) else None

    def _exact(self, n: int) -> bytes | None:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(left)
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class LeaderLink:
    """Rank 0's side: listens until every other rank said hello, then watches them."""

    def __init__(self, host: str, port: int, size: int):
        self.size = size
        self.roles: dict[int, str] = {}
        self.peers: dict[int, _Peer] = {}
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=max(size, 8))
        self._on_lost: Callable[[str], None] | None = None

    def accept_all(self, timeout: float) -> None:
        """Wait for ranks 1..size-1 (each sends {"type": "hello", "rank": r, "role": role}); then stop listening."""
        self._listener.settimeout(timeout)
        try:
            while len(self.peers) < self.size - 1:
                sock, _ = self._listener.accept()
                sock.settimeout(HELLO_SECONDS)  # a connection that says nothing cannot hold the set-up up for long
                peer = _Peer(sock)
                hello = peer.recv()
                rank = hello.get("rank") if hello else None
                if (not hello or hello.get("type") != "hello" or not isinstance(rank, int) or isinstance(rank, bool)
                        or not 0 < rank < self.size or rank in self.peers or hello.get("role") not in ("primary", "standby")):
                    log.warning("rank link: dropped a connection that is no rank of this engine (%r)", str(hello)[:80])
                    peer.close()
                    continue
                sock.settimeout(None)
                peer.rank = rank
                self.peers[rank] = peer
                self.roles[rank] = hello["role"]
        except socket.timeout:
            missing = sorted(set(range(1, self.size)) - set(self.peers))
            raise TimeoutError(f"rank(s) {missing} of this tensor-parallel engine did not join within {timeout:.0f}s") from None
        finally:
            self._listener.close()  # nobody else may join later

    def watch(self, on_role: Callable[[int, str], None], on_lost: Callable[[str], None]) -> None:
        """One thread per rank: role changes go to `on_role`, a lost rank to `on_lost` (once)."""
        for rank, peer in self.peers.items():
            threading.Thread(target=self._read, args=(rank, peer, on_role, on_lost), name=f"rank-link-{rank}",
                             daemon=True).start()

    def _read(self, rank: int, peer: _Peer, on_role: Callable[[int, str], None], on_lost: Callable[[str], None]) -> None:
        while True:
            message = peer.recv()
            if message is None:
                on_lost(f"rank {rank} left the tensor-parallel engine")
                return
            if message.get("type") == "role" and message.get("role") in ("primary", "standby"):
                self.roles[rank] = message["role"]
                on_role(rank, message["role"])

    def run(self, tokens: list[int], max_tokens: int) -> None:
        """Tell every rank to run the same generation (rank 0 runs it right after)."""
        for peer in self.peers.values():
            peer.send({"type": "run", "tokens": tokens, "max_tokens": max_tokens})

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()


class FollowerLink:
    """A rank > 0: connects to rank 0, says hello, then takes its orders."""

    def __init__(self, host: str, port: int, rank: int, role: str, timeout: float = LINK_CONNECT_SECONDS):
        import time

        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=5.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0 of this tensor-parallel engine did not listen on {host}:{port} "
                                       f"within {timeout:.0f}s") from None
                time.sleep(0.02)
        sock.settimeout(None)
        self.peer = _Peer(sock)
        self.rank = rank
        self.peer.send({"type": "hello", "rank": rank, "role": role})

    def report_role(self, role: str) -> None:
        try:
            self.peer.send({"type": "role", "rank": self.rank, "role": role})
        except OSError:
            pass  # rank 0 is gone: the loop sees it and retires

    def orders(self) -> "Any":
        """Messages from rank 0 until it goes away."""
        while True:
            message = self.peer.recv()
            if message is None:
                return
            yield message

    def close(self) -> None:
        self.peer.close()


def group_role(own: str, others: dict[int, str], size: int) -> str:
    """The engine's role: primary only when every rank holds the primary lease; never a mix."""
    roles = [own] + [others.get(r, "standby") for r in range(1, size)]
    return "primary" if all(r == "primary" for r in roles) else "standby"


def retire(reason: str, attachment: Any, code: int = 0) -> None:
    """Leave at once, lease first: this rank's agent promotes its standby the moment the lease ends."""
    log.warning("retiring: %s; ending the lease and exiting", reason)
    try:
        if attachment is not None:
            attachment.close()
    finally:
        logging.shutdown()
        os._exit(code)
