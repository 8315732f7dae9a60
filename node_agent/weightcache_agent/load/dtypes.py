"""Element types of checkpoint tensors, without torch.

Headers, plans, layouts and manifests name a tensor's type; none of them needs torch to
do so, and the agent's cold path into GPU memory copies bytes through the CUDA driver
alone, so it must not pay for importing torch (seconds, and gigabytes of libraries read
from the disk the checkpoint is being read from). `DType` carries what they use -- the
name, the item size, whether it is floating point -- and compares equal to the torch
dtype of the same name, so code holding either agrees. Torch work (a cast, a
quantization, an engine's views) asks `torch_dtype` for the real one.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class DType:
    name: str  # torch's name for it: "bfloat16", "float8_e4m3fn"
    itemsize: int
    is_floating_point: bool

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self.name == other.name
        loaded = sys.modules.get("torch")  # a torch dtype exists only once torch is imported
        if loaded is not None and isinstance(other, loaded.dtype):
            return self.name == str(other).removeprefix("torch.")
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DType({self.name!r})"


# safetensors dtype code -> DType
DTYPES: dict[str, DType] = {
    code: DType(name, size, floating)
    for code, name, size, floating in (
        ("F64", "float64", 8, True),
        ("F32", "float32", 4, True),
        ("F16", "float16", 2, True),
        ("BF16", "bfloat16", 2, True),
        ("I64", "int64", 8, False),
        ("I32", "int32", 4, False),
        ("I16", "int16", 2, False),
        ("I8", "int8", 1, False),
        ("U8", "uint8", 1, False),
        ("BOOL", "bool", 1, False),
        ("F8_E4M3", "float8_e4m3fn", 1, True),
        ("F8_E5M2", "float8_e5m2", 1, True),
        ("U16", "uint16", 2, False),
        ("U32", "uint32", 4, False),
        ("U64", "uint64", 8, False),
    )
}
BY_NAME: dict[str, DType] = {dt.name: dt for dt in DTYPES.values()}
FLOAT32 = BY_NAME["float32"]
BFLOAT16 = BY_NAME["bfloat16"]
FP8_E4M3 = BY_NAME["float8_e4m3fn"]


def dtype_name(dtype: Any) -> str:
    """`bfloat16` for a DType, a torch dtype, or the name itself."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r}; known: {', '.join(sorted(BY_NAME))}") from None


_torch_dtypes: dict[str, "torch.dtype"] = {}


def torch_dtype(dtype: Any) -> "torch.dtype":
    """The torch dtype for a DType or a name (imports torch: for code that makes tensors)."""
    name = dtype_name(dtype)
    found = _torch_dtypes.get(name)
    if found is None:
        import torch

        found = getattr(torch, dtype_from_name(name).name, None)
        if not isinstance(found, torch.dtype):
            raise CheckpointError(f"dtype {name!r} needs a newer torch than {torch.__version__}")
        _torch_dtypes[name] = found
    return found
