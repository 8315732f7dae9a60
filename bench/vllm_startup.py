"""vLLM's start-up, phase by phase: what a new engine waits for between its process starting and its
first token, with the node's compile cache cold and warm, and each idea to shorten it measured.

Weights cost milliseconds once an agent holds them (bench/vllm_gpu.py); what is left of an engine's
start is vLLM's own. Every engine here is a fresh `python3 -m vllm.entrypoints.openai.api_server
--load-format weightcache` process beside one agent (cuda backend, the synthetic Llama of
bench/vllm_gpu.py). Its log is read as vLLM writes it and each line stamped with this process's clock
(vLLM's own timestamps have whole seconds), so a phase is the span between two of vLLM's lines:

  imports                  process start -> vLLM's banner (the API server has imported vLLM)
  configuration            -> "Resolved architecture" (the model's config; vLLM inspects the model
                              class in a child process unless its cache under VLLM_CACHE_ROOT knows it)
  engine core start        -> "Initializing a V1 LLM engine" (a new process: imports again, CUDA)
  model runner set-up      -> "Loading model from scratch" (distributed state, the runner)
  model build + weights    -> "Model loading took" (the model built, the arena attached)
  torch.compile            -> "torch.compile took" (Dynamo, then Inductor or its cached artifacts)
  profiling, KV cache      -> "GPU KV cache size"
  CUDA graph capture       -> "Graph capturing finished"
  rest of engine start     -> "init engine (profile, ...) took" (warm-up runs, the sampler)
  API server ready         -> "Application startup complete"
  first token              -> the first completion token answered (polled every 20 ms)

The node cache is one folder holding vLLM's cache root (VLLM_CACHE_ROOT: torch.compile's artifacts,
the model-class inspection), Inductor's (TORCHINDUCTOR_CACHE_DIR) and Triton's (TRITON_CACHE_DIR):
what the operator mounts into every engine pod of a node (docs/engineset.md, "Compile cache").
Variants, each a fresh process:
  cold                     the node cache emptied first (a node that never ran this model)
  warm                     the node cache as the cold start left it (twice)
  warm, no AOT artifact    VLLM_USE_AOT_COMPILE=0: Dynamo traces again, Inductor's graphs from cache
  warm, CUDA graphs [1]    one CUDA-graph size (a standby's first requests are few); started twice,
                           the second counted (its own compile-cache key)
  warm, eager              --enforce-eager: no torch.compile, no CUDA graphs (decode speed reported)
  warm, engine core in-process  VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in the API
                           server's process, which has imported vLLM already (one GPU, no TP)
  warm, engine core forked VLLM_WORKER_MULTIPROC_METHOD=fork: vLLM's server spawns its engine core
                           process (which imports vLLM again) unless told to fork it
  warm, started ahead      the process started ahead of need (bench/vllm_started_ahead.py: vLLM's API
                           server imported, no CUDA, waiting for a go), timed from the go; also forked
  warm, started ahead deeper  the same, having also imported the engine core's modules and parsed its
                           arguments before the go (WEIGHTCACHE_AHEAD_DEEPER=1), forked
  import only              `python3 -c "import vllm.entrypoints.openai.api_server"`: the most an engine
                           process started ahead of need (imported, no CUDA yet) could save
  replacement standby      a group's primary serving, its standby sleeping; the primary SIGKILLed, a
                           new standby started at once: kill -> the new standby attached and sleeping;
                           then again with the new standby started ahead (forked), told to go at the kill,
                           and (--ideas deeper) started ahead deeper
  two at once, then a third  two engines started together on an emptied node cache (both compile and
                           write it at the same time, as two pods of a node do), then a third start:
                           it must load vLLM's artifact ("Directly load AOT compilation") and all
                           three answer the same greedy tokens

Each start's row says what vLLM's log says of the cache (its artifact loaded, or compiled anew), and the
node cache's size on disk after the cold start is reported (what one key of the operator's cache holds).

Usage (vLLM importable by this python): python3 bench/vllm_startup.py [--layers 24 --hidden 4096]
    [--out DIR] [--ideas ahead|deeper]   (on the H200: WEIGHTCACHE_BENCH=bench/vllm_startup.py bench/vllm_gpu.sh start)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import vllm_gpu  # noqa: E402
from vllm_gpu import CUDA, GIB, Engine, Leases, AgentProcess, log, make_checkpoint, llama_shape  # noqa: E402
from report import bars_line, report  # noqa: E402

PHASES = [
    ("imports", re.compile(r"version \d+\.\d+")),
    ("configuration", re.compile(r"Resolved architecture")),
    ("engine core start", re.compile(r"Initializing a V1 LLM engine")),
    ("model runner set-up", re.compile(r"Loading model from scratch|Starting to load model")),
    ("model build + weights", re.compile(r"Model loading took")),
    ("torch.compile", re.compile(r"torch\.compile took")),
    ("profiling, KV cache", re.compile(r"GPU KV cache size")),
    ("CUDA graph capture", re.compile(r"Graph capturing finished")),
    ("rest of engine start", re.compile(r"init engine \(profile")),
    ("API server ready", re.compile(r"Application startup complete")),
]


class StampedLog:
    """Stamps each line of an engine's log file with this process's clock as it appears (polled every 5 ms)."""

    def __init__(self, engine: Engine):
        self.engine, self.lines = engine, []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        with open(self.engine.log_path, errors="replace") as f:
            partial = ""
            while not self.done.is_set():
                chunk = f.read()
                if not chunk:
                    time.sleep(0.005)
                    continue
                now = time.perf_counter() - self.engine.started
                partial += chunk
                *whole, partial = re.split(r"[\r\n]", partial)
                self.lines += [(now, line) for line in whole if line]

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)

    def phases(self, first_token: float) -> dict[str, float]:
        """Each phase's seconds: from the previous marker found to its own (a phase whose marker never came,
        e.g. torch.compile in eager mode, is absent and its time is counted in the next one found)."""
        out, previous, start = {}, 0.0, 0
        for name, marker in PHASES:
            for k in range(start, len(self.lines)):
                if marker.search(self.lines[k][1]):
                    out[name] = self.lines[k][0] - previous
                    previous, start = self.lines[k][0], k + 1
                    break
        out["first token"] = first_token - previous
        return out


def node_cache(work: str) -> str:
    return os.path.dirname(vllm_gpu.compile_caches(work)["VLLM_CACHE_ROOT"])


STARTED_AHEAD = os.path.join(HERE, "vllm_started_ahead.py")


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """`env` set in this process's environment while an Engine is made (Engine passes it on)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(name: str, model: str, work: str, sock: str, kv: int, env: dict[str, str] | None = None,
           extra: tuple[str, ...] = (), role: str | None = None, ahead: bool = False) -> Engine:
    """A fresh engine process; `ahead`: started ahead of need (bench/vllm_started_ahead.py), returned once
    it has imported vLLM and waits for `go`."""
    with environment(dict(env or {}, **({"WEIGHTCACHE_GO_FILE": go_file(work, name)} if ahead else {}))):
        engine = Engine(name, model, work, "weightcache", sock, kv, role=role, extra=extra,
                        launcher=(STARTED_AHEAD,) if ahead else ())
    if ahead:
        deadline = time.perf_counter() + 300
        while "imported" not in engine.text():
            if not engine.alive() or time.perf_counter() > deadline:
                engine._fail("the process started ahead did not import vLLM")
            time.sleep(0.01)
        engine.imported_s = time.perf_counter() - engine.started
    return engine


def go_file(work: str, name: str) -> str:
    return os.path.join(work, f"{name}.go")


def go(engine: Engine, work: str) -> None:
    """Tells an engine started ahead to start vLLM's server; its clock starts here."""
    open(go_file(work, engine.name), "w").close()
    engine.started = time.perf_counter()


def start_engine(name: str, model: str, work: str, sock: str, kv: int, ahead: bool = False,
                 **kw) -> tuple[Engine, StampedLog]:
    """A fresh engine process timed from its start, or (`ahead`) from the go after its imports."""
    engine = launch(name, model, work, sock, kv, ahead=ahead, **kw)
    if ahead:
        go(engine, work)
    return engine, StampedLog(engine)


AOT_LOADED = re.compile(r"Directly load AOT compilation from path")
GRAPHS_LOADED = re.compile(r"Directly load the compiled graph")
RECOMPILED = re.compile(r"Compiling model again due to a load failure")
# vLLM starts its engine core process with fork unless something forces spawn, which imports again
SPAWN_FORCED = re.compile(r"Overriding VLLM_WORKER_MULTIPROC_METHOD to 'spawn'.*?Reason: [^\n]*")


def cache_said(text: str) -> str:
    """What vLLM's log says of its compile cache: its artifact loaded, Inductor's graphs loaded, or neither."""
    if RECOMPILED.search(text):
        return "artifact unreadable: compiled again"
    if AOT_LOADED.search(text):
        return "artifact loaded"
    if GRAPHS_LOADED.search(text):
        return "graphs loaded"
    return "compiled" if "torch.compile took" in text else "no compile"


def finish(name: str, engine: Engine, stamped: StampedLog, seconds: float) -> dict:
    try:
        ok, tokens = engine.complete(max_tokens=16)
        rate = engine.decode_rate()
    finally:
        stamped.stop()
        engine.stop()
    phases = stamped.phases(seconds)
    text = engine.text()
    said, spawned = cache_said(text), SPAWN_FORCED.search(text)
    log(f"{name}: first token {seconds:.2f} s, decode {rate:.1f} tokens/s, cache: {said}, " +
        ", ".join(f"{k} {v:.2f}" for k, v in phases.items()) + (f"; {spawned[0]}" if spawned else ""))
    return {"name": name, "seconds": seconds, "decode_tokens_per_s": rate, "phases": phases, "cache": said,
            "tokens": tokens if ok else None, "spawn_forced": spawned[0] if spawned else None,
            "imported_ahead_s": getattr(engine, "imported_s", None)}


def timed_start(name: str, model: str, work: str, sock: str, kv: int, **kw) -> dict:
    engine, stamped = start_engine(name, model, work, sock, kv, **kw)
    try:
        seconds = engine.first_token()
    except BaseException:
        stamped.stop()
        engine.stop()
        raise
    return finish(name, engine, stamped, seconds)


def started_together(model: str, work: str, sock: str, kv: int) -> list[dict]:
    """Two engines started at once on an emptied node cache, then a third start once both serve."""
    shutil.rmtree(node_cache(work), ignore_errors=True)
    pair = [start_engine(f"together {i}", model, work, sock, kv) for i in (1, 2)]
    seconds = [engine.first_token() for engine, _ in pair]
    runs = [finish(f"together {i + 1}", e, s, t) for i, ((e, s), t) in enumerate(zip(pair, seconds))]
    return runs + [timed_start("after the two", model, work, sock, kv)]


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if not os.path.islink(os.path.join(d, f)))


def import_only() -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import vllm.entrypoints.openai.api_server"], check=True,
                   capture_output=True)
    return time.perf_counter() - t


def replacement_standby(model: str, work: str, sock: str, kv: int, ahead: bool = False,
                        env: dict[str, str] | None = None, tag: str = "rs") -> dict:
    """A primary and a sleeping standby; the primary killed and a new standby started at once (`ahead`:
    a process started ahead of need, imported and waiting since before the kill, told to go at it)."""
    leases = Leases(sock)
    primary, _ = start_engine(f"{tag}-primary", model, work, sock, kv, role="primary", env=env)
    primary.first_token()
    standby, _ = start_engine(f"{tag}-standby", model, work, sock, kv, role="standby", env=env)
    first_standby = standby.warm_standby()
    name = f"{tag}-replacement"
    replacement = launch(name, model, work, sock, kv, role="standby", env=env, ahead=True) if ahead else None
    t_kill = time.perf_counter()
    primary.kill()
    if replacement:
        go(replacement, work)
    else:
        replacement = launch(name, model, work, sock, kv, role="standby", env=env)
    replacement.started = t_kill
    stamped = StampedLog(replacement)
    replacement.warm_standby()
    sleeping = time.perf_counter() - t_kill
    promoted = leases.role_of(standby)
    stamped.stop()
    for engine in (replacement, standby, primary):
        engine.stop()
    log(f"replacement standby {tag}: kill -> new standby sleeping {sleeping:.2f} s "
        f"(first standby {first_standby:.2f} s)")
    return {"kill_to_new_standby_sleeping": sleeping, "first_standby_start_to_sleeping": first_standby,
            "old_standby_role_after": promoted, "replacement_phases": stamped.phases(sleeping)}


def table(runs: list[dict]) -> list[str]:
    names = [n for n, _ in PHASES] + ["first token"]
    head = "| phase | " + " | ".join(r["name"] for r in runs) + " |"
    rows = [head, "| --- |" + " ---: |" * len(runs)]
    for n in names:
        rows.append(f"| {n} | " + " | ".join(f"{r['phases'][n]:.2f}" if n in r["phases"] else "-" for r in runs) + " |")
    rows.append("| **process start -> first token** | " + " | ".join(f"**{r['seconds']:.2f}**" for r in runs) + " |")
    rows.append("| decode, one request of 256 tokens (tokens/s) | " +
                " | ".join(f"{r['decode_tokens_per_s']:.0f}" for r in runs) + " |")
    rows.append("| what vLLM's log says of the compile cache | " + " | ".join(r["cache"] for r in runs) + " |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=vllm_gpu.LAYERS)
    p.add_argument("--hidden", type=int, default=vllm_gpu.HIDDEN)
    p.add_argument("--kv-gib", type=float, default=8 if CUDA else 0.0625)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    p.add_argument("--only", default="", help="comma-separated warm variants to run alone on the node cache "
                   "a full run left (e.g. 'warm 1,in-process'), for a second look at one idea")
    p.add_argument("--ideas", choices=("all", "ahead", "deeper"), default="all",
                   help="ahead: one cold and one warm start, the engine core forked, the process started ahead "
                   "and forked, the replacement standby plain and started ahead; deeper: a cold start, then "
                   "started ahead and started ahead deeper, each timed and as the replacement standby; "
                   "all: every idea but deeper")
    args = p.parse_args()
    import torch
    import vllm

    work = args.dir or tempfile.mkdtemp(prefix="wc-vllm-startup-")
    model = os.path.join(work, "llama")
    size = make_checkpoint(model, llama_shape(args.layers, args.hidden))
    sock = os.path.join(work, "agent.sock")
    agent = AgentProcess(model, sock, "cuda" if CUDA else "cpu")
    agent.ready()
    kv = int(args.kv_gib * GIB)
    head = [f"vLLM {vllm.__version__}, torch {torch.__version__}; synthetic Llama {args.layers} layers, hidden "
            f"{args.hidden}, bf16, {size / GIB:.2f} GiB, `--load-format weightcache`, --kv-cache-memory-bytes "
            f"{args.kv_gib:g} GiB", ""]
    data: dict = {"errors": []}
    runs: list[dict] = []

    def step(what: str, fn):
        """One variant; a failure is reported with the others' figures instead of ending the bench."""
        try:
            return fn()
        except (Exception, SystemExit) as e:
            log(f"{what} failed: {e}")
            data["errors"].append(f"{what}: {str(e)[:3000]}")
            for engine in vllm_gpu.ENGINES:
                if engine.alive():
                    engine.stop()
            return None

    def add(run: dict | None) -> None:
        if run:
            runs.append(run)

    one_graph = ("--compilation-config", '{"cudagraph_capture_sizes": [1]}')
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    fork = {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    deeper = dict(fork, WEIGHTCACHE_AHEAD_DEEPER="1")
    every, deep = args.ideas == "all", args.ideas == "deeper"
    if args.only:
        variants = {"warm 1": {}, "in-process": {"env": in_process}, "fork": {"env": fork}, "ahead": {"ahead": True},
                    "ahead+fork": {"ahead": True, "env": fork}, "deeper": {"ahead": True, "env": deeper}}
        try:
            for name in args.only.split(","):
                add(step(name, lambda: timed_start(name, model, work, sock, kv, **variants[name])))
        finally:
            agent.stop()
        report(args.out, "vllm_startup_only", head + table(runs) + [f"Failed: {e}" for e in data["errors"]], data)
        return 0
    try:
        shutil.rmtree(node_cache(work), ignore_errors=True)
        add(step("cold", lambda: timed_start("cold", model, work, sock, kv)))
        data["node_cache_bytes_after_cold"] = step("cache size", lambda: {
            d: du(os.path.join(node_cache(work), d)) for d in sorted(os.listdir(node_cache(work)))})
        for i in (1, 2) if every else () if deep else (1,):
            add(step(f"warm {i}", lambda: timed_start(f"warm {i}", model, work, sock, kv)))
        if every:
            add(step("no AOT", lambda: timed_start("warm, no AOT artifact", model, work, sock, kv,
                                                   env={"VLLM_USE_AOT_COMPILE": "0"})))
            step("graphs first", lambda: timed_start("CUDA graphs [1], first", model, work, sock, kv,
                                                     extra=one_graph))
            add(step("graphs", lambda: timed_start("warm, CUDA graphs [1]", model, work, sock, kv, extra=one_graph)))
            add(step("eager", lambda: timed_start("warm, eager", model, work, sock, kv, extra=("--enforce-eager",))))
            add(step("in-process", lambda: timed_start("warm, engine core in-process", model, work, sock, kv,
                                                       env=in_process)))
        if not deep:
            add(step("fork", lambda: timed_start("warm, engine core forked", model, work, sock, kv, env=fork)))
        if every:
            add(step("ahead", lambda: timed_start("warm, started ahead", model, work, sock, kv, ahead=True)))
        add(step("ahead, fork", lambda: timed_start("warm, started ahead, forked", model, work, sock, kv,
                                                    ahead=True, env=fork)))
        if deep:
            add(step("deeper", lambda: timed_start("warm, started ahead deeper, forked", model, work, sock, kv,
                                                   ahead=True, env=deeper)))
        data["import_only_s"] = (step("import only", lambda: [import_only() for _ in range(2)]) or []) if every else []
        if not deep:
            data["standby"] = step("replacement standby", lambda: replacement_standby(model, work, sock, kv))
        data["standby_ahead"] = step("replacement standby started ahead", lambda: replacement_standby(
            model, work, sock, kv, ahead=True, env=fork, tag="rs-ahead"))
        if deep:
            data["standby_deeper"] = step("replacement standby started ahead deeper", lambda: replacement_standby(
                model, work, sock, kv, ahead=True, env=deeper, tag="rs-deeper"))
        data["together"] = (step("together", lambda: started_together(model, work, sock, kv)) or []) if every else []
    finally:
        data["runs"] = runs
        agent.stop()
        for e in vllm_gpu.ENGINES:
            if e.alive():
                e.stop()
    # a start timed from its process's start, and one started ahead, timed from its go
    warm = [r["seconds"] for r in runs if r["name"].startswith("warm") and r["imported_ahead_s"] is None]
    from_go = [r["seconds"] for r in runs if r["imported_ahead_s"] is not None]
    s, together = data.get("standby") or {}, data.get("together")
    # the replacement standbys started ahead: (what was done before the go, its figures)
    started_ahead = [(how, data[key]) for key, how in (("standby_ahead", "imported"),
                                                       ("standby_deeper", "imported deeper, arguments parsed"))
                     if data.get(key)]
    sizes = data.get("node_cache_bytes_after_cold") or {}
    kill_to_standby = s.get("kill_to_new_standby_sleeping", float("nan"))
    forced = [f"{r['name']}: {r['spawn_forced']}" for r in runs if r.get("spawn_forced")]
    # what this run measured, and nothing of what it did not (--only, --ideas)
    measured = [
        data.get("import_only_s") and "Import only (`import vllm.entrypoints.openai.api_server` in a fresh python): "
        f"{', '.join(f'{x:.2f} s' for x in data['import_only_s'])}: the most a process started ahead of need "
        "could take off.",
        s and "Replacement standby: kill of the primary -> a new standby started at once has attached and "
        f"sleeps: **{kill_to_standby:.2f} s** (the first standby, started beside a serving primary: "
        f"{s.get('first_standby_start_to_sleeping', float('nan')):.2f} s; the old standby's role afterwards: "
        f"{s.get('old_standby_role_after')}).",
        *[f"Replacement standby started ahead ({how} and waiting before the kill, engine core forked): kill -> "
          f"sleeping **{a['kill_to_new_standby_sleeping']:.2f} s** (phases: " + ", ".join(
              f"{k} {v:.2f}" for k, v in a["replacement_phases"].items()) + ")." for how, a in started_ahead],
        forced and "vLLM forced spawn for its engine core: " + "; ".join(forced) + ".",
        sizes and f"Node cache after the cold start: {sum(sizes.values()) / 2**20:.1f} MiB "
        f"({', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in sizes.items())}).",
        together and "Two engines started together on an emptied node cache, then a third: " + "; ".join(
            f"{r['name']} {r['seconds']:.2f} s ({r['cache']}, tokens {r['tokens']!r})" for r in together) + ".",
    ]
    bars = {}
    for what, seconds in (("warm start", warm), ("start from the go of one started ahead", from_go)):
        if seconds:
            bars[f"fastest {what} <= 10 s"], bars[f"fastest {what} < 5 s"] = min(seconds) <= 10.0, min(seconds) < 5.0
    if together:
        bars["a start after two compiled at once loads vLLM's artifact"] = together[-1]["cache"] == "artifact loaded"
    if s or started_ahead:
        bars["replacement standby sleeping <= 10 s after the kill"] = min(
            [a["kill_to_new_standby_sleeping"] for a in (s, *(x for _, x in started_ahead)) if a]) <= 10.0
    lines = head + [
        "Seconds per phase (each ends at the vLLM line named in bench/vllm_startup.py); fresh processes, in order:",
        "", *table(runs), "", *filter(None, measured),
        f"Tokens of the cold and warm starts: {sorted({str(r['tokens']) for r in runs[:3]})}.",
        *[f"Failed: {e}" for e in data["errors"]],
        bars_line(bars),
    ]
    report(args.out, "vllm_startup", lines, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
