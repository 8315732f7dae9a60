"""SGLang loading from the cache: `--load-format weightcache`, through SGLang itself, on CPU.

SGLang lives in its own virtual environment (0.5.17 pins torch 2.11 and transformers 5.12.1):
`$WEIGHTCACHE_SGLANG_PYTHON` names its python, with SGLang installed there (docs/sglang.md, "Tests").
Without it these tests skip. SGLang has no CPU build usable without sgl-kernel's CPU wheels, so no
forward pass runs here (bench/sglang_gpu.py serves on the GPU); what runs is SGLang's own code up to
a loaded model (tests/sglang_driver.py):
- the plugin entry point: SGLang's `load_plugins` finds it, its argument parser then takes
  `--load-format weightcache` (and refuses it without the plugin), `get_model_loader` picks the loader;
- SGLang's Llama (bf16) and Qwen2 (fp32, tied embeddings) built by the loader against real agents
  (cpu backend): every parameter a view of the arena, 0 B copied, each equal to what SGLang's
  default loader reads from disk; the same with TP 2 (gloo), each rank on its own rank's agent;
- misses: another fingerprint falls back to SGLang's default loader with one WARNING; no agent with
  fallback off fails with one ERROR line naming the socket.
Agents run under SGLang's python too: the torch version is part of the fingerprint.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from weightcache_agent import agent_status
from weightcache_agent.errors import WeightCacheError
from weightcache_agent.testing.synthetic import LlamaShape, qwen2_shape, write_llama_checkpoint, write_word_tokenizer

SGLANG_PYTHON = os.environ.get("WEIGHTCACHE_SGLANG_PYTHON")
ROOT = Path(__file__).resolve().parent.parent
DRIVER = str(ROOT / "tests" / "sglang_driver.py")

# CI builds the environment while the suite runs (.ci/run): tests/sglang_venv.sh's exit status lands here
SGLANG_READY = os.environ.get("WEIGHTCACHE_SGLANG_READY")

pytestmark = [pytest.mark.timeout(900), pytest.mark.skipif(
    not SGLANG_PYTHON, reason="no SGLang environment ($WEIGHTCACHE_SGLANG_PYTHON; docs/sglang.md, Tests)")]


@pytest.fixture(scope="module", autouse=True)
def sglang_environment() -> None:
    """Waits for CI's environment build where one runs; a failed build fails these tests with its log."""
    if not SGLANG_READY:
        return
    deadline = time.monotonic() + 600
    while not os.path.exists(SGLANG_READY):
        assert time.monotonic() < deadline, f"SGLang's environment not built in 10 minutes ({SGLANG_READY})"
        time.sleep(2)
    rc = Path(SGLANG_READY).read_text().strip()
    log = Path(SGLANG_READY).with_suffix(".log")
    assert rc == "0", f"tests/sglang_venv.sh failed ({rc}):\n{log.read_text()[-3000:] if log.exists() else ''}"


def sglang_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT / "node_agent"))
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drive(run: dict) -> dict:
    proc = subprocess.run([SGLANG_PYTHON, DRIVER, json.dumps(run)], capture_output=True, text=True, timeout=600,
                          env=sglang_env(), cwd=ROOT / "tests")
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == 1, f"SGLang driver failed ({proc.returncode}):\n" \
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return results[0]


def drive_ranks(runs: list[dict]) -> list[dict]:
    """One driver per tensor-parallel rank, at once (they meet in gloo)."""
    procs = [subprocess.Popen([SGLANG_PYTHON, DRIVER, json.dumps(run)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=sglang_env(), cwd=ROOT / "tests") for run in runs]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        results = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and len(results) == 1, f"rank failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
        out.append(results[0])
    return out


class Agent:
    """`weightcache agent` under SGLang's python (its torch is in the fingerprint)."""

    def __init__(self, model: str, sock: str, *extra: str):
        self.sock = sock
        self.log = open(sock + ".log", "w")
        self.proc = subprocess.Popen([SGLANG_PYTHON, "-m", "weightcache_agent", "agent", "--model", model, "--socket",
                                      sock, "--backend", "cpu", "--progress", "never", *extra],
                                     stdout=subprocess.DEVNULL, stderr=self.log, env=sglang_env())

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(self.sock + ".log").read_text()[-3000:]
            try:
                if agent_status(self.sock).get("phase") == "ready":
                    return
            except (WeightCacheError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"agent at {self.sock} not ready: {Path(self.sock + '.log').read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sglang-models")
    out = {}
    for name, shape in (("llama", LlamaShape()), ("qwen2", qwen2_shape(tie_word_embeddings=True))):
        directory = str(root / name)
        write_llama_checkpoint(directory, shape)
        write_word_tokenizer(directory, shape.vocab_size)
        out[name] = directory
    return out


@pytest.fixture(scope="module")
def agents(models, tmp_path_factory):
    """Llama bf16, Qwen2 fp32, and Qwen2 fp32 at TP 2 (one agent per rank)."""
    sockets = tmp_path_factory.mktemp("sglang-sockets")
    specs = {
        "llama": (models["llama"], ()),
        "qwen2-fp32": (models["qwen2"], ("--dtype", "float32")),
        **{f"qwen2-fp32-r{r}": (models["qwen2"], ("--dtype", "float32", "--tp-size", "2", "--tp-rank", str(r)))
           for r in (0, 1)},
    }
    procs = {name: Agent(model, str(sockets / f"{name}.sock"), *extra) for name, (model, extra) in specs.items()}
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield {name: proc.sock for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


def attached_lines(result: dict) -> list[str]:
    return [message for level, message in result["lines"] if "attached from" in message]


def test_the_plugin_entry_point_makes_sglangs_parser_take_the_load_format(models):
    argv = ["--model-path", models["llama"], "--load-format", "weightcache", "--model-loader-extra-config",
            json.dumps({"socket": "/run/weightcache/r{rank}.sock"})]
    found = drive({"op": "parse", "argv": argv})
    assert found["load_format"] == "weightcache"
    assert found["loader"] == "weightcache_agent.integrations.sglang_loader.WeightcacheModelLoader"
    assert "read-only arena" in found["repr"]  # what SGLang prints when asked to reload weights from disk
    # without the plugin, the same command line is refused by SGLang's parser
    assert drive({"op": "parse", "argv": argv, "plugins": False}) == {"exit": 2}


def test_an_unknown_option_is_refused_by_name(models):
    argv = ["--model-path", models["llama"], "--load-format", "weightcache", "--model-loader-extra-config",
            json.dumps({"sockett": "/tmp/x.sock"})]
    found = drive({"op": "parse", "argv": argv})
    assert "unknown key(s) sockett" in found["error"] and "known: socket, fallback, timeout, revision" in found["error"]


@pytest.mark.parametrize("model,dtype,agent", [("llama", "bfloat16", "llama"), ("qwen2", "float32", "qwen2-fp32")])
def test_every_parameter_is_an_arena_view_equal_to_sglangs_default_loader(models, agents, model, dtype, agent):
    found = drive({"op": "load", "model": models[model], "dtype": dtype, "port": free_port(), "compare": True,
                   "extra": {"socket": agents[agent], "fallback": False}})
    assert found["source"] == "agent", found
    assert found["copies"] == [] and found["on_meta"] == [], found
    assert found["same_names"] and found["different"] == [], found
    # SGLang's fused parameters, each one view
    assert "model.layers.0.self_attn.qkv_proj.weight" in found["params"]
    assert "model.layers.0.mlp.gate_up_proj.weight" in found["params"]
    (line,) = attached_lines(found)
    assert f"{Path(models[model]).name} rank 0/1 attached from {agents[agent]}" in line
    assert "0 B copied (no copies)" in line
    assert not [m for level, m in found["lines"] if level in ("WARNING", "ERROR")]


def test_tensor_parallel_ranks_attach_their_own_agents_and_match_sglangs_shards(models, agents):
    port = free_port()
    results = drive_ranks([{"op": "load", "model": models["qwen2"], "dtype": "float32", "tp": 2, "rank": r,
                            "port": port, "compare": True,
                            "extra": {"socket": agents["qwen2-fp32-r0"].replace("-r0.sock", "-r{rank}.sock"),
                                      "fallback": False}} for r in (0, 1)])
    for rank, found in enumerate(results):
        assert found["source"] == "agent" and found["copies"] == [] and found["different"] == [], found
        (line,) = attached_lines(found)
        assert f"rank {rank}/2 attached from {agents[f'qwen2-fp32-r{rank}']}" in line
    # each rank holds its own shard: qkv_proj's rows split across the two
    full = drive({"op": "load", "model": models["qwen2"], "dtype": "float32", "port": free_port(),
                  "extra": {"socket": agents["qwen2-fp32"]}})
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert results[0]["params"][name][0][0] * 2 == full["params"][name][0][0]


def test_a_mismatching_agent_falls_back_to_sglangs_loader_with_one_warning(models, agents):
    # the agent holds bf16; this engine runs fp32
    found = drive({"op": "load", "model": models["llama"], "dtype": "float32", "port": free_port(), "compare": True,
                   "extra": {"socket": agents["llama"]}})
    assert found["source"] == "disk" and found["different"] == [], found
    warnings = [m for level, m in found["lines"] if level == "WARNING"]
    assert len(warnings) == 1, found["lines"]
    assert "cache miss" in warnings[0] and "FingerprintMismatch" in warnings[0] and "dtype" in warnings[0]
    assert "SGLang's default loader" in warnings[0]


def test_no_agent_without_fallback_fails_with_one_line_naming_the_socket(models, tmp_path):
    missing = str(tmp_path / "none.sock")
    found = drive({"op": "load", "model": models["llama"], "port": free_port(),
                   "extra": {"socket": missing, "fallback": False}})
    assert found["error"].startswith("RuntimeError: weightcache: cannot attach")
    assert missing in found["error"] and "(fallback is off)" in found["error"]
    errors = [m for level, m in found["lines"] if level == "ERROR"]
    assert len(errors) == 1 and missing in errors[0]


def test_a_standby_releases_its_kv_cache_when_idle_and_gets_it_back_when_promoted(models, agents):
    base = {"op": "standby", "model": models["llama"], "group": "g", "extra": {"socket": agents["llama"]}}
    primary = subprocess.Popen([SGLANG_PYTHON, DRIVER, json.dumps({**base, "role": "primary", "port": free_port()})],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=sglang_env())
    standby = None
    try:
        loaded = next(line for line in primary.stdout if line.startswith("LOADED "))
        assert json.loads(loaded[len("LOADED "):])["source"] == "agent"
        standby = subprocess.Popen([SGLANG_PYTHON, DRIVER, json.dumps({**base, "role": "standby", "port": free_port()})],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=sglang_env())
        next(line for line in standby.stdout if line.startswith("IDLE"))
        primary.kill()  # the agent promotes the standby at once
        stdout, stderr = standby.communicate(timeout=120)
    finally:
        primary.kill()
        primary.wait()
        if standby is not None and standby.poll() is None:
            standby.kill()
    (result,) = [json.loads(line[len("RESULT "):]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert result["role"] == "primary", stderr[-3000:]
    # released once while a standby; mapped back once, before the lease's role was seen as primary here
    # (the callback runs before the agent is told, which is before anyone routes here); never released again
    assert [(name, tags) for name, tags, _ in result["calls"]] == [("release", ["kv_cache"]), ("resume", ["kv_cache"])]
    assert result["calls"][1][2] <= 0.05 and not result["released"]
    messages = [m for _, m in result["lines"]]
    assert any("standby: released its KV cache (1.00 GiB) until promoted" in m for m in messages), messages
    assert any("promoted to primary: KV cache back (1.00 GiB)" in m for m in messages), messages
