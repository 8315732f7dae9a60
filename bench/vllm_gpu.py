"""vLLM's OpenAI server on a GPU with `--load-format weightcache`: tokens, start-up, a sleeping
standby, failover and a planned switchover, all measured from outside.

One agent (`weightcache agent`, the cuda backend) holds a synthetic Llama
(bf16, >= 8 GiB, a word-level tokenizer so the OpenAI server runs). Every engine is a fresh
`python3 -m vllm.entrypoints.openai.api_server` process in its own session, timed from the
parent's clock:
  1. tokens: the same prompt, greedy, from vLLM's default loader and from the cache; the
     loader's own line says how many parameter bytes are arena views and how many were copied;
  2. start-up: process start -> first completion token, both loaders interleaved (each one's
     first start with the compile caches emptied), with the load phase from each engine's log (the
     default's "Loading weights took"; weightcache's wait and attach once the model is built) and
     every open of a checkpoint file by any process while the engine starts (inotify);
  3. memory: a primary and a standby (`--enable-sleep-mode`, same GPU, same group): the GPU
     memory each adds on top of the agent's arena (the device's used memory before and after
     it starts), the standby's once it has released its KV cache;
  4. failover: an OpenAI client sends a completion every 200 ms to the group's primary (as the
     agent says: what the serving label follows on Kubernetes) and retries a failed one once,
     on the engine the agent promoted; the primary is SIGKILLed; timed: kill -> the agent lists
     the standby as primary -> a completion from it (its KV cache back). Standbys start a few at
     a time in the background, so each trial has a fresh one;
  5. a planned switchover (`weightcache switchover --to-pid`) under the same client.
On a machine without CUDA (vLLM's CPU build) the same steps run on a tiny model with the cpu
backend, without sleep mode: a check of the script, not figures.
With --fp8 the checkpoint is block FP8 as DeepSeek-V3's releases are (amax/448 scales per 128x128
block) and the agent serves it as it is (`--quantization fp8-block`); every step runs on it. vLLM's
CPU build has no block-FP8 kernel (its engine stops at start), so --fp8 is for the GPU.

Usage (vLLM importable by this python): python3 bench/vllm_gpu.py [--layers 24 --hidden 4096]
    [--startup-trials 3] [--failovers 20] [--fp8] [--out DIR]      (bench/vllm_gpu.sh runs it on the H200)
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "node_agent"))

import torch  # noqa: E402

from agent_process import AgentProcess  # noqa: E402
from report import bars_line, report  # noqa: E402
from vllm_start import OpenCounter  # noqa: E402
from weightcache_agent import agent_status  # noqa: E402
from weightcache_agent.errors import WeightCacheError  # noqa: E402
from weightcache_agent.testing.synthetic import LlamaShape, write_word_tokenizer  # noqa: E402

CUDA = torch.cuda.is_available()
LAYERS, HIDDEN = (24, 4096) if CUDA else (2, 256)  # an 8.41 GiB Llama on a GPU; a tiny one on CPU
GROUP = "bench"
PROMPT = [5, 9, 33, 100, 7, 42]  # token ids (the OpenAI API's array form): no tokenizer behaviour in the way
PACE_S = 0.2
# the load phase, the model built: the default loader reading the weights in; weightcache waiting for the agent
# beyond the build, then attaching (its line's parts)
LOAD_PHASE = re.compile(r"Loading weights took ([\d.]+) seconds|preparation waited on ([\d.]+)s, attach ([\d.]+)s")
LOADER_LINE = re.compile(r"attached from \S+ in ([\d.]+)s")  # weightcache's whole load_model
MODEL_LOADING = re.compile(r"Model loading took .*? and ([\d.]+) seconds")  # vLLM's own figure, either loader
ATTACHED = re.compile(r"attached from \S+ in [\d.]+s: (.+?) in arena views, (.+?) copied")
RELEASED = re.compile(r"standby: released its KV cache \(([^,]+),")
WOKE = re.compile(r"promoted to primary: KV cache back \(([^)]+)\) in ([\d.]+) ms")
GIB = 1 << 30
ENGINES: list["Engine"] = []  # every engine started, stopped at the end whatever happened


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_used_bytes() -> int:
    """The device's used memory, as the driver counts it (all processes): no CUDA context here."""
    if not CUDA:
        return 0
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) << 20


def settled_gpu_used(seconds: float = 2.0) -> int:
    time.sleep(seconds)
    return gpu_used_bytes()


def llama_shape(layers: int, hidden: int) -> LlamaShape:
    """A Llama of `layers` layers of width `hidden`: 8B's proportions (GQA 4:1, MLP 43/16 wide)."""
    return LlamaShape(hidden_size=hidden, intermediate_size=hidden * 43 // 16, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512),
                      vocab_size=32000)


def make_checkpoint(directory: str, shape: LlamaShape, fp8: bool = False) -> int:
    """Random bf16 weights (made on the GPU where there is one), sharded safetensors, a tokenizer.

    fp8: each linear weight quantized to block FP8 as DeepSeek-V3's releases ship (128x128 blocks,
    `weight_scale_inv`, `quantization_config` in config.json), the rest left bf16."""
    from safetensors.torch import save_file

    from weightcache_agent.testing.synthetic_moe import fp8_config, prequantize

    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    kv = shape.num_key_value_heads * (h // shape.num_attention_heads)
    dims = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}

    def rand(*d: int) -> torch.Tensor:
        return (torch.randn(*d, generator=gen, device=device) * d[-1] ** -0.5).to(torch.bfloat16).cpu()

    os.makedirs(directory, exist_ok=True)
    weight_map: dict[str, str] = {}
    shards = [["model.embed_tokens.weight", "lm_head.weight"]] + [[n] for n in range(shape.num_hidden_layers)]
    for k, part in enumerate(shards):
        tensors: dict[str, torch.Tensor] = {}
        for item in part:
            if isinstance(item, str):
                tensors[item] = rand(v, h)
                continue
            p = f"model.layers.{item}."
            tensors.update({f"{p}{name}.weight": rand(*d) for name, d in dims.items()})
            tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
            tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if k == len(shards) - 1:
            tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if fp8:
            tensors = prequantize(tensors)
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        config = shape.config(torch.bfloat16)
        json.dump(fp8_config(config) if fp8 else config, f)
    write_word_tokenizer(directory, v)
    if CUDA:
        torch.cuda.empty_cache()  # what this process keeps on the GPU stays constant from here on
    os.sync()
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors"))


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it (/proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo.extend(children.get(p, []))
    return out


class Engine:
    """One vLLM OpenAI server, a process session of its own, its log in a file."""

    def __init__(self, name: str, model: str, workdir: str, fmt: str, sock: str, kv_bytes: int,
                 role: str | None = None, extra: tuple[str, ...] = (), launcher: tuple[str, ...] = ()):
        self.name, self.fmt, self.role = name, fmt, role
        self.port = free_port()
        self.log_path = os.path.join(workdir, f"{name}.log")
        # launcher: a script run instead of `-m vllm.entrypoints.openai.api_server`, taking its arguments
        args = [sys.executable, *(launcher or ("-m", "vllm.entrypoints.openai.api_server")),
                "--model", model, "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "bfloat16", "--max-model-len", "1024",
                "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0"]
        if CUDA:
            # the free-memory check at start-up: several engines share the GPU, each sized by its KV bytes
            args += ["--gpu-memory-utilization", "0.05"]
        else:
            args += ["--enforce-eager"]
        if fmt == "weightcache":
            args += ["--load-format", "weightcache", "--model-loader-extra-config",
                     json.dumps({"socket": sock, "fallback": False})]
        args += list(extra)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   **compile_caches(workdir))
        if role:
            env.update(WEIGHTCACHE_ROLE=role, WEIGHTCACHE_GROUP=GROUP)
            if CUDA:
                args += ["--enable-sleep-mode"]
        self.logf = open(self.log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(args, stdout=self.logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
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

    def decode_rate(self, tokens: int = 256) -> float:
        """Tokens per second of one greedy completion of `tokens` tokens (EOS ignored), one request alone."""
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            t = time.perf_counter()
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            return tokens / (time.perf_counter() - t) if response.status == 200 else float("nan")
        finally:
            conn.close()

    def healthy(self) -> bool:
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

    def warm_standby(self, timeout: float = 300.0) -> float:
        """Seconds from process start until the server answers /health and its worker said it released
        its KV cache (a completion would wake it, so none is sent)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if not self.alive():
                self._fail(f"exited {self.proc.returncode} before standing by")
            if RELEASED.search(self.text()) and self.healthy():
                return time.perf_counter() - self.started
            time.sleep(0.1)
        self._fail("not a warm standby in time")
        return 0.0

    def load_phase(self) -> float | None:
        m = LOAD_PHASE.search(self.text())
        return None if not m else float(m[1]) if m[1] else float(m[2]) + float(m[3])

    def loader_line(self) -> float | None:
        m = LOADER_LINE.search(self.text())
        return float(m[1]) if m else None

    def model_loading(self) -> float | None:
        m = MODEL_LOADING.search(self.text())
        return float(m[1]) if m else None

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
        self.logf.close()


class Leases:
    """The agent's word on the group's leases (oldest first), matched to engines by the lease's pid."""

    def __init__(self, sock: str):
        self.sock = sock

    def clients(self) -> list[dict]:
        try:
            return agent_status(self.sock).get("clients") or []
        except (WeightCacheError, OSError):
            return []

    def pid_of(self, engine: Engine, clients: list[dict] | None = None) -> int | None:
        """The pid holding `engine`'s lease (its engine core), once it has one; kept, it never changes."""
        if engine.lease_pid is None:
            pids = descendants(engine.proc.pid)
            engine.lease_pid = next((c["pid"] for c in clients or self.clients() if c.get("pid") in pids), None)
        return engine.lease_pid

    def role_of(self, engine: Engine) -> str | None:
        clients = self.clients()
        pid = self.pid_of(engine, clients)
        return next((c["role"] for c in clients if c.get("pid") == pid), None)

    def find(self, engines: list[Engine], role: str, avoid: Engine | None = None) -> Engine | None:
        """The engine whose lease is the oldest one with `role`."""
        clients = self.clients()
        for c in clients:
            if c.get("role") != role:
                continue
            for engine in engines:
                if engine is not avoid and engine.alive() and self.pid_of(engine, clients) == c.get("pid"):
                    return engine
        return None


@dataclass
class Request:
    start: float
    end: float
    engine: str
    ok: bool
    retried: bool
    error: str = ""


@dataclass
class Client:
    """An OpenAI completion every 200 ms to the group's primary; a failed one retried once on the primary the
    agent names next (waiting up to 2 s for it), as a client behind the serving label's Service would."""

    leases: Leases
    engines: list[Engine]
    records: list[Request] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)

    def primary(self, avoid: Engine | None = None) -> Engine | None:
        return self.leases.find(list(self.engines), "primary", avoid)

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            target = self.primary()
            ok, error = target.complete() if target else (False, "no primary")
            retried = not ok
            if retried:
                deadline = time.perf_counter() + 2.0
                other = None
                while other is None and time.perf_counter() < deadline:
                    other = self.primary(avoid=target)
                    if other is None:
                        time.sleep(0.01)
                if other is not None:
                    target = other
                    ok, error2 = other.complete()
                    error = f"{error}; retry: {error2}" if not ok else error
            self.records.append(Request(start, time.perf_counter(), target.name if target else "-", ok, retried,
                                        "" if ok else error))
            self.stop.wait(PACE_S)

    def __enter__(self) -> Client:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)

    def since(self, t: float) -> list[Request]:
        return [r for r in list(self.records) if r.start >= t]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def compile_caches(workdir: str) -> dict[str, str]:
    """The compile caches of vLLM, Inductor and Triton, in the bench's directory: emptied for a cold start."""
    root = os.path.join(workdir, "compile-cache")
    return {"VLLM_CACHE_ROOT": os.path.join(root, "vllm"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(root, "triton")}


def startup_table(runs: dict[str, list[dict]], cold: dict[str, dict], size: int, trials: int) -> tuple[list[str], bool]:
    # tokens compared where the kernels are the same: runs that load them from the compile cache. A fresh compilation
    # (each loader's first start) autotunes its own kernels, and on random weights a near-tie can tip either way
    warm = [(f"{fmt} {i + 1}", r["text"]) for fmt, rs in runs.items() for i, r in enumerate(rs)]
    reference = runs["auto"][0]["text"]
    different = [name for name, text in warm if text != reference]
    same = not different
    med = {f: median([r["seconds"] for r in rs]) for f, rs in runs.items()}
    phase = {f: median([r["load_phase"] for r in rs if r["load_phase"] is not None]) for f, rs in runs.items()}
    whole = {f: median([r["model_loading"] for r in rs if r.get("model_loading") is not None]) for f, rs in runs.items()}
    loader_line = median([r["loader_line"] for r in runs["weightcache"] if r.get("loader_line") is not None])
    opens = {f: max(r["opens"] for r in rs) for f, rs in runs.items()}
    copied = {r["copied"] for r in runs["weightcache"]}
    lines = [
        f"{trials} interleaved trials per loader after one of each with the compile caches emptied (vLLM's, "
        f"Inductor's, Triton's); fresh processes; medians. Checkpoint {size / GIB:.2f} GiB, page cache warm for "
        "both loaders.",
        "",
        "| loader | process start -> first token | load phase (weights into the built model) | model loading "
        "(vLLM's line) | "
        "checkpoint files opened by any process while the engine started | parameter bytes copied |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| vLLM default | {med['auto']:.2f} s | {phase['auto']:.3f} s | {whole['auto']:.3f} s | {opens['auto']} | "
        f"all ({size / GIB:.2f} GiB read) |",
        f"| weightcache | {med['weightcache']:.2f} s | {phase['weightcache']:.3f} s | {whole['weightcache']:.3f} s | "
        f"{opens['weightcache']} | {', '.join(sorted(c or '?' for c in copied))} (views: "
        f"{runs['weightcache'][0]['views']}) |",
        f"| ratio default / weightcache | **{med['auto'] / med['weightcache']:.2f}x** | "
        f"**{phase['auto'] / phase['weightcache']:.1f}x** | **{whole['auto'] / whole['weightcache']:.1f}x** | | |",
        "",
        f"Each start, seconds to first token: default {[round(r['seconds'], 2) for r in runs['auto']]}, weightcache "
        f"{[round(r['seconds'], 2) for r in runs['weightcache']]}; with the compile caches emptied: default "
        f"{cold['auto']['seconds']:.2f} s, weightcache {cold['weightcache']['seconds']:.2f} s. Decode, one request "
        f"of 256 tokens alone (median): default {median([r['decode_tokens_per_s'] for r in runs['auto']]):.1f} "
        f"tokens/s, weightcache {median([r['decode_tokens_per_s'] for r in runs['weightcache']]):.1f} tokens/s.",
        f"Greedy completion of {PROMPT!r} (16 tokens) from the compiled kernels in the compile cache, {len(warm)} "
        "runs: "
        + (f"the same from both loaders in every run ({reference!r})." if same else
           f"differs from the first default run's ({reference!r}) in " + "; ".join(
               f"{name}: {text!r}" for name, text in warm if name in different) + ".")
        + f" With kernels compiled afresh (the caches emptied): default {cold['auto']['text']!r}, weightcache "
        f"{cold['weightcache']['text']!r}.",
        "The load phase is the span in which a built model gets its weights, from each loader's line: vLLM's default "
        "reading the checkpoint into the parameters (\"Loading weights took\"), weightcache waiting for the agent "
        "beyond the model's construction and attaching its arena (\"preparation waited on\" + \"attach\"). vLLM's "
        "\"Model loading took\" times construction, load phase and post-processing for both, with the model "
        f"runner's own set-up; weightcache's whole load_model took {loader_line:.3f} s (median, its line).",
        bars_line({"same tokens (same kernels)": same, "0 B copied": copied == {"0 B"}, "load phase >= 10x faster":
                   phase["auto"] >= 10 * phase["weightcache"], "engine opens no checkpoint file": opens["weightcache"] == 0}),
    ]
    return lines, same


def startup_phase(model: str, work: str, sock: str, size: int, trials: int, kv: int) -> tuple[list[str], dict]:
    counter = OpenCounter(model)
    runs: dict[str, list[dict]] = {"auto": [], "weightcache": []}
    cold: dict = {}
    order = ["weightcache", "auto"]
    # trial 0: each loader's engine with the compile caches emptied first (it compiles every kernel), not in the medians
    for t in range(trials + 1):
        for fmt in order if t % 2 == 0 else order[::-1]:
            if t == 0:
                shutil.rmtree(os.path.dirname(compile_caches(work)["VLLM_CACHE_ROOT"]), ignore_errors=True)
            counter.take()
            engine = Engine(f"start-{fmt}-{t}", model, work, fmt, sock, kv)
            seconds = engine.first_token()
            ok, text = engine.complete(max_tokens=16)
            rate = engine.decode_rate()
            opens = sum(n for name, n in counter.take().items() if name.endswith(".safetensors"))
            log_text = engine.text()
            attached = ATTACHED.search(log_text)
            engine.stop()
            run = {"seconds": seconds, "load_phase": engine.load_phase(), "model_loading": engine.model_loading(),
                   "loader_line": engine.loader_line(), "decode_tokens_per_s": rate,
                   "opens": opens, "text": text if ok else None,
                   "views": attached[1] if attached else None, "copied": attached[2] if attached else None}
            log(f"{fmt} trial {t}: first token {seconds:.2f}s, load phase {run['load_phase']}, opens {opens}, "
                f"views {run['views']}, copied {run['copied']}, decode {rate:.1f} tokens/s, text {text!r}")
            if not ok:
                raise SystemExit(f"{engine.name}: completion failed: {text}")
            if t == 0:
                cold[fmt] = run
            else:
                runs[fmt].append(run)
    lines, same = startup_table(runs, cold, size, trials)
    return lines, {"runs": runs, "compile_cold": cold, "same": same}


def common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agent_fp8_phase(work: str, shape: LlamaShape, kv: int) -> tuple[list[str], dict]:
    """A bf16 checkpoint quantized by the agent (`--quantization fp8-block`), vLLM told by `--hf-overrides`,
    against vLLM's own online FP8 of the same checkpoint (`--quantization fp8`) and vLLM's bf16."""
    from weightcache_agent.integrations.vllm_fp8 import HF_OVERRIDES

    model = os.path.join(work, "llama-bf16")
    make_checkpoint(model, shape)  # the same seed: the weights the FP8 checkpoint was quantized from
    sock = os.path.join(work, "agent-fp8-block.sock")
    agent = AgentProcess(model, sock, "cuda" if CUDA else "cpu", "--quantization", "fp8-block")
    agent.ready()
    cases = [("weightcache, agent's fp8-block", "weightcache", ("--hf-overrides", json.dumps(HF_OVERRIDES))),
             ("vLLM default loader, --quantization fp8 (vLLM's online FP8)", "auto", ("--quantization", "fp8")),
             ("vLLM default loader, bf16", "auto", ())]
    rows, data = [], []
    try:
        for i, (label, fmt, extra) in enumerate(cases):
            engine = Engine(f"aq-{i}", model, work, fmt, sock, kv, extra=extra)
            seconds = engine.first_token()
            ok, text = engine.complete(max_tokens=16)
            attached = ATTACHED.search(engine.text())
            engine.stop()
            if not ok:
                raise SystemExit(f"{engine.name}: completion failed: {text}")
            data.append({"case": label, "seconds": seconds, "text": text,
                         "views": attached[1] if attached else None, "copied": attached[2] if attached else None})
            log(f"{label}: first token {seconds:.2f}s, {text!r}")
    finally:
        agent.stop()
    reference = data[-1]["text"].split()
    for d in data:
        rows.append(f"| {d['case']} | {d['seconds']:.2f} s | {d['views'] or '-'} / {d['copied'] or '-'} | "
                    f"{common_prefix(d['text'].split(), reference)} of 16 | `{d['text'].strip()}` |")
    same_as_vllm_fp8 = common_prefix(data[0]["text"].split(), data[1]["text"].split())
    lines = ["The same random bf16 weights; greedy completion of 16 tokens; each engine a fresh process with the "
             "compile cache of this run.", "",
             "| engine | process start -> first token | arena views / copied | tokens equal to bf16's (prefix) | "
             "tokens |", "| --- | ---: | --- | ---: | --- |", *rows, "",
             f"The agent's block FP8 and vLLM's online FP8 agree on the first {same_as_vllm_fp8} of 16 tokens: "
             "different quantizers (128x128 blocks with power-of-two scales against one scale per tensor), so "
             "near-ties in random weights' logits may tip differently.",
             bars_line({"served from the arena, 0 B copied": bool(data[0]["copied"]) and
                        data[0]["copied"].startswith("0 B")})]
    return lines, {"cases": data}


def memory_phase(model: str, work: str, sock: str, kv: int) -> tuple[list[str], dict]:
    base = settled_gpu_used()
    primary = Engine("mem-primary", model, work, "weightcache", sock, kv, role="primary")
    primary.first_token()
    with_primary = settled_gpu_used()
    standby = Engine("mem-standby", model, work, "weightcache", sock, kv, role="standby")
    standby.warm_standby()
    with_standby = settled_gpu_used()
    released = RELEASED.search(standby.text())
    standby.stop()  # before the primary: no promotion to wait for
    primary.stop()
    own_p, own_s = with_primary - base, with_standby - with_primary
    ratio = own_s / own_p if own_p else float("nan")
    lines = [
        f"GPU memory each engine adds beyond the agent's arena (the device's used memory before and after it starts, "
        f"nvidia-smi), --kv-cache-memory-bytes {kv / GIB:g} GiB each:",
        "",
        "| engine | role | GPU memory of its own | KV cache |",
        "| --- | --- | ---: | --- |",
        f"| mem-primary | primary | {own_p / GIB:.2f} GiB | held |",
        f"| mem-standby | standby, sleeping | {own_s / GIB:.2f} GiB | released ({released[1] if released else '?'}) |",
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
        # trials + 1 standbys: each trial spends one, the switchover one more; at most `batch` starting at once
        while started < trials + 1 and len(pending) < batch:
            started += 1
            pending.append(Engine(f"fo-{started}", model, work, "weightcache", sock, kv, role="standby"))

    top_up()
    results = []
    client = Client(leases, engines)

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
            woke = WOKE.search(expected.text())
            results.append({"victim": victim.name, "promoted": expected.name, "promoted_s": promoted_s,
                            "serving_s": serving_s, "wake_ms": float(woke[2]) if woke else None})
            log(f"trial {i + 1}/{trials}: {victim.name} -> {expected.name}: promoted "
                f"{promoted_s and promoted_s * 1e3:.0f} ms, serving {serving_s and serving_s * 1e3:.0f} ms, "
                f"KV cache back in {woke[2] if woke else '?'} ms")
        t_fail_end = time.perf_counter()
        # a planned switchover to the standby that stands by now, make before break
        target = next_standby()
        old = client.primary()
        pid = leases.pid_of(target)
        time.sleep(2.0)
        t_switch = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "weightcache_agent", "switchover", "--socket", sock, "--group",
                               GROUP, "--to-pid", str(pid), "--json"], capture_output=True, text=True, timeout=120)
        switched_s = time.perf_counter() - t_switch
        time.sleep(2.0)
        now_primary = client.primary()
        old.stop()  # the demoted primary drains and goes
        time.sleep(3.0)
    for e in engines + pending:
        e.stop()
    fail_reqs = [r for r in client.records if r.start >= t_begin and r.start < t_fail_end]
    switch_reqs = client.since(t_switch)
    promoted = [r["promoted_s"] for r in results if r["promoted_s"] is not None]
    serving = [r["serving_s"] for r in results if r["serving_s"] is not None]
    wakes = [r["wake_ms"] for r in results if r["wake_ms"] is not None]
    failed = [r for r in fail_reqs if not r.ok]
    lines = [
        f"{trials} trials, SIGKILL of the primary's process group (API server and engine core), "
        f"--kv-cache-memory-bytes {kv / GIB:g} GiB, standbys sleeping:",
        "",
        "| kill -> | p50 | p99 | max |",
        "| --- | ---: | ---: | ---: |",
        f"| the agent lists the standby as primary | {median(promoted) * 1e3:.0f} ms | {pct(promoted, .99) * 1e3:.0f} ms "
        f"| {max(promoted) * 1e3:.0f} ms |",
        f"| a completion from the promoted standby (KV cache back) | {median(serving) * 1e3:.0f} ms | "
        f"{pct(serving, .99) * 1e3:.0f} ms | {max(serving) * 1e3:.0f} ms |",
        f"| (inside it: the standby maps its KV cache again) | {median(wakes):.1f} ms | {pct(wakes, .99):.1f} ms | "
        f"{max(wakes) if wakes else float('nan'):.1f} ms |",
        "",
        f"OpenAI client, a completion every {PACE_S * 1e3:.0f} ms, one retry: {len(fail_reqs)} sent during the "
        f"trials, {len(failed)} failed, {sum(r.retried and r.ok for r in fail_reqs)} answered on their retry.",
        f"Planned switchover {old.name} -> {target.name} (`weightcache switchover --to-pid`, exit {proc.returncode}, "
        f"{switched_s * 1e3:.0f} ms), then the old primary stopped: {len(switch_reqs)} completions sent from the "
        f"switchover on, {sum(not r.ok for r in switch_reqs)} failed; primary afterwards: "
        f"{now_primary.name if now_primary else '-'}.",
        bars_line({"every trial served": len(serving) == trials, "p99 <= 1 s": pct(serving, .99) <= 1.0,
                   "0 failed requests": not failed, "switchover: 0 failed": not any(not r.ok for r in switch_reqs),
                   "switchover moved the primary": now_primary is target}),
    ]
    return lines, {"trials": results, "failed": [r.__dict__ for r in failed],
                   "switchover": {"exit": proc.returncode, "stdout": proc.stdout[-2000:], "stderr": proc.stderr[-2000:],
                                  "failed": [r.__dict__ for r in switch_reqs if not r.ok]}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--startup-trials", type=int, default=3)
    p.add_argument("--failovers", type=int, default=20)
    p.add_argument("--batch", type=int, default=5, help="standbys starting at once (default 5)")
    p.add_argument("--kv-gib", type=float, default=8 if CUDA else 0.0625, help="KV cache per engine, failover")
    p.add_argument("--memory-kv-gib", type=float, default=32 if CUDA else 0.25, help="KV cache per engine, memory")
    p.add_argument("--skip", default="", help="comma list of phases to skip: startup,memory,failover,agentfp8")
    p.add_argument("--fp8", action="store_true", help="the checkpoint in block FP8 (DeepSeek-V3's form): every phase "
                   "on it; VLLM_USE_DEEP_GEMM=0 in the environment runs vLLM's CUTLASS block-FP8 kernel instead")
    p.add_argument("--dir", default=None, help="where the checkpoint and logs go (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    args = p.parse_args()
    import vllm

    skip = set(filter(None, args.skip.split(",")))
    work = args.dir or tempfile.mkdtemp(prefix="wc-vllm-gpu-")
    model = os.path.join(work, "llama")
    h = args.hidden
    t0 = time.perf_counter()
    size = make_checkpoint(model, llama_shape(args.layers, h), fp8=args.fp8)
    log(f"checkpoint: {size / GIB:.2f} GiB in {time.perf_counter() - t0:.1f}s")
    sock = os.path.join(work, "agent.sock")
    agent = AgentProcess(model, sock, "cuda" if CUDA else "cpu", *(("--quantization", "fp8-block") if args.fp8 else ()))
    status = agent.ready()
    log(f"agent ready: {status.get('load_seconds')} s load, {status.get('wall_seconds'):.1f} s from process start")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip() if CUDA else "no GPU"
    head = [f"vLLM {vllm.__version__}, torch {torch.__version__}, {gpu}; synthetic Llama {args.layers} layers, hidden "
            f"{h}, {'block FP8' if args.fp8 else 'bf16'}, {size / GIB:.2f} GiB"
            f"{', VLLM_USE_DEEP_GEMM=' + os.environ['VLLM_USE_DEEP_GEMM'] if 'VLLM_USE_DEEP_GEMM' in os.environ else ''}; agent's cold load {status.get('load_seconds', 0):.2f} s", ""]
    sections: list[str] = []
    data: dict = {"size": size, "agent": {k: status.get(k) for k in ("load_seconds", "wall_seconds", "arena_bytes")}}
    phases = {
        "startup": ("Tokens and start-up, default loader vs weightcache",
                    lambda: startup_phase(model, work, sock, size, args.startup_trials, int(args.kv_gib * GIB))),
        "memory": ("A primary and a sleeping standby on one GPU",
                   lambda: memory_phase(model, work, sock, int(args.memory_kv_gib * GIB))),
        "failover": ("Failover and a planned switchover under OpenAI traffic",
                     lambda: failover_phase(model, work, sock, int(args.kv_gib * GIB), args.failovers, args.batch)),
    }
    if args.fp8:
        phases["agentfp8"] = ("A bf16 checkpoint quantized by the agent against vLLM's own FP8",
                              lambda: agent_fp8_phase(work, llama_shape(args.layers, h), int(args.kv_gib * GIB)))
    failed = 0
    try:
        for name, (title, run) in phases.items():
            if name in skip:
                continue
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
            report(args.out, "vllm_gpu", head + sections, data)
    finally:
        agent.stop()
        for e in ENGINES:
            if e.alive():
                e.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
