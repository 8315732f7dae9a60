"""What an engine's load format needs from weightcache whatever the engine: no engine imported here.

An engine loader (SGLang's `sglang_loader`; vLLM's `vllm_loader` has its own copy of the same
steps) builds the engine's model, attaches this rank's arena and counts what it got. The steps
that know nothing of the engine live here:
  - `parse_options`: the loader's options (`--model-loader-extra-config`), each key and type
    checked, an unknown key or a wrong type refused by name;
  - `parameters_on_meta`: the model is built with every parameter moved to the meta device as it
    is registered (its class and the engine's attributes on it stay), buffers real;
  - `prepare_in_background`: the attach path's once-per-process costs and the arena's mapping,
    on a thread, while the engine builds its model;
  - `FusedCopies`: a fused parameter (`qkv_proj`, `gate_up_proj`, or whatever the model's
    `packed_modules_mapping` adds) whose parts the cache serves apart is assembled by copying,
    and named, through `attach`'s `materialize`;
  - `view_bytes`, `copied_by_kind`: after the engine's post-load processing, the parameter bytes
    that are views of the mapped arena and the bytes that are private copies (by parameter name).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..client.materialize import Materialize, Pending
from ..client.session import Attachment
from ..client.warmup import prepare
from ..errors import AttachError, WeightCacheError
from ..load.layout import FUSIONS

_swap = torch._C._swap_tensor_impl

# The options every engine loader takes, and their types.
OPTIONS: dict[str, Any] = {"socket": str, "fallback": bool, "timeout": (int, float), "revision": str}


class NotServable(Exception):
    """This engine's configuration has no weightcache equivalent (the reason is the message)."""


# What a miss looks like: anything the agent or its answer can be, and models the cache cannot serve.
MISSES = (WeightCacheError, TimeoutError, ConnectionError, EOFError, NotServable)


def parse_options(options: Mapping[str, Any] | None, load_format: str = "weightcache") -> dict[str, Any]:
    """The loader's options, checked: an unknown key or a wrong type is a `ValueError` naming it."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"--model-loader-extra-config: unknown key(s) {', '.join(unknown)} for load format "
                         f"{load_format} (known: {', '.join(OPTIONS)})")
    for key, value in options.items():
        if not isinstance(value, OPTIONS[key]) or (key == "timeout" and isinstance(value, bool)):
            raise ValueError(f"--model-loader-extra-config: {key} must be a {_kind(OPTIONS[key])}, got {value!r}")
    return options


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered meanwhile moves to the meta device as it is registered, in place
    (its class, and the attributes the engine hangs on it, stay); buffers stay where they are made."""
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            _swap(param, torch.empty_like(param, device="meta"))

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def prepare_in_background(socket: str | None, rank: int, log: logging.Logger) -> threading.Thread:
    """Start warming the attach path and mapping the agent's arena; join the thread before attaching.
    The device is this thread's current one (the rank's GPU), taken here: a new thread's is GPU 0."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

    def run() -> None:
        try:
            prepare(device=device, socket=socket, rank=rank)
        except Exception as e:  # noqa: BLE001 -- only a head start: the attach does the same work and reports
            log.debug("weightcache: preparing the attach path failed (%s); the attach does it", e)

    thread = threading.Thread(target=run, name="weightcache-prepare", daemon=True)
    thread.start()
    return thread


class FusedCopies:
    """Fused parameters whose parts the cache serves apart are assembled by copying, and named.

    The arena fuses what `FUSIONS` knows; a model may fuse more (its
    `packed_modules_mapping`), or a group may be incomplete in the cache: those parts are
    claimed from the bind and concatenated into the model's fused parameter."""

    def __init__(self, model: nn.Module):
        self.copied: list[str] = []
        fusions = {f.fused: f.parts for f in FUSIONS}
        fusions.update({k: tuple(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()})
        self.part_of = {part: fused for fused, parts in fusions.items() for part in parts}
        self.fusions = fusions
        self.declared = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        self.materialize = Materialize(fill=self._fill, claim=self._claim, places=self._places)

    def _place(self, name: str) -> str | None:
        """The model's fused parameter that cache tensor `name` is a part of, if it declares one."""
        module_name, _, leaf = name.rpartition(".")
        prefix, _, part = module_name.rpartition(".")
        fused = self.part_of.get(part)
        place = f"{prefix}.{fused}.{leaf}" if fused else None
        return place if place in self.declared else None

    def _claim(self, name: str) -> bool:
        return self._place(name) is not None

    def _places(self, model: nn.Module, claimed: list[str]) -> list[str]:
        return [self._place(name) for name in claimed]

    def _fill(self, model: nn.Module, pending: Pending) -> None:
        for place in pending.places:
            module_name, _, leaf = place.rpartition(".")
            prefix, _, fused = module_name.rpartition(".")
            names = [f"{prefix}.{part}.{leaf}" for part in self.fusions[fused]]
            missing = [n for n in names if n not in pending.claimed]
            if missing:
                raise AttachError(f"cannot attach: {place}: the cache holds no {', '.join(missing)} to assemble it from")
            current = model.get_submodule(module_name)._parameters[leaf]
            _swap(current, torch.cat([pending.claimed[n] for n in names]).to(pending.device))
            self.copied.append(place)


def view_bytes(model: nn.Module, attachment: Attachment) -> tuple[int, int]:
    """Parameter bytes inside the mapped arena, and outside it, once post-processing is done."""
    views = copies = 0
    for n in _copied(model, attachment).values():
        copies += n
    for param in dict.fromkeys(model.parameters()):
        views += param.numel() * param.element_size()
    return views - copies, copies


def copied_by_kind(model: nn.Module, attachment: Attachment) -> dict[str, int]:
    """Parameter bytes outside the mapped arena once post-processing is done, by the parameter's own
    name in its module (`weight`, `weight_scale_inv`, `bias`, ...), largest first."""
    return dict(sorted(_copied(model, attachment).items(), key=lambda kv: -kv[1]))


def _copied(model: nn.Module, attachment: Attachment) -> dict[str, int]:
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in attachment.tensors.values()]
    lo = min(start for start, _ in spans)
    hi = max(start + n for start, n in spans)
    kinds: dict[str, int] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen or lo <= param.data_ptr() < hi:
            continue
        seen.add(id(param))
        kind = name.rpartition(".")[2]
        kinds[kind] = kinds.get(kind, 0) + param.numel() * param.element_size()
    return kinds


def socket_for_rank(socket: str | None, rank: int) -> str:
    """This rank's agent socket: `socket` with `{rank}` replaced, else the environment's (what the
    operator injects into engine pods); `NotServable` when neither names one."""
    from ..client.env import socket_from_env

    if socket:
        return socket.replace("{rank}", str(rank))
    try:
        return socket_from_env(rank)
    except ValueError as e:
        raise NotServable(f"no agent named: pass --model-loader-extra-config '{{\"socket\": PATH}}' ({e})") from None


def _kind(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("number" if k in (int, float) else k.__name__ for k in kinds)
