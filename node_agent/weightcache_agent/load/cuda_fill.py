"""The cold path into GPU memory: disk -> pinned staging -> async H2D -> (cast / quantize) -> arena.

The jobs, the shard segments and the readers are the cpu pipeline's (reading.py: jobs in
file order, O_DIRECT for cold bytes, buffered for bytes the page cache holds); only the
sink differs. A few reader threads (`default_readers`) each take the next job, read it
into one of their two pinned host buffers and queue its copy on their own stream, then
take the next job while the GPU works: a request is always in flight, so the disk never
waits for a reader's copy or for the GPU, and a buffer is reused only after the event
recorded behind its copy has fired.

Two sinks. `_DriverSink` goes through the CUDA driver alone (`cuMemHostAlloc`,
`cuMemcpyHtoDAsync`, events), so the agent never imports torch: importing torch reads
gigabytes of libraries from the disk the checkpoint is being read from, and costs a cold
load seconds. It fills every plan that copies bytes as they are (the usual case, and every
pre-quantized checkpoint) or quantizes bf16 to FP8: the reader thread runs the C quantizer
(`fp8.quantize_bf16_at`, no GIL) into a second pinned buffer and copies the result. A cast,
or FP8 from another dtype, runs as torch kernels on the GPU (`_TorchSink`), vectorised
over whole pieces. Both produce the bytes of the cpu path (power-of-two scales make every
step exact but the final e4m3 rounding, which every quantizer does the same way).
Non-finite weights are refused by tensor name: at once by the C quantizer, after one
synchronisation at the end on the GPU.
"""
from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any

from . import fp8
from ..errors import CheckpointError
from .dtypes import torch_dtype
from .layout import ArenaLayout, TensorSlot
from .plan import LoadProgress, PlannedTensor
from .reading import (ALIGN, STAGING_BYTES, Files, Job, JobFeed, LockedProgress, Reader, align_up, at_normal_priority,
                      default_readers, rows_of)

if TYPE_CHECKING:
    import torch

    from ..arena.cuda import CudaArena

BUFFERS_PER_READER = 2


def quantize_blocks(src: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block-wise FP8 of `src` [R, C] into `out` (e4m3, [R, C]) and `scale` ([ceil(R/128), ceil(C/128)]).

    Same arithmetic as `fp8.quantize_rows`, all blocks at once. Returns a 0-d bool tensor
    on the device: True if `src` held a non-finite value (checked later, without a sync).
    """
    import torch

    rows, cols = src.shape
    rb, cb = scale.shape
    work = src if src.dtype == torch.bfloat16 else src.float()
    padded = torch.zeros(rb * fp8.BLOCK, cb * fp8.BLOCK, dtype=work.dtype, device=src.device)
    padded[:rows, :cols] = work
    blocks = padded.view(rb, fp8.BLOCK, cb, fp8.BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).float()
    bad = ~torch.isfinite(amax).all()
    k = fp8._pow2_exponent(torch.nan_to_num(amax, nan=0.0, posinf=0.0))
    scale.copy_(torch.ldexp(torch.ones_like(amax), k))
    inv = torch.ldexp(torch.ones_like(amax), -k).to(work.dtype)
    blocks.mul_(inv.view(rb, 1, cb, 1))  # exact: a power of two
    out.copy_(padded[:rows, :cols])  # the one rounding, into e4m3
    return bad


def _host_view(ptr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


class _DriverSink:
    """One reader's pinned buffers, stream and events, through the CUDA driver alone (no torch).

    Plain bytes are copied as they are. A bf16 piece to quantize (`driver_fills` admits no
    other transform) is quantized on the reader's own thread by the C quantizer, without the
    GIL, into a second pinned buffer -- e4m3 rows, then their scale rows -- and that is copied:
    the same bytes as the GPU kernels and the cpu backend, at several GB/s per thread."""

    def __init__(self, ordinal: int, base: int, slots: dict[str, TensorSlot], buffer_bytes: int):
        from ..arena.cuda import checked, driver, retain_context

        self._cu, self._checked = driver(), checked
        retain_context(ordinal)  # current on this thread: the current context is per thread
        self.base, self.slots = base, slots
        self.stream = self._checked(self._cu.cuStreamCreate(self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        # the driver's pinned allocations are page-aligned, as O_DIRECT reads need
        self._hosts = [self._alloc(buffer_bytes) for _ in range(BUFFERS_PER_READER)]
        self.buffers = [_host_view(ptr, buffer_bytes) for ptr in self._hosts]
        self._outs: list[tuple[int, int] | None] = [None] * BUFFERS_PER_READER  # (address, size) of quantized bytes
        self._events: list[Any] = [None] * BUFFERS_PER_READER
        self._oneoff: list[int] = []  # buffers of the one job that outgrew the staging buffers

    def _alloc(self, nbytes: int) -> int:
        return self._checked(self._cu.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc")

    def wait(self, k: int) -> None:
        if self._events[k] is not None:
            self._checked(self._cu.cuEventSynchronize(self._events[k]), "cuEventSynchronize")

    def oneoff(self, nbytes: int) -> memoryview:
        self._oneoff.append(self._alloc(nbytes))
        return _host_view(self._oneoff[-1], nbytes)

    def _out(self, k: int | None, nbytes: int) -> int:
        """A pinned buffer of `nbytes` for buffer k's quantized bytes (its previous copy has left it: `wait`)."""
        if k is None:
            self._oneoff.append(self._alloc(nbytes))
            return self._oneoff[-1]
        held = self._outs[k]
        if held is None or held[1] < nbytes:
            if held is not None:
                self._cu.cuMemFreeHost(held[0])
            self._outs[k] = held = (self._alloc(nbytes), nbytes)
        return held[0]

    def _h2d(self, offset: int, src: int, nbytes: int) -> None:
        self._checked(self._cu.cuMemcpyHtoDAsync(self.base + offset, src, nbytes, self.stream), "cuMemcpyHtoDAsync")

    def copy(self, job: Job, k: int | None, skip: int, nbytes: int, row_bytes: int) -> None:
        item = job.item
        slot = self.slots[item.name]
        src = (self._hosts[k] if k is not None else self._oneoff[-1]) + skip
        if item.transform == "read":
            self._h2d(slot.offset + job.lo * row_bytes, src, nbytes)
        else:  # fp8 of whole 128-row blocks of bf16: their scales are whole rows of the scale slot
            rows, cols = job.hi - job.lo, item.shard.shape[1]
            scale_at, scale_rows, scale_cols = fp8.scale_rows(self.slots[fp8.scale_name(item.name)], job.lo, rows)
            scale_bytes = scale_rows * scale_cols * 4
            at = align_up(rows * cols)  # the scales after the e4m3 rows
            out = self._out(k, at + scale_bytes)
            fp8.quantize_bf16_at(src, out, out + at, rows, cols, item.name)
            self._h2d(slot.offset + job.lo * cols, out, rows * cols)
            self._h2d(scale_at, out + at, scale_bytes)
        if k is None:
            self._checked(self._cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
            self._free_oneoff()
            return
        if self._events[k] is None:
            self._events[k] = self._checked(self._cu.cuEventCreate(self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                                         "cuEventCreate")
        self._checked(self._cu.cuEventRecord(self._events[k], self.stream), "cuEventRecord")

    def _free_oneoff(self) -> None:
        while self._oneoff:
            self._cu.cuMemFreeHost(self._oneoff.pop())

    def close(self) -> None:
        """Wait for every copy out of the buffers, then free them."""
        if self.stream is None:
            return
        self._cu.cuStreamSynchronize(self.stream)
        for event in self._events:
            if event is not None:
                self._cu.cuEventDestroy(event)
        self._free_oneoff()
        for ptr in self._hosts + [held[0] for held in self._outs if held is not None]:
            self._cu.cuMemFreeHost(ptr)
        self._cu.cuStreamDestroy(self.stream)
        self.stream = None


def driver_fills(plan: list["PlannedTensor"]) -> bool:
    """Whether the driver sink can fill this plan: bytes as they are, or bf16 quantized by the C quantizer."""
    return all(p.transform == "read" or fp8.quantized_natively(p) for p in plan)


class _TorchSink:
    """One reader's pinned buffers and stream as torch objects: copies, casts and quantization."""

    def __init__(self, arena: "CudaArena", slots: dict[str, TensorSlot], buffer_bytes: int, dest: "torch.Tensor",
                 flags: list):
        import torch

        self.torch, self.slots, self.dest, self.flags = torch, slots, dest, flags
        self.device = torch.device("cuda", arena.ordinal)
        torch.cuda.set_device(self.device)  # the current device is per thread
        self.stream = torch.cuda.Stream(self.device)
        pinned = [self._pinned(buffer_bytes) for _ in range(BUFFERS_PER_READER)]
        self._hosts = [host for host, _ in pinned]
        self.buffers = [view for _, view in pinned]
        self._events: list[Any] = [None] * BUFFERS_PER_READER
        self._oneoff: "torch.Tensor | None" = None

    def _pinned(self, nbytes: int) -> tuple["torch.Tensor", memoryview]:
        """A page-aligned pinned host buffer (O_DIRECT reads land in it), as a tensor and a memoryview."""
        whole = self.torch.empty(nbytes + ALIGN, dtype=self.torch.uint8, pin_memory=True)
        skip = -whole.data_ptr() % ALIGN
        buf = whole[skip : skip + nbytes]
        return buf, _host_view(buf.data_ptr(), nbytes)

    def wait(self, k: int) -> None:
        if self._events[k] is not None:
            self._events[k].synchronize()

    def oneoff(self, nbytes: int) -> memoryview:
        """A buffer for one 128-row block wider than a staging buffer: used once (`copy` with k None)."""
        self._oneoff, view = self._pinned(nbytes)
        return view

    def copy(self, job: Job, k: int | None, skip: int, nbytes: int, row_bytes: int) -> None:
        host = self._hosts[k] if k is not None else self._oneoff
        with self.torch.cuda.stream(self.stream):
            bad = _sink(job, host[skip : skip + nbytes], self.dest, self.slots, row_bytes, self.device)
            if bad is not None:
                self.flags.append((job.item.name, bad))
            event = self.torch.cuda.Event()
            event.record(self.stream)
        if k is None:
            event.synchronize()
            self._oneoff = None
        else:
            self._events[k] = event

    def close(self) -> None:
        self.stream.synchronize()


def fill_cuda_arena(arena: "CudaArena", layout: ArenaLayout, plan: list["PlannedTensor"], progress: "LoadProgress",
                    staging_bytes: int = STAGING_BYTES, readers: int | None = None, read_ahead: Any = None) -> None:
    """Read (and cast or quantize) every planned tensor into its slot of the device arena (module docstring).

    `read_ahead`: a read-ahead of the files to read behind (`Files.for_fill`)."""
    slots = {slot.name: slot for slot in layout.slots}
    files = Files.for_fill(read_ahead)
    progress_ = LockedProgress(progress)
    # Each pinned buffer takes exactly `staging_bytes` (torch's pinned allocator rounds a request up
    # to a power of two): an O_DIRECT read's aligned superset of a job, from any file offset, plus
    # the slack that aligns the buffer itself.
    pooled = staging_bytes - ALIGN
    job_bytes = staging_bytes - 2 * ALIGN
    feed = JobFeed(plan, slots, job_bytes, progress_)
    flags: list[tuple[str, Any]] = []
    errors: list[BaseException] = []
    if driver_fills(plan):
        base = arena.writable_ptr()  # one mapping, made before the readers share it

        def new_sink() -> Any:
            return _DriverSink(arena.ordinal, base, slots, pooled)
    else:
        dest = arena.device_tensor()

        def new_sink() -> Any:
            return _TorchSink(arena, slots, pooled, dest, flags)

    def read_loop() -> None:
        at_normal_priority()
        reader = Reader(progress_, files, pooled)
        sink = None
        turn = 0
        try:
            sink = new_sink()
            while not errors:
                job = feed.next()
                if job is None:
                    break
                row_bytes = rows_of(job.item)[0] if job.piece else 1
                lo, hi = job.lo * row_bytes, job.hi * row_bytes
                if hi > lo:
                    if hi - lo <= job_bytes:
                        k, turn = turn, (turn + 1) % BUFFERS_PER_READER
                        sink.wait(k)  # its previous copy has left the buffer
                        view = sink.buffers[k]
                    else:
                        k, view = None, sink.oneoff(align_up(hi - lo) + ALIGN)
                    direct = reader.direct(job.item, job.segments, lo, hi)
                    if direct is None:
                        reader.read(job.item, job.segments, lo, hi, view[: hi - lo])
                        skip = 0
                    else:
                        skip = reader.read_direct(direct, job.item, job.segments, lo, hi, view)
                    sink.copy(job, k, skip, hi - lo, row_bytes)
                feed.finish(job.item)
        except BaseException as e:  # the other readers see it and stop; re-raised below
            errors.append(e)
        finally:
            if sink is not None:
                sink.close()  # nothing of ours may still be copying out of a buffer we drop
            reader.close()

    threads = [threading.Thread(target=read_loop, name=f"cuda-fill-{k}", daemon=True)
               for k in range(max(1, readers or default_readers()))]
    try:
        for t in threads:
            t.start()
    except BaseException as e:
        errors.append(e)
    finally:
        for t in threads:
            if t.ident is not None:
                t.join()
        files.close()
    if errors:
        raise errors[0]
    for name, bad in flags:
        if bool(bad):
            raise CheckpointError(f"tensor {name!r}: non-finite values; cannot quantize")


def _sink(job: Job, host: "torch.Tensor", dest: "torch.Tensor", slots: dict, row_bytes: int,
          device: "torch.device") -> "torch.Tensor | None":
    """Queue the copy (and transform) of `job`'s bytes, in pinned `host`, into the arena.

    A plain job is shard bytes [lo, hi) (`row_bytes` 1); a piece is rows [lo, hi).
    """
    import torch

    item = job.item
    slot = slots[item.name]
    if item.transform == "read":
        lo = slot.offset + job.lo * row_bytes
        dest[lo : lo + host.numel()].copy_(host, non_blocking=True)
        return None
    r0, r1 = job.lo, job.hi
    src_item = item.source.dtype.itemsize
    out_row = row_bytes // src_item * item.dtype.itemsize
    n = r1 - r0
    staged = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    staged.copy_(host, non_blocking=True)
    src = staged.view(torch_dtype(item.source.dtype))
    lo = slot.offset + r0 * out_row
    out = dest[lo : lo + n * out_row].view(torch_dtype(item.dtype))
    if item.transform == "cast":
        out.copy_(src)
        return None
    cols = item.shard.shape[1]
    s_lo, s_rows, s_cols = fp8.scale_rows(slots[fp8.scale_name(item.name)], r0, n)
    scale = dest[s_lo : s_lo + s_rows * s_cols * 4].view(torch.float32).view(s_rows, s_cols)
    return quantize_blocks(src.view(n, cols), out.view(n, cols), scale)
