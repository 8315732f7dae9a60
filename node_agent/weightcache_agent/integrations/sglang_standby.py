"""An SGLang standby holds no KV cache memory while it stands by, and gets it back when promoted.

A standby shares the primary's GPU and weights (the arena), so what it would hold of its own is
its KV cache. SGLang can give that memory back and take it again at the same addresses (its
`release_memory_occupation` / `resume_memory_occupation` with the tag `kv_cache`, on the memory
saver that `--enable-memory-saver` turns on): captured CUDA graphs stay valid. Flow, in each
scheduler process (one per tensor-parallel rank) of a server loaded with `--load-format
weightcache`:
  1. the loader attaches with `on_promote=promoted`, hands the lease to `watch`, and runs
     `install`, which wraps two methods of SGLang's `Scheduler` (the class SGLang uses in this
     process, before its event loop starts);
  2. `Scheduler.on_idle` (the event loop's idle turn, on the scheduler's thread): while the lease
     is a standby and the scheduler is fully idle, the KV cache is released through the
     scheduler's own handler: the radix cache is flushed (its pages' contents are gone), the
     memory saver unmaps the `kv_cache` region's physical memory and keeps its addresses;
  3. `Scheduler.get_next_batch_to_run` (before it, on the scheduler's thread): work reached a
     released standby (a request sent to it directly, the server's own warm-up): the memory is
     mapped again first. The standby releases it again at its next idle turn;
  4. on promotion (the lease's thread, before the agent is told this engine serves, so before
     the serving label moves) the memory is mapped again, and the engine, now a primary, keeps it.
A primary demoted by a planned switchover drains what it holds, then releases its KV cache at
its first idle turn as a standby. Without `--enable-memory-saver` a standby keeps its KV cache
and says so in one WARNING.
"""
from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from typing import Any, Callable

import torch

from ..client.session import Attachment
from ..load.progress import size_text as _size

log = logging.getLogger("sglang.srt.model_loader.weightcache")
KV_CACHE = "kv_cache"  # SGLang's GPU_MEMORY_TYPE_KV_CACHE
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"


class _Standby:
    """This process's lease and scheduler, and whether the scheduler's KV cache memory is released."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attachment: Attachment | None = None
        self.device: torch.device | None = None
        self.scheduler: Any = None
        self.released = False
        self.warned = False
        self.releases = 0

    def idle(self, scheduler: Any) -> None:
        """On the scheduler's thread, at an idle turn: release the KV cache of a standby."""
        attachment = self.attachment
        if attachment is None or self.released or self.warned or attachment.role != "standby":
            return
        with self.lock:
            if self.released or attachment.role != "standby" or not scheduler.is_fully_idle():
                return
            updater = scheduler.weight_updater
            total = kv_bytes(scheduler)
            if not updater.memory_saver_adapter.enabled:
                self.warned = True
                log.warning("weightcache: this standby keeps its whole KV cache (%s) on the GPU while it stands by: "
                            "start SGLang with --enable-memory-saver so that it releases it until promoted",
                            _size(total))
                return
            from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

            updater.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=[KV_CACHE]))
            self.scheduler, self.released = scheduler, True
            self.releases += 1
        log.info("weightcache: standby: released its KV cache (%s) until promoted", _size(total))

    def wake(self, why: str) -> None:
        """Map the KV cache again (any thread); nothing to do unless it is released."""
        if not self.released:
            return
        with self.lock:
            if not self.released:
                return
            started = time.perf_counter()
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the lease's thread: the scheduler's device current here too
            from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

            self.scheduler.weight_updater.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=[KV_CACHE]))
            self.released = False
            seconds = time.perf_counter() - started
        log.info("weightcache: %s: KV cache back (%s) in %.1f ms", why, _size(kv_bytes(self.scheduler)), seconds * 1e3)


_standby = _Standby()


def watch(attachment: Attachment, device: torch.device | None = None) -> None:
    """The lease of this process's model, and its device: a standby releases its KV cache when idle."""
    with _standby.lock:
        _standby.attachment, _standby.device = attachment, device


def promoted(attachment: Attachment) -> None:
    """`attach`'s on_promote: the KV cache is back before the agent moves traffic here."""
    try:
        _standby.wake("promoted to primary")
    except Exception as e:  # noqa: BLE001 -- the lease thread must acknowledge; the next batch wakes it again
        log.error("weightcache: promoted, but the KV cache could not be restored now (%s: %s)", type(e).__name__, e)


def install() -> None:
    """Wrap the idle turn (release when a standby) and the batch choice (wake when released) of the
    `Scheduler` class of this process (the one whose loader runs), once."""
    module = sys.modules.get(SCHEDULER_MODULE)
    scheduler = getattr(module, "Scheduler", None)
    if scheduler is None:  # a model loaded outside a server's scheduler: nothing stands by
        return
    _wrap(scheduler, "on_idle", after=_standby.idle)
    _wrap(scheduler, "get_next_batch_to_run", before=_before_batch)


def _before_batch(scheduler: Any) -> None:
    if _standby.released and not scheduler.is_fully_idle():
        _standby.wake("a request reached the standby")


def kv_bytes(scheduler: Any) -> int:
    """Bytes of the scheduler's KV cache pool (SGLang's own count), 0 where it has none."""
    try:
        return int(scheduler.token_to_kv_pool_allocator.get_kvcache().mem_usage * (1 << 30))
    except (AttributeError, TypeError, ValueError):
        return 0


def _wrap(cls: type, name: str, *, before: Callable[[Any], None] | None = None,
          after: Callable[[Any], None] | None = None) -> None:
    original = getattr(cls, name, None)
    if original is None or getattr(original, "_weightcache", False):
        return

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(self)
        result = original(self, *args, **kwargs)
        if after is not None:
            after(self)
        return result

    functools.update_wrapper(wrapper, original)
    wrapper._weightcache = True  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)
