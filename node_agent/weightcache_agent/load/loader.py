"""The cold path: checkpoint on disk -> planned tensors -> filled, sealed arena.

`plan_tensors` decides what the arena holds: for every checkpoint tensor this rank's
shard (`sharding`), its final dtype, and how it gets there -- read as is, cast, or
quantized to block-wise FP8 (`fp8`, which adds a `weight_scale_inv` "extra" slot).
`lay_out` places the slots; the memory budget is checked before anything is
allocated; `pipeline.fill_arena` reads exactly the shard bytes and transforms them
while the disk keeps reading; the arena is then sealed. The agent and an engine in
`off` mode run exactly this code, which is what makes their weights bit-identical.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from . import fp8
from .checkpoint import Checkpoint, TensorRecord, file_signature, open_checkpoint, open_regular
from .dtypes import FLOAT32, FP8_E4M3, dtype_from_name
from ..arena.cpu import CpuArena, new_cpu_arena
from ..errors import CheckpointError, UnsupportedQuantization
from .fingerprint import fingerprint, fingerprint_fields, resolved_dtype
from .layout import ArenaLayout, lay_out
from .pipeline import fill_arena
from .plan import PlannedTensor
from .progress import LoadProgress, log_interval, size_text
from ..quantization import check_quantization
from .sharding import (SCALE_SUFFIX, Shard, ShardingPlan, check_heads, config_path, expert_index, expert_owner,
                       fused_parts, resolve_plan, split, whole)
from ..spec import CacheSpec

log = logging.getLogger(__name__)

@dataclass
class LoadedCache:
    spec: CacheSpec
    checkpoint: Checkpoint
    arena: CpuArena
    layout: ArenaLayout
    fields: dict[str, Any]
    fingerprint: str
    load_seconds: float


def plan_tensors(checkpoint: Checkpoint, spec: CacheSpec) -> list[PlannedTensor]:
    """What the arena holds, in file order so the disk reads sequentially."""
    check_quantization(spec.quantization)
    prequantized = fp8.checkpoint_quantization(checkpoint)
    if prequantized and spec.quantization != prequantized:
        raise UnsupportedQuantization(
            f"{config_path(checkpoint)}: the checkpoint is already {prequantized} quantized (weight_scale_inv "
            f"tensors, quantization_config); serve it with --quantization {prequantized}, not {spec.quantization!r}"
        )
    target = None if spec.dtype == "auto" else dtype_from_name(spec.dtype)
    sharded = spec.tp_size > 1
    plan = resolve_plan(checkpoint, spec.sharding) if sharded or spec.sharding else None
    _check_vocab(checkpoint)
    planned: list[PlannedTensor] = []
    for record in sorted(checkpoint.tensors.values(), key=lambda r: (r.file, r.start)):
        shard = shard_for(checkpoint, record, spec, plan)
        if shard is None:  # an expert another rank holds
            continue
        name, shape = record.name, shard.shape
        if name.endswith(SCALE_SUFFIX):
            planned.append(PlannedTensor(name, record.dtype, shape, record, "extra", shard))
        elif prequantized and record.dtype == FP8_E4M3:
            _check_scale(checkpoint, record)
            planned.append(PlannedTensor(name, record.dtype, shape, record, "weight", shard))
        elif (spec.quantization == "fp8-block" and not prequantized and record.dtype.is_floating_point
              and fp8.quantizable(name, shape)):
            planned.append(PlannedTensor(name, FP8_E4M3, shape, record, "weight", shard, "fp8"))
            planned.append(PlannedTensor(fp8.scale_name(name), FLOAT32, fp8.scale_shape(shape), None, "extra"))
        elif target is not None and record.dtype.is_floating_point and record.dtype.itemsize > 1 and record.dtype != target:
            planned.append(PlannedTensor(name, target, shape, record, "weight", shard, "cast"))
        else:
            planned.append(PlannedTensor(name, record.dtype, shape, record, "weight", shard))
    return planned


def shard_for(checkpoint: Checkpoint, record: TensorRecord, spec: CacheSpec, plan: ShardingPlan | None) -> Shard | None:
    """This rank's part of `record` (None when expert parallelism gives it to another rank)."""
    is_scale = record.name.endswith(SCALE_SUFFIX)
    base = record.name.removesuffix(SCALE_SUFFIX) + ".weight" if is_scale else record.name
    expert = expert_index(base)
    if spec.expert_parallel and expert is not None:
        # whole experts per rank, global names kept (see sharding's docstring)
        return whole(record) if expert_owner(checkpoint, base, expert, spec.tp_size) == spec.tp_rank else None
    if spec.tp_size == 1 or plan is None:
        return whole(record)
    rule = plan.rule_for(base)
    if rule is None or rule.mode == "replicated":
        return whole(record)
    dim = rule.split_dim
    check_heads(checkpoint, record, rule, spec.tp_size)
    if is_scale:
        weight = checkpoint.tensors.get(base)
        if weight is None:
            raise CheckpointError(f"{record.file}: tensor {record.name!r} has no weight {base!r} to scale")
        # the weight's slice must fall on 128 boundaries; the scale is then sliced in blocks
        parts = fused_parts(checkpoint, weight, rule, dim)
        split(weight, dim, parts, spec.tp_rank, spec.tp_size, block=fp8.BLOCK)
        return split(record, dim, tuple(p // fp8.BLOCK for p in parts), spec.tp_rank, spec.tp_size)
    parts = fused_parts(checkpoint, record, rule, dim)
    block = fp8.BLOCK if record.dtype == FP8_E4M3 and len(record.shape) == 2 and (
        fp8.scale_name(record.name) in checkpoint.tensors) else 1
    return split(record, dim, parts, spec.tp_rank, spec.tp_size, block=block)


def _check_scale(checkpoint: Checkpoint, weight: TensorRecord) -> None:
    scale = checkpoint.tensors.get(fp8.scale_name(weight.name))
    where = f"{weight.file}: tensor {weight.name!r}"
    if scale is None:
        raise CheckpointError(f"{where}: fp8 weight without its {fp8.scale_name(weight.name)!r}")
    if len(weight.shape) != 2 or scale.shape != fp8.scale_shape(weight.shape) or scale.dtype != FLOAT32:
        raise CheckpointError(
            f"{where}: weight_scale_inv is {list(scale.shape)} {scale.dtype}, but a {list(weight.shape)} weight "
            f"in 128x128 blocks needs float32 {list(fp8.scale_shape(weight.shape))}"
        )


def check_scales_finite(plan: list[PlannedTensor]) -> None:
    """Refuse an FP8 checkpoint whose `weight_scale_inv` holds NaN or infinity, as quantizing on load
    refuses non-finite weights: every value of such a block would dequantize to garbage, served
    without a word. The scales are 1/16384 of the weights' elements: read whole from the file
    (each scale tensor this rank serves), before any weight is."""
    import numpy

    for item in plan:
        record = item.source
        if record is None or item.kind != "extra" or not record.name.endswith(SCALE_SUFFIX) or record.dtype != FLOAT32:
            continue
        with open_regular(record.file) as f:
            raw = os.pread(f.fileno(), record.nbytes, record.start)
        if len(raw) != record.nbytes:
            raise CheckpointError(f"{record.file}: tensor {record.name!r}: truncated ({len(raw)} of {record.nbytes} bytes)")
        finite = numpy.isfinite(numpy.frombuffer(raw, dtype="<f4"))
        if not finite.all():
            first = int(numpy.argmin(finite))
            raise CheckpointError(f"{record.file}: tensor {record.name!r}: non-finite scale at element {first} "
                                  "(NaN or infinity): refused, as quantizing on load refuses non-finite values")


def _check_vocab(checkpoint: Checkpoint) -> None:
    """Embedding / lm_head rows must agree with config.json's vocab_size (a header that contradicts the config)."""
    vocab = (checkpoint.config or {}).get("vocab_size")
    if not isinstance(vocab, int):
        return
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        record = checkpoint.tensors.get(name)
        if record is not None and record.shape and record.shape[0] != vocab:
            raise CheckpointError(f"{record.file}: tensor {name!r} has {record.shape[0]} rows (dim 0) but "
                                  f"{config_path(checkpoint)} says vocab_size {vocab}")


@dataclass
class PreparedCache:
    """Everything known about a cache before its data is read: from headers and config alone."""

    spec: CacheSpec
    checkpoint: Checkpoint
    plan: list[PlannedTensor]
    layout: ArenaLayout
    fields: dict[str, Any]
    fingerprint: str


def prepare_cache(spec: CacheSpec, device: str = "cpu") -> PreparedCache:
    """Plan and lay out the arena for `spec`, refusing a checkpoint that is bad or too big."""
    checkpoint = open_checkpoint(spec.model)
    plan = plan_tensors(checkpoint, spec)
    check_scales_finite(plan)
    layout = lay_out((p.name, p.dtype, p.shape, p.kind) for p in plan)
    fields = fingerprint_fields(spec, checkpoint, device)
    return PreparedCache(spec, checkpoint, plan, layout, fields, fingerprint(fields))


def fill_cache(prepared: PreparedCache, arena: Any, progress: LoadProgress | None = None, show_bar: bool = False,
               started: float | None = None, read_ahead: Any = None) -> LoadedCache:
    """Read the checkpoint into `arena` (cpu or cuda) and seal it. Closes the arena on failure.

    `read_ahead`: a `prefetch.Prefetch` reading the files into the page cache; the fill then
    reads buffered, right behind it (see prefetch.py).
    """
    t0 = time.monotonic() if started is None else started
    plan, layout, checkpoint, spec = prepared.plan, prepared.layout, prepared.checkpoint, prepared.spec
    progress = progress or LoadProgress()
    # read = this rank's bytes of the source tensors; resident = the arena's tensors after cast / quantization
    progress.start(sum(p.shard.nbytes for p in plan if p.shard is not None),
                   sum(1 for p in plan if p.source is not None), show_bar,
                   bytes_resident=layout.nbytes, tensors_resident=len(plan), quantization=spec.quantization,
                   log_every=0.0 if show_bar else log_interval(), what=_what(checkpoint, spec))
    log.info("loading %s: reading %d source tensors, %s -> %s", checkpoint.directory, progress.tensors_total,
             size_text(progress.bytes_total), progress.target())
    try:
        if getattr(arena, "backend", "cpu") == "cuda":
            from .cuda_fill import fill_cuda_arena

            try:
                fill_cuda_arena(arena, layout, plan, progress, read_ahead=read_ahead)
            finally:
                progress.finish()
        else:
            # with the memfd, fill_arena writes into it (sendfile / pwrite: no page faults, no
            # zeroing) and the writes allocate an arena made with reserve=False; without, it
            # writes through the mapping, reserving pages on a thread ahead of the readers
            upfront = getattr(arena, "reserved_upfront", True)
            buffer = arena.writable(populate=upfront)
            try:
                fill_arena(buffer, layout, plan, progress, reserve=None if upfront else arena.reserve,
                           fd=getattr(arena, "fd", None), read_ahead=read_ahead)
            finally:
                buffer.release()
                progress.finish()
        # The files read must be the ones whose headers were planned: one replaced or rewritten
        # meanwhile (os.replace, an in-place write) would leave the arena a mix of two checkpoints.
        # Their identity (name, size, mtime, inode, ctime) was taken before the headers were read.
        if checkpoint.signature and file_signature(checkpoint.directory) != checkpoint.signature:
            raise CheckpointError(f"{checkpoint.directory}: the checkpoint's files changed while they were being "
                                  "loaded (replaced or rewritten): nothing of this load is served; load again")
        arena.seal()
    except BaseException:
        arena.close()
        raise
    finally:
        progress.finish()  # also when the fill never started: the progress lines stop with the load
    loaded = loaded_from(prepared, arena, time.monotonic() - t0)
    log.info("loaded %s: read %d source tensors, %s -> %s in %.2fs (dtype %s)", checkpoint.directory,
             progress.tensors_total, size_text(progress.bytes_total), progress.target(), loaded.load_seconds,
             resolved_dtype(spec, checkpoint))
    return loaded


def _what(checkpoint: Checkpoint, spec: CacheSpec) -> str:
    """The model (and rank, when sharded) a progress line is about: a node's ranks share one log."""
    name = os.path.basename(os.path.normpath(checkpoint.directory))
    return f"{name} rank {spec.tp_rank}/{spec.tp_size}" if spec.tp_size > 1 else name


def loaded_from(prepared: PreparedCache, arena: Any, seconds: float) -> LoadedCache:
    return LoadedCache(prepared.spec, prepared.checkpoint, arena, prepared.layout, prepared.fields,
                       prepared.fingerprint, seconds)


def load_cache(spec: CacheSpec, progress: LoadProgress | None = None, show_bar: bool = False, name: str = "weightcache") -> LoadedCache:
    """Run the whole cold path for `spec` on the cpu backend and return a sealed arena with its layout."""
    t0 = time.monotonic()
    prepared = prepare_cache(spec)
    return fill_cache(prepared, new_cpu_arena(prepared.layout.size, spec, name), progress, show_bar, started=t0)
