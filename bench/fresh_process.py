"""What a user times: fresh processes, measured from outside, end to end; warm figures second.

One run, one backend (cpu here, cuda on a GPU host), the same checkpoint throughout:
  1. first attach in a fresh engine process (torch imported, CUDA context made, module
     on meta, before the timer), with and without `weightcache_agent.prepare(socket=...)`
     called at engine start (the attach path warmed, the agent's arena mapped), and the
     phases of that first attach; the median of later attaches in the same process second;
  2. agent restart with an engine attached (SIGKILL, start again): process start -> status
     says ready, bytes read from disk, and whether torch got loaded into the agent;
  3. cold load from process start, page cache dropped (`posix_fadvise(DONTNEED)` per file,
     and `drop_caches` where root may), per quantization, against the mean of two raw
     sequential reads of the same files, one just before and one just after; the agent's
     peak RSS and what it prefetched during start-up;
  4. N engine processes (default 64) attaching one agent at the same moment (each already
     started and prepared, released together): p50 / p99 of their attaches, and the
     slowest `status` answer from a poller asking every 10 ms throughout.

Usage: python bench/fresh_process.py cpu|cuda [--model DIR] [--engines 64] [--out DIR]
Without --model, a checkpoint of 2001 small tensors is written (222 Llama layers).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(HERE, "..", "node_agent")
sys.path.insert(0, PKG)

from agent_process import AgentProcess  # noqa: E402  (torch-free, as this module)
from page_cache import between_raw_reads  # noqa: E402
from report import bars_line, report  # noqa: E402
from weightcache_agent import agent_status  # noqa: E402  (torch-free)

ENGINE = r"""
import json, os, sys, time
t_start = time.perf_counter()
sys.path.insert(0, sys.argv[1])
import torch
model, sock, backend, prepare, later = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1", int(sys.argv[6])
import weightcache_agent
from weightcache_agent import CacheSpec, attach
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.synthetic import skeleton_module
if backend == "cuda":
    torch.empty(1, device="cuda")  # every engine makes its CUDA context: not part of an attach
shapes = {n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()}
module = skeleton_module(shapes)
if prepare:  # as an engine calls it while it starts: the attach path warmed, the agent's arena mapped
    weightcache_agent.prepare("cpu" if backend == "cpu" else 0, socket=sock)
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()  # released
t0 = time.perf_counter()
att = attach(module, CacheSpec(model=model), socket=sock)
first = time.perf_counter() - t0
out = {"first": first, "phases": att.phases, "later": []}
for _ in range(later):
    m = skeleton_module(shapes)
    t1 = time.perf_counter()
    a = attach(m, CacheSpec(model=model), socket=sock)
    out["later"].append(time.perf_counter() - t1)
    a.close()
    a = m = None  # the mapping goes with them, here: not inside the next attach's timer
print(json.dumps(out), flush=True)
sys.stdin.readline()  # hold the lease until told
att.close()
"""


class Agent(AgentProcess):
    """The agent, importing this checkout's package (see `_env`)."""

    def __init__(self, model: str, sock: str, backend: str, *extra: str):
        super().__init__(model, sock, backend, *extra, env=_env())


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = PKG + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Engine:
    def __init__(self, model: str, sock: str, backend: str, prepare: bool, later: int = 0):
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE, PKG, model, sock, backend, str(int(prepare)),
                                      str(later)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"engine died: {self.proc.wait()}")

    def go(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def result(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"engine died: {self.proc.wait()}")
        return json.loads(line)

    def finish(self) -> None:
        if self.proc.poll() is None:
            try:
                self.go()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def files_of(model: str) -> list[str]:
    return sorted(os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors"))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("backend", choices=("cpu", "cuda"))
    p.add_argument("--model", help="checkpoint directory (default: 2001 small tensors, written on first use)")
    p.add_argument("--cold-model", help="checkpoint for the cold loads (default: --model)")
    p.add_argument("--dir", default=os.environ.get("WEIGHTCACHE_BENCH_DIR", "/tmp/weightcache-bench"))
    p.add_argument("--fresh", type=int, default=5, help="fresh engine processes per variant")
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--quantizations", default="none,fp8-block")
    p.add_argument("--sections", default="attach,restart,concurrent,cold")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    sections = set(args.sections.split(","))
    model = args.model
    if model is None:
        from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

        model = os.path.join(args.dir, "profile-2001")
        if not os.path.exists(os.path.join(model, "config.json")):
            write_llama_checkpoint(model, LlamaShape(hidden_size=256, intermediate_size=512, num_hidden_layers=222,
                                                     num_attention_heads=8, num_key_value_heads=8, vocab_size=1024),
                                   shards=16)
    tmp = tempfile.mkdtemp(prefix="wc-fresh-")
    sock = os.path.join(tmp, "agent.sock")
    rows: list[tuple[str, str, str]] = []
    result: dict = {"backend": args.backend, "model": model}
    agent = Agent(model, sock, args.backend)
    st = agent.ready()
    result["tensors"], result["bytes"] = st["tensors"], st["bytes"]

    # 1. first attach in fresh engine processes, with and without prepare()
    for prepare in (True, False) if "attach" in sections else ():
        firsts, later, phases = [], [], []
        for _ in range(args.fresh):
            engine = Engine(model, sock, args.backend, prepare, later=5)
            engine.wait_ready()
            engine.go()
            out = engine.result()
            engine.finish()
            firsts.append(out["first"])
            later += out["later"]
            phases.append(out["phases"])
        key = "prepared" if prepare else "unprepared"
        result[f"first_attach_{key}"] = firsts
        result[f"later_attach_{key}"] = later
        split = ", ".join(f"{k} {statistics.median(ph[k] for ph in phases) * 1e3:.2f}" for k in phases[0])
        rows.append((f"first attach in a fresh engine process, {'with' if prepare else 'without'} `prepare(socket=...)` "
                     f"at engine start (median of {args.fresh} processes; phases ms: {split})",
                     ms(statistics.median(firsts)), f"max {ms(max(firsts))}"))
        if prepare:
            rows.append(("later attaches in those processes (median)", ms(statistics.median(later)), ""))

    # 2. agent restart with an engine attached
    held = Engine(model, sock, args.backend, True)
    held.wait_ready()
    held.go()
    held.result()
    if "restart" in sections:
        agent.stop(kill=True)
        agent = Agent(model, sock, args.backend)
        st = agent.ready()
        torch_in_agent = agent.torch_loaded()
        result["restart"] = {"wall_seconds": st["wall_seconds"], "adopted": st["adopted"],
                             "bytes_read": st["progress"]["bytes_done"], "torch_loaded": torch_in_agent}
        rows.append(("agent restart, engine attached: process start -> serving",
                     f"{st['wall_seconds'] * 1e3:.0f} ms",
                     f"adopted={st['adopted']}, {st['progress']['bytes_done']} bytes read, torch "
                     f"{'loaded' if torch_in_agent else 'not loaded'}"))

    # 4. N engines attaching at once, status polled throughout
    engines = [Engine(model, sock, args.backend, True) for _ in range(args.engines if "concurrent" in sections else 0)]
    for engine in engines:
        engine.wait_ready()
    status_times: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            agent_status(sock)
            status_times.append(time.perf_counter() - t0)
            stop.wait(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.05)
    for engine in engines:
        engine.go()
    times = [engine.result()["first"] for engine in engines]
    stop.set()
    poller.join()
    for engine in engines:
        engine.finish()
    held.finish()
    if engines:
        p50, p99 = pct(times, 0.5), pct(times, 0.99)
        result["concurrent"] = {"attach_s": times, "status_s": status_times}
        rows.append((f"{args.engines} engine processes attaching at once: p50 / p99 attach", f"{ms(p50)} / {ms(p99)}",
                     f"p99 = {p99 / p50:.2f}x p50"))
        rows.append((f"status while they attach ({len(status_times)} polls): median / max",
                     f"{ms(statistics.median(status_times))} / {ms(max(status_times))}", ""))
    agent.stop()

    # 3. cold load from process start, page cache dropped
    cold_model = args.cold_model or model
    files = files_of(cold_model)
    size = sum(os.path.getsize(f) for f in files)
    quants = args.quantizations.split(",") if "cold" in sections else []

    def cold_load(quant: str) -> tuple[dict, bool]:
        cold = Agent(cold_model, os.path.join(tmp, f"cold-{quant}.sock"), args.backend, "--quantization", quant)
        st = cold.ready()
        torch_loaded = cold.torch_loaded()
        cold.stop()
        return st, torch_loaded

    loads = [lambda quant=quant: cold_load(quant) for quant in quants]
    for quant, ((st, torch_in_cold), raw_before, raw_after) in zip(quants, between_raw_reads(files, loads)):
        raw = (raw_before + raw_after) / 2  # the mean of the raw reads around the load
        wall = st["wall_seconds"]
        result[f"cold_{quant}"] = {"raw_s": raw, "raw_before_s": raw_before, "raw_after_s": raw_after, "wall_s": wall,
                                   "load_s": st["load_seconds"], "torch_loaded": torch_in_cold,
                                   "peak_rss_bytes": st.get("peak_rss_bytes"),
                                   "prefetched_bytes": st.get("prefetched_bytes"),
                                   "breakdown": st.get("load_breakdown")}
        rows.append((f"cold load, {quant}, {size / 2**30:.1f} GiB: process start -> serving (raw reads just before and "
                     f"after: {raw_before:.2f} s, {raw_after:.2f} s = {size / raw / 1e9:.2f} GB/s on average)",
                     f"{wall:.2f} s = {size / wall / 1e9:.2f} GB/s",
                     f"{raw / wall:.2f} of raw; torch {'loaded' if torch_in_cold else 'not loaded'}"))
        phases = ", ".join(f"{k} {v:.2f}" for k, v in (st.get("load_breakdown") or {}).items()
                           if k in ("prepare", "fill", "prefetch"))
        rows.append((f"  agent peak RSS during it; bytes read ahead of the fill (s since load start: {phases})",
                     f"{(st.get('peak_rss_bytes') or 0) / 2**20:.0f} MiB",
                     f"{(st.get('prefetched_bytes') or 0) / 2**30:.2f} GiB prefetched"))

    bars = {}
    if "attach" in sections:
        bars["first attach <= 15 ms"] = statistics.median(result["first_attach_prepared"]) <= 0.015
    if "restart" in sections:
        bars["restart -> serving <= 1 s, 0 bytes"] = (result["restart"]["wall_seconds"] <= 1.0 and
                                                       result["restart"]["bytes_read"] == 0 and result["restart"]["adopted"])
    if engines:
        bars["concurrent p99 <= 2x p50"] = p99 <= 2 * p50
        bars["status <= 50 ms throughout"] = max(status_times) <= 0.05
    for quant in quants:
        c = result[f"cold_{quant}"]
        bars[f"cold {quant} >= 90% of raw"] = c["raw_s"] / c["wall_s"] >= 0.9
    lines = [f"{args.backend}, {result['tensors']} tensors, {result['bytes'] / 2**30:.2f} GiB attached", "",
             "| what (fresh processes, from outside) | time | note |", "| --- | ---: | --- |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    report(args.out, f"fresh_process_{args.backend}", lines + ["", bars_line(bars)], result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
