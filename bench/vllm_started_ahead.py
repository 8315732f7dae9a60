"""A vLLM OpenAI server process started ahead of need: imported, no CUDA, waiting for a go.

What an engine pod's process could be while the group does not need it yet: this process imports
vLLM's API server (and with it torch, Dynamo, Inductor, and the weightcache plugin), prints
"imported", then waits until the file named by $WEIGHTCACHE_GO_FILE exists; then it runs vLLM's
API server as `python3 -m vllm.entrypoints.openai.api_server ARGS` would, in this process, so that
what a fresh process spends importing is already behind it. bench/vllm_startup.py times a start
from the go.

Usage: WEIGHTCACHE_GO_FILE=PATH python3 bench/vllm_started_ahead.py [vLLM's API server arguments]
"""
from __future__ import annotations

import os
import runpy
import sys
import time

import vllm.entrypoints.openai.api_server  # noqa: F401  (the point: imported before the go)

go = os.environ["WEIGHTCACHE_GO_FILE"]
print("imported", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
print("go", flush=True)
sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
