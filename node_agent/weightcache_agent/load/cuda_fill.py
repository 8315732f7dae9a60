"""The cold path into GPU memory: disk -> pinned staging -> async H2D -> (quantize) -> arena.

The plan, the shard segments and the reader are the cpu pipeline's (pipeline.py); only
the sink differs. The calling thread reads each piece of a shard into one of a few
pinned host buffers and queues its copy (and cast or FP8 quantization) on a CUDA
stream, then moves on to read the next piece while the GPU works: the disk never waits
for the GPU, and a buffer is reused only after the event recorded behind its copy has
fired. Quantization runs on the GPU, vectorised over whole pieces, and produces the same
bytes as the cpu path (power-of-two scales make every step exact but the final e4m3
rounding, which both devices do the same way). Non-finite weights are flagged on the
device and reported, by tensor name, after one synchronisation at the end.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from . import fp8
from ..errors import CheckpointError
from .layout import ArenaLayout
from .plan import LoadProgress, PlannedTensor
from .pipeline import STAGING_BYTES, _Reader, _rows, _rows_per_piece

if TYPE_CHECKING:
    from ..arena.cuda import CudaArena

STAGING_BUFFERS = 4


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
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return buf, memoryview((ctypes.c_char * nbytes).from_address(buf.data_ptr())).cast("B")


def fill_cuda_arena(arena: "CudaArena", layout: ArenaLayout, plan: list["PlannedTensor"], progress: "LoadProgress",
                    staging_bytes: int = STAGING_BYTES) -> None:
    device = torch.device("cuda", arena.ordinal)
    dest = arena.device_tensor()
    slots = {slot.name: slot for slot in layout.slots}
    stream = torch.cuda.Stream(device)
    staging = [_pinned(staging_bytes) for _ in range(STAGING_BUFFERS)]
    events: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
    flags: list[tuple[str, torch.Tensor]] = []
    reader = _Reader(progress)
    turn = 0
    try:
        for item in plan:
            if item.source is None:  # scales: written by the quantization of their weight
                continue
            segments = item.shard.segments()
            row_bytes, rows = _rows(item)
            block = fp8.BLOCK if item.transform == "fp8" else 1
            step = _rows_per_piece(row_bytes, rows, staging_bytes, block)
            for r0 in range(0, max(rows, 1), step):
                r1 = min(rows, r0 + step)
                need = (r1 - r0) * row_bytes if item.shard.nbytes else 0
                if need == 0:
                    continue
                if need <= staging_bytes:
                    k, turn = turn, (turn + 1) % STAGING_BUFFERS
                    if events[k] is not None:
                        events[k].synchronize()  # its previous copy has left the buffer
                    host, view = staging[k]
                else:  # one 128-row block wider than a staging buffer: a one-off buffer
                    k = None
                    host, view = _pinned(need)
                reader.read(item, segments, r0 * row_bytes, r1 * row_bytes, view[:need])
                with torch.cuda.stream(stream):
                    bad = _sink(item, host[:need], dest, slots, r0, r1, row_bytes, device)
                    if bad is not None:
                        flags.append((item.name, bad))
                    event = torch.cuda.Event()
                    event.record(stream)
                if k is not None:
                    events[k] = event
                else:
                    event.synchronize()
            progress.advance(0, tensors=1)
        stream.synchronize()
    finally:
        reader.close()
    for name, bad in flags:
        if bool(bad):
            raise CheckpointError(f"tensor {name!r}: non-finite values; cannot quantize")


def _sink(item: "PlannedTensor", host: torch.Tensor, dest: torch.Tensor, slots: dict, r0: int, r1: int,
          row_bytes: int, device: torch.device) -> torch.Tensor | None:
    """Queue the copy (and transform) of rows [r0, r1) of `item` from pinned `host` into the arena."""
    slot = slots[item.name]
    if item.transform == "read":
        lo = slot.offset + r0 * row_bytes
        dest[lo : lo + host.numel()].copy_(host, non_blocking=True)
        return None
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
