"""The worker's lifecycle: which phase it is in, and which phase may follow which.

Why a table: the phase is what `status` reports and what the operator rolls up, and it is
written from three threads (the load, the scrubber's tamper report, the refill). A move the
table does not name is a bug in the worker, and raising at the move says where, instead of a
status that quietly reads "ready" while attaches wait.

    starting -> preparing -> [adopting] -> [loading] -> ready <-> refilling
    preparing, adopting, loading -> failed;  refilling -> failed

`serve/arena_holder.py` owns the one `Lifecycle` of a worker and makes every move; the
façade (`serve/agent.py`) and status only read it.
"""
from __future__ import annotations

import threading
from enum import Enum


class Phase(str, Enum):
    """A worker's phase; equal to its name as a string (what status says and tests compare)."""

    STARTING = "starting"
    PREPARING = "preparing"  # reading headers and planning, or reading a predecessor's record
    ADOPTING = "adopting"  # waiting for an engine that outlived the predecessor to hand the arena back
    LOADING = "loading"  # filling an arena: from another replica's, or from the disk
    READY = "ready"
    REFILLING = "refilling"  # the served arena was found changed: a fresh one is being filled
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# A tamper report can come in before the load's last step (the scrubber starts as soon as the
# digest is made), hence loading/adopting -> refilling. Loading repeats: a copy from another
# replica that fails falls back to the disk, and both say "loading".
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.PREPARING, Phase.FAILED}),
    Phase.PREPARING: frozenset({Phase.ADOPTING, Phase.LOADING, Phase.FAILED}),
    Phase.ADOPTING: frozenset({Phase.LOADING, Phase.READY, Phase.REFILLING, Phase.FAILED}),
    Phase.LOADING: frozenset({Phase.LOADING, Phase.READY, Phase.REFILLING, Phase.FAILED}),
    Phase.READY: frozenset({Phase.REFILLING}),
    Phase.REFILLING: frozenset({Phase.READY, Phase.FAILED}),
    Phase.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move the transition table does not allow: a bug in the worker, not a client's doing."""


class Lifecycle:
    """The current phase, moved only along `TRANSITIONS`."""

    def __init__(self) -> None:
        self._phase = Phase.STARTING
        self._lock = threading.Lock()  # check and move as one step: two threads may race to move it

    @property
    def phase(self) -> Phase:
        return self._phase

    def to(self, new: Phase) -> None:
        """Move to `new`; `IllegalTransition` when the table does not allow it from here."""
        with self._lock:
            if new not in TRANSITIONS[self._phase]:
                raise IllegalTransition(f"the agent cannot go from {self._phase} to {new}")
            self._phase = new

    def is_(self, phase: Phase) -> bool:
        return self._phase is phase
