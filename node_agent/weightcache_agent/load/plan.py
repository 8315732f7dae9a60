"""The plan types every stage of the cold path shares.

`loader.plan_tensors` turns a checkpoint and a spec into `PlannedTensor`s (what the arena
holds and how each tensor gets there); the fill pipelines (`pipeline` for host memory,
`cuda_fill` for the GPU) consume them and advance one `LoadProgress`, which the agent's
status reads while the load runs (`progress`, which needs no torch: the agent imports it
before it knows whether a load will run). Kept apart so that the loader and its pipelines
import these, never each other.
"""
from __future__ import annotations

from dataclasses import dataclass

from .checkpoint import TensorRecord
from .dtypes import DType
from .progress import LoadProgress
from .sharding import Shard

__all__ = ["LoadProgress", "PlannedTensor"]


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    source: TensorRecord | None  # None: made by the loader (a quantization scale)
    kind: str = "weight"  # "weight" | "extra" (weight_scale_inv)
    shard: Shard | None = None  # which bytes of `source` this rank reads
    transform: str = "read"  # "read" (bytes as they are) | "cast" | "fp8"
