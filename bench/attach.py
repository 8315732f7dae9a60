"""Attach vs. load: what an engine restart costs with and without the agent (cpu backend).

One run, same bytes, side by side:
  (a) baseline  -- safetensors `load_file` + `load_state_dict` into a materialised module
  (b) agent cold load -- `weightcache agent` process start to ready
  (c) attach   -- `attach()` in client mode, rebind included (fresh meta module each time)
  (d) rebind   -- `rebind()` alone on fresh views, per tensor; and `load_state_dict(assign=True)` for scale

Usage: python bench/attach.py [--gib 2] [--tensors 1024] [--repeat 20] [--dir DIR]
The checkpoint is generated once under --dir (default $WEIGHTCACHE_BENCH_DIR or /tmp/weightcache-bench).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

from weightcache_agent import CacheSpec, agent_status, attach
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.arena.cpu import map_readonly
from weightcache_agent.errors import AgentUnavailable
from weightcache_agent.load.loader import load_cache
from weightcache_agent.client.rebind import manifest_views, rebind
from weightcache_agent.testing.synthetic import skeleton_module, write_checkpoint


def make_checkpoint(directory: str, gib: float, count: int) -> str:
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return directory
    per = int(gib * 2**30 / count / 2)  # bf16 elements per tensor
    cols = 1024
    rows = max(per // cols, 1)
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.proj.weight": torch.randn(rows, cols, generator=gen).to(torch.bfloat16) for i in range(count)}
    print(f"writing {gib:.1f} GiB checkpoint with {count} tensors to {directory} ...", file=sys.stderr)
    return write_checkpoint(directory, tensors, {"architectures": ["Synthetic"]})


def skeleton(ckpt) -> torch.nn.Module:
    return skeleton_module({n: (r.shape, r.dtype) for n, r in ckpt.tensors.items()})


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--tensors", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--dir", default=os.environ.get("WEIGHTCACHE_BENCH_DIR", "/tmp/weightcache-bench"))
    args = p.parse_args()
    model = make_checkpoint(os.path.join(args.dir, f"attach-{args.gib:g}g-{args.tensors}"), args.gib, args.tensors)
    ckpt = open_checkpoint(model)
    n = len(ckpt.tensors)
    path = ckpt.files[0]
    with open(path, "rb") as f:  # warm the page cache: every variant reads warm bytes
        while f.read(64 << 20):
            pass

    def baseline() -> None:
        module = skeleton(ckpt).to_empty(device="cpu")
        module.load_state_dict(load_file(path))

    base = timed(baseline, 3)

    sock = os.path.join(tempfile.mkdtemp(prefix="wc-bench-"), "agent.sock")
    t0 = time.perf_counter()
    agent = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", sock,
                              "--progress", "never"], stderr=subprocess.DEVNULL)
    while True:
        try:
            status = agent_status(sock)
            if status["phase"] == "ready":
                break
        except AgentUnavailable:
            pass
        if agent.poll() is not None:
            raise SystemExit("agent exited")
        time.sleep(0.005)
    cold = time.perf_counter() - t0
    try:
        spec = CacheSpec(model=model)
        attaches, modules = [], [skeleton(ckpt) for _ in range(args.repeat)]
        for module in modules:
            t0 = time.perf_counter()
            att = attach(module, spec, socket=sock)
            attaches.append(time.perf_counter() - t0)
            att.close()
        del modules
    finally:
        agent.terminate()
        agent.wait()

    loaded = load_cache(CacheSpec(model=model))
    arena, columns = map_readonly(loaded.arena.fd, loaded.layout.size), loaded.layout.to_manifest()
    rebinds, assigns = [], []
    for _ in range(args.repeat):
        module, views = skeleton(ckpt), manifest_views(arena, columns)  # rebind consumes its views
        t0 = time.perf_counter()
        rebind(module, views)
        rebinds.append(time.perf_counter() - t0)
    for _ in range(3):
        module, views = skeleton(ckpt), manifest_views(arena, columns)
        t0 = time.perf_counter()
        module.load_state_dict(views, assign=True)
        assigns.append(time.perf_counter() - t0)

    b, a, r, s = statistics.median(base), statistics.median(attaches), statistics.median(rebinds), statistics.median(assigns)
    size = ckpt.nbytes / 2**30
    print(f"\n{size:.2f} GiB, {n} tensors, torch {torch.__version__}, {os.cpu_count()} cpus; medians of "
          f"{len(base)} / 1 / {len(attaches)} / {len(rebinds)} runs\n")
    print("| step | time | vs baseline |")
    print("| --- | ---: | ---: |")
    print(f"| (a) baseline: load_file + load_state_dict | {b * 1e3:.1f} ms | 1.0x |")
    print(f"| (b) agent cold load (process start to ready, warm page cache) | {cold * 1e3:.1f} ms | {b / cold:.2f}x |")
    print(f"| (c) attach incl. rebind (client mode) | {a * 1e3:.2f} ms (p90 {sorted(attaches)[int(0.9 * len(attaches))] * 1e3:.2f}) | **{b / a:.0f}x faster** |")
    print(f"| (d) rebind alone | {r * 1e3:.2f} ms = {r / n * 1e6:.2f} us/tensor | {b / r:.0f}x faster |")
    print(f"| (d') load_state_dict(assign=True) on the same views | {s * 1e3:.1f} ms = {s / n * 1e6:.1f} us/tensor | rebind is {s / r:.0f}x faster |")
    ok = b / a >= 50 and r / n * 1e6 <= 10
    print(f"\nbar: attach >= 50x faster than baseline ({b / a:.0f}x), rebind <= 10 us/tensor ({r / n * 1e6:.2f}): "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
