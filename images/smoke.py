"""Smoke test of an installed weightcache, run by the Python it is installed in.

Writes a tiny synthetic checkpoint, starts `weightcache agent --backend cpu` (the console
script beside this interpreter), waits for `weightcache status --socket ... --json` to say
ready, attaches an engine's module with `weightcache_agent.attach` and compares every
tensor with the checkpoint's. Prints one JSON line (what a test checks) and exits 0 only if
the engine attached from the agent with the checkpoint's bytes.

    python images/smoke.py                       # in a venv with the wheel installed
    buildah run -v $PWD/images:/smoke:ro CTR -- python3 /smoke/smoke.py   # in the agent image
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

import weightcache_agent
from weightcache_agent import CacheSpec, attach
from weightcache_agent.client import rebind
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint

BIN = os.path.dirname(sys.executable)


def command(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, name), *args], capture_output=True, text=True, timeout=120)


def wait_ready(socket: str, agent: subprocess.Popen, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            raise SystemExit(f"agent exited with {agent.returncode}: {agent.stderr.read()[-2000:]}")
        done = command("weightcache", "status", "--socket", socket, "--json")
        if done.returncode == 0 and json.loads(done.stdout).get("phase") == "ready":
            return json.loads(done.stdout)
        time.sleep(0.2)
    raise SystemExit(f"agent not ready after {timeout:.0f} s")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="wc-smoke-") as work:
        report = smoke(work)
    print(json.dumps(report), flush=True)
    return 0 if report["source"] == "agent" and report["equal"] else 1


def smoke(work: str) -> dict:
    model = write_llama_checkpoint(os.path.join(work, "model"),
                                   LlamaShape(hidden_size=64, intermediate_size=128, num_hidden_layers=1, vocab_size=128))
    socket = os.path.join(work, "agent.sock")
    helps = {name: command(name, "--help").returncode for name in ("weightcache", "weightcache-operator")}
    agent = subprocess.Popen([os.path.join(BIN, "weightcache"), "agent", "--model", model, "--socket", socket,
                              "--backend", "cpu", "--progress", "never"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        status = wait_ready(socket, agent)
        expected = load_file(os.path.join(model, "model.safetensors"))
        module = skeleton_module({name: (t.shape, t.dtype) for name, t in expected.items()})
        with attach(module, CacheSpec(model=model), socket=socket, mode="client", fallback=False) as att:
            params = dict(module.named_parameters())
            return {
                "package": os.path.dirname(weightcache_agent.__file__),
                "torch": torch.__version__,
                "help_exit": helps,
                "status_phase": status["phase"],
                "source": att.source,
                "tensors": len(params),
                "equal": sorted(params) == sorted(expected) and all(torch.equal(params[n], t) for n, t in expected.items()),
                "bind": "torch-native" if rebind._torch_rows is not None else "c" if rebind._bindfast is not None
                else "python",
            }
    finally:
        agent.terminate()
        agent.wait(30)

if __name__ == "__main__":
    sys.exit(main())
