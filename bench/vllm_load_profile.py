"""Where vLLM's model loading spends its time, per loader: the span vLLM times as "Model loading
took", profiled.

For each case a fresh process builds vLLM's engine in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
eager mode: nothing compiled) and runs the model runner's `load_model` under cProfile; it prints
that span's wall time, the loaders' own lines, and the functions that took most of it. Cases:
`weightcache` (beside an agent holding the checkpoint), `auto` (vLLM's default loader, page cache
warm) and `auto-cold` (the same after the checkpoint's pages are dropped from the page cache with
`posix_fadvise(DONTNEED)`, as on a node that has not read it since boot).

Usage (vLLM importable): python3 bench/vllm_load_profile.py [--dir DIR] [--top 25]
    [--cases weightcache,auto,auto-cold] [--out DIR]     (bench/vllm_gpu.sh profile runs it on the H200)
The checkpoint is bench/vllm_gpu.py's synthetic Llama in DIR (made when missing), served by an agent
this script starts (default flags).
"""
from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30


def drop_page_cache(model: str) -> int:
    """Drops the checkpoint's pages from the page cache; the bytes asked for."""
    total = 0
    for path in glob.glob(os.path.join(model, "*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def child(case: str, model: str, sock: str, top: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import cProfile
    import io
    import pstats

    import torch
    from vllm import LLM, SamplingParams

    from vllm_gpu import PROMPT

    runners = []
    for module, name in (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
                         ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
                         ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner")):
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if "load_model" in cls.__dict__:
            runners.append(cls)
    spans: list[tuple[float, str]] = []

    def profiled(original):
        def load_model(self, *args, **kwargs):
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            try:
                return original(self, *args, **kwargs)
            finally:
                prof.disable()
                out = io.StringIO()
                stats = pstats.Stats(prof, stream=out)
                stats.sort_stats("cumulative").print_stats(top)
                stats.sort_stats("tottime").print_stats(top // 2)
                spans.append((time.perf_counter() - t0, out.getvalue()))
        return load_model

    for cls in runners:
        cls.load_model = profiled(cls.load_model)
    kwargs = {}
    if case == "weightcache":
        kwargs = {"load_format": "weightcache", "model_loader_extra_config": {"socket": sock, "fallback": False}}
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=1024, max_num_seqs=4,
              kv_cache_memory_bytes=GIB, gpu_memory_utilization=0.05, seed=0, **kwargs)
    text = llm.generate([{"prompt_token_ids": PROMPT}],
                        SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    seconds, table = spans[0]
    print(f"=== {case}: load_model {seconds:.3f} s (profiled), {torch.cuda.memory_allocated() / GIB:.2f} GiB "
          f"allocated by torch; completion {text!r}")
    print(table)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/wc-vllm-gpu")
    p.add_argument("--layers", type=int, default=None, help="default: bench/vllm_gpu.py's")
    p.add_argument("--hidden", type=int, default=None, help="default: bench/vllm_gpu.py's")
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--socket", default="", help=argparse.SUPPRESS)
    p.add_argument("--cases", default="weightcache,auto,auto-cold")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.model, args.socket, args.top)
        return 0
    import vllm_gpu
    from agent_process import AgentProcess

    layers, hidden = args.layers or vllm_gpu.LAYERS, args.hidden or vllm_gpu.HIDDEN
    args.model = os.path.join(args.dir, "llama")
    if not os.path.exists(os.path.join(args.model, "config.json")):
        size = vllm_gpu.make_checkpoint(args.model, vllm_gpu.llama_shape(layers, hidden))
        print(f"checkpoint: {size / GIB:.2f} GiB")
    args.socket = os.path.join(args.dir, "profile.sock")
    agent = AgentProcess(args.model, args.socket, "cuda" if vllm_gpu.CUDA else "cpu")
    agent.ready()
    try:
        return run_cases(args)
    finally:
        agent.stop()


def run_cases(args: argparse.Namespace) -> int:
    results = {}
    for case in args.cases.split(","):
        if case == "auto-cold":
            print(f"dropped {drop_page_cache(args.model) / GIB:.2f} GiB of checkpoint pages from the page cache")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", case, "--model", args.model, "--socket",
                               args.socket, "--top", str(args.top)], capture_output=True, text=True)
        lines = [line for line in (proc.stdout + proc.stderr).splitlines()
                 if any(k in line for k in ("took", "attached from", "Error"))]
        print(f"--- {case}: exit {proc.returncode}, process {time.perf_counter() - t0:.1f} s")
        print("\n".join(lines[-12:]))
        print(proc.stdout[proc.stdout.rfind("=== "):][-12000:])  # the child's own report: its span, the profile
        results[case] = {"exit": proc.returncode, "lines": lines, "stdout": proc.stdout, "stderr": proc.stderr[-20000:]}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "vllm_load_profile.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["exit"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
