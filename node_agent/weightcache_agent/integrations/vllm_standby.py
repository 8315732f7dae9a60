"""A vLLM standby holds no KV cache memory while it stands by, and gets it back when promoted.

A standby shares the primary's device and weights (the arena), so what it would hold of its own
is its KV cache. Flow, in each worker process of a vLLM engine loaded with `--load-format
weightcache`:
  1. the loader attaches with `on_promote=promoted` and hands the lease to `watch`;
  2. `install` (run by the loader, in the worker's process) wraps the worker's `compile_or_warm_up_model`:
     once the worker is warm (KV cache allocated, graphs captured) and its lease is a standby,
     the KV cache's memory is released, its addresses kept:
       - CUDA, with `--enable-sleep-mode`: vLLM's allocator unmaps the `kv_cache` pool's
         physical memory (what sleep mode level 1 does to the KV cache; weights are the arena's
         and stay mapped, captured graphs stay valid);
       - CPU (no sleep mode there): `madvise(MADV_DONTNEED)` over the KV buffer gives its pages
         back to the kernel; a page touched again comes back zero-filled;
  3. on promotion (the lease's thread, before the agent is told this engine serves, so before
     the serving label moves) the memory comes back: CUDA maps the pool again; on CPU the pages
     return as the cache fills, the full block count is there at once.
A forward pass while released (a request sent to the standby directly) wakes it first. A
demoted primary (planned switchover) keeps its cache: it drains what it holds.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import sys
import threading
import time
from typing import Any

import torch

from vllm.logger import init_logger

from ..client.session import Attachment
from ..load.progress import size_text as _size

log = init_logger("vllm.model_executor.model_loader.weightcache")
MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE


class _Standby:
    """This process's lease and worker, and whether the worker's KV cache memory is released."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attachment: Attachment | None = None
        self.worker: Any = None
        self.released = False

    def warm(self, worker: Any) -> None:
        with self.lock:
            self.worker = worker
            if self.attachment is not None and self.attachment.role == "standby" and not self.released:
                self._release()

    def wake(self, why: str) -> None:
        with self.lock:
            if self.released:
                self._wake(why)

    def _release(self) -> None:
        worker = self.worker
        spans = kv_spans(worker)
        total = sum(n for _, n in spans)
        if not spans:
            return
        if _on_cuda(worker):
            if not worker.vllm_config.model_config.enable_sleep_mode:
                log.warning("weightcache: this standby keeps its whole KV cache (%s) on the GPU while it stands by: "
                            "start vLLM with --enable-sleep-mode so that it releases it until promoted", _size(total))
                return
            _discard_kv_cache(worker)
        else:
            libc = _libc()
            for start, n in spans:
                lo, hi = -(-start // PAGE) * PAGE, (start + n) // PAGE * PAGE
                if hi > lo and libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED) != 0:
                    log.warning("weightcache: could not release the standby's KV cache (madvise failed, errno %d); "
                                "it keeps it", ctypes.get_errno())
                    return
        self.released = True
        log.info("weightcache: standby: released its KV cache (%s, %s resident now) until promoted", _size(total),
                 _size(resident_bytes(spans)) if not _on_cuda(worker) else "0 B")

    def _wake(self, why: str) -> None:
        started = time.perf_counter()
        worker = self.worker
        if _on_cuda(worker):
            worker.wake_up(["kv_cache"])
        self.released = False
        log.info("weightcache: %s: KV cache back (%s) in %.1f ms", why, _size(sum(n for _, n in kv_spans(worker))),
                 (time.perf_counter() - started) * 1e3)


_standby = _Standby()


def watch(attachment: Attachment) -> None:
    """The lease of this process's model: a standby's KV cache is released once the worker is warm."""
    with _standby.lock:
        _standby.attachment = attachment


def promoted(attachment: Attachment) -> None:
    """`attach`'s on_promote: the KV cache is back before the agent moves traffic here."""
    try:
        _standby.wake("promoted to primary")
    except Exception as e:  # noqa: BLE001 -- the lease thread must acknowledge; vLLM's next forward wakes it again
        log.error("weightcache: promoted, but the KV cache could not be restored now (%s: %s)", type(e).__name__, e)


def install() -> None:
    """Wrap the workers' warm-up (release when a warm standby) and forward passes (wake when released):
    vLLM's worker classes already imported in this process (the one whose loader runs)."""
    workers = (("vllm.v1.worker.gpu_worker", "Worker"), ("vllm.v1.worker.cpu_worker", "CPUWorker"))
    for cls in (getattr(sys.modules[m], name) for m, name in workers if m in sys.modules):
        _wrap(cls, "compile_or_warm_up_model", after=_after_warm_up)
        for name in ("execute_model", "execute_dummy_batch"):
            _wrap(cls, name, before=_before_forward)


def _after_warm_up(worker: Any) -> None:
    if worker.vllm_config.load_config.load_format == "weightcache":
        _standby.warm(worker)


def _before_forward(worker: Any) -> None:
    if _standby.released:
        _standby.wake("a forward pass reached the standby")


def _wrap(cls: type, name: str, *, before: Any = None, after: Any = None) -> None:
    original = cls.__dict__.get(name)
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


def kv_spans(worker: Any) -> list[tuple[int, int]]:
    """(address, bytes) of each distinct KV cache allocation of the worker's model runner."""
    spans: dict[int, int] = {}
    for kv in getattr(worker.model_runner, "kv_caches", None) or []:
        for t in kv if isinstance(kv, (list, tuple)) else (kv,):
            if isinstance(t, torch.Tensor) and t.numel():
                storage = t.untyped_storage()
                spans[storage.data_ptr()] = storage.nbytes()
    return sorted(spans.items())


def resident_bytes(spans: list[tuple[int, int]]) -> int:
    """Bytes of host memory `spans` hold in RAM now (mincore)."""
    libc, total = _libc(), 0
    for start, n in spans:
        lo, hi = start // PAGE * PAGE, -(-(start + n) // PAGE) * PAGE
        pages = (hi - lo) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0:
            total += sum(b & 1 for b in vec) * PAGE
    return total


def _discard_kv_cache(worker: Any) -> None:
    """Unmap the physical memory of the sleep-mode allocator's `kv_cache` pool, keeping its
    addresses; `worker.wake_up(["kv_cache"])` maps it again."""
    if hasattr(worker, "discard"):
        worker.discard(("kv_cache",))
        return
    # vLLM before the worker's `discard` (0.24): the same, through the allocator's own records
    from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        if data.tag == "kv_cache":
            unmap_and_release(data.handle)


def _on_cuda(worker: Any) -> bool:
    return getattr(worker, "device", None) is not None and worker.device.type == "cuda"


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

