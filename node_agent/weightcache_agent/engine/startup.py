"""An engine process's start-up, overlapped, and where its time went.

A restart is measured from process start to the first token. The weights' attach is ~10 ms
of it; the rest is start-up: the interpreter and torch's import, the GPU's context, the
attach path's first use, NCCL's set-up (tensor parallel) and the first kernels. What does
not need torch runs beside its import, and what does not need the weights runs beside the
attach:

    main thread                                  beside it
    flags checked; `begin(socket)`           ->  ask the agent which GPU it serves; make that
    import torch                                 GPU's primary context through the driver
    device ready: torch on that GPU, `prepare()` (the attach path warmed on an arena of its own)
    [TP] `tensor_parallel.start_collectives` ->  NCCL: rendezvous and communicator
    build on meta, attach, RoPE tables,
    [TP] this rank's share of a forward (`warm_local`: GEMM library, kernels, allocator)
    [TP] rank link; wait for the collectives; warm-up through them
    serving

`PHASES` records each step as seconds since the process started (the kernel's record of
the start, so the interpreter's own start-up counts); the engine logs them in one line
and serves them in /healthz. `WEIGHTCACHE_ENGINE_START=sequential` runs the same steps
one after another (no context beside the import, NCCL after the rank link, no local
warm-up): the order before the overlap, kept to measure what it saves.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from ..logs import Phases as _Phases

log = logging.getLogger("weightcache.engine")

ENV_START = "WEIGHTCACHE_ENGINE_START"


def overlapped() -> bool:
    """False when `WEIGHTCACHE_ENGINE_START=sequential` asks for the steps one after another."""
    return os.environ.get(ENV_START, "overlapped") != "sequential"


class Phases(_Phases):
    """`logs.Phases`, logged in one line."""

    def log(self, who: str) -> None:
        log.info("%s start-up (seconds since process start): %s", who, json.dumps(self.as_dict()))


PHASES = Phases()


class EarlyDevice:
    """The GPU the agent at `socket` serves, and its primary context, found beside torch's import.

    Never raises: whatever goes wrong here, the main thread asks again and reports it.
    """

    def __init__(self, socket: str):
        self.socket = socket
        self.status: dict[str, Any] | None = None
        self.ordinal: int | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="weightcache-early-device", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            from ..protocol import agent_status

            status = agent_status(self.socket)
            if status.get("backend") == "cuda" and status.get("device"):
                from ..arena.cuda import retain_context
                from ..arena.devices import local_ordinal

                ordinal = local_ordinal(status["device"])
                retain_context(ordinal)
                self.ordinal = ordinal
            self.status = status
            PHASES.mark("agent asked, context made (beside the import)")
        except Exception as e:  # noqa: BLE001 (reported by the main thread's own attempt)
            self.error = f"{type(e).__name__}: {e}"

    def result(self, timeout: float = 30.0) -> "EarlyDevice":
        self._thread.join(timeout)
        return self


_early: EarlyDevice | None = None


def begin(socket: str | None) -> None:
    """Start asking the agent at `socket` for its GPU and making that GPU's context (before torch's import)."""
    global _early
    PHASES.mark("flags checked")
    if socket and overlapped():
        _early = EarlyDevice(socket)


def early_device(socket: str) -> EarlyDevice | None:
    """What `begin` found for `socket` (waiting for it), once; None if it was not asked or found nothing."""
    global _early
    found, _early = _early, None
    if found is None or found.socket != socket:
        return None
    found.result()
    return found if found.status is not None else None


def warm_local(model: Any) -> None:
    """This rank's share of a short generation, its output discarded, before the ranks are joined.

    It pays the first use of the GEMM library, of the forward's kernels and of the allocator
    while NCCL sets up; the collectives' own first use comes with the engine's warm-up. The
    forward's guard against a lone rank's forward is lifted only for this call: no
    collective is wired yet, so each rank computes its own part alone.
    """
    if not hasattr(model, "tensor_parallel") or model.tensor_parallel or model.config.tp_size == 1:
        return
    model.tensor_parallel = True
    try:
        model.generate([0] * 8, 2)
    finally:
        model.tensor_parallel = False
