"""vLLM from process start to its first token: vLLM's default loader vs `--load-format weightcache`.

The same checkpoint (a synthetic Llama, bf16, tokenizer included) served both ways, the
trials interleaved. Each trial is a fresh vLLM process (its in-process engine), timed from
the parent's clock: spawn -> the first generated token printed. Alongside, from the
engine's own log: vLLM's "Loading weights took" (default) or weightcache's "attached ... in"
(cache), the inner load phase. An inotify watch on the checkpoint directory counts every
open of a `.safetensors` file while the engine runs: the bytes the engine could have read
from the checkpoint (0 with the cache: the agent read it once, before the trials).
The page cache is warm for both loaders (this machine cannot drop it): a cold disk only
widens the gap.

Usage: WEIGHTCACHE_VLLM_PYTHON=... python3 bench/vllm_start.py [--layers 16 --hidden 1024] [--trials 3] [--out DIR]
(tests/vllm_venv.sh makes the vLLM environment.)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

from report import bars_line, report

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "node_agent"))

from weightcache_agent.testing.agent_process import AgentProcess  # noqa: E402
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint, write_word_tokenizer  # noqa: E402

CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, fmt, socket = sys.argv[1:4]
    kwargs = {} if fmt == "auto" else dict(load_format=fmt, model_loader_extra_config={"socket": socket})
    llm = LLM(model=model, dtype="bfloat16", max_model_len=256, enforce_eager=True, kv_cache_memory_bytes=32 << 20,
              **kwargs)
    out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    print("FIRST_TOKEN", json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": [1, 5 + i, 9]} for i in range(4)],
                        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    print("DECODE", sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0), flush=True)
"""
IN_OPEN = 0x20
LOAD_PHASE = re.compile(r"Loading weights took ([\d.]+) seconds|attached from \S+ in ([\d.]+)s")


class OpenCounter:
    """inotify on a directory: how many times each file in it is opened, by any process."""

    def __init__(self, directory: str):
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, directory.encode(), IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), "inotify")
        self.opens: dict[str, int] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            data = os.read(self.fd, 65536)
            at = 0
            while at < len(data):
                _, _, _, length = struct.unpack_from("iIII", data, at)
                name = data[at + 16 : at + 16 + length].rstrip(b"\0").decode()
                with self.lock:
                    self.opens[name] = self.opens.get(name, 0) + 1
                at += 16 + length

    def take(self) -> dict[str, int]:
        time.sleep(0.2)  # events of the process that just ended
        with self.lock:
            taken, self.opens = self.opens, {}
        return taken


def trial(python: str, model: str, fmt: str, socket: str) -> tuple[float, float | None, list[int], float]:
    t0 = time.perf_counter()
    proc = subprocess.run([python, "-c", CHILD, model, fmt, socket], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                                   VLLM_NO_USAGE_STATS="1"))
    seconds = time.perf_counter() - t0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("FIRST_TOKEN ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"vLLM ({fmt}) failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    phase = LOAD_PHASE.search(proc.stdout + proc.stderr)
    decode = float(next(x for x in proc.stdout.splitlines() if x.startswith("DECODE ")).split()[1])
    return seconds, float(phase[1] or phase[2]) if phase else None, json.loads(line.split(" ", 1)[1]), decode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    args = p.parse_args()
    python = os.environ.get("WEIGHTCACHE_VLLM_PYTHON")
    if not python:
        raise SystemExit("set WEIGHTCACHE_VLLM_PYTHON to a vLLM environment's python (tests/vllm_venv.sh makes one)")
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "llama")
        shape = LlamaShape(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                           num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                           num_key_value_heads=args.hidden // 128, vocab_size=32000)
        write_llama_checkpoint(model, shape)
        write_word_tokenizer(model, shape.vocab_size)
        size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
        socket = os.path.join(tmp, "agent.sock")
        with AgentProcess(model, socket) as agent:
            counter = OpenCounter(model)
            runs: dict[str, list[dict]] = {"auto": [], "weightcache": []}
            for _ in range(args.trials):
                for fmt in runs:
                    seconds, phase, tokens, decode = trial(python, model, fmt, socket)
                    opens = sum(n for name, n in counter.take().items() if name.endswith(".safetensors"))
                    runs[fmt].append({"seconds": seconds, "load_phase": phase, "tokens": tokens, "opens": opens,
                                      "decode": decode})
                    print(f"{fmt}: first token {seconds:.2f}s (load phase {phase}s), safetensors opened {opens}x",
                          file=sys.stderr, flush=True)
            agent_status = agent.status()
    med = {fmt: statistics.median(r["seconds"] for r in rs) for fmt, rs in runs.items()}
    phase = {fmt: statistics.median(r["load_phase"] for r in rs) for fmt, rs in runs.items()}
    opens = {fmt: max(r["opens"] for r in rs) for fmt, rs in runs.items()}
    decode = {fmt: statistics.median(r["decode"] for r in rs) for fmt, rs in runs.items()}
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["auto"], runs["weightcache"]))
    lines = [
        f"vLLM {args.layers}-layer Llama, hidden {args.hidden}, bf16: {size / 2**30:.2f} GiB of safetensors; "
        f"{args.trials} interleaved trials, fresh processes, warm page cache; medians",
        "",
        "| loader | process start -> first token | load phase | checkpoint bytes the engine opened | decode, 4 x 32 "
        "tokens |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| vLLM default | {med['auto']:.2f} s | {phase['auto']:.3f} s | {size * min(opens['auto'], 1) / 2**30:.2f} GiB "
        f"({opens['auto']} opens) | {decode['auto']:.1f} tok/s |",
        f"| weightcache | {med['weightcache']:.2f} s | {phase['weightcache']:.3f} s | "
        f"{size * min(opens['weightcache'], 1) / 2**30:.2f} GiB ({opens['weightcache']} opens) | "
        f"{decode['weightcache']:.1f} tok/s |",
        f"| ratio default / weightcache | **{med['auto'] / med['weightcache']:.2f}x** | "
        f"**{phase['auto'] / phase['weightcache']:.1f}x** | | {decode['auto'] / decode['weightcache']:.2f}x |",
        "",
        f"agent's cold load before the trials: {agent_status.get('load_seconds', 0):.2f} s; same first token both "
        f"ways: {same}",
        bars_line({"engine opens no checkpoint file with weightcache": opens["weightcache"] == 0,
                   "same tokens": same}),
    ]
    report(args.out, "vllm_start", lines, {"runs": runs, "bytes": size})


if __name__ == "__main__":
    main()
