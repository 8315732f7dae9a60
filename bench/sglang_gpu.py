"""SGLang's OpenAI server on a GPU with `--load-format weightcache`: tokens, start-up, a sleeping
standby, failover, and one agent serving SGLang and vLLM at once, all measured from outside.

One agent (the cuda backend) holds a synthetic Llama (bf16, >= 8 GiB, a word-level tokenizer so the
OpenAI server runs), made as bench/vllm_gpu.py makes it. Every engine is a fresh
`python3 -m sglang.launch_server` process in its own session (FlashAttention-3, PyTorch sampling),
timed from the parent's clock. Phases, each on its own flag (`--phases`):
  tokens   the same prompt, greedy, 16 tokens, from SGLang's default loader and from the cache; the
           loader's own line says how many parameter bytes are arena views and how many were copied;
  startup  built model -> weights in place (bench/sglang_load_timing.py times the default loader's
           part), SGLang's "Load weight end. elapsed" and process start -> first completion token, both
           loaders interleaved, one warm-up start of each first (Triton's cache), then N of each;
           and every open of a checkpoint file by any process while the engine starts (inotify);
  memory   a primary and a standby (`--enable-memory-saver`, same GPU, same group): the GPU memory
           each adds on top of the agent's arena (nvidia-smi before and after it starts), the
           standby's once it has released its KV cache;
  failover an OpenAI client sends a completion every 200 ms to the group's primary (as the agent
           says) and retries a failed one once on the engine the agent promoted; the primary's
           session is SIGKILLed; timed: kill -> the agent lists the standby as primary -> a completion
           from it. Standbys start a few at a time in the background, so each trial has a fresh one;
  mixed    (with --vllm-site, the tree bench/vllm_gpu.sh unpacks) one vLLM server and one SGLang server
           attached to the same agent at once: both answer, both count their parameters as views, the
           agent lists two leases, the arena is on the GPU once.
`--phases tokens,startup` with `--startup-trials 1` is a short call (a few minutes).

Usage (SGLang importable by this python): python3 bench/sglang_gpu.py [--phases tokens,startup,memory,failover]
    [--layers 24 --hidden 4096] [--startup-trials 3] [--failovers 20] [--out DIR]   (bench/sglang_gpu.sh runs it)
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "node_agent"))

import torch  # noqa: E402

from agent_process import AgentProcess  # noqa: E402
from report import bars_line, report  # noqa: E402
from vllm_gpu import (CUDA, GIB, PACE_S, Client, Leases, free_port, llama_shape, log, make_checkpoint,  # noqa: E402
                      median, pct, settled_gpu_used)
from vllm_start import OpenCounter  # noqa: E402

GROUP = "bench-sglang"
PROMPT = [5, 9, 33, 100, 7, 42]  # token ids: no tokenizer behaviour in the way
ATTACHED = re.compile(r"attached from \S+ in ([\d.]+)s: (.+?) in arena views, (.+?) copied \(([^)]*)\)")
ATTACH_PART = re.compile(r"preparation waited on ([\d.]+)s, attach ([\d.]+)s, post-processing ([\d.]+)s")
DEFAULT_SPAN = re.compile(r"bench timing: default loader's weights in place in ([\d.]+)s")  # sglang_load_timing.py
LOAD_END = re.compile(r"Load weight end\. elapsed=([\d.]+) s")  # SGLang's own figure, either loader
RELEASED = re.compile(r"standby: released its KV cache \(([^)]+)\)")
WOKE = re.compile(r"KV cache back \(([^)]+)\) in ([\d.]+) ms")
PROMOTED = re.compile(r"promoted to primary: KV cache back \(([^)]+)\) in ([\d.]+) ms")
KV_TOKEN_BYTES = 0  # bytes of KV cache per token, from the model's shape (main)
ENGINES: list["Engine"] = []


class Engine:
    """One SGLang OpenAI server, a process session of its own, its log in a file."""

    def __init__(self, name: str, model: str, workdir: str, fmt: str, sock: str, kv_bytes: int,
                 role: str | None = None, env: dict[str, str] | None = None):
        self.name, self.fmt, self.role = name, fmt, role
        self.port = free_port()
        self.log_path = os.path.join(workdir, f"{name}.log")
        tokens = max(2048, kv_bytes // KV_TOKEN_BYTES)
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--served-model-name", "m",
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16", "--context-length", "1024",
                "--max-running-requests", "16", "--max-total-tokens", str(tokens), "--mem-fraction-static", "0.9",
                "--random-seed", "0", "--log-level", "info"]
        if CUDA:
            args += ["--attention-backend", "fa3", "--sampling-backend", "pytorch"]
        else:
            args += ["--device", "cpu"]
        if fmt == "weightcache":
            args += ["--load-format", "weightcache", "--model-loader-extra-config",
                     json.dumps({"socket": sock, "fallback": False})]
        full_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        TRITON_CACHE_DIR=os.path.join(workdir, "triton-cache"), **(env or {}))
        if role:
            full_env.update(WEIGHTCACHE_ROLE=role, WEIGHTCACHE_GROUP=GROUP)
            args += ["--enable-memory-saver"]
        self.logf = open(self.log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(args, stdout=self.logf, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        self.lease_pid: int | None = None
        ENGINES.append(self)

    def text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _fail(self, what: str) -> None:
        raise SystemExit(f"{self.name}: {what}; log tail:\n{self.text()[-6000:]}")

    def complete(self, max_tokens: int = 4, timeout: float = 60.0) -> tuple[bool, str]:
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            answer = response.read()
            if response.status != 200:
                return False, f"HTTP {response.status} {answer[:200]!r}"
            return True, json.loads(answer)["choices"][0]["text"]
        except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
            return False, f"{type(e).__name__}: {e}"
        finally:
            conn.close()

    def healthy(self) -> bool:
        """SGLang's /health: 200 once the server is up and its own warm-up request is done (no generation)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def first_token(self, timeout: float = 900.0) -> float:
        """Seconds from process start to its first completion token (polled every 20 ms)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if not self.alive():
                self._fail(f"exited {self.proc.returncode} before serving")
            ok, _ = self.complete(max_tokens=1)
            if ok:
                return time.perf_counter() - self.started
            time.sleep(0.02)
        self._fail("no completion in time")
        return 0.0

    def released(self) -> bool:
        """The standby's last word is a release (the server's own warm-up wakes it once, then it sleeps again)."""
        text = self.text()
        return len(RELEASED.findall(text)) > len(WOKE.findall(text))

    def warm_standby(self, timeout: float = 600.0) -> float:
        """Seconds from process start until /health answers and the KV cache is released (a completion would
        wake it, so none is sent)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if not self.alive():
                self._fail(f"exited {self.proc.returncode} before standing by")
            if self.healthy() and self.released():
                return time.perf_counter() - self.started
            time.sleep(0.1)
        self._fail("not a warm standby in time")
        return 0.0

    def first(self, pattern: re.Pattern) -> re.Match | None:
        return pattern.search(self.text())

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 60.0) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self.kill()  # SGLang's children, should one outlive the launcher
        self.logf.close()


def run_of(engine: Engine, seconds: float, text: str | None, opens: int) -> dict:
    attached, part, end = engine.first(ATTACHED), engine.first(ATTACH_PART), engine.first(LOAD_END)
    default_span = engine.first(DEFAULT_SPAN)
    # built model -> weights in place: the cache loader's wait for preparation, attach and post-processing;
    # the default loader's checkpoint read and post-processing
    span = sum(map(float, part.groups())) if part else float(default_span[1]) if default_span else None
    return {"seconds": seconds, "text": text, "opens": opens, "load_end": float(end[1]) if end else None,
            "weights_in": span,
            "views": attached[2] if attached else None, "copied": attached[3] if attached else None,
            "copied_names": attached[4] if attached else None}


def tokens_phase(model: str, work: str, sock: str, kv: int) -> tuple[list[str], dict]:
    runs = {}
    for fmt in ("auto", "weightcache"):
        engine = Engine(f"tokens-{fmt}", model, work, fmt, sock, kv)
        seconds = engine.first_token()
        ok, text = engine.complete(max_tokens=16)
        runs[fmt] = run_of(engine, seconds, text if ok else None, 0)
        engine.stop()
        log(f"tokens {fmt}: {text!r}, views {runs[fmt]['views']}, copied {runs[fmt]['copied']}")
        if not ok:
            raise SystemExit(f"{engine.name}: completion failed: {text}")
    same = runs["auto"]["text"] == runs["weightcache"]["text"]
    lines = [
        f"Greedy completion of {PROMPT!r}, 16 tokens: default loader {runs['auto']['text']!r}, weightcache "
        f"{runs['weightcache']['text']!r}: {'the same' if same else 'DIFFERENT'}.",
        f"weightcache's loader: {runs['weightcache']['views']} in arena views, {runs['weightcache']['copied']} copied "
        f"({runs['weightcache']['copied_names']}).",
        bars_line({"same tokens": same, "0 B copied": runs["weightcache"]["copied"] == "0 B"}),
    ]
    return lines, {"runs": runs, "same": same}


def startup_phase(model: str, work: str, sock: str, size: int, trials: int, kv: int) -> tuple[list[str], dict]:
    counter = OpenCounter(model)
    runs: dict[str, list[dict]] = {"auto": [], "weightcache": []}
    warm: dict[str, dict] = {}
    order = ["weightcache", "auto"]
    for t in range(trials + 1):  # trial 0: each loader's warm-up start (Triton's cache), not in the medians
        for fmt in order if t % 2 == 0 else order[::-1]:
            counter.take()
            engine = Engine(f"start-{fmt}-{t}", model, work, fmt, sock, kv)
            seconds = engine.first_token()
            ok, text = engine.complete(max_tokens=16)
            opens = sum(n for name, n in counter.take().items() if name.endswith(".safetensors"))
            engine.stop()
            run = run_of(engine, seconds, text if ok else None, opens)
            log(f"{fmt} trial {t}: first token {seconds:.2f}s, load weight end {run['load_end']}, weights in "
                f"{run['weights_in']}, opens {opens}, copied {run['copied']}, text {text!r}")
            if not ok:
                raise SystemExit(f"{engine.name}: completion failed: {text}")
            if t:
                runs[fmt].append(run)
            else:
                warm[fmt] = run
    med = {f: median([r["seconds"] for r in rs]) for f, rs in runs.items()}
    load = {f: median([r["load_end"] for r in rs if r["load_end"] is not None]) for f, rs in runs.items()}
    span = {f: median([r["weights_in"] for r in rs if r["weights_in"] is not None]) for f, rs in runs.items()}
    opens = {f: max(r["opens"] for r in rs) for f, rs in runs.items()}
    texts = {r["text"] for rs in runs.values() for r in rs}
    copied = {r["copied"] for r in runs["weightcache"]}
    each = {f: [round(r["weights_in"], 3) if r["weights_in"] is not None else None for r in rs] for f, rs in runs.items()}
    lines = [
        f"{trials} interleaved starts per loader after one warm-up start of each; fresh processes; medians. "
        f"Checkpoint {size / GIB:.2f} GiB, page cache warm for both loaders.",
        "",
        "| loader | built model -> weights in place | SGLang's \"Load weight end. elapsed\" (model built + weights in) | "
        "process start -> first token | checkpoint files opened while the engine started | parameter bytes copied |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| SGLang default | {span['auto']:.3f} s | {load['auto']:.3f} s | {med['auto']:.2f} s | {opens['auto']} | "
        f"all ({size / GIB:.2f} GiB read) |",
        f"| weightcache | {span['weightcache']:.3f} s | {load['weightcache']:.3f} s | {med['weightcache']:.2f} s | "
        f"{opens['weightcache']} | {', '.join(sorted(c or '?' for c in copied))} |",
        f"| ratio default / weightcache | **{span['auto'] / span['weightcache']:.0f}x** | "
        f"**{load['auto'] / load['weightcache']:.1f}x** | **{med['auto'] / med['weightcache']:.2f}x** | | |",
        "",
        "Built model -> weights in place: for the default loader SGLang's `load_weights_and_postprocess` (the "
        "checkpoint read into the built model, then post-processing; timed by bench/sglang_load_timing.py), for "
        "weightcache its wait for the attach path's preparation beyond the model's construction, the attach and "
        f"post-processing (its own log line). Each start: default {each['auto']} s / "
        f"{[round(r['seconds'], 2) for r in runs['auto']]} s to the first token, weightcache {each['weightcache']} s / "
        f"{[round(r['seconds'], 2) for r in runs['weightcache']]} s; warm-up starts to the first token: default "
        f"{warm['auto']['seconds']:.2f} s, weightcache {warm['weightcache']['seconds']:.2f} s.",
        f"Greedy completions (16 tokens) over all {2 * trials} starts: {len(texts)} distinct ({sorted(map(str, texts))}).",
        bars_line({"same tokens in every start": len(texts) == 1, "0 B copied": copied == {"0 B"},
                   "engine opens no checkpoint file": opens["weightcache"] == 0,
                   "built model -> weights in place >= 10x faster": span["auto"] >= 10 * span["weightcache"]}),
    ]
    return lines, {"runs": runs, "warm_up": warm}


def memory_phase(model: str, work: str, sock: str, kv: int) -> tuple[list[str], dict]:
    base = settled_gpu_used()
    primary = Engine("mem-primary", model, work, "weightcache", sock, kv, role="primary")
    primary.first_token()
    with_primary = settled_gpu_used()
    standby = Engine("mem-standby", model, work, "weightcache", sock, kv, role="standby")
    standby.warm_standby()
    with_standby = settled_gpu_used()
    released = RELEASED.findall(standby.text())
    standby.stop()  # before the primary: no promotion to wait for
    primary.stop()
    own_p, own_s = with_primary - base, with_standby - with_primary
    ratio = own_s / own_p if own_p else float("nan")
    lines = [
        f"GPU memory each engine adds beyond the agent's arena (the device's used memory before and after it starts, "
        f"nvidia-smi), a KV cache of {kv / GIB:g} GiB each (--max-total-tokens), --enable-memory-saver:",
        "",
        "| engine | role | GPU memory of its own | KV cache |",
        "| --- | --- | ---: | --- |",
        f"| mem-primary | primary | {own_p / GIB:.2f} GiB | held |",
        f"| mem-standby | standby, sleeping | {own_s / GIB:.2f} GiB | released ({released[-1] if released else '?'}) |",
        "",
        f"Standby / primary: {ratio * 100:.1f}% (agent and arena before both: {base / GIB:.2f} GiB used).",
        bars_line({"standby <= 10% of the primary": ratio <= 0.10}) if CUDA else "(no GPU: not measured)",
    ]
    return lines, {"base": base, "with_primary": with_primary, "with_standby": with_standby, "ratio": ratio}


def failover_phase(model: str, work: str, sock: str, kv: int, trials: int, batch: int) -> tuple[list[str], dict]:
    leases = Leases(sock)
    engines: list[Engine] = []
    primary = Engine("fo-0", model, work, "weightcache", sock, kv, role="primary")
    primary.first_token()
    engines.append(primary)
    pending: list[Engine] = []
    started = 0

    def top_up() -> None:
        nonlocal started
        while started < trials and len(pending) < batch:  # each trial spends one standby
            started += 1
            pending.append(Engine(f"fo-{started}", model, work, "weightcache", sock, kv, role="standby"))

    def next_standby(timeout: float = 900.0) -> Engine:
        """The standby the agent would promote (its oldest standby lease), warm."""
        deadline = time.perf_counter() + timeout
        while (standby := leases.find(engines + pending, "standby")) is None:
            if time.perf_counter() > deadline:
                raise SystemExit(f"no standby lease in time; agent: {leases.clients()}")
            time.sleep(0.1)
        if standby in pending:
            pending.remove(standby)
            standby.warm_standby()
            engines.append(standby)
            top_up()
        return standby

    top_up()
    results = []
    client = Client(leases, engines)
    with client:
        t_begin = time.perf_counter()
        for i in range(trials):
            expected = next_standby()
            victim = client.primary()
            if victim is None:
                raise SystemExit(f"trial {i}: no primary; agent: {leases.clients()}")
            time.sleep(1.0)  # traffic on this primary before the kill
            t0 = time.perf_counter()
            victim.kill()
            promoted_s = serving_s = None
            deadline = t0 + 30
            while time.perf_counter() < deadline and serving_s is None:
                if promoted_s is None:
                    if leases.role_of(expected) == "primary":
                        promoted_s = time.perf_counter() - t0
                    else:
                        time.sleep(0.002)
                        continue
                ok, _ = expected.complete(max_tokens=1)
                if ok:
                    serving_s = time.perf_counter() - t0
            victim.proc.wait()
            engines.remove(victim)
            woke = PROMOTED.search(expected.text())
            results.append({"victim": victim.name, "promoted": expected.name, "promoted_s": promoted_s,
                            "serving_s": serving_s, "wake_ms": float(woke[2]) if woke else None})
            log(f"trial {i + 1}/{trials}: {victim.name} -> {expected.name}: promoted "
                f"{promoted_s and promoted_s * 1e3:.0f} ms, serving {serving_s and serving_s * 1e3:.0f} ms, "
                f"KV cache back in {woke[2] if woke else '?'} ms")
        t_end = time.perf_counter()
        time.sleep(1.0)
    for e in engines + pending:
        e.stop()
    reqs = [r for r in client.records if t_begin <= r.start < t_end]
    failed = [r for r in reqs if not r.ok]
    promoted = [r["promoted_s"] for r in results if r["promoted_s"] is not None]
    serving = [r["serving_s"] for r in results if r["serving_s"] is not None]
    wakes = [r["wake_ms"] for r in results if r["wake_ms"] is not None]
    lines = [
        f"{trials} trials, SIGKILL of the primary's process session (launcher, tokenizer, scheduler, detokenizer), "
        f"a KV cache of {kv / GIB:g} GiB each, standbys sleeping (--enable-memory-saver):",
        "",
        "| kill -> | p50 | p99 | max |",
        "| --- | ---: | ---: | ---: |",
        f"| the agent lists the standby as primary | {median(promoted) * 1e3:.0f} ms | {pct(promoted, .99) * 1e3:.0f} ms "
        f"| {max(promoted, default=float('nan')) * 1e3:.0f} ms |",
        f"| a completion from the promoted standby (KV cache back) | {median(serving) * 1e3:.0f} ms | "
        f"{pct(serving, .99) * 1e3:.0f} ms | {max(serving, default=float('nan')) * 1e3:.0f} ms |",
        f"| (inside it: the standby maps its KV cache again) | {median(wakes):.1f} ms | {pct(wakes, .99):.1f} ms | "
        f"{max(wakes, default=float('nan')):.1f} ms |",
        "",
        f"OpenAI client, a completion every {PACE_S * 1e3:.0f} ms, one retry: {len(reqs)} sent during the trials, "
        f"{len(failed)} failed, {sum(r.retried and r.ok for r in reqs)} answered on their retry.",
        bars_line({"every trial served": len(serving) == trials, "p99 <= 1 s": pct(serving, .99) <= 1.0,
                   "0 failed requests": not failed}),
    ]
    return lines, {"trials": results, "failed": [r.__dict__ for r in failed]}


def mixed_phase(model: str, work: str, sock: str, kv: int, vllm_site: str) -> tuple[list[str], dict]:
    """One vLLM and one SGLang server on the same agent, at once."""
    if not os.path.isdir(os.path.join(vllm_site, "vllm")):
        raise SystemExit(f"--vllm-site {vllm_site}: no vllm there (bench/vllm_gpu.sh receive + run unpacks it)")
    base = settled_gpu_used()
    checkout = os.path.dirname(HERE)
    # weightcache's vLLM entry point, as an installed weightcache would declare it (vLLM's tree may not hold one)
    plugin = os.path.join(work, "vllm-plugin", "weightcache-0.1.0.dist-info")
    os.makedirs(plugin, exist_ok=True)
    with open(os.path.join(plugin, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: weightcache\nVersion: 0.1.0\n")
    with open(os.path.join(plugin, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nweightcache = weightcache_agent.integrations.vllm:register\n")
    vllm_env = dict(os.environ, PYTHONPATH=f"{checkout}/node_agent:{os.path.dirname(plugin)}:{vllm_site}",
                    VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    port = free_port()
    vllm_log = os.path.join(work, "mixed-vllm.log")
    with open(vllm_log, "w") as logf:
        vllm = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--dtype",
                                 "bfloat16", "--max-model-len", "1024", "--max-num-seqs", "16",
                                 "--kv-cache-memory-bytes", str(kv), "--gpu-memory-utilization", "0.05",
                                 "--load-format", "weightcache", "--model-loader-extra-config",
                                 json.dumps({"socket": sock, "fallback": False})],
                                stdout=logf, stderr=subprocess.STDOUT, env=vllm_env, start_new_session=True)
    sglang = Engine("mixed-sglang", model, work, "weightcache", sock, kv)
    try:
        sglang.first_token()
        ok_s, text_s = sglang.complete(max_tokens=16)
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        ok_v, text_v, deadline = False, "", time.perf_counter() + 900
        while not ok_v and time.perf_counter() < deadline and vllm.poll() is None:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                answer = response.read()
                ok_v = response.status == 200
                text_v = json.loads(answer)["choices"][0]["text"] if ok_v else ""
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                time.sleep(0.5)
        leases = Leases(sock).clients()
        both = settled_gpu_used()
        with open(vllm_log, errors="replace") as f:
            vllm_attached = ATTACHED.search(f.read())
    finally:
        os.killpg(vllm.pid, signal.SIGTERM)
        vllm.wait(60)
        sglang.stop()
    sglang_attached = sglang.first(ATTACHED)
    lines = [
        f"vLLM and SGLang attached to one agent at once: {len(leases)} leases; vLLM {'answered' if ok_v else 'FAILED'} "
        f"{text_v!r}, SGLang {'answered' if ok_s else 'FAILED'} {text_s!r}.",
        f"Parameters: vLLM {vllm_attached[2] if vllm_attached else '?'} views, {vllm_attached[3] if vllm_attached else '?'} "
        f"copied; SGLang {sglang_attached[2] if sglang_attached else '?'} views, "
        f"{sglang_attached[3] if sglang_attached else '?'} copied. GPU memory the two engines added beyond the arena: "
        f"{(both - base) / GIB:.2f} GiB (KV caches {kv / GIB:g} GiB each).",
        bars_line({"both answered": ok_v and ok_s, "two leases on one arena": len(leases) >= 2,
                   "0 B copied by either": bool(vllm_attached and sglang_attached and vllm_attached[3] == "0 B"
                                                and sglang_attached[3] == "0 B")}),
    ]
    return lines, {"leases": leases, "vllm": text_v, "sglang": text_s, "added": both - base}


def main() -> int:
    global KV_TOKEN_BYTES
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default="tokens,startup,memory,failover",
                   help="comma list of tokens,startup,memory,failover,mixed (default: all but mixed)")
    p.add_argument("--layers", type=int, default=24 if CUDA else 2)
    p.add_argument("--hidden", type=int, default=4096 if CUDA else 256)
    p.add_argument("--startup-trials", type=int, default=3)
    p.add_argument("--failovers", type=int, default=20)
    p.add_argument("--batch", type=int, default=5, help="standbys starting at once (default 5)")
    p.add_argument("--kv-gib", type=float, default=8 if CUDA else 0.0625, help="KV cache per engine")
    p.add_argument("--memory-kv-gib", type=float, default=32 if CUDA else 0.25, help="KV cache per engine, memory")
    p.add_argument("--vllm-site", default=os.environ.get("WEIGHTCACHE_VLLM_SITE", "/tmp/vllm-site"),
                   help="vLLM's unpacked tree, for the mixed phase")
    p.add_argument("--dir", default=None, help="where the checkpoint and logs go (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    args = p.parse_args()
    import sglang

    phases = [x for x in args.phases.split(",") if x]
    work = args.dir or tempfile.mkdtemp(prefix="wc-sglang-gpu-")
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "llama")
    shape = llama_shape(args.layers, args.hidden)
    head_dim = shape.hidden_size // shape.num_attention_heads
    KV_TOKEN_BYTES = 2 * shape.num_hidden_layers * shape.num_key_value_heads * head_dim * 2  # K and V, bf16
    t0 = time.perf_counter()
    if os.path.exists(os.path.join(model, "config.json")):
        size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
        log(f"checkpoint: {size / GIB:.2f} GiB, kept from an earlier run")
    else:
        shutil.rmtree(model, ignore_errors=True)
        size = make_checkpoint(model, shape)
        log(f"checkpoint: {size / GIB:.2f} GiB in {time.perf_counter() - t0:.1f}s")
    sock = os.path.join(work, "agent.sock")
    agent = AgentProcess(model, sock, "cuda" if CUDA else "cpu")
    status = agent.ready()
    log(f"agent ready: {status.get('load_seconds')} s load, {status.get('wall_seconds'):.1f} s from process start")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip() if CUDA else "no GPU"
    head = [f"SGLang {sglang.__version__}, torch {torch.__version__}, {gpu}; synthetic Llama {args.layers} layers, "
            f"hidden {args.hidden}, bf16, {size / GIB:.2f} GiB; agent's cold load {status.get('load_seconds', 0):.2f} s",
            ""]
    sections: list[str] = []
    data: dict = {"size": size, "agent": {k: status.get(k) for k in ("load_seconds", "wall_seconds", "arena_bytes")}}
    kv, memory_kv = int(args.kv_gib * GIB), int(args.memory_kv_gib * GIB)
    table = {
        "tokens": ("Tokens and views, default loader vs weightcache", lambda: tokens_phase(model, work, sock, kv)),
        "startup": ("Start-up, default loader vs weightcache",
                    lambda: startup_phase(model, work, sock, size, args.startup_trials, kv)),
        "memory": ("A primary and a sleeping standby on one GPU", lambda: memory_phase(model, work, sock, memory_kv)),
        "failover": ("Failover under OpenAI traffic",
                     lambda: failover_phase(model, work, sock, kv, args.failovers, args.batch)),
        "mixed": ("One agent, a vLLM and an SGLang engine at once",
                  lambda: mixed_phase(model, work, sock, kv, args.vllm_site)),
    }
    unknown = [x for x in phases if x not in table]
    if unknown:
        raise SystemExit(f"unknown phase(s) {unknown}; known: {', '.join(table)}")
    failed = 0
    try:
        for name in phases:
            title, run = table[name]
            log(f"phase {name}")
            try:
                lines, data[name] = run()
            except (Exception, SystemExit) as e:  # noqa: BLE001 -- the next phase still runs; the report says why
                failed += 1
                lines = [f"FAILED: {type(e).__name__}: {str(e)[-3000:]}"]
                traceback.print_exc()
                for engine in ENGINES:
                    if engine.alive():
                        engine.stop()
            sections += [f"### {title}", "", *lines, ""]
            report(args.out, "sglang_gpu", head + sections, data)
    finally:
        agent.stop()
        for e in ENGINES:
            if e.alive():
                e.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
