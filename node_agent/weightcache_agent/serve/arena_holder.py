"""The arena an agent serves: filled once, guarded, replaced when found changed.

`load()` walks the worker's lifecycle (serve/phase.py) through the fill sources
(serve/fill_sources.py), cheapest first:

    plan      the predecessor's record (a restart with engines to adopt from), another
              replica's record (with a peer), else the checkpoint's headers
    adopt     an engine that outlived the predecessor hands its arena back (`offer`, called by
              the rejoin handler), checked against the recorded digest (serve/arena_guard.py)
    copy      another replica's arena on this node, device to device
    read      the checkpoint from disk, behind the read-ahead started with the process

then digests the result, encodes the manifest once for every attach, records the plan for a
successor, and says ready. Handlers take the arena with `serving()`, which waits while a
refill is under way. A tamper report from the scrub quarantines the arena (nothing hands it
out), and a fresh one is filled from the checkpoint in its place (`_refill`).

The lease book's lock is this holder's too: who was handed the arena and which arena is served
change together.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

from ..arena.devices import Device
from ..errors import WeightCacheError
from ..load.layout import NAMINGS
from ..load.prefetch import Prefetch, lead_for, shard_paths
from ..load.progress import LoadProgress
from ..logs import Phases
from ..packed_rows import EncodedManifests
from ..spec import CacheSpec
from . import fill_sources
from .arena_guard import ArenaGuard
from .lease_book import LeaseBook
from .phase import Lifecycle, Phase
from .prepared_record import RecordedCache
from .restart_state import RestartState

if TYPE_CHECKING:
    from ..load.loader import LoadedCache, PreparedCache
    from ..load.peer_copy import PeerArena

log = logging.getLogger(__name__)


class ArenaHolder:
    def __init__(self, spec: CacheSpec, device: Device, socket_path: str, state: RestartState, book: LeaseBook,
                 scrub_interval: float, peer: str | None = None, read_ahead: Prefetch | None = None,
                 adopt_wait: float = 3.0, show_progress: bool = False):
        self.spec, self.device, self.socket_path = spec, device, socket_path
        self.state, self.book, self.lock = state, book, book.lock
        self.peer = peer  # another replica's socket for this rank: copy its arena instead of reading the disk
        self._read_ahead = read_ahead  # the checkpoint read into the page cache since the process started
        self.adopt_wait, self.show_progress = adopt_wait, show_progress
        self.lifecycle = Lifecycle()
        self.error: str | None = None
        self.progress = LoadProgress()
        self.startup = Phases()  # the load's steps, seconds since the process started
        self.timings: dict[str, float] = {}  # where the load's seconds went: prepare, allocate, fill
        self.prefetched = 0  # checkpoint bytes read into the page cache ahead of the fill (load/prefetch.py)
        self.filled_from = "disk"
        self.planned_from = "checkpoint"  # or "record" (a predecessor's), "peer" (another replica's record)
        self.adopted = False
        self.prepared: PreparedCache | RecordedCache | None = None
        self.cache: LoadedCache | None = None
        self.planned = threading.Event()  # `prepared` is set (or the load failed): a rejoin may be checked
        self.ready = threading.Event()  # set when an arena is served (or the load failed); cleared by a tamper
        self._adoption = threading.Event()
        self._adopted_arena: Any = None
        self._adoptable = False
        self._adopt_lock = threading.Lock()  # one offered arena checked at a time
        self._peer: PeerArena | None = None
        self._device_mark: str | None = None
        # Names this agent's arena in every manifest and "arena" reply: an engine that mapped the
        # arena while it started (`prepare(socket=...)`) uses that mapping only for the same arena.
        self.arena_id = secrets.token_hex(16)
        self.manifests: EncodedManifests | None = None  # the rows under each naming, once loaded
        self.guard = ArenaGuard(state, scrub_interval, self._on_tamper)

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    # -- the load --------------------------------------------------------------------------------

    def load(self) -> None:
        """Prepare from headers, then adopt an arena an engine hands back, copy a replica's, or read the disk.

        With engines to adopt from, the plan comes from the predecessor's record when it still
        holds (prepared_record.py): no torch, no header read, until a load from disk needs them.
        """
        self.lifecycle.to(Phase.PREPARING)
        adopting = self.adopt_wait > 0 and self.state.engines_may_hold_arena()
        prefetch = self._read_ahead_for(adopting)
        try:
            recorded, t0 = self._plan(adopting)
            if self._adoptable:
                self._wait_for_adoption(t0)
            if self.cache is None and self.peer:
                self._peer = self._peer or fill_sources.open_peer(self.peer, self.spec)
                if self._peer is not None:
                    self.cache = self._fill_from_peer(self._peer, t0)
            if self.cache is None:
                self._fill_from_disk(recorded is not None, t0, prefetch)
                recorded = None
        except BaseException as e:
            self.lifecycle.to(Phase.FAILED)
            self.error = str(e)
            self.planned.set()
            self.ready.set()  # wake waiting attaches so they get the error
            raise
        finally:
            self._after_fill(prefetch)
        self._publish(recorded is None or self.planned_from == "peer")

    def _read_ahead_for(self, adopting: bool) -> Prefetch | None:
        """The read-ahead the fill reads behind, when a load of whole files from disk is coming."""
        prefetch = None
        if self.spec.tp_size == 1 and not adopting and not self.peer:
            # A load from disk is coming: keep the disk busy while CUDA and the plan start up.
            # (One rank reads every byte; a tensor-parallel rank reads only its shards, so whole files would waste the disk.)
            paths = shard_paths(os.path.abspath(self.spec.model))
            lead = lead_for(paths, self.device.backend == "cpu")
            prefetch = self._read_ahead or Prefetch(paths, lead=lead)
            prefetch.follow(lambda: self.progress.bytes_done, lead)
        elif self._read_ahead is not None:
            self._read_ahead.stop()
        self._read_ahead = None
        return prefetch

    def _plan(self, adopting: bool) -> tuple[RecordedCache | None, float]:
        """`prepared`, from a record where one holds: (the record used, when planning began)."""
        # Device start-up (a CUDA context: ~0.2 s) is the process's, not the load's: keep it out of load_seconds.
        device_mark = self._device_mark = fill_sources.device_mark(self.device)
        self.startup.mark("device ready")
        t0 = time.monotonic()
        recorded = None
        if adopting:
            recorded = self.state.read_record(self.spec, device_mark)
            self.planned_from = "record" if recorded else "checkpoint"
        elif self.peer:
            # Another replica loads these very bytes: wait for it, then plan from its record.
            self.lifecycle.to(Phase.LOADING)
            self._peer = fill_sources.open_peer(self.peer, self.spec)
            if self._peer is not None:
                recorded = self.state.read_record(self.spec, device_mark, self.peer)
            self.planned_from = "peer" if recorded else "checkpoint"
        self.prepared = recorded or fill_sources.prepare(self.spec, device_mark)
        self.timings["prepare"] = time.monotonic() - t0 - (self._peer.wait_seconds if self._peer else 0.0)
        self.startup.mark("planned")
        self._adoptable = self.adopt_wait > 0 and bool(self.state.previous_leases())
        self.planned.set()
        return recorded, t0

    def _wait_for_adoption(self, t0: float) -> None:
        self.lifecycle.to(Phase.ADOPTING)
        log.info("an earlier agent served this cache with engines attached: waiting up to %.1fs for one to "
                 "hand the arena back", self.adopt_wait)
        self._adoption.wait(self.adopt_wait)
        with self._adopt_lock, self.lock:  # an offer being checked is finished first
            self._adoptable = False
        if self._adopted_arena is not None:
            self.cache = fill_sources.loaded(self.prepared, self._adopted_arena, time.monotonic() - t0)
            self.adopted = True
            log.info("re-adopted the arena from an engine in %.1fms; nothing read from disk",
                     self.cache.load_seconds * 1e3)

    def _fill_from_peer(self, peer: "PeerArena", t0: float) -> Any:
        """This rank's arena copied from another replica's (load/peer_copy), or None: read the disk."""
        assert self.prepared is not None
        self.lifecycle.to(Phase.LOADING)
        t1 = time.monotonic()
        arena = self._new_arena(self.prepared.layout.size)
        t2 = time.monotonic()
        info = fill_sources.copy_from_peer(peer, self.prepared, arena, self.peer or "")
        if info is None:
            return None
        self.filled_from = "peer"
        # fill: what this replica spent on its bytes, the wait for the source's own load left out
        self.timings.update(allocate=t2 - t1, peer_wait=info["wait_seconds"], peer_copy=info["copy_seconds"],
                            fill=time.monotonic() - t2)
        return fill_sources.loaded(self.prepared, arena, time.monotonic() - t0 - info["wait_seconds"])

    def _fill_from_disk(self, replan: bool, t0: float, prefetch: Prefetch | None) -> None:
        from ..load.loader import fill_cache

        if replan:  # no arena handed back or copied: plan from the checkpoint after all
            self.prepared = fill_sources.prepare(self.spec, self._device_mark)
            self.planned_from = "checkpoint"
        self.lifecycle.to(Phase.LOADING)
        t1 = time.monotonic()
        arena = self._new_arena(self.prepared.layout.size)
        t2 = time.monotonic()
        self.startup.mark("arena allocated")
        self.cache = fill_cache(self.prepared, arena, self.progress, show_bar=self.show_progress, started=t0,
                                read_ahead=prefetch)
        self.timings.update(allocate=t2 - t1, fill=time.monotonic() - t2)
        self.startup.mark("filled")

    def _after_fill(self, prefetch: Prefetch | None) -> None:
        if prefetch is not None:
            prefetch.stop()
            self.prefetched = prefetch.read
            self.timings["prefetch"] = prefetch.seconds  # from its first request until its last byte (or stop)
            if prefetch.read:
                self.startup.mark("read-ahead: first request", prefetch.began)
                self.startup.mark("read-ahead: last byte", prefetch.finished)
        if self._peer is not None:
            self._peer.close()
            self._peer = None

    def _publish(self, record: bool) -> None:
        """Digest the arena, encode the manifest once, record what a successor needs, say ready."""
        self._guard(self.cache.arena, fresh=not self.adopted)
        self.manifests = EncodedManifests(self.cache.layout, NAMINGS)
        if self.book.sorted():  # engines that rejoined during the load hold the arena too
            self.book.persist_or_warn("the engines that rejoined")
        if record:
            # What a successor or another replica may plan from. Before ready: a replica waiting
            # on this agent reads it as soon as its attach is answered.
            self.state.write_record(self.prepared)
        self.startup.mark("ready")
        with self.lock:
            # The scrub starts with the digest: an arena found changed already is the refill's to
            # declare ready (or failed), never this load's.
            if self.guard.tampered == 0:
                self.lifecycle.to(Phase.READY)
                self.ready.set()

    def _new_arena(self, size: int, fd: int | None = None) -> Any:
        return fill_sources.new_arena(self.device, self.spec, self.socket_path, size, fd)

    def _guard(self, arena: Any, fresh: bool) -> None:
        seconds = self.guard.guard(arena, fresh)
        if seconds is not None:
            self.timings["digest"] = seconds

    # -- adoption --------------------------------------------------------------------------------

    def offer(self, size: int, fd: int, pid: int | None, uid: int) -> bool:
        """Take the arena an engine offers (fd) as this agent's, where the adoption window is open and
        its bytes digest to what the predecessor recorded. Owns `fd` either way."""
        arena = None
        with self._adopt_lock:
            try:
                with self.lock:
                    open_window = self._adoptable and self._adopted_arena is None
                if not open_window:
                    return False
                # The layout's own size, never the client's: an arena of any other size is refused;
                # a memfd must carry every seal the agent puts on its own.
                arena = self._new_arena(size, fd=fd)
                fd = -1  # the arena owns it now
                seconds = self.guard.check_offer(arena, pid, uid)
                if seconds is None:
                    return False
                self.timings["digest"] = seconds
                with self.lock:
                    self._adopted_arena, arena = arena, None
                self._adoption.set()
                return True
            except (OSError, WeightCacheError, ValueError) as e:
                log.warning("could not adopt the arena offered by pid=%s uid=%s: %s", pid, uid, e)
                return False
            finally:
                if arena is not None:
                    arena.close()
                elif fd >= 0:
                    os.close(fd)

    # -- serving ---------------------------------------------------------------------------------

    def serving(self) -> tuple[Any, list[dict[str, Any]]] | None:
        """The cache to hand out and its arenas' description, once ready and not found changed (a
        refill in progress is waited for); None when there is none (the load or the refill failed)."""
        while True:
            self.ready.wait()
            with self.lock:
                if not self.guard.quarantined and self.ready.is_set():
                    cache = self.cache
                    if cache is None:
                        return None
                    return cache, [{"index": 0, "size": cache.arena.size, "backend": cache.arena.backend,
                                    "device": self.device.uuid, "id": self.arena_id}]

    # -- a changed arena -------------------------------------------------------------------------

    def _on_tamper(self, segment: int) -> None:
        """The served arena changed: stop handing it out, say so once, fill a fresh one."""
        with self.lock:
            if self.guard.quarantined:
                return
            self.guard.quarantined = True
            self.ready.clear()
            self.lifecycle.to(Phase.REFILLING)
            self.guard.tampered += 1
            holders = self.book.holders()
        shown = ", ".join(f"uid={u} pid={p}" for u, p in holders[:32]) + (" ..." if len(holders) > 32 else "")
        log.error("arena %s changed since this agent filled it (segment %d of %d differs from its keyed digest): "
                  "no longer handing it out, filling a fresh one; engines that map it serve changed weights; it was "
                  "handed to: %s", self.arena_id, segment, self.guard.segments(), shown or "nobody")
        threading.Thread(target=self._refill, name="refill", daemon=True).start()

    def _refill(self) -> None:
        """A fresh arena from the checkpoint, in place of one found changed. Attaches wait meanwhile;
        if it fails, they are refused (never given the changed arena)."""
        old = self.cache
        try:
            from ..load.loader import fill_cache

            if not hasattr(self.prepared, "plan"):  # planned from a record: the checkpoint is needed now
                self.prepared = fill_sources.prepare(self.spec, self._device_mark or
                                                     fill_sources.device_mark(self.device))
                self.planned_from = "checkpoint"
            arena = self._new_arena(self.prepared.layout.size)
            self.progress = LoadProgress()
            cache = fill_cache(self.prepared, arena, self.progress, show_bar=False)
            self._guard(arena, fresh=True)
        except Exception as e:  # noqa: BLE001 -- reported as the agent's failure: attaches are refused
            with self.lock:
                self.cache = None
                self.lifecycle.to(Phase.FAILED)
                self.error = f"the arena was found changed and refilling it failed: {e}"
            log.error("refilling the changed arena failed: %s; refusing attaches", e)
            self.ready.set()
            return
        with self.lock:
            self.cache, self.arena_id, self.adopted, self.filled_from = cache, secrets.token_hex(16), False, "disk"
            self.book.forget_handouts()
            self.guard.quarantined = False
            self.guard.refills += 1
            self.lifecycle.to(Phase.READY)
        self.ready.set()
        log.info("serving a fresh arena %s in place of the changed one (filled in %.2fs)", self.arena_id,
                 cache.load_seconds)
        if old is not None:
            old.arena.close()  # engines that still map it keep it alive; the agent holds none of it

    def close(self) -> None:
        self.guard.stop()
        if self.cache is not None:
            self.cache.arena.close()
