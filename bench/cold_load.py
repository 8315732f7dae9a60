"""Cold load vs the disk: the agent's loader as a fraction of a raw sequential read, one run.

    python bench/cold_load.py [--gib 4.4] [--trials 3] [--dir $WEIGHTCACHE_BENCH_DIR]

Writes a Llama-shaped bf16 checkpoint of at least 4 GiB once (kept under the bench dir),
then, for each trial: drops the files from the page cache (posix_fadvise DONTNEED),
times a raw sequential read of the same files into one reused buffer; drops again and
times `load_cache` (plan, arena, read, seal) without quantization; drops again and
times it with fp8-block. Prints the median rate of each and its fraction of the raw
read rate. Every rate is checkpoint bytes read per second of wall time, so the loader
is charged for everything it does (headers, plan, arena allocation, quantization,
sealing). Bar (DESIGN §4): fp8-block >= 90% of raw.
"""
from __future__ import annotations

import argparse
import glob
import os
import platform
import statistics
import sys
import time

import torch

from weightcache_agent.loader import load_cache
from weightcache_agent.spec import CacheSpec
from weightcache_agent.synthetic import LlamaShape, write_llama_checkpoint

BUF = 64 * 1024 * 1024


def checkpoint(directory: str, layers: int) -> str:
    path = os.path.join(directory, f"llama-h4096-l{layers}")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        print(f"writing checkpoint to {path} (once) ...", file=sys.stderr)
        shape = LlamaShape(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=32000)
        write_llama_checkpoint(path + ".tmp", shape, shards=4)
        os.rename(path + ".tmp", path)
    return path


def files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def drop(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: list[str], buf: memoryview) -> tuple[int, float]:
    total, t0 = 0, time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        pos = 0
        while True:
            n = os.preadv(fd, [buf], pos)
            if n <= 0:
                break
            pos += n
        total += pos
        os.close(fd)
    return total, time.perf_counter() - t0


def cold_load(path: str, quantization: str) -> tuple[int, float, int]:
    t0 = time.perf_counter()
    cache = load_cache(CacheSpec(path, quantization=quantization), name="bench")
    seconds = time.perf_counter() - t0
    arena_bytes = cache.layout.size
    read = cache.checkpoint.nbytes
    cache.arena.close()
    return read, seconds, arena_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.environ.get("WEIGHTCACHE_BENCH_DIR", "/tmp/weightcache-bench"))
    ap.add_argument("--layers", type=int, default=12, help="12 layers of h=4096: 4.4 GiB")
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    path = checkpoint(args.dir, args.layers)
    paths = files(path)
    size = sum(os.path.getsize(p) for p in paths)
    assert size >= 4 * 2**30 or args.layers < 12, "the bar needs a checkpoint of at least 4 GiB"
    buf = memoryview(bytearray(BUF))
    rates: dict[str, list[float]] = {"raw sequential read": [], "cold load, none": [], "cold load, fp8-block": []}
    arena: dict[str, int] = {}
    for trial in range(args.trials):
        drop(paths)
        n, s = raw_read(paths, buf)
        rates["raw sequential read"].append(n / s)
        for q in ("none", "fp8-block"):
            drop(paths)
            n, s, arena[q] = cold_load(path, q)
            rates[f"cold load, {q}"].append(n / s)
        print(f"trial {trial}: " + ", ".join(f"{k} {v[-1] / 1e9:.2f} GB/s" for k, v in rates.items()), file=sys.stderr)
    raw = statistics.median(rates["raw sequential read"])
    print(f"\nmachine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, "
          f"checkpoint {size / 2**30:.2f} GiB in {len(paths)} files, {args.trials} trials (median)")
    print(f"| {'step':24s} | {'GB/s (median)':>13s} | {'min..max':>13s} | {'of raw':>6s} | {'arena':>9s} |")
    print(f"| {'-' * 24} | {'-' * 13}:| {'-' * 13}:| {'-' * 6}:| {'-' * 9}:|")
    for name, values in rates.items():
        med = statistics.median(values)
        q = name.rsplit(", ", 1)[-1]
        arena_txt = f"{arena[q] / 2**30:.2f} GiB" if q in arena else "-"
        print(f"| {name:24s} | {med / 1e9:13.2f} | {min(values) / 1e9:5.2f}..{max(values) / 1e9:5.2f} | "
              f"{med / raw:6.0%} | {arena_txt:>9s} |")


if __name__ == "__main__":
    main()
