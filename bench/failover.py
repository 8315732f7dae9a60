"""Failover vs cold restart, side by side in one run, on the same checkpoint.

Failover (hot standby through the agent): an agent, a primary and a standby of one
group. Each trial SIGKILLs the current primary and times until the standby answers a
`POST /generate` with 200; the promoted standby becomes the next primary and a fresh
standby joins (not timed). Cold restart (the baseline): start `weightcache engine
--mode off` (process start, imports, disk load, warm-up) and time until its first
successful `/generate`. Same request, same checkpoint, same machine, same run.

    python bench/failover.py                 # 20 + 20 trials on the demo's medium checkpoint
    python bench/failover.py --model DIR     # any Llama/Qwen2 checkpoint

Percentiles are nearest-rank (with 20 trials, p99 is the slowest trial). The page
cache stays warm for the cold restarts: the baseline is timed at its best.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time

import torch

from weightcache_agent.engine.demo import Console, default_cache_dir, ensure_checkpoint
from weightcache_agent.serve.process_group import EngineChild, ProcessGroup

PROMPT = [1, 450, 4996, 17354, 1701, 29916, 432, 17204]
GROUP = "bench"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def first_success(engine: EngineChild, start: float, max_tokens: int, timeout: float) -> tuple[float, list[int]]:
    """Seconds from `start` (perf_counter) to the first 200 from `engine`'s /generate."""
    while True:
        try:
            code, reply = engine.post("/generate", {"tokens": PROMPT, "max_tokens": max_tokens}, timeout=timeout)
        except OSError:  # not listening yet (cold start)
            code, reply = 0, {}
        if code == 200:
            return time.perf_counter() - start, reply["tokens"]
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"{engine.name}: no successful answer within {timeout}s (last: {code} {reply})\n{engine.log_tail()}")
        engine.check_alive()
        time.sleep(0.0005)


def bench_failover(sup: ProcessGroup, model: str, trials: int, max_tokens: int, timeout: float,
                   backend: str) -> tuple[list[float], list[int], list[float]]:
    agent = sup.start_agent(model, backend=backend)
    agent.wait_ready(timeout)
    primary = sup.start_engine(model, "primary-0", socket=agent.socket, group=GROUP)
    standby = sup.start_engine(model, "standby-1", socket=agent.socket, group=GROUP, role="standby")
    primary.wait_state(lambda h: h["ready"], timeout, "readiness")
    standby.wait_serving(timeout)
    _, expected = primary.generate(PROMPT, max_tokens)
    # The request's own cost on a warm engine: the part of a failover that is not promotion.
    compute = []
    for _ in range(trials):
        t0 = time.perf_counter()
        first_success(primary, t0, max_tokens, timeout)
        compute.append(time.perf_counter() - t0)
    times = []
    for n in range(1, trials + 1):
        primary.kill(signal.SIGKILL)
        killed = time.perf_counter()
        seconds, tokens = first_success(standby, killed, max_tokens, timeout)
        if tokens != expected["tokens"]:
            raise RuntimeError(f"trial {n}: the promoted standby answered {tokens}, expected {expected['tokens']}")
        times.append(seconds)
        print(f"  failover trial {n:2d}: {seconds * 1e3:8.1f} ms", file=sys.stderr)
        primary.proc.wait()
        primary, standby = standby, sup.start_engine(model, f"standby-{n + 1}", socket=agent.socket, group=GROUP,
                                                     role="standby")
        standby.wait_serving(timeout)  # not timed: a new standby joins in the background in production
    return times, expected["tokens"], compute


def bench_cold(sup: ProcessGroup, model: str, trials: int, max_tokens: int, timeout: float, expected: list[int]) -> list[float]:
    times = []
    for n in range(1, trials + 1):
        started = time.perf_counter()
        engine = sup.start_engine(model, f"cold-{n}", mode="off")
        engine.wait_listening(timeout)
        seconds, tokens = first_success(engine, started, max_tokens, timeout)
        if tokens != expected:
            raise RuntimeError(f"cold trial {n}: answered {tokens}, expected {expected}")
        times.append(seconds)
        print(f"  cold restart trial {n:2d}: {seconds * 1e3:8.1f} ms", file=sys.stderr)
        engine.stop()
    return times


def machine(backend: str) -> str:
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, backend {backend}, load average {os.getloadavg()[0]:.1f} at the end")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: the demo checkpoint of --size)")
    p.add_argument("--size", default="medium", help="demo checkpoint size when --model is not given")
    p.add_argument("--trials", type=int, default=20, help="failover trials")
    p.add_argument("--cold-trials", type=int, default=20, help="cold restart trials")
    p.add_argument("--max-tokens", type=int, default=1, help="tokens per probe request")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda"),
                   help="the agent's backend; the cold restart (--mode off) loads on the cpu either way")
    args = p.parse_args()

    model = args.model or ensure_checkpoint(default_cache_dir(), args.size, Console(quiet=False))[0]
    size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
    with ProcessGroup(tempfile.mkdtemp(prefix="wc-bench-")) as sup:
        print(f"failover: {args.trials} trials", file=sys.stderr)
        failover, expected, compute = bench_failover(sup, model, args.trials, args.max_tokens, args.timeout, args.backend)
        print(f"cold restart: {args.cold_trials} trials", file=sys.stderr)
        cold = bench_cold(sup, model, args.cold_trials, args.max_tokens, args.timeout, expected)

    f50, f99, c50, c99 = (percentile(failover, 50), percentile(failover, 99), percentile(cold, 50), percentile(cold, 99))
    ok = f99 < 1.0 and c50 / f50 >= 20 and c99 / f99 >= 20
    print()
    print(f"model: {model} ({size / 1e6:.0f} MB safetensors); request: {len(PROMPT)} prompt tokens, "
          f"max_tokens {args.max_tokens}")
    print(f"machine: {machine(args.backend)}")
    print(f"command: python bench/failover.py {' '.join(sys.argv[1:])}".rstrip())
    print()
    print("| path | trials | p50 | p99 | mean |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(f"| failover: SIGKILL primary -> standby answers | {len(failover)} | {f50 * 1e3:.1f} ms | {f99 * 1e3:.1f} ms "
          f"| {statistics.mean(failover) * 1e3:.1f} ms |")
    print(f"| (the same request on a warm primary: compute only) | {len(compute)} | {percentile(compute, 50) * 1e3:.1f} ms "
          f"| {percentile(compute, 99) * 1e3:.1f} ms | {statistics.mean(compute) * 1e3:.1f} ms |")
    print(f"| cold restart from disk (`--mode off`) -> answers | {len(cold)} | {c50 * 1e3:.0f} ms | {c99 * 1e3:.0f} ms "
          f"| {statistics.mean(cold) * 1e3:.0f} ms |")
    print(f"| **ratio (cold / failover)** | | **{c50 / f50:.0f}x** | **{c99 / f99:.0f}x** | |")
    print()
    print(f"bar: failover p99 < 1 s and >= 20x faster than a cold restart: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
