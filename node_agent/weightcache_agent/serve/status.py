"""What an agent says about itself: the `status` document, and the counters and readings behind it.

The document is assembled from the parts that own each fact -- the arena holder (phase, load,
timings, integrity), the lease book (clients), the transport (refused connections), these
attach counters -- without taking the lease book's lock: attaches hold it across a state-file
write, and `status` must answer at once while dozens of engines attach. The CLI, the node
supervisor (which feeds Prometheus from it) and the operator read it.
"""
from __future__ import annotations

import os
import resource
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..spec import CacheSpec

if TYPE_CHECKING:
    from .arena_holder import ArenaHolder

ATTACH_SAMPLES_IN_STATUS = 256  # bounded: status is polled every second or so
FREE_BYTES_TTL = 1.0  # seconds a reading of free memory is served before it is read again


class Sampled:
    """A reading kept off the request path: `get()` answers the last one at once and, once it is older
    than `ttl`, has one background thread read it again. Free device memory is read this way:
    cuMemGetInfo waits in the driver while engines map arenas, and `status` must answer at once
    while dozens of them attach."""

    def __init__(self, read: Callable[[], Any], ttl: float):
        self._read, self._ttl = read, ttl
        self._value: Any = None
        self._at: float | None = None
        self._reading = threading.Lock()

    def get(self) -> Any:
        if self._at is None:  # the first reading is waited for: there is no earlier one to answer
            with self._reading:
                if self._at is None:
                    self._refresh()
        elif time.monotonic() - self._at > self._ttl and self._reading.acquire(blocking=False):
            threading.Thread(target=self._refresh_then_release, name="sampled", daemon=True).start()
        return self._value

    def _refresh(self) -> None:
        try:
            self._value = self._read()
        finally:
            self._at = time.monotonic()

    def _refresh_then_release(self) -> None:
        try:
            self._refresh()
        finally:
            self._reading.release()


class AttachStats:
    """Attaches served and refused, and a bounded sample of their latencies, newest last."""

    def __init__(self) -> None:
        self.attach_seconds: list[float] = []
        self.attaches = 0
        self.misses = 0  # attaches refused because this cache cannot serve what was asked (fingerprint, failed load)
        self._lock = threading.Lock()

    def attached(self, seconds: float) -> None:
        # Sample before count: a status read in between then misses one sample, never pairs
        # a new count with an old sample.
        self.attach_seconds = (self.attach_seconds + [seconds])[-1000:]
        self.attaches += 1

    def missed(self) -> None:
        with self._lock:
            self.misses += 1


def status_document(spec: CacheSpec, socket_path: str, holder: "ArenaHolder", stats: AttachStats, free_bytes: Sampled,
                    clients: list[dict[str, Any]], refused: dict[str, int],
                    identity_reviews: Any) -> dict[str, Any]:
    """The `status` reply; the holder's fields are read as they are, without its lock."""
    cache, device = holder.cache, holder.device
    return {
        "type": "status",
        "phase": holder.phase.value,
        "error": holder.error,
        "pid": os.getpid(),
        "socket": socket_path,
        "model": os.path.abspath(spec.model),
        "revision": spec.revision,
        "spec": spec.to_json(),
        "backend": device.backend,
        "device": device.uuid,
        "adopted": holder.adopted,
        "filled_from": "adopted" if holder.adopted else holder.filled_from,
        "planned_from": holder.planned_from,
        "progress": holder.progress.to_json(),
        "fingerprint": cache.fingerprint if cache else None,
        "fields": cache.fields if cache else None,
        "layout_hash": cache.layout.layout_hash if cache else None,
        "bytes": cache.layout.nbytes if cache else 0,
        "arena_bytes": cache.layout.size if cache else 0,
        # Room for a second arena beside this one (a new model revision loading while engines
        # still map this one): the operator checks it before it starts such a transition.
        "free_bytes": free_bytes.get(),
        "tensors": len(cache.layout.slots) if cache else 0,
        "load_seconds": cache.load_seconds if cache else None,
        "load_breakdown": holder.timings,
        "startup": holder.startup.as_dict(),
        "prefetched_bytes": holder.prefetched,
        # The agent's own high-water mark (a cold load's staging, a manifest), not the arena's memory.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "attaches": stats.attaches,
        "misses": stats.misses,
        "refused_connections": refused,
        # Whether the served arena still holds what was loaded: state verified / tampered /
        # unverified / unavailable / error, the scrub's schedule and cost, arenas found changed.
        "integrity": holder.guard.to_json(),
        # TokenReviews sent to prove engines' pods (null off Kubernetes): repeats are cached.
        "identity_reviews": identity_reviews,
        # Recent latencies, newest last: the node supervisor feeds the ones it has not
        # seen (by the change in `attaches`) into its Prometheus histogram.
        "attach_seconds": stats.attach_seconds[-ATTACH_SAMPLES_IN_STATUS:],
        "clients": clients,
    }
