"""Cold load vs the disk: the agent's loader as a fraction of a raw sequential read, one run.

    python bench/cold_load.py [--trials 3] [--readers auto[,1,4...]] [--direct off,on[,auto]]
                              [--layers 12] [--dir $WEIGHTCACHE_BENCH_DIR]

Writes a Llama-shaped bf16 checkpoint of at least 4 GiB once (kept under the bench dir),
then, for each trial, each reader count and each direct-I/O setting: drops the files from
the page cache (posix_fadvise DONTNEED) and times a raw sequential read of the same files
into one reused buffer; drops again and times `load_cache` (plan, arena, read, seal)
without quantization; then the same pair (raw, drop, load) with fp8-block. Every load is
paired with the raw read just before it, so a disk whose rate drifts between trials (a
VM's virtual disk, a shared host) is compared with itself. The raw read is always a
buffered sequential preadv (the baseline issue 3 defines); `--direct` sets the loader's
WEIGHTCACHE_DIRECT_IO (off: buffered reads and sendfile; on / auto: O_DIRECT reads of
the cold files, see load/pipeline.py), one row per setting.

Every rate is checkpoint bytes read per second of wall time, so the loader is charged
for everything it does (headers, plan, arena allocation, quantization, sealing). Per
step it prints: the median rate and range; "of raw" = median rate / median raw rate;
"paired" = the median over trials of (load rate / rate of the raw read just before it);
the process CPU time per GB (all threads, user + system: what the step costs the host);
and, when the files sit on a block device, the share of wall time the device had a
request in flight ("disk busy") and the mean number in flight ("qd"), from
/sys/dev/block/M:m/stat -- the direct measure of "the disk never waits".
Bar (DESIGN §4): fp8-block >= 90% of raw, on the cpu backend.
"""
from __future__ import annotations

import argparse
import glob
import os
import platform
import re
import statistics
import sys
import time

import torch
from weightcache_agent.load.loader import load_cache
from weightcache_agent.load.pipeline import default_workers
from weightcache_agent.load.reading import DIRECT_IO_ENV, DIRECT_IO_MODES, default_readers, direct_io_mode
from weightcache_agent.spec import CacheSpec
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

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


class Disk:
    """io_ticks / time_in_queue of the block device holding the checkpoint, when there is one."""

    def __init__(self, path: str):
        dev = os.stat(path).st_dev
        self.stat = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
        self.name = os.path.basename(os.path.realpath(os.path.dirname(self.stat)))
        if not os.path.exists(self.stat):
            self.stat, self.name = None, "-"

    def sample(self) -> tuple[int, int] | None:
        if self.stat is None:
            return None
        with open(self.stat) as f:
            fields = f.read().split()
        return int(fields[9]), int(fields[10])  # io_ticks, time_in_queue (ms)


def mount_of(path: str) -> str:
    """'fstype source' of the mount holding `path` (longest mount point that prefixes it)."""
    path, best = os.path.realpath(path), ("?", "?", "")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            point = left.split()[4]
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[2]):
                fstype, source = right.split()[:2]
                best = (fstype, source, point)
    return f"{best[0]} on {best[1]}"


class Step:
    def __init__(self, name: str):
        self.name = name
        self.rates: list[float] = []
        self.paired: list[float] = []
        self.cpu: list[float] = []  # core-seconds per GB
        self.busy: list[float] = []
        self.depth: list[float] = []
        self.arena = 0


def measure(step: Step, disk: Disk, run, raw_rate: float | None = None) -> float:
    """Run `run()` -> (bytes, seconds[, arena]) and record its rate, CPU and disk use."""
    d0, c0 = disk.sample(), os.times()
    out = run()
    c1, d1 = os.times(), disk.sample()
    n, secs = out[0], out[1]
    if len(out) > 2:
        step.arena = out[2]
    rate = n / secs
    step.rates.append(rate)
    step.cpu.append((c1.user - c0.user + c1.system - c0.system) / (n / 1e9))
    if raw_rate:
        step.paired.append(rate / raw_rate)
    if d0 is not None and d1 is not None:
        step.busy.append((d1[0] - d0[0]) / 1e3 / secs)
        step.depth.append((d1[1] - d0[1]) / 1e3 / secs)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.environ.get("WEIGHTCACHE_BENCH_DIR", "/tmp/weightcache-bench"))
    ap.add_argument("--layers", type=int, default=12, help="12 layers of h=4096: 4.4 GiB")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--readers", default="auto",
                    help="comma-separated reader-thread counts to run the loads with ('auto': the loader's default)")
    ap.add_argument("--direct", default=None,
                    help=f"comma-separated {DIRECT_IO_ENV} settings to run the loads with ({', '.join(DIRECT_IO_MODES)}; "
                         f"default: ${DIRECT_IO_ENV} or the loader's default, auto)")
    args = ap.parse_args()
    directs = [d.strip().lower() for d in (args.direct or direct_io_mode()).split(",") if d.strip()]
    for d in directs:
        if d not in DIRECT_IO_MODES:
            ap.error(f"--direct {d!r}: expected one of {', '.join(DIRECT_IO_MODES)}")
    path = checkpoint(args.dir, args.layers)
    paths = files(path)
    size = sum(os.path.getsize(p) for p in paths)
    assert size >= 4 * 2**30 or args.layers < 12, "the bar needs a checkpoint of at least 4 GiB"
    buf = memoryview(bytearray(BUF))
    disk = Disk(paths[0])
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    saved = {k: os.environ.get(k) for k in ("WEIGHTCACHE_READERS", DIRECT_IO_ENV)}
    env_auto = saved["WEIGHTCACHE_READERS"] or str(default_readers())

    def label(r: str) -> str:
        n = env_auto if r == "auto" else r
        return f"{n} reader{'s' if n != '1' else ''}" + (" (default)" if r == "auto" else "")

    def name(q: str, r: str, d: str) -> str:
        parts = [q] + ([f"direct {d}"] if len(directs) > 1 else []) + ([label(r)] if len(readers) > 1 else [])
        return "cold load, " + ", ".join(parts)

    raw = Step("raw sequential read")
    steps = {(r, d, q): Step(name(q, r, d)) for r in readers for d in directs for q in ("none", "fp8-block")}
    for trial in range(args.trials):
        line = []
        for r in readers:
            os.environ["WEIGHTCACHE_READERS"] = env_auto if r == "auto" else r
            for d in directs:
                os.environ[DIRECT_IO_ENV] = d
                for q in ("none", "fp8-block"):
                    drop(paths)
                    base = measure(raw, disk, lambda: raw_read(paths, buf))
                    drop(paths)
                    rate = measure(steps[r, d, q], disk, lambda q=q: cold_load(path, q), base)
                    line.append(f"raw {base / 1e9:.2f} -> {q}/{os.environ['WEIGHTCACHE_READERS']}r/direct {d} "
                                f"{rate / 1e9:.2f} GB/s")
        print(f"trial {trial}: " + ", ".join(line), file=sys.stderr)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v

    med_raw = statistics.median(raw.rates)
    print(f"\nmachine: {platform.machine()} {cpu_model()}, {len(os.sched_getaffinity(0))} cores, "
          f"Linux {platform.release()}, torch {torch.__version__}")
    print(f"checkpoint: {size / 2**30:.2f} GiB in {len(paths)} files, {mount_of(path)}"
          f"{f' (device {disk.name})' if disk.stat else ' (no block-device stats)'}; {args.trials} trials (median); "
          f"loader: {env_auto} readers by default, {default_workers()} workers, {DIRECT_IO_ENV} "
          f"{'/'.join(directs)}")
    w = max(42, *(len(step.name) for step in steps.values()))
    print(f"| {'step':{w}s} | {'GB/s':>5s} | {'min..max':>11s} | {'of raw':>6s} | {'paired':>6s} | "
          f"{'CPU s/GB':>8s} | {'disk busy':>9s} | {'qd':>4s} | {'arena':>9s} |")
    print(f"| {'-' * w} | {'-' * 4}:| {'-' * 10}:| {'-' * 5}:| {'-' * 5}:| {'-' * 7}:| {'-' * 8}:| {'-' * 3}:| {'-' * 8}:|")
    for step in [raw, *steps.values()]:
        med = statistics.median(step.rates)
        paired = f"{statistics.median(step.paired):6.0%}" if step.paired else f"{'-':>6s}"
        busy = f"{statistics.median(step.busy):9.0%}" if step.busy else f"{'-':>9s}"
        depth = f"{statistics.median(step.depth):4.1f}" if step.depth else f"{'-':>4s}"
        arena = f"{step.arena / 2**30:.2f} GiB" if step.arena else "-"
        print(f"| {step.name:{w}s} | {med / 1e9:5.2f} | {min(step.rates) / 1e9:4.2f}..{max(step.rates) / 1e9:5.2f} | "
              f"{med / med_raw:6.0%} | {paired} | {statistics.median(step.cpu):8.2f} | {busy} | {depth} | {arena:>9s} |")
    for r in readers:
        for d in directs:
            fp = steps[r, d, "fp8-block"]
            of_raw, paired = statistics.median(fp.rates) / med_raw, statistics.median(fp.paired)
            verdict = "PASS" if min(of_raw, paired) >= 0.9 else "FAIL"
            print(f"bar, {fp.name}: >= 90% of raw: {verdict} (of raw {of_raw:.0%}, paired {paired:.0%})")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return re.sub(r"\s+", " ", line.split(":", 1)[1].strip())
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
