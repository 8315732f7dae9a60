"""A vLLM OpenAI server process started ahead of need: imported, no CUDA, waiting for a go.

What an engine pod's process could be while the group does not need it yet: this process imports
vLLM's API server (and with it torch, Dynamo, Inductor, and the weightcache plugin), prints
"imported", then waits until the file named by $WEIGHTCACHE_GO_FILE exists; then it runs vLLM's
API server as `python3 -m vllm.entrypoints.openai.api_server ARGS` would, in this process, so that
what a fresh process spends importing is already behind it. bench/vllm_startup.py times a start
from the go.

Deeper, with $WEIGHTCACHE_AHEAD_DEEPER=1: before the go it also imports what the engine core, its
worker and model runner, the model and torch.compile import later (a forked engine core inherits
them), and parses and checks the server's arguments (an engine's arguments are its pod's command,
known before it is needed); at the go it runs the server on those arguments. The "imported" line
says whether CUDA was initialized by then: it must not be, or vLLM spawns its engine core.

Usage: WEIGHTCACHE_GO_FILE=PATH [WEIGHTCACHE_AHEAD_DEEPER=1] python3 bench/vllm_started_ahead.py
       [vLLM's API server arguments]
"""
from __future__ import annotations

import importlib
import os
import runpy
import sys
import time

import vllm.entrypoints.openai.api_server as api_server

# What a forked engine core imports after the go (vLLM 0.24, one GPU): its process, executor,
# worker, model runner, attention backend, model and loader, and the compile path.
ENGINE_CORE_MODULES = (
    "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner", "vllm.v1.attention.backends.flash_attn",
    "vllm.model_executor.models.llama", "vllm.model_executor.model_loader",
    "weightcache_agent.integrations.vllm", "vllm.compilation.backends", "torch._inductor.compile_fx",
    "torch._inductor.codecache", "triton.compiler",
)


def prepare_deeper() -> object:
    """The engine core's modules imported and the server's arguments parsed; returns the arguments."""
    missing = []
    for name in ENGINE_CORE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        print("missing before the go: " + "; ".join(missing), flush=True)
    api_server.cli_env_setup()
    parser = api_server.make_arg_parser(api_server.FlexibleArgumentParser())
    args = parser.parse_args(sys.argv[1:])
    api_server.validate_parsed_serve_args(args)
    return args


args = prepare_deeper() if os.environ.get("WEIGHTCACHE_AHEAD_DEEPER") == "1" else None
import torch  # noqa: E402  (imported by vLLM already)

print(f"imported (CUDA initialized: {torch.cuda.is_initialized()})", flush=True)
go = os.environ["WEIGHTCACHE_GO_FILE"]
while not os.path.exists(go):
    time.sleep(0.005)
print("go", flush=True)
if args is None:
    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
else:
    api_server.uvloop.run(api_server.run_server(args))
