"""SGLang loading from the cache: `--load-format weightcache`, through SGLang itself, on CPU.

SGLang lives in its own virtual environment (0.5.17 pins torch 2.11 and transformers 5.12.1):
`$WEIGHTCACHE_SGLANG_PYTHON` names its python, with SGLang installed there (docs/sglang.md, "Tests").
Without it these tests skip. SGLang has no CPU build usable without sgl-kernel's CPU wheels, so no
forward pass runs here (bench/sglang_gpu.py serves on the GPU); what runs is SGLang's own code up to
a loaded model (tests/sglang_driver.py, each run a process of its own that tests/sglang_zygote.py
forks: SGLang is imported once per module, not once per run):
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
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightcache_agent import agent_status
from weightcache_agent.errors import WeightCacheError
from weightcache_agent.testing.synthetic import LlamaShape, qwen2_shape, write_llama_checkpoint, write_word_tokenizer

SGLANG_PYTHON = os.environ.get("WEIGHTCACHE_SGLANG_PYTHON")
ROOT = Path(__file__).resolve().parent.parent
ZYGOTE = str(ROOT / "tests" / "sglang_zygote.py")

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


class Run:
    """One run of tests/sglang_driver.py, in the process the zygote forked for it: its pid, its stdout's
    lines as they come, then its exit status (as subprocess gives one) and the end of its stderr."""

    def __init__(self, zygote: "Zygote", run: dict):
        self.zygote = zygote
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.settimeout(600)
        self.conn.connect(zygote.path)
        self.conn.sendall(json.dumps(run).encode() + b"\n")
        self.out = self.conn.makefile("r", encoding="utf-8", newline="\n")
        first = self.out.readline()
        assert first.startswith("PID "), f"no process for the run: {first!r}"
        self.pid = int(first.split()[1])
        self.stdout: list[str] = []
        self.returncode: int | None = None
        self.stderr = ""

    def __iter__(self) -> Iterator[str]:
        """stdout's lines until the process ends."""
        while self.returncode is None:
            line = self.out.readline()
            if line.startswith("EXIT "):
                self.returncode = int(line.split()[1])
                self.stderr = self.out.read()
                self.out.close()
                self.conn.close()
            elif not line:
                raise AssertionError(f"the zygote closed the run without its status: {self.zygote.log()}")
            elif line != "\n":  # the zygote's EXIT begins a line of its own
                self.stdout.append(line)
                yield line

    def wait_for(self, prefix: str) -> str:
        line = next((line for line in self if line.startswith(prefix)), None)
        assert line is not None, f"no {prefix} line ({self.returncode}):\n{''.join(self.stdout)[-3000:]}\n" \
            f"{self.stderr[-6000:]}"
        return line

    def wait(self) -> int:
        for _ in self:
            pass
        return self.returncode

    def results(self) -> list[dict]:
        return [json.loads(line[len("RESULT "):]) for line in self.stdout if line.startswith("RESULT ")]

    def kill(self) -> None:
        """SIGKILL, as to any process; only while it is still the zygote's child (its pid not yet reused)."""
        if self.returncode is not None:
            return
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return
        if int(stat.rpartition(")")[2].split()[1]) == self.zygote.proc.pid:
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        self.out.close()
        self.conn.close()


class Zygote:
    """tests/sglang_zygote.py under SGLang's python: SGLang imported once, a forked process per run."""

    def __init__(self, log: Path):
        self.log_path = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen([SGLANG_PYTHON, ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, env=sglang_env(), cwd=ROOT / "tests")
        ready = self.proc.stdout.readline()
        if not ready.startswith("READY "):
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"SGLang's zygote did not start ({self.proc.returncode}): {self.log()}")
        self.path = ready[len("READY "):].strip()

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]

    def start(self, run: dict) -> Run:
        return Run(self, run)

    def drive(self, run: dict) -> dict:
        proc = self.start(run)
        proc.wait()
        results = proc.results()
        assert proc.returncode == 0 and len(results) == 1, f"SGLang driver failed ({proc.returncode}):\n" \
            f"{''.join(proc.stdout)[-3000:]}\n{proc.stderr[-6000:]}"
        return results[0]

    def drive_ranks(self, runs: list[dict]) -> list[dict]:
        """One run per tensor-parallel rank, at once (they meet in gloo)."""
        procs = [self.start(run) for run in runs]
        out = []
        for proc in procs:
            proc.wait()
            results = proc.results()
            assert proc.returncode == 0 and len(results) == 1, \
                f"rank failed:\n{''.join(proc.stdout)[-3000:]}\n{proc.stderr[-6000:]}"
            out.append(results[0])
        return out

    def stop(self) -> None:
        """Its stdin closed: it kills what still runs, removes its directory and exits."""
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        assert self.proc.returncode == 0, f"SGLang's zygote exited {self.proc.returncode}: {self.log()}"
        assert not os.path.exists(os.path.dirname(self.path)), f"SGLang's zygote left {os.path.dirname(self.path)}"


@pytest.fixture(scope="module")
def zygote(sglang_environment, tmp_path_factory) -> Iterator[Zygote]:
    started = Zygote(tmp_path_factory.mktemp("sglang-zygote") / "zygote.log")
    try:
        yield started
    finally:
        started.stop()


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


def test_the_plugin_entry_point_makes_sglangs_parser_take_the_load_format(models, zygote):
    argv = ["--model-path", models["llama"], "--load-format", "weightcache", "--model-loader-extra-config",
            json.dumps({"socket": "/run/weightcache/r{rank}.sock"})]
    found = zygote.drive({"op": "parse", "argv": argv})
    assert found["load_format"] == "weightcache"
    assert found["loader"] == "weightcache_agent.integrations.sglang_loader.WeightcacheModelLoader"
    assert "read-only arena" in found["repr"]  # what SGLang prints when asked to reload weights from disk
    # without the plugin, the same command line is refused by SGLang's parser
    assert zygote.drive({"op": "parse", "argv": argv, "plugins": False}) == {"exit": 2}


def test_an_unknown_option_is_refused_by_name(models, zygote):
    argv = ["--model-path", models["llama"], "--load-format", "weightcache", "--model-loader-extra-config",
            json.dumps({"sockett": "/tmp/x.sock"})]
    found = zygote.drive({"op": "parse", "argv": argv})
    assert "unknown key(s) sockett" in found["error"] and "known: socket, fallback, timeout, revision" in found["error"]


@pytest.mark.parametrize("model,dtype,agent", [("llama", "bfloat16", "llama"), ("qwen2", "float32", "qwen2-fp32")])
def test_every_parameter_is_an_arena_view_equal_to_sglangs_default_loader(models, agents, zygote, model, dtype,
                                                                         agent):
    found = zygote.drive({"op": "load", "model": models[model], "dtype": dtype, "port": free_port(), "compare": True,
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


def test_tensor_parallel_ranks_attach_their_own_agents_and_match_sglangs_shards(models, agents, zygote):
    port = free_port()
    results = zygote.drive_ranks([{"op": "load", "model": models["qwen2"], "dtype": "float32", "tp": 2, "rank": r,
                                   "port": port, "compare": True,
                                   "extra": {"socket": agents["qwen2-fp32-r0"].replace("-r0.sock", "-r{rank}.sock"),
                                             "fallback": False}} for r in (0, 1)])
    for rank, found in enumerate(results):
        assert found["source"] == "agent" and found["copies"] == [] and found["different"] == [], found
        (line,) = attached_lines(found)
        assert f"rank {rank}/2 attached from {agents[f'qwen2-fp32-r{rank}']}" in line
    # each rank holds its own shard: qkv_proj's rows split across the two
    full = zygote.drive({"op": "load", "model": models["qwen2"], "dtype": "float32", "port": free_port(),
                         "extra": {"socket": agents["qwen2-fp32"]}})
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert results[0]["params"][name][0][0] * 2 == full["params"][name][0][0]


def test_a_mismatching_agent_falls_back_to_sglangs_loader_with_one_warning(models, agents, zygote):
    # the agent holds bf16; this engine runs fp32
    found = zygote.drive({"op": "load", "model": models["llama"], "dtype": "float32", "port": free_port(),
                          "compare": True, "extra": {"socket": agents["llama"]}})
    assert found["source"] == "disk" and found["different"] == [], found
    warnings = [m for level, m in found["lines"] if level == "WARNING"]
    assert len(warnings) == 1, found["lines"]
    assert "cache miss" in warnings[0] and "FingerprintMismatch" in warnings[0] and "dtype" in warnings[0]
    assert "SGLang's default loader" in warnings[0]


def test_no_agent_without_fallback_fails_with_one_line_naming_the_socket(models, zygote, tmp_path):
    missing = str(tmp_path / "none.sock")
    found = zygote.drive({"op": "load", "model": models["llama"], "port": free_port(),
                          "extra": {"socket": missing, "fallback": False}})
    assert found["error"].startswith("RuntimeError: weightcache: cannot attach")
    assert missing in found["error"] and "(fallback is off)" in found["error"]
    errors = [m for level, m in found["lines"] if level == "ERROR"]
    assert len(errors) == 1 and missing in errors[0]


def test_a_standby_releases_its_kv_cache_when_idle_and_gets_it_back_when_promoted(models, agents, zygote):
    base = {"op": "standby", "model": models["llama"], "group": "g", "extra": {"socket": agents["llama"]}}
    primary = zygote.start({**base, "role": "primary", "port": free_port()})
    standby = None
    try:
        loaded = primary.wait_for("LOADED ")
        assert json.loads(loaded[len("LOADED "):])["source"] == "agent"
        standby = zygote.start({**base, "role": "standby", "port": free_port()})
        standby.wait_for("IDLE")
        primary.kill()  # a real SIGKILL of the primary's process: the agent promotes the standby at once
        standby.conn.settimeout(120)
        standby.wait()
    finally:
        primary.kill()
        primary.wait()
        if standby is not None and standby.returncode is None:
            standby.kill()
            standby.close()
    (result,) = standby.results()
    assert result["role"] == "primary", standby.stderr[-3000:]
    # released once while a standby; mapped back once, before the lease's role was seen as primary here
    # (the callback runs before the agent is told, which is before anyone routes here); never released again
    assert [(name, tags) for name, tags, _ in result["calls"]] == [("release", ["kv_cache"]), ("resume", ["kv_cache"])]
    assert result["calls"][1][2] <= 0.05 and not result["released"]
    messages = [m for _, m in result["lines"]]
    assert any("standby: released its KV cache (1.00 GiB) until promoted" in m for m in messages), messages
    assert any("promoted to primary: KV cache back (1.00 GiB)" in m for m in messages), messages
