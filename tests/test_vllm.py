"""vLLM serving from the cache: `--load-format weightcache`, through vLLM itself.

vLLM lives in its own virtual environment (it pins its own torch and transformers):
`$WEIGHTCACHE_VLLM_PYTHON` names its python, with vLLM and weightcache installed there
(`tests/vllm_venv.sh` makes one; `.ci/run` does). Without it these tests skip, except in CI.

Real agents (cpu backend, `--layout vllm`) serve tiny random Llama and Qwen2 checkpoints
(tied embeddings and q/k/v biases) with a word-level tokenizer; vLLM runs them from its
default loader and from the cache, and the greedy tokens must be the same:
- in-process engine: Llama bf16 and Qwen2 fp32, a mismatching agent (fallback: one
  WARNING, served from disk), no agent with fallback off (one ERROR line naming the reason);
- vLLM's multi-process engine with TP=2 (gloo): Qwen2 fp32, each worker on its own rank's agent;
- the README's commands as written (an agent, vLLM's OpenAI server): `/v1/completions`.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from agent_fixtures import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, qwen2_shape, write_llama_checkpoint, write_word_tokenizer

VLLM_PYTHON = os.environ.get("WEIGHTCACHE_VLLM_PYTHON")
DRIVER = os.path.join(os.path.dirname(__file__), "vllm_driver.py")
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 5, 9, 33, 100], [7, 7, 7]]
ATTACHED = re.compile(r"weightcache: (\S+) rank (\d+)/(\d+) attached from \S+ in [\d.]+s: ([\d.]+ \w+|\d+ B) in arena "
                      r"views, ([\d.]+ \w+|\d+ B) copied")

pytestmark = [pytest.mark.timeout(1200), pytest.mark.skipif(not VLLM_PYTHON and not os.environ.get("CI"),
                                                            reason="no vLLM environment ($WEIGHTCACHE_VLLM_PYTHON; tests/vllm_venv.sh makes one)")]


def vllm_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))
    # vLLM's environment has its own weightcache; and vLLM runs outside the checkout, whose build
    # metadata (weightcache.egg-info) would otherwise stand in for the installed package's entry points
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def drive(runs: list[dict], **env: str) -> tuple[list[dict], str]:
    assert VLLM_PYTHON, "CI must provide $WEIGHTCACHE_VLLM_PYTHON (tests/vllm_venv.sh)"
    proc = subprocess.run([VLLM_PYTHON, DRIVER, json.dumps(runs)], capture_output=True, text=True, timeout=900,
                          env=vllm_env(**env), cwd=os.path.dirname(DRIVER))
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(runs), f"vLLM driver failed ({proc.returncode}):\n" \
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return results, proc.stdout + proc.stderr  # vLLM logs to stdout


def _causes(log: str) -> str:
    """vLLM's root cause sits above its last traceback: the error lines, then the tail."""
    errors = [line for line in log.splitlines() if "Error" in line or "ERROR" in line]
    return "\n".join(errors[-20:]) + "\n...\n" + log[-3000:]


def attached_lines(log: str) -> list[tuple[str, int, int, str, str]]:
    return [(m[1], int(m[2]), int(m[3]), m[4], m[5]) for m in ATTACHED.finditer(log)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vllm-models")
    out = {}
    for name, shape in (("llama", LlamaShape()), ("qwen2", qwen2_shape(tie_word_embeddings=True))):
        directory = str(root / name)
        write_llama_checkpoint(directory, shape)
        write_word_tokenizer(directory, shape.vocab_size)
        out[name] = directory
    return out


@pytest.fixture(scope="module")
def agents(models, tmp_path_factory):
    """Agents with vLLM's layout: Llama bf16, Qwen2 fp32, and Qwen2 fp32 at TP=2 (one per rank)."""
    sockets = tmp_path_factory.mktemp("vllm-sockets")
    specs = {
        "llama": (models["llama"], []),
        "qwen2-fp32": (models["qwen2"], ["--dtype", "float32"]),
        **{f"qwen2-fp32-r{r}": (models["qwen2"], ["--dtype", "float32", "--tp-size", "2", "--tp-rank", str(r)])
           for r in (0, 1)},
    }
    procs = {name: AgentProcess(model, str(sockets / f"{name}.sock"), "--layout", "vllm", *extra)
             for name, (model, extra) in specs.items()}
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield {name: proc.socket for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def in_process(models, agents, tmp_path_factory):
    """One vLLM process, its runs one after another: default loader vs the cache, and the misses."""
    missing = str(tmp_path_factory.mktemp("nowhere") / "none.sock")
    runs = {
        "llama default": dict(model=models["llama"]),
        "llama cache": dict(model=models["llama"], load_format="weightcache", extra={"socket": agents["llama"]}),
        "qwen2 fp32 default": dict(model=models["qwen2"], dtype="float32"),
        "qwen2 fp32 cache": dict(model=models["qwen2"], dtype="float32", load_format="weightcache",
                                 extra={"socket": agents["qwen2-fp32"]}),
        # an agent holding another model: a fingerprint mismatch, served from disk with fallback (the default)
        "llama mismatch": dict(model=models["llama"], load_format="weightcache",
                               extra={"socket": agents["qwen2-fp32"]}),
        "llama no agent": dict(model=models["llama"], load_format="weightcache",
                               extra={"socket": missing, "fallback": False}),
    }
    results, log = drive([dict(r, prompts=PROMPTS) for r in runs.values()], VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return dict(zip(runs, results)), log, missing


@pytest.mark.parametrize("model", ["llama", "qwen2 fp32"])
def test_the_cache_serves_the_same_greedy_tokens_as_vllms_loader(in_process, model):
    results, log, _ = in_process
    assert results[f"{model} cache"]["tokens"] == results[f"{model} default"]["tokens"]
    assert all(len(t) == 8 for t in results[f"{model} cache"]["tokens"])


def test_every_parameter_byte_is_an_arena_view_after_post_load_processing(in_process):
    _, log, _ = in_process
    lines = attached_lines(log)
    assert [(name, rank, size) for name, rank, size, _, _ in lines] == [("llama", 0, 1), ("qwen2", 0, 1)]
    for _, _, _, views, copies in lines:
        assert copies == "0 B" and not views.startswith("0 "), lines


def test_a_mismatching_agent_falls_back_to_disk_with_one_warning(in_process):
    results, log, _ = in_process
    warnings = [line for line in log.splitlines() if "weightcache: cache miss" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "FingerprintMismatch" in warnings[0], warnings
    assert "content" in warnings[0]  # names the field that differs
    assert results["llama mismatch"]["tokens"] == results["llama default"]["tokens"]


def test_no_agent_without_fallback_fails_with_one_line_naming_the_socket(in_process):
    results, log, missing = in_process
    assert "error" in results["llama no agent"]
    errors = [line for line in log.splitlines() if "weightcache: cannot attach" in line and "ERROR" in line]
    assert len(errors) == 1, errors
    assert missing in errors[0] and "AgentUnavailable" in errors[0] and "fallback is off" in errors[0]


def test_tensor_parallel_workers_attach_their_own_ranks_and_match_tp1(models, agents, in_process):
    template = agents["qwen2-fp32"].replace("qwen2-fp32.sock", "qwen2-fp32-r{rank}.sock")
    results, log = drive([dict(model=models["qwen2"], dtype="float32", tp=2, prompts=PROMPTS,
                               load_format="weightcache", extra={"socket": template})])
    assert results[0]["tokens"] == in_process[0]["qwen2 fp32 default"]["tokens"]
    assert sorted((rank, size, copies) for _, rank, size, _, copies in attached_lines(log)) == [(0, 2, "0 B"),
                                                                                                 (1, 2, "0 B")]


def readme_vllm_commands(model: str, socket_path: str) -> list[list[str]]:
    """The README's 'Serving with vLLM' commands as written, with its model and socket paths swapped
    for the test's (and `python`, `weightcache` for the environments' own)."""
    section = (ROOT / "README.md").read_text().split("## Serving with vLLM", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = []
    for line in block.strip().splitlines():
        line = line.replace("/models/qwen", model).replace("/run/weightcache/qwen.sock", socket_path)
        argv = shlex.split(line.rstrip(" &"))
        argv[0] = {"python": VLLM_PYTHON, "weightcache": os.path.join(os.path.dirname(sys.executable), "weightcache")}[argv[0]]
        commands.append(argv)
    return commands


def test_the_readme_vllm_commands_serve_openai_completions_from_the_cache(models, in_process, tmp_path):
    agent_cmd, vllm_cmd = readme_vllm_commands(models["llama"], str(tmp_path / "qwen.sock"))
    with socket.socket() as s:  # the README's server listens on vLLM's default port
        assert s.connect_ex(("127.0.0.1", 8000)) != 0, "port 8000 is taken: the README's vLLM server needs it"
    log_path = tmp_path / "server.log"
    agent = subprocess.Popen(agent_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # one engine, vLLM's own thread binding; a 1 GiB KV cache, where the README's 0.5 would be half
    # of this machine's memory on vLLM's CPU build
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_CPU_OMP_THREADS_BIND")
    with open(log_path, "w") as log_file:
        server = subprocess.Popen(vllm_cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        base = "http://127.0.0.1:8000"
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, f"vLLM's server exited: {_causes(log_path.read_text())}"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"vLLM's server not up: {_causes(log_path.read_text())}"
            time.sleep(1)
        body = json.dumps({"model": models["llama"], "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
        request = urllib.request.Request(base + "/v1/completions", body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.load(r)
        assert answer["choices"][0]["text"] == in_process[0]["llama default"]["text"][0]
        lines = attached_lines(log_path.read_text())
        assert [(rank, size, copies) for _, rank, size, _, copies in lines] == [(0, 1, "0 B")], lines
    finally:
        for proc in (server, agent):
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
