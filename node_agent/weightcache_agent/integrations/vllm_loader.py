"""The `weightcache` load format for vLLM: the model's weights are views of the agent's arena.

`WeightcacheModelLoader.load_model`, in each tensor-parallel worker:
  1. builds vLLM's model with every parameter on the meta device and every buffer real
     (rotary tables, attention scales are computed by the model as usual): parameters are
     moved to meta as they are registered, keeping their class and vLLM's attributes;
  2. attaches this rank's arena (its own socket, its own lease) naming the fused tensors
     (`attach(names="fused")`): every arena lays q|k|v and gate|up back to back, so vLLM's
     fused `qkv_proj` and `gate_up_proj` are one view each. A fused parameter whose parts the
     cache serves apart (a model whose `packed_modules_mapping` the layout does not know, an
     incomplete group) is assembled by copying, and counted;
  3. runs vLLM's post-load processing with nothing that would rewrite an arena tensor: on CPU
     the linear layers stay on `F.linear` (or, for block FP8, vLLM's unpacked FP8 kernel) instead
     of a repacked copy (the arena is read-only, and a repack is a private copy of every weight);
     on CUDA unquantized layers process nothing, and block FP8 layers keep their weights as views
     (`vllm_fp8`: which quantization forms are served, and DeepGEMM's in-place re-quantization);
  4. counts parameter bytes that are arena views and bytes that are copies (by parameter name),
     logs them in one line and exports them as Prometheus gauges;
  5. hands the lease to `vllm_standby`: a standby gives its KV cache's memory back once warm,
     and takes it again when the agent promotes it.
A miss (no agent, another fingerprint, an unsupported model or quantization) falls back to
vLLM's default loader with one WARNING naming the reason, or, with `"fallback": false`,
fails with that reason in one ERROR line; so does a miss for a model that only an agent holds
(a bf16 checkpoint vLLM was told is block FP8, which the agent quantizes), whatever `fallback` says.

Options (`--model-loader-extra-config`): `socket` (the agent's socket; `{rank}` is replaced
by the tensor-parallel rank; default: the environment the operator injects, see `attach`),
`fallback` (default true), `timeout` (seconds to wait for an agent still loading, default
600), `revision` (the revision label the agent must serve).
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_default_torch_dtype

from ..client.session import Attachment, attach
from ..errors import WeightCacheError
from ..load.progress import size_text as _size
from ..protocol import agent_status
from ..spec import CacheSpec
from . import vllm_fp8, vllm_standby
from ._engine_common import (MISSES, FusedCopies, NotServable, copied_by_kind, parameters_on_meta, parse_options,
                             prepare_in_background, socket_for_rank, view_bytes)

# under vLLM's own logger tree, so the lines show where vLLM's do, in its format
log = init_logger("vllm.model_executor.model_loader.weightcache")


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
        self.quantization = "none"  # the agent's method for the model being loaded (vllm_fp8.cache_quantization)

    # -- vLLM's loader API ---------------------------------------------------------------------

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the agent reads the checkpoint; a fallback downloads as vLLM does."""

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """The arena bytes this rank will map (vLLM sizes its KV cache without them); 0 on a miss."""
        if self.attachment is not None:
            return self.attachment.bytes
        rank = get_tensor_model_parallel_rank()
        try:
            status = agent_status(socket_for_rank(self.socket, rank))
        except (WeightCacheError, OSError, NotServable):
            return 0
        return int(status.get("arena_bytes") or 0)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """vLLM's in-place reload: from disk into a model the fallback loaded; refused for one bound to
        the arena, whose weights are shared with other engines and read-only."""
        if getattr(model, "_weightcache", None) is not None:
            raise RuntimeError("weightcache: this model's weights are the agent's shared, read-only arena and cannot "
                               "be reloaded in place; serve new weights through the agent (a new revision) and "
                               "restart the engine")
        DefaultModelLoader(self._default_config()).load_weights(model, model_config)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        rank = get_tensor_model_parallel_rank()
        vllm_standby.install()
        started = time.perf_counter()
        # layers register by name as they are built: a fallback builds the model again
        layers = vllm_config.compilation_config.static_forward_context
        known = set(layers)
        self.quantization = "none"
        try:
            spec = self._spec(vllm_config, model_config, rank)
            socket = socket_for_rank(self.socket, rank)
            # the attach path's once-per-process costs and the arena's mapping, while vLLM builds the model
            preparing = prepare_in_background(socket, rank, log)
            model, device = self._build(vllm_config, model_config, prefix)
            built = time.perf_counter()
            preparing.join()
            prepared = time.perf_counter()
            copier = FusedCopies(model)
            self.attachment = attach(model, spec, socket=socket, mode="client", fallback=False, timeout=self.timeout,
                                     materialize=copier.materialize, on_promote=vllm_standby.promoted, names="fused")
        except MISSES as e:
            reason = f"{type(e).__name__}: {e}" if not isinstance(e, NotServable) else str(e)
            for name in set(layers) - known:
                del layers[name]
            return self._miss(reason, type(e).__name__, vllm_config, model_config, prefix)
        attached = time.perf_counter()
        with set_default_torch_dtype(model_config.dtype):
            _keep_cpu_weights_unpacked(model, device)
            with vllm_fp8.kept_as_views(model, list(self.attachment.tensors.values())) as notes:
                process_weights_after_loading(model, model_config, device)
        model._weightcache = self.attachment  # the lease lives as long as the model
        vllm_standby.watch(self.attachment)
        views, copies = view_bytes(model, self.attachment)
        done = time.perf_counter()
        # where the time went: vLLM building the model (parameters on meta), the wait for the attach path's
        # preparation beyond that, the attach itself, vLLM's post-load processing
        log.info("weightcache: %s rank %d/%d attached from %s in %.3fs: %s in arena views, %s copied (%s); model "
                 "built in %.3fs, preparation waited on %.3fs, attach %.3fs, post-processing %.3fs",
                 os.path.basename(model_config.model.rstrip("/")), rank, spec.tp_size, socket,
                 done - started, _size(views), _size(copies), _copies_text(model, self.attachment, copier, notes),
                 built - started, prepared - built, attached - prepared, done - attached)
        _metrics().record(source="agent", reason="", views=views, copies=copies)
        return model.eval()

    # -- steps ---------------------------------------------------------------------------------

    def _spec(self, vllm_config: VllmConfig, model_config: ModelConfig, rank: int) -> CacheSpec:
        if not os.path.isdir(model_config.model):
            raise NotServable(f"{model_config.model!r} is not a local directory (the agent reads a checkpoint "
                              "directory on the node)")
        if get_pp_group().world_size > 1:
            raise NotServable("pipeline parallelism is not served from the cache (tensor parallelism is)")
        self.quantization = vllm_fp8.cache_quantization(model_config, vllm_config.quant_config,
                                                        vllm_config.cache_config)
        dtype = str(model_config.dtype).removeprefix("torch.")
        return CacheSpec(model=model_config.model, tp_size=get_tensor_model_parallel_world_size(), tp_rank=rank,
                         dtype=dtype, revision=self.revision, quantization=self.quantization)

    def _build(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str) -> tuple[nn.Module, torch.device]:
        device_config = vllm_config.device_config
        device = torch.device(device_config.device if self.load_config.device is None else self.load_config.device)
        with set_default_torch_dtype(model_config.dtype), device, parameters_on_meta():
            model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        vllm_fp8.kv_scales_as_vllm_makes_them(model, device)
        return model, device

    def _miss(self, reason: str, kind: str, vllm_config: VllmConfig, model_config: ModelConfig,
              prefix: str) -> nn.Module:
        where = self.socket or "the environment's agent"
        no_disk = vllm_fp8.disk_serves(model_config.model, self.quantization)
        if self.fallback and no_disk:
            line = f"weightcache: cannot attach {model_config.model} from {where}: {reason}; no disk fallback: {no_disk}"
            log.error("%s", line)
            raise RuntimeError(line) from None
        if not self.fallback:
            line = f"weightcache: cannot attach {model_config.model} from {where}: {reason} (fallback is off)"
            log.error("%s", line)
            raise RuntimeError(line) from None
        log.warning("weightcache: cache miss for %s (%s): %s; loading from disk with vLLM's default loader",
                    model_config.model, where, reason)
        _metrics().record(source="disk", reason=kind, views=0, copies=0)
        return DefaultModelLoader(self._default_config()).load_model(vllm_config, model_config, prefix)

    def _default_config(self) -> LoadConfig:
        return dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})


def _copies_text(model: nn.Module, attachment: Attachment, copier: FusedCopies, notes: list[str]) -> str:
    """What was copied, for the log line: bytes by parameter name, fused parameters assembled, and why."""
    kinds = copied_by_kind(model, attachment)
    parts = [", ".join(f"{kind} {_size(n)}" for kind, n in kinds.items())] if kinds else []
    parts += [f"assembled {', '.join(copier.copied)}"] if copier.copied else []
    return "; ".join(parts + notes) or "no copies"


def _keep_cpu_weights_unpacked(model: nn.Module, device: torch.device) -> None:
    """On CPU, vLLM repacks each linear weight for oneDNN into a private copy (and drops the
    original): keep the arena's weights on `F.linear` instead, shared and read-only."""
    if device.type != "cpu" or not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, LinearBase):
            module._cpu_skip_gemm_dispatch = True
        elif isinstance(module, VocabParallelEmbedding) and module.quant_method is not None:
            # embeddings and the LM head: their method repacks unconditionally; the lookup itself needs no repack
            method = module.quant_method
            method.process_weights_after_loading = lambda layer: setattr(layer, "cpu_linear", F.linear)


class _Metrics:
    """`weightcache_vllm_loads_total{source,reason}` and the bytes of the last attach, views and copies."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.loads = Counter("weightcache_vllm_loads", "vLLM model loads by --load-format weightcache, by where the "
                             "weights came from (agent, or disk on a miss) and the kind of miss", ["source", "reason"])
        self.bytes = Gauge("weightcache_vllm_weight_bytes", "Parameter bytes of the loaded model that are arena views "
                           "(kind=view) or private copies (kind=copy)", ["kind"], multiprocess_mode="liveall")

    def record(self, source: str, reason: str, views: int, copies: int) -> None:
        self.loads.labels(source, reason).inc()
        self.bytes.labels("view").set(views)
        self.bytes.labels("copy").set(copies)


_metrics_instance: _Metrics | None = None


def _metrics() -> _Metrics:
    global _metrics_instance
    if _metrics_instance is None:
        _metrics_instance = _Metrics()
    return _metrics_instance
