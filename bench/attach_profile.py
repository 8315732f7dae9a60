"""Where an attach spends its time: request, socket round trip, map, bind (and a profile).

Starts an agent for a checkpoint of 2001 small tensors (Llama names, 222 layers), then
attaches 24 times phase by phase -- binding alternately with the C extension and with the
pure-Python path -- prints the median of each phase, and profiles one whole `attach()`.
Use it to see per-tensor costs on a machine: `python bench/attach_profile.py cpu`
here, `PYTHONPATH=node_agent python3 bench/attach_profile.py cuda` on a GPU host.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from weightcache_agent import CacheSpec, agent_status, attach, protocol
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.client.session import _manifest_reply, _send_attach, map_arena
from weightcache_agent.errors import AgentUnavailable
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.client.rebind import _bindfast, bind_manifest
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("backend", choices=("cpu", "cuda"))
    p.add_argument("--dir", default=os.environ.get("WEIGHTCACHE_BENCH_DIR", "/tmp/weightcache-bench"))
    args = p.parse_args()
    model = os.path.join(args.dir, "profile-2001")
    if not os.path.exists(os.path.join(model, "config.json")):
        write_llama_checkpoint(model, LlamaShape(hidden_size=256, intermediate_size=512, num_hidden_layers=222,
                                                 num_attention_heads=8, num_key_value_heads=8, vocab_size=1024), shards=16)
    sock = os.path.join(tempfile.mkdtemp(prefix="wc-prof-"), "agent.sock")
    agent = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", sock,
                              "--backend", args.backend, "--progress", "never"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if agent_status(sock)["phase"] == "ready":
                    break
            except AgentUnavailable:
                pass
            time.sleep(0.05)
        shapes = {n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()}
        if args.backend == "cuda":
            torch.empty(1, device="cuda")  # the engine's CUDA context: not part of an attach
        phases: dict[str, list[float]] = {k: [] for k in ("request", "round trip", "map", "bind (C)", "bind (Python)")}
        for i in range(24):
            native = i % 2 == 0
            module = skeleton_module(shapes)
            t0 = time.perf_counter()
            request = engine_request(CacheSpec(model=model))
            t1 = time.perf_counter()
            conn = protocol.connect(sock)
            _send_attach(conn, "primary", None, None, request)
            reply, fds = _manifest_reply(conn)  # the rows packed, as attach receives them
            t2 = time.perf_counter()
            base = map_arena(reply, fds)
            t3 = time.perf_counter()
            bind_manifest(module, base, reply["tensors"], native=native)
            t4 = time.perf_counter()
            for key, value in (("request", t1 - t0), ("round trip", t2 - t1), ("map", t3 - t2),
                               ("bind (C)" if native else "bind (Python)", t4 - t3)):
                phases[key].append(value * 1e3)
            conn.close()
            for fd in fds:
                os.close(fd)
            del module, base
        print(f"{len(shapes)} tensors, {args.backend}, C extension {'built' if _bindfast else 'NOT built'}; "
              f"median ms per phase (after warm-ups):")
        print({k: round(statistics.median(v[1:]), 2) for k, v in phases.items()})
        module = skeleton_module(shapes)
        profile = cProfile.Profile()
        profile.runcall(lambda: attach(module, CacheSpec(model=model), socket=sock).close())
        pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    finally:
        agent.kill()
        agent.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
