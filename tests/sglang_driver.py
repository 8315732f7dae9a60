"""Runs in SGLang's environment for tests/test_sglang.py: SGLang's own plugin loading, argument
parsing, loader selection and model construction, on the CPU device, with this checkout's code.

    python tests/sglang_driver.py '<json run>'    prints one line `RESULT <json>`

The tests do not start this script once per run: tests/sglang_zygote.py imports it and SGLang's
modules once, then forks one process per run, which calls `execute` as `main` does here.
This checkout's `node_agent` is put first on `sys.path`, and a distribution `weightcache` whose
only metadata is pyproject.toml's `sglang.srt.plugins` entry points is put beside it (in a
directory that lives as long as the process that made it): SGLang's `load_plugins` then finds the
plugin as it finds it in an installed weightcache. Runs:
  {"op": "parse", "argv": [...], "plugins": true}   load_plugins (unless false), then
      prepare_server_args(argv): the load format, and the loader SGLang's get_model_loader picks
  {"op": "load", "model": DIR, "dtype": "bfloat16", "extra": {...}, "tp": 1, "rank": 0, "port": N,
   "compare": true}   SGLang's model for DIR through `--load-format weightcache` (distributed state
      on gloo, TP `tp`), each parameter's bytes against SGLang's default loader's, views counted
  {"op": "standby", "role": ..., "group": ..., ...}   a load as that role of that group; a standby's
      KV cache release and promotion driven through a stand-in for SGLang's scheduler (its handlers
      need a GPU's memory saver), the promotion by the real agent
SGLang's CPU engine needs sgl-kernel's CPU build; without it SGLang builds its layers as for CUDA,
whose rotary embedding takes one kernel from vLLM when CUDA is absent: a placeholder stands for it
here, never called (no forward pass runs); with TP 2 the groups are gloo's alone (no NCCL on CPU).
Where torchvision does not load (CI's environment pairs SGLang with torch's CPU build, for which no
package index reachable here has a torchvision), placeholders stand for its modules: SGLang and
transformers import its image decoding and transforms at start, and nothing on this path calls them.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
import tempfile
import tomllib
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plugin_distribution(site: str) -> None:
    """Writes into the directory `site` a `weightcache` distribution: pyproject.toml's SGLang entry points."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    points = project["entry-points"]["sglang.srt.plugins"]
    info = os.path.join(site, f"weightcache-{project['version']}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: weightcache\nVersion: {project['version']}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))


def prepare(site: str) -> None:
    """This process made ready for runs: this checkout's agent first on `sys.path`, the plugin's distribution
    (written into `site`, which must outlive every run) beside it, placeholders where SGLang's imports need them."""
    plugin_distribution(site)
    sys.path[:0] = [os.path.join(ROOT, "node_agent"), site]
    placeholder_kernels()


class Placeholder(types.ModuleType):
    """A module whose every name is a placeholder: importable, usable as a default or a key, raises if called."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []
        self.__version__ = "0.26.0"  # the torchvision SGLang 0.5.17 pins, for version checks at import

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{self.__name__}.{name}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"placeholder {self.__name__}: not used on the path these tests run")


class PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of a package and its submodules, answered with placeholders."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.package and not name.startswith(self.package + "."):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return Placeholder(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def placeholder_kernels() -> None:
    vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*args: object, **kwargs: object) -> None:
        raise RuntimeError("placeholder kernel: no forward pass runs in these tests")

    ops.rotary_embedding = rotary_embedding
    vllm._custom_ops = ops
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", ops)
    try:
        importlib.import_module("torchvision.io")
    except (ImportError, RuntimeError):  # a torchvision built for another torch fails registering its ops
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, PlaceholderFinder("torchvision"))


def no_nccl() -> None:
    """SGLang's tensor-parallel groups open NCCL communicators beside gloo's; there is no NCCL on CPU, and
    loading needs no collective: the groups get gloo alone."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.device_communicators import pynccl

    class Off:
        disabled = True

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    pynccl.PyNcclCommunicator = Off
    parallel_state.set_custom_all_reduce(False)


class Lines(logging.Handler):
    """weightcache's log lines in SGLang's processes, kept."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def parse(run: dict) -> dict:
    from sglang.srt.plugins import load_plugins

    if run.get("plugins", True):
        load_plugins()
    from sglang.srt.server_args import prepare_server_args

    try:
        args = prepare_server_args([*run["argv"], "--device", "cpu"])  # no accelerator here
    except SystemExit as e:
        return {"exit": e.code}
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader

    out = {"load_format": str(args.load_format), "extra": args.model_loader_extra_config}
    try:
        loader = get_model_loader(LoadConfig(load_format=args.load_format,
                                             model_loader_extra_config=args.model_loader_extra_config))
        out.update(loader=f"{type(loader).__module__}.{type(loader).__qualname__}", repr=repr(loader))
    except ValueError as e:
        out["error"] = str(e)
    return out


def load(run: dict, lines: Lines) -> dict:
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler

    tp, rank = run.get("tp", 1), run.get("rank", 0)
    args = prepare_server_args(["--model-path", run["model"], "--dtype", run.get("dtype", "bfloat16"), "--load-format",
                                "weightcache", "--model-loader-extra-config", json.dumps(run.get("extra", {})),
                                "--tp-size", str(tp), "--device", "cpu"])
    set_global_server_args_for_scheduler(args)
    if tp > 1:
        no_nccl()
    init_distributed_environment(backend="gloo", world_size=tp, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{run['port']}")
    initialize_model_parallel(tensor_model_parallel_size=tp)
    model_config = ModelConfig.from_server_args(args)
    initialize_dp_attention(args, model_config)
    device = DeviceConfig("cpu", 0)
    loader = get_model_loader(LoadConfig(load_format=args.load_format, tp_rank=rank,
                                         model_loader_extra_config=args.model_loader_extra_config), model_config)
    out: dict = {"loader": type(loader).__name__}
    try:
        model = loader.load_model(model_config=model_config, device_config=device)
    except Exception as e:  # noqa: BLE001 -- the test reads what the engine would have died of
        return {**out, "error": f"{type(e).__name__}: {e}", "lines": lines.lines}
    attachment = getattr(model, "_weightcache", None)
    params = dict(model.named_parameters())
    out.update(source="agent" if attachment is not None else "disk", lines=lines.lines,
               params={n: [list(p.shape), str(p.dtype)] for n, p in params.items()},
               on_meta=[n for n, p in params.items() if p.is_meta])
    if attachment is not None:
        spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in attachment.tensors.values()]
        lo, hi = min(s for s, _ in spans), max(s + n for s, n in spans)
        out["copies"] = [n for n, p in params.items() if not lo <= p.data_ptr() < hi]
        out["read_only_views"] = all(not p.untyped_storage().nbytes() or lo <= p.data_ptr() < hi
                                     for p in params.values())
    if run.get("compare"):
        reference = DefaultModelLoader(LoadConfig(load_format="auto", tp_rank=rank)).load_model(
            model_config=model_config, device_config=device)
        ref = dict(reference.named_parameters())
        out["same_names"] = sorted(ref) == sorted(params)
        out["different"] = [n for n in ref if n in params and not (ref[n].shape == params[n].shape and
                                                                  bool((ref[n] == params[n]).all()))]
    return out


class StandInScheduler:
    """What `sglang_standby` calls on SGLang's scheduler, recorded: its release and resume handlers (a KV cache
    of 1 GiB, idle). SGLang's scheduler needs a GPU's memory saver to run them for real (bench/sglang_gpu.py)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], float]] = []
        scheduler = self

        class Adapter:
            enabled = True

        class Updater:
            memory_saver_adapter = Adapter()

            def release_memory_occupation(self, req: object) -> None:
                scheduler.calls.append(("release", list(req.tags), __import__("time").monotonic()))

            def resume_memory_occupation(self, req: object) -> None:
                scheduler.calls.append(("resume", list(req.tags), __import__("time").monotonic()))

        class Pool:
            def get_kvcache(self) -> object:
                return types.SimpleNamespace(mem_usage=1.0)

        self.weight_updater, self.token_to_kv_pool_allocator = Updater(), Pool()

    def is_fully_idle(self) -> bool:
        return True


def standby(run: dict, lines: Lines) -> dict:
    """Loaded as `run["role"]` of group `run["group"]`; a primary holds its lease until killed, a standby
    releases at an idle turn and waits (30 s at most) for the agent to promote it."""
    import time

    from weightcache_agent.integrations import sglang_standby

    os.environ.update(WEIGHTCACHE_ROLE=run["role"], WEIGHTCACHE_GROUP=run["group"])
    loaded = load(run, lines)
    print("LOADED " + json.dumps(loaded), flush=True)
    if run["role"] == "primary":
        time.sleep(600)
    scheduler = StandInScheduler()
    attachment = sglang_standby._standby.attachment
    sglang_standby._standby.idle(scheduler)
    sglang_standby._standby.idle(scheduler)  # released already: nothing more
    print("IDLE", flush=True)
    deadline = time.monotonic() + 30
    while attachment.role != "primary" and time.monotonic() < deadline:
        time.sleep(0.01)
    promoted_at = time.monotonic()
    time.sleep(0.5)
    sglang_standby._standby.idle(scheduler)  # a primary now: keeps its KV cache
    return {"role": attachment.role, "calls": [[name, tags, at - promoted_at] for name, tags, at in scheduler.calls],
            "released": sglang_standby._standby.released, "lines": lines.lines}


def execute(run: dict) -> None:
    """One run, in a process that `prepare` made ready and that ends with it: prints `RESULT <json>` last."""
    lines = Lines()
    logging.getLogger("sglang.srt.model_loader.weightcache").addHandler(lines)
    result = {"parse": parse, "load": lambda r: load(r, lines), "standby": lambda r: standby(r, lines)}[run["op"]](run)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    run = json.loads(sys.argv[1])
    with tempfile.TemporaryDirectory(prefix="wc-sglang-dist-") as site:
        prepare(site)
        execute(run)
    os._exit(0)  # SGLang's process groups and threads: nothing to tear down for a test


if __name__ == "__main__":
    main()
