"""The cold path into GPU memory: disk -> pinned staging -> async H2D -> (quantize) -> arena.

The jobs, the shard segments and the readers are the cpu pipeline's (pipeline.py: jobs in
file order, O_DIRECT for cold bytes, buffered for bytes the page cache holds); only the
sink differs. A few reader threads (`default_readers`) each take the next job, read it
into one of their two pinned host buffers and queue its copy (and cast or FP8
quantization) on their own CUDA stream, then take the next job while the GPU works: a
request is always in flight, so the disk never waits for a reader's copy or for the
GPU, and a buffer is reused only after the event recorded behind its copy has fired. Quantization runs on the GPU, vectorised over whole pieces, and produces the same
bytes as the cpu path (power-of-two scales make every step exact but the final e4m3
rounding, which both devices do the same way). Non-finite weights are flagged on the
device and reported, by tensor name, after one synchronisation at the end.
"""
from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any

import torch

from . import fp8
from ..errors import CheckpointError
from .layout import ArenaLayout
from .plan import LoadProgress, PlannedTensor
from .pipeline import (ALIGN, STAGING_BYTES, _Files, _Job, _JobFeed, _LockedProgress, _Reader, _rows, _up,
                       default_readers)

if TYPE_CHECKING:
    from ..arena.cuda import CudaArena

BUFFERS_PER_READER = 2


def quantize_blocks(src: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block-wise FP8 of `src` [R, C] into `out` (e4m3, [R, C]) and `scale` ([ceil(R/128), ceil(C/128)]).

    Same arithmetic as `fp8.quantize_rows`, all blocks at once. Returns a 0-d bool tensor
    on the device: True if `src` held a non-finite value (checked later, without a sync).
    """
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


def _pinned(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """A page-aligned pinned host buffer (O_DIRECT reads land in it), as a tensor and a memoryview."""
    whole = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
    skip = -whole.data_ptr() % ALIGN
    buf = whole[skip : skip + nbytes]
    return buf, memoryview((ctypes.c_char * nbytes).from_address(buf.data_ptr())).cast("B")


def fill_cuda_arena(arena: "CudaArena", layout: ArenaLayout, plan: list["PlannedTensor"], progress: "LoadProgress",
                    staging_bytes: int = STAGING_BYTES, readers: int | None = None, read_ahead: Any = None) -> None:
    """Read and transform every planned tensor into its slot of the device arena (module docstring).

    `read_ahead`: a read-ahead of the files to read behind (`_Files.for_fill`)."""
    device = torch.device("cuda", arena.ordinal)
    dest = arena.device_tensor()
    slots = {slot.name: slot for slot in layout.slots}
    files = _Files.for_fill(read_ahead)
    progress_ = _LockedProgress(progress)
    # Each pinned buffer takes exactly `staging_bytes` (torch's pinned allocator rounds a request up
    # to a power of two): an O_DIRECT read's aligned superset of a job, from any file offset, plus
    # the slack that aligns the buffer itself.
    pooled = staging_bytes - ALIGN
    job_bytes = staging_bytes - 2 * ALIGN
    feed = _JobFeed(plan, slots, job_bytes, progress_)
    flags: list[tuple[str, torch.Tensor]] = []
    errors: list[BaseException] = []

    def read_loop() -> None:
        reader = _Reader(progress_, files, pooled)
        stream = None
        events: list[torch.cuda.Event | None] = [None] * BUFFERS_PER_READER
        turn = 0
        try:
            torch.cuda.set_device(device)  # the current device is per thread
            stream = torch.cuda.Stream(device)
            buffers = [_pinned(pooled) for _ in range(BUFFERS_PER_READER)]
            while not errors:
                job = feed.next()
                if job is None:
                    break
                row_bytes = _rows(job.item)[0] if job.piece else 1
                lo, hi = job.lo * row_bytes, job.hi * row_bytes
                if hi > lo:
                    if hi - lo <= job_bytes:
                        k, turn = turn, (turn + 1) % BUFFERS_PER_READER
                        if events[k] is not None:
                            events[k].synchronize()  # its previous copy has left the buffer
                        host, view = buffers[k]
                    else:  # one 128-row block wider than a staging buffer: a one-off buffer
                        k = None
                        host, view = _pinned(_up(hi - lo) + ALIGN)
                    direct = reader.direct(job.item, job.segments, lo, hi)
                    if direct is None:
                        reader.read(job.item, job.segments, lo, hi, view[: hi - lo])
                        skip = 0
                    else:
                        skip = reader.read_direct(direct, job.item, job.segments, lo, hi, view)
                    with torch.cuda.stream(stream):
                        bad = _sink(job, host[skip : skip + hi - lo], dest, slots, row_bytes, device)
                        if bad is not None:
                            flags.append((job.item.name, bad))
                        event = torch.cuda.Event()
                        event.record(stream)
                    if k is not None:
                        events[k] = event
                    else:
                        event.synchronize()
                feed.finish(job.item)
            stream.synchronize()
        except BaseException as e:  # the other readers see it and stop; re-raised below
            errors.append(e)
            if stream is not None:
                stream.synchronize()  # nothing of ours may still be copying out of a buffer we drop
        finally:
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


def _sink(job: "_Job", host: torch.Tensor, dest: torch.Tensor, slots: dict, row_bytes: int,
          device: torch.device) -> torch.Tensor | None:
    """Queue the copy (and transform) of `job`'s bytes, in pinned `host`, into the arena.

    A plain job is shard bytes [lo, hi) (`row_bytes` 1); a piece is rows [lo, hi).
    """
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
    src = staged.view(item.source.dtype)
    lo = slot.offset + r0 * out_row
    out = dest[lo : lo + n * out_row].view(item.dtype)
    if item.transform == "cast":
        out.copy_(src)
        return None
    cols = item.shard.shape[1]
    scale_slot = slots[fp8.scale_name(item.name)]
    s_cols = scale_slot.shape[1]
    s_row0, s_rows = r0 // fp8.BLOCK, -(-n // fp8.BLOCK)
    s_lo = scale_slot.offset + s_row0 * s_cols * 4
    scale = dest[s_lo : s_lo + s_rows * s_cols * 4].view(torch.float32).view(s_rows, s_cols)
    return quantize_blocks(src.view(n, cols), out.view(n, cols), scale)
