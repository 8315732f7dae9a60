"""The first attach of an engine started just after a checkpoint streamed through the page cache.

An engine restarted while (or just after) an agent cold-loads meets a host whose page cache
was just dropped and refilled: its first attach is slower than on a quiet host. This runs
rounds of: drop the page cache (`drop_caches` where root may), read the checkpoint once as a
cold load does, then start one fresh engine process per package tree -- in alternating order,
so each tree is as often first after the stream as second -- and time its first attach
(torch imported, CUDA context made, module on meta, `prepare(socket=...)` called, before the timer),
its phases, its minor and major page faults, then five later attaches. One agent, of this
checkout, serves every round. Trees: this checkout's `node_agent`, and any named with
`--tree NAME=PATH` (another checkout's `node_agent`, its C extension built), side by side.

Usage: python bench/after_stream.py cpu|cuda [--model DIR | --gib G] [--tree old=PATH]
       [--rounds 6] [--budget SECONDS] [--out DIR]
Without --model: cuda writes a Llama-shaped checkpoint of 2001 tensors and about --gib GiB
(default 8), cpu one of 2001 small tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(HERE, "..", "node_agent")
sys.path.insert(0, PKG)

from agent_process import AgentProcess  # noqa: E402
from page_cache import drop_cache, raw_read  # noqa: E402
from report import report  # noqa: E402
from weightcache_agent.load.checkpoint import open_checkpoint  # noqa: E402

ENGINE = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[4])
import torch
import weightcache_agent
from weightcache_agent import CacheSpec, attach
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.synthetic import skeleton_module
model, sock, backend = sys.argv[1], sys.argv[2], sys.argv[3]
if backend == "cuda":
    torch.empty(1, device="cuda")
shapes = {n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()}
module = skeleton_module(shapes)
try:  # the attach path warmed and the agent's arena mapped, as an engine does while it starts
    weightcache_agent.prepare(0 if backend == "cuda" else "cpu", socket=sock)
except TypeError:  # a release whose prepare() maps no arena
    weightcache_agent.prepare(0 if backend == "cuda" else "cpu")
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
att = attach(module, CacheSpec(model=model), socket=sock)
first = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
later = []
for _ in range(5):
    m = skeleton_module(shapes)
    t1 = time.perf_counter()
    a = attach(m, CacheSpec(model=model), socket=sock)
    later.append(time.perf_counter() - t1)
    a.close()
    a = m = None
print(json.dumps({"first": first * 1e3, "phases": {k: v * 1e3 for k, v in att.phases.items()},
                  "minor": r1.ru_minflt - r0.ru_minflt, "major": r1.ru_majflt - r0.ru_majflt,
                  "later": [x * 1e3 for x in later]}))
"""


def checkpoint(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if args.backend == "cuda":
        from gpu_bench import make_checkpoint

        # 222 layers of this shape hold ~8.2 GiB: the 2001 tensors of the other benchmarks
        hidden = 1280 if args.gib <= 8.2 else 2560
        return make_checkpoint(os.path.join(args.dir, f"stream-{args.gib:g}g"), args.gib, 2000, hidden=hidden,
                               intermediate=hidden * 27 // 10, heads=hidden // 128)
    from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

    model = os.path.join(args.dir, "profile-2001")
    if not os.path.exists(os.path.join(model, "config.json")):
        write_llama_checkpoint(model, LlamaShape(hidden_size=256, intermediate_size=512, num_hidden_layers=222,
                                                 num_attention_heads=8, num_key_value_heads=8, vocab_size=1024),
                               shards=16)
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("backend", choices=("cpu", "cuda"))
    p.add_argument("--model", help="checkpoint directory (default: written on first use, see --gib)")
    p.add_argument("--gib", type=float, default=8, help="size of the cuda checkpoint written without --model")
    p.add_argument("--dir", default=os.environ.get("WEIGHTCACHE_BENCH_DIR", "/tmp/weightcache-bench"))
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="another package tree to compare (a checkout's node_agent); repeatable")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--budget", type=float, default=600, help="start no round after this many seconds")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    started = time.perf_counter()
    trees = {"this checkout": PKG, **dict(t.split("=", 1) for t in args.tree)}
    model = checkpoint(args)
    ck = open_checkpoint(model)
    files = ck.files
    sock = os.path.join(tempfile.mkdtemp(prefix="wc-stream-"), "agent.sock")
    agent = AgentProcess(model, sock, args.backend, env=dict(os.environ, PYTHONPATH=PKG))
    agent.ready()
    runs: list[dict] = []
    try:
        for r in range(args.rounds):
            if r and time.perf_counter() - started > args.budget:
                break
            drop_cache(files)
            stream = raw_read(files)
            order = list(trees) if len(trees) > 1 else [*trees] * 2  # one tree: its first and second engine
            order = order if r % 2 == 0 else order[::-1]
            for place, name in enumerate(order):
                out = subprocess.run([sys.executable, "-c", ENGINE, model, sock, args.backend, trees[name]],
                                     capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"engine of {name} failed: {out.stderr[-2000:]}")
                run = json.loads(out.stdout) | {"tree": name, "round": r, "place": place, "stream_s": stream}
                runs.append(run)
                print(json.dumps(run), file=sys.stderr, flush=True)
    finally:
        agent.proc.kill()
        agent.proc.wait()

    def of(tree: str, place: int) -> list[dict]:
        return [run for run in runs if run["tree"] == tree and run["place"] == place]

    def median(tree: str, place: int, key: str) -> float:
        return statistics.median(run[key] for run in of(tree, place))

    base = next(iter(trees))
    lines = [f"{len(ck.tensors)} tensors, {args.backend}; {len({run['round'] for run in runs})} rounds, "
             f"checkpoint streamed in {statistics.median(run['stream_s'] for run in runs):.2f} s (median)", "",
             "| tree | first attach, first engine after the stream | its bind | its minor / major faults | "
             "first attach, second engine | later attaches | first after the stream, of "
             f"{base}'s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in trees:
        firsts = ", ".join(f"{run['first']:.2f}" for run in of(name, 0))
        binds = statistics.median(run["phases"]["bind"] for run in of(name, 0))
        later = statistics.median(x for run in runs if run["tree"] == name for x in run["later"])
        lines.append(f"| {name} | {median(name, 0, 'first'):.2f} ms ({firsts}) | {binds:.2f} ms | "
                     f"{median(name, 0, 'minor'):.0f} / {median(name, 0, 'major'):.0f} | "
                     f"{median(name, 1, 'first'):.2f} ms | {later:.2f} ms | "
                     f"{median(name, 0, 'first') / median(base, 0, 'first'):.2f}x |")
    report(args.out, "after_stream", lines, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
