"""What an engine process pays before its first attach, in fresh processes, side by side.

Each trial is a new `python3` process timed from the parent's clock (the same wall clock):
process start -> torch imported -> the GPU's context current in torch (`torch.empty` on it).
Variants, interleaved trial by trial:
  after     torch's import, then the context (what an engine did before `engine.startup`)
  beside    the context made through the driver on a thread while torch imports
            (`arena.cuda.retain_context`, as `engine.startup.EarlyDevice` does)
  pycache   as `after`, with a bytecode cache the interpreter may write and read
            (PYTHONPYCACHEPREFIX; PYTHONDONTWRITEBYTECODE unset; primed by one unmeasured run)

Usage (on a GPU machine): python3 bench/engine_start.py [--trials 5] [--out DIR]
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

from report import report

HERE = os.path.dirname(os.path.abspath(__file__))
NODE_AGENT = os.path.join(HERE, "..", "node_agent")

CHILD = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[2])
thread = None
if sys.argv[1] == "beside":
    def early():
        try:
            from weightcache_agent.arena.cuda import retain_context
            retain_context(0)
        except Exception as e:  # no GPU or no cuda-bindings: a dry run of the script
            print("no context beside the import:", e, file=sys.stderr)
    thread = threading.Thread(target=early, daemon=True)
    thread.start()
import torch
imported = time.time()
if thread is not None:
    thread.join()
if torch.cuda.is_available():
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda:0")
    torch.cuda.synchronize()
print(json.dumps({"imported": imported, "context": time.time()}))
"""


def trial(variant: str, env: dict) -> dict:
    started = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, "after" if variant == "pycache" else variant, NODE_AGENT],
                         env=env, capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise SystemExit(f"{variant} failed: {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {"import": got["imported"] - started, "context": got["context"] - started}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    base = dict(os.environ)
    cache = tempfile.mkdtemp(prefix="wc-pycache-")
    envs = {"after": base, "beside": base,
            "pycache": {**{k: v for k, v in base.items() if k != "PYTHONDONTWRITEBYTECODE"},
                        "PYTHONPYCACHEPREFIX": cache}}
    flags = subprocess.run([sys.executable, "-c", "import sys, os; print(sys.flags.dont_write_bytecode, "
                            "os.environ.get('PYTHONPYCACHEPREFIX'), sys.pycache_prefix)"], capture_output=True,
                           text=True).stdout.strip()
    trial("pycache", envs["pycache"])  # primes the cache
    runs: dict[str, list[dict]] = {v: [] for v in envs}
    for _ in range(args.trials):
        for variant, env in envs.items():
            runs[variant].append(trial(variant, env))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("import", "context")} for v, rs in runs.items()}
    lines = [f"python {sys.version.split()[0]}; dont_write_bytecode, PYTHONPYCACHEPREFIX, pycache_prefix: {flags}",
             "", "| variant | torch imported (median) | context current (median) | trials (context, s) | ratio |",
             "| --- | ---: | ---: | --- | ---: |"]
    for v, rs in runs.items():
        lines.append(f"| {v} | {med[v]['import']:.2f} s | {med[v]['context']:.2f} s | "
                     f"{', '.join('%.2f' % r['context'] for r in rs)} | "
                     f"{med[v]['context'] / med['after']['context']:.2f}x after |")
    report(args.out, "engine_start", lines, {"flags": flags, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
