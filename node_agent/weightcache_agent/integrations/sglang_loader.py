"""The `weightcache` load format for SGLang: the model's weights are views of the agent's arena.

`WeightcacheModelLoader.load_model` runs in each scheduler process of an SGLang server (one per
tensor-parallel rank), where SGLang's `get_model_loader` instantiates the class that
`integrations.sglang` put in the `LoadConfig`:
  1. builds SGLang's model with every parameter on the meta device and every buffer real
     (rotary tables are computed by the model as usual): parameters move to meta as they are
     registered, keeping their class and SGLang's attributes (`weight_loader`, ...);
  2. attaches this rank's arena (its own socket, its own lease) naming the fused tensors
     (`attach(names="fused")`): every arena lays each rank's q|k|v and gate|up back to back, so
     SGLang's `qkv_proj` and `gate_up_proj` are one view each, as vLLM's are. A fused parameter
     whose parts the cache serves apart (a fusion the arena does not know) is assembled by
     copying, and counted;
  3. runs SGLang's post-load processing (the model's `post_load_weights`, each quantization
     method's `process_weights_after_loading`): unquantized layers on CUDA process nothing, so
     every weight stays a view; whatever a method replaces by a private tensor shows as copied;
  4. counts parameter bytes that are arena views and bytes that are copies, in one log line;
  5. hands the lease to `sglang_standby`: a standby gives its KV cache's memory back while it
     stands by, and takes it again when the agent promotes it.
A miss (no agent, another
fingerprint, a quantized or pipeline-parallel model) falls back to SGLang's default loader with
one WARNING naming the reason, or, with `"fallback": false`, fails with that reason in one
ERROR line.

Options (`--model-loader-extra-config`, JSON): `socket` (the agent's socket; `{rank}` is
replaced by the tensor-parallel rank; default: the environment the operator injects),
`fallback` (default true), `timeout` (seconds to wait for an agent still loading, default 600),
`revision` (the revision label the agent must serve).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket as socketlib
import time

import torch
from torch import nn

from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig, LoadFormat
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from sglang.srt.model_loader.loader import (BaseModelLoader, DefaultModelLoader, _get_quantization_config,
                                            _initialize_model, _post_load_weights)
from sglang.srt.model_loader.utils import set_default_torch_dtype

from ..client.env import ENV_ENGINE
from ..client.session import Attachment, attach
from ..load.progress import size_text as _size
from ..spec import CacheSpec
from . import sglang_standby
from ._engine_common import (MISSES, FusedCopies, NotServable, parameters_on_meta, parse_options,
                             prepare_in_background, socket_for_rank, view_bytes)

# under SGLang's logger tree, so the lines show where SGLang's do, in its format
log = logging.getLogger("sglang.srt.model_loader.weightcache")


class WeightcacheModelLoader(BaseModelLoader):
    """`--load-format weightcache` (see the module docstring)."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        options = parse_options(load_config.model_loader_extra_config)
        self.socket: str | None = options.get("socket")
        self.fallback: bool = options.get("fallback", True)
        self.timeout = float(options.get("timeout", 600.0))
        self.revision: str | None = options.get("revision")
        self.attachment: Attachment | None = None

    def __repr__(self) -> str:
        # what SGLang prints when asked to update weights in place from disk ("Failed to get model loader: ...")
        return ("WeightcacheModelLoader (the weights are the agent's shared, read-only arena: serve new weights "
                "through the agent as a new revision and restart the engine)")

    # -- SGLang's loader API -------------------------------------------------------------------

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the agent reads the checkpoint; a fallback downloads as SGLang does."""

    def load_model(self, *, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        rank = get_tensor_model_parallel_rank()
        sglang_standby.install()
        started = time.perf_counter()
        model: nn.Module | None = None
        try:
            spec = self._spec(model_config, rank)
            socket = socket_for_rank(self.socket, rank)
            # the attach path's once-per-process costs and the arena's mapping, while SGLang builds the model
            preparing = prepare_in_background(socket, rank, log)
            model, device = self._build(model_config, device_config)
            built = time.perf_counter()
            preparing.join()
            prepared = time.perf_counter()
            copier = FusedCopies(model)
            self.attachment = attach(model, spec, socket=socket, mode="client", fallback=False, timeout=self.timeout,
                                     materialize=copier.materialize, on_promote=sglang_standby.promoted,
                                     engine=engine_id(), names="fused")
        except MISSES as e:
            reason = f"{type(e).__name__}: {e}" if not isinstance(e, NotServable) else str(e)
            model = None  # the half-built model goes before the fallback builds its own
            return self._miss(reason, model_config, device_config)
        attached = time.perf_counter()
        with set_default_torch_dtype(model_config.dtype):
            post_process(model)
        model._weightcache = self.attachment  # the lease lives as long as the model
        # the lease's thread maps the KV cache back on promotion: on this rank's GPU, not its thread's default
        on = torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device
        sglang_standby.watch(self.attachment, on)
        views, copies = view_bytes(model, self.attachment)
        done = time.perf_counter()
        # where the time went: SGLang building the model (parameters on meta), the wait for the attach path's
        # preparation beyond that, the attach itself, SGLang's post-load processing
        log.info("weightcache: %s rank %d/%d attached from %s in %.3fs: %s in arena views, %s copied (%s); model "
                 "built in %.3fs, preparation waited on %.3fs, attach %.3fs, post-processing %.3fs",
                 os.path.basename(model_config.model_path.rstrip("/")), rank, spec.tp_size, socket,
                 done - started, _size(views), _size(copies), ", ".join(copier.copied) or "no copies",
                 built - started, prepared - built, attached - prepared, done - attached)
        return model.eval()

    # -- steps ---------------------------------------------------------------------------------

    def _spec(self, model_config: ModelConfig, rank: int) -> CacheSpec:
        if not os.path.isdir(model_config.model_path):
            raise NotServable(f"{model_config.model_path!r} is not a local directory (the agent reads a checkpoint "
                              "directory on the node)")
        if get_pp_group().world_size > 1:
            raise NotServable("pipeline parallelism is not served from the cache (tensor parallelism is)")
        if model_config.quantization or getattr(model_config, "modelopt_quant", None):
            raise NotServable(f"SGLang quantization {model_config.quantization or 'modelopt'!r} is not bound from the "
                              "cache yet: its linear methods repack weights after loading (serve an unquantized "
                              "checkpoint)")
        dtype = str(model_config.dtype).removeprefix("torch.")
        return CacheSpec(model=model_config.model_path, tp_size=get_tensor_model_parallel_world_size(), tp_rank=rank,
                         dtype=dtype, revision=self.revision)

    def _build(self, model_config: ModelConfig, device_config: DeviceConfig) -> tuple[nn.Module, torch.device]:
        device = torch.device(device_config.device)
        quant_config = _get_quantization_config(model_config, self.load_config)
        with set_default_torch_dtype(model_config.dtype), device, parameters_on_meta():
            model = _initialize_model(model_config, self.load_config, quant_config)
        return model, device

    def _miss(self, reason: str, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        where = self.socket or "the environment's agent"
        if not self.fallback:
            line = f"weightcache: cannot attach {model_config.model_path} from {where}: {reason} (fallback is off)"
            log.error("%s", line)
            raise RuntimeError(line) from None
        log.warning("weightcache: cache miss for %s (%s): %s; loading from disk with SGLang's default loader",
                    model_config.model_path, where, reason)
        gc.collect()  # the model built for the cache: its buffers go before the default loader builds another
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return DefaultModelLoader(default_config(self.load_config)).load_model(model_config=model_config,
                                                                               device_config=device_config)


def post_process(model: nn.Module) -> None:
    """SGLang's post-load processing, as its loaders that do not read the checkpoint run it: the model's
    own fix-up, then each quantization method's. The arena is read-only: what a step replaces becomes
    a private tensor of this engine (counted as copied); nothing is written in place."""
    _post_load_weights(model)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def default_config(load_config: LoadConfig) -> LoadConfig:
    """The same load configuration for SGLang's default loader: safetensors from disk, no options."""
    return dataclasses.replace(load_config, load_format=LoadFormat.AUTO, model_loader_extra_config={})


def engine_id() -> str:
    """One name for this server across its tensor-parallel ranks (each rank is a scheduler process of the
    same launcher), so that the ranks' agents promote the same engine: `$WEIGHTCACHE_ENGINE_ID`, else the
    host and the launcher's pid. In a pod of an EngineSet the pod's uid names it instead."""
    return os.environ.get(ENV_ENGINE) or f"sglang-{socketlib.gethostname()}-{os.getppid()}"
