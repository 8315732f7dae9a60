"""How fast the agent's read-ahead streams a checkpoint, against a plain sequential read.

A cold load from process start can go no faster than the one stream that reads the files
(load/prefetch.py). Each row drops the files from the page cache (`posix_fadvise` per
file, and `drop_caches` when root: `page_cache.drop_cache`), then times, in a fresh process, one way of reading
every byte: the raw read (`page_cache.raw_read`, one thread, 64 MiB reads: the
cold-load benchmarks' baseline), the read-ahead alone at a given request size, and the read-ahead
beside what an agent does while it starts (import torch, make the CUDA context when there
is a GPU, plan the load from the headers).

    python3 bench/read_ahead.py --model DIR [--chunks 16,64]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RAW = """
import os, sys
sys.path.insert(0, BENCH)
from page_cache import raw_read
from weightcache_agent.load.prefetch import shard_paths
paths = shard_paths(MODEL)
print(sum(os.path.getsize(p) for p in paths), raw_read(paths))
"""

READ_AHEAD = """
import weightcache_agent.load.prefetch as prefetch
prefetch.CHUNK = CHUNK
ahead = prefetch.Prefetch(prefetch.shard_paths(MODEL), lambda: 0, lead=1 << 50)
if BESIDE_STARTUP:
    import torch
    if torch.cuda.is_available():
        torch.empty(1, device="cuda")
    from weightcache_agent import CacheSpec
    from weightcache_agent.load.loader import prepare_cache
    prepare_cache(CacheSpec(model=MODEL), device="bench")
ahead._thread.join()
print(ahead.read, ahead.seconds)  # its own start to its last byte
"""


def timed(code: str, model: str, **values: object) -> tuple[int, float]:
    prelude = "".join(f"{k} = {v!r}\n" for k, v in {"MODEL": model, "BENCH": HERE, **values}.items())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "node_agent"),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", prelude + code], env=env, check=True, capture_output=True, text=True)
    nbytes, seconds = out.stdout.split()
    return int(nbytes), float(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--chunks", default="16,64", help="read-ahead request sizes to try, MiB")
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "node_agent"))
    from page_cache import drop_cache
    from weightcache_agent.load.prefetch import shard_paths

    paths = shard_paths(os.path.abspath(args.model))
    rows: list[tuple[str, int, float]] = []
    drop_cache(paths)
    rows.append(("raw: one thread, 64 MiB reads", *timed(RAW, args.model)))
    for mib in (int(c) for c in args.chunks.split(",")):
        for beside in (False, True):
            drop_cache(paths)
            what = f"read-ahead, {mib} MiB requests" + (", beside torch + CUDA context + plan" if beside else "")
            rows.append((what, *timed(READ_AHEAD, args.model, CHUNK=mib << 20, BESIDE_STARTUP=beside)))
    raw = rows[0][2]
    print("| reader (page cache dropped before each) | GiB | seconds | GB/s | of raw |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for what, nbytes, seconds in rows:
        print(f"| {what} | {nbytes / 2**30:.1f} | {seconds:.2f} | {nbytes / seconds / 1e9:.2f} | {raw / seconds:.2f} |")


if __name__ == "__main__":
    main()
