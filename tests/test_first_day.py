"""What a new user meets on the first day, run as they would run it: the README's commands
copied literally, and each mistake answered in one line with the documented exit code,
leaving nothing lost (the agent keeps serving, the files stay). Every case runs the
command as a real process."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from engine_fixtures import SMALL_LLAMA, short_run_dir
from k8s_lab import free_ports
from test_cli_mistakes import one_line, weightcache
from weightcache_agent import CacheSpec, agent_status, protocol
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint
from weightcache_agent.usage import EXIT_FAILED, EXIT_OK, EXIT_USAGE

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    # The README's example prompt uses token 4996: a vocabulary that holds it.
    shape = LlamaShape(**{**SMALL_LLAMA, "vocab_size": 8192})
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "llama-3-8b"), shape, seed=3)


@pytest.fixture
def run_dir():
    path = short_run_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def bash_blocks(section: str) -> list[str]:
    """The ```bash blocks of the README section whose heading starts with `section`."""
    body = README.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", body, re.DOTALL)


def stop_session(leader: int, timeout: float = 30) -> None:
    """SIGTERM every process of the session `leader` started, and wait until none is left."""
    deadline = time.monotonic() + timeout
    try:
        os.killpg(leader, signal.SIGTERM)
        while time.monotonic() < deadline:
            os.killpg(leader, 0)
            time.sleep(0.05)
        os.killpg(leader, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- the README's failover quick start ---------------------------------------------------------

def test_the_readme_failover_quick_start_copied_literally_fails_over(model, run_dir):
    """The agent line of the quick start, then the reference engine's block as one script, with
    only the model directory ($MODEL, as the vLLM section sets it), the socket and the ports
    replaced by this machine's."""
    sock = os.path.join(run_dir, "llama.sock")
    ports = dict(zip(("8001", "8002"), map(str, free_ports(2))))

    def localize(text: str) -> str:
        text = text.replace("/models/llama-3-8b", model).replace("/run/weightcache/llama.sock", sock)
        text = text.replace("tiny-llama.sock", sock).replace("tiny-llama", model)  # the quick start's names
        return re.sub(r"(?<!\d)800[12](?!\d)", lambda m: ports[m[0]], text)  # one pass: a port never re-replaced

    quick_start = bash_blocks("Quick start")[0].splitlines()
    agent_line = next(line for line in quick_start if line.startswith("weightcache agent"))
    wait_line = next(line for line in quick_start if line.startswith("weightcache status")).split("#")[0]
    engines = next(block for block in bash_blocks("The reference engine") if "--role standby" in block)
    assert "kill -9 $PRIMARY" in engines and "--group chat & PRIMARY=$!" in engines
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    if shutil.which("weightcache", path=env["PATH"]) is None:
        pytest.skip("the README's commands need the installed `weightcache` command (pip install)")
    script = (f"MODEL={shlex.quote(model)}\n{localize(agent_line)}\n{localize(wait_line)} >/dev/null\n"
              f"{localize(engines)}")
    with open(os.path.join(run_dir, "out"), "w+") as out_file, open(os.path.join(run_dir, "err"), "w+") as err_file:
        # files, not pipes: what the block leaves running in the background keeps its output open
        shell = subprocess.Popen(["bash", "-c", script], stdout=out_file, stderr=err_file, text=True, env=env,
                                 start_new_session=True)
        try:
            shell.wait(timeout=180)
        finally:
            stop_session(shell.pid)  # the agent and the standby the block left running
        out, err = pathlib.Path(out_file.name).read_text(), pathlib.Path(err_file.name).read_text()
    assert shell.returncode == 0, (out, err[-3000:])
    answers, decoder, at = [], json.JSONDecoder(), out.find("{")
    while at >= 0:  # curl prints each answer as the engine sent it, without a newline between
        answer, end = decoder.raw_decode(out, at)
        answers.append(answer)
        at = out.find("{", end)
    generated = [a for a in answers if "tokens" in a]
    assert len(generated) == 2, (out, err[-3000:])
    # each wait prints one answer, the one it waited for, not every 503 before it
    assert [a["ready"] for a in answers if "tokens" not in a] == [True, True, True], out
    before, after = generated
    assert before["role"] == "primary" and after["role"] == "primary", answers
    assert after["tokens"] == before["tokens"] and len(after["tokens"]) == 8  # the standby, promoted, same weights
    assert "promoted" in err.lower(), err[-3000:]


def wait_lines() -> list[str]:
    """The README's lines that wait for a server: each checks that the process it waits on still lives."""
    lines = [line for section in ("Serving with vLLM", "The reference engine") for block in bash_blocks(section)
             for line in block.splitlines() if line.startswith("until curl")]
    assert len(lines) == 4, lines
    assert not re.search(r"--retry", "".join(bash_blocks("Serving with vLLM") + bash_blocks("The reference engine")))
    return lines


@pytest.mark.parametrize("index", range(4))
def test_every_readme_wait_stops_at_once_when_its_process_has_exited(index):
    """A server that died before it answered: the wait ends within a second or two, saying so once, instead
    of retrying in silence; the command after it fails at once."""
    line = wait_lines()[index]
    port, = free_ports(1)  # nothing listens there
    dead = subprocess.Popen(["true"])
    dead.wait()
    pid_var = re.search(r"kill -0 \$(\w+)", line).group(1)
    script = re.sub(r"localhost:800[01]", f"localhost:{port}", f"{pid_var}={dead.pid}\n{line}")
    began = time.monotonic()
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert time.monotonic() - began < 5, (line, done)
    assert done.stdout.strip() == "" and done.stderr.count("No such process") == 1, (line, done)


# -- a standby with no group, or a group with no primary ---------------------------------------

def test_a_standby_without_a_group_is_refused_in_one_line(model, run_dir):
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTCACHE_GROUP"}
    out = subprocess.run([sys.executable, "-m", "weightcache_agent", "engine", "--model", model, "--socket",
                          os.path.join(run_dir, "a.sock"), "--role", "standby"], capture_output=True, text=True,
                         timeout=60, env=env)
    one_line(out, EXIT_USAGE, "weightcache engine", "--role standby needs --group", "same --group")


def test_the_agent_refuses_a_standby_without_a_group_and_keeps_serving(model, run_dir):
    """A client that is not the reference engine gets the same refusal from the agent itself."""
    with AgentProcess(model, os.path.join(run_dir, "a.sock")) as served:
        conn = protocol.connect(served.socket)
        try:
            protocol.send_message(conn, {"type": "attach", "role": "standby", "group": None,
                                         "request": engine_request(CacheSpec(model=model))})
            reply, _ = protocol.recv_message(conn, 1 << 20)
        finally:
            conn.close()
        assert reply["type"] == "error" and reply["code"] == "standby_without_group", reply
        assert "needs a group" in reply["message"]
        status = served.status()
        assert status["phase"] == "ready" and status["clients"] == []


def test_a_standby_whose_group_has_no_primary_yet_is_warned_about_in_one_line(model, run_dir):
    """Engines may start in any order: a standby first is served, and told (once) what it waits for."""
    port_file = os.path.join(run_dir, "port")
    with AgentProcess(model, os.path.join(run_dir, "a.sock")) as served:
        standby = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "engine", "--model", model, "--socket",
                                    served.socket, "--role", "standby", "--group", "chat", "--port", "0",
                                    "--port-file", port_file], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        try:
            deadline = time.monotonic() + 60
            while True:  # warmed up: the warning, which follows the attach, is written by then
                assert standby.poll() is None and time.monotonic() < deadline, standby.stderr.read()
                if os.path.exists(port_file):
                    health = subprocess.run(["curl", "-s", f"localhost:{open(port_file).read().strip()}/healthz"],
                                            capture_output=True, text=True, timeout=10).stdout
                    if health and json.loads(health)["state"] == "serving":
                        break
                time.sleep(0.1)
            assert [c["role"] for c in agent_status(served.socket)["clients"]] == ["standby"]
            standby.send_signal(signal.SIGTERM)
            assert standby.wait(30) == EXIT_OK
            warnings = [line for line in standby.stderr.read().splitlines() if "has no primary" in line]
            assert len(warnings) == 1 and "--group chat" in warnings[0], warnings
        finally:
            if standby.poll() is None:
                standby.kill()
        assert served.stop() == EXIT_OK
    assert "joined group 'chat', which has no primary" in served.proc.stderr.read()


# -- without torch --------------------------------------------------------------------------

def without_torch(*args: str) -> subprocess.CompletedProcess:
    """`weightcache ARGS` in a Python where torch is not installed: `sys.modules["torch"] = None` is
    what the import system documents for a module that must not be found (find_spec says None, an
    import raises ModuleNotFoundError), the same answers a Python without torch gives."""
    block = ("import sys\nsys.modules['torch'] = None\nfrom weightcache_agent.cli import main\n"
             f"sys.exit(main({list(args)!r}))")
    return subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["engine", "demo"])
def test_the_engine_and_the_demo_without_torch_name_what_to_install(command, model, tmp_path):
    args = ["--model", model, "--mode", "off"] if command == "engine" else ["--dir", str(tmp_path / "demo")]
    out = without_torch(command, *args)
    one_line(out, EXIT_FAILED, f"weightcache {command}", "needs torch, which is not installed",
             "pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert list(tmp_path.iterdir()) == []  # nothing written before the refusal


def test_an_agent_load_that_needs_torch_without_it_names_what_to_install(model, run_dir):
    """A load that keeps the checkpoint's dtype serves without torch; one that casts needs it."""
    sock = os.path.join(run_dir, "a.sock")
    out = without_torch("agent", "--model", model, "--socket", sock, "--progress", "never", "--dtype", "float16")
    assert out.returncode == EXIT_FAILED, out.stderr
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("weightcache agent: load failed: this load casts or quantizes, which needs torch"), last
    assert "pip install torch --index-url" in last
    assert not os.path.exists(sock)
    with AgentProcess(model, sock):  # the same socket serves as soon as torch is there
        pass


# -- `weightcache status | head` ---------------------------------------------------------------

@pytest.mark.parametrize("form", [[], ["--json"]], ids=["text", "json"])
def test_status_into_a_reader_that_stopped_reading_ends_quietly(form, model, run_dir):
    """What `weightcache status | head -1` does once head has its line: the pipe's reader is gone
    before status writes (made certain here by closing the read end first)."""
    with AgentProcess(model, os.path.join(run_dir, "a.sock")) as served:
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            out = subprocess.run([sys.executable, "-m", "weightcache_agent", "status", "--socket", served.socket,
                                  *form], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
        finally:
            os.close(write_end)
        assert out.returncode == EXIT_OK and out.stderr == "", out.stderr
        assert served.status()["phase"] == "ready"  # the agent never noticed
        piped = subprocess.run(f"{shlex.quote(sys.executable)} -m weightcache_agent status --socket "
                               f"{shlex.quote(served.socket)} {' '.join(form)} | head -1", shell=True,
                               capture_output=True, text=True, timeout=60)
        assert piped.stderr == "" and len(piped.stdout.splitlines()) == 1, piped


# -- a device that does not exist ------------------------------------------------------------

def gpus_here() -> bool:
    from weightcache_agent.arena.devices import cuda_available

    return cuda_available()


@pytest.mark.parametrize("device", ["7", "GPU-nonexistent", "cuda:0"])
def test_a_gpu_named_on_a_machine_without_one_is_refused(device, model, run_dir):
    if gpus_here():
        pytest.skip("this machine has a GPU: see the test below")
    sock = os.path.join(run_dir, "a.sock")
    out = weightcache("agent", "--model", model, "--socket", sock, "--progress", "never", "--device", device)
    one_line(out, EXIT_USAGE, "weightcache agent", f"--device {device} names a GPU", "shows no GPU",
             "the cpu backend is what is available", "leave --device out")
    out = weightcache("agent", "--model", model, "--socket", sock, "--backend", "cpu", "--device", device)
    one_line(out, EXIT_USAGE, "weightcache agent", "--backend cpu uses none")
    assert os.listdir(run_dir) == []  # no socket, no lock: refused before either


@pytest.mark.parametrize("device", ["7", "GPU-nonexistent"])
def test_a_gpu_that_does_not_exist_is_refused_naming_the_ones_that_do(device, model, run_dir):
    if not gpus_here():
        pytest.skip("needs a GPU (and cuda-bindings)")
    from weightcache_agent.arena.devices import cuda_devices

    if device == "7" and len(cuda_devices()) > 7:
        pytest.skip("this machine has a GPU 7")
    sock = os.path.join(run_dir, "a.sock")
    out = weightcache("agent", "--model", model, "--socket", sock, "--progress", "never", "--device", device)
    line = one_line(out, EXIT_USAGE, "weightcache agent", f"device {device!r} is neither", "the GPUs here:")
    assert cuda_devices()[0].uuid in line
    assert not os.path.exists(sock)


# -- status of a socket directory ------------------------------------------------------------

def test_status_of_a_node_agents_socket_directory_lists_every_socket_in_it(model, tmp_path, run_dir):
    socket_dir = os.path.join(run_dir, "node")
    node = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket-dir",
                             socket_dir, "--backend", "cpu", "--tp-size", "1", "--replicas", "2", "--http-port", "0",
                             "--http-host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            out = weightcache("status", "--socket", socket_dir, "--json")
            if out.returncode == EXIT_OK and [s["phase"] for s in json.loads(out.stdout)] == ["ready", "ready"]:
                break
            assert node.poll() is None and time.monotonic() < deadline, (out.stderr, node.stderr)
            time.sleep(0.2)
        assert sorted(os.path.basename(s["socket"]) for s in json.loads(out.stdout)) == ["cpu-0.sock", "cpu-1.sock"]
        text = weightcache("status", "--socket", socket_dir)
        assert text.returncode == EXIT_OK, text.stderr
        assert len(re.findall(r"^PHASE\s+ready$", text.stdout, re.MULTILINE)) == 2, text.stdout
    finally:
        node.send_signal(signal.SIGTERM)
        assert node.wait(30) == EXIT_OK
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("mine")
    one_line(weightcache("status", "--socket", str(empty)), EXIT_USAGE, "weightcache status",
             "is a directory with no agent socket in it", "pass one socket with --socket")
    assert (empty / "notes.txt").read_text() == "mine"


# -- a checkpoint without config.json ----------------------------------------------------------

@pytest.mark.parametrize("mode", ["--socket", "--socket-dir"])
def test_a_checkpoint_without_config_json_is_refused_at_the_agent(mode, model, tmp_path, run_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(model):
        if name != "config.json":
            os.link(os.path.join(model, name), bare / name)
    where = os.path.join(run_dir, "a.sock" if mode == "--socket" else "node")
    out = weightcache("agent", "--model", str(bare), mode, where, "--progress", "never", "--backend", "cpu")
    one_line(out, EXIT_FAILED, "weightcache agent", f"no config.json in {bare}", "copy it from where the weights came")
    assert os.listdir(run_dir) == []  # nothing bound, nothing made
    assert sorted(os.listdir(bare)) == sorted(n for n in os.listdir(model) if n != "config.json")
    out = weightcache("engine", "--model", str(bare), "--mode", "off")
    one_line(out, EXIT_FAILED, "weightcache engine", f"no config.json in {bare}")


# -- a plain attach() of a Hugging Face model ------------------------------------------------

def test_a_plain_attach_of_a_transformers_model_names_the_fix_for_its_computed_buffers(run_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(str(tmp_path / "hf"))
    script = f"""
import sys, torch, transformers
from weightcache_agent import CacheSpec, attach
from weightcache_agent.errors import AttachError
config = transformers.AutoConfig.from_pretrained({str(tmp_path / 'hf')!r})
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
try:
    attach(model, CacheSpec(model={str(tmp_path / 'hf')!r}), socket=sys.argv[1])
except AttachError as e:
    print(e, file=sys.stderr)
    sys.exit(1)
"""
    with AgentProcess(str(tmp_path / "hf"), os.path.join(run_dir, "a.sock")) as served:
        out = subprocess.run([sys.executable, "-c", script, served.socket], capture_output=True, text=True,
                             timeout=300)
        assert served.status()["clients"] == []  # the refused attach holds no lease
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "model.rotary_emb.inv_freq: still on the meta device (a non-persistent buffer)" in line, line
    assert "materialize=" in line and "integrations.transformers.from_cache" in line, line


# -- the engine's --help example -------------------------------------------------------------

def test_the_engines_help_example_works_as_written_and_text_is_refused_naming_token_ids(model, run_dir):
    helptext = weightcache("engine", "--help").stdout
    example = next(line.strip() for line in helptext.splitlines() if line.strip().startswith("curl "))
    assert "no tokenizer" in example and "token ids" in helptext
    port, = free_ports(1)
    with AgentProcess(model, os.path.join(run_dir, "a.sock")) as served:
        engine = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "engine", "--model", model, "--socket",
                                   served.socket, "--port", str(port)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
        try:
            ready = subprocess.run(["curl", "-s", "--retry", "60", "--retry-connrefused", "--retry-delay", "1",
                                    f"localhost:{port}/readyz"], capture_output=True, text=True, timeout=120)
            # curl retries a 503 (still warming) too, printing each answer: the last one counts
            assert json.loads(ready.stdout[ready.stdout.rfind("{"):])["ready"], ready
            answer = subprocess.run(["bash", "-c", example.replace("8000", str(port))], capture_output=True,
                                    text=True, timeout=60)
            assert len(json.loads(answer.stdout)["tokens"]) == 16, answer
            text = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", f"localhost:{port}/generate", "-d",
                                   '{"prompt": "Hello", "max_tokens": 16}'], capture_output=True, text=True, timeout=60)
            body, code = text.stdout.rsplit("\n", 1)
            assert code == "400" and "no tokenizer: send token ids" in json.loads(body)["error"], text.stdout
            assert json.loads(subprocess.run(["bash", "-c", example.replace("8000", str(port))], capture_output=True,
                                             text=True, timeout=60).stdout)["tokens"]  # still serving
        finally:
            engine.terminate()
            engine.wait(30)


# -- what `agent --help` names -----------------------------------------------------------------

def test_agent_help_names_every_environment_variable_a_load_reads():
    source = ROOT / "node_agent" / "weightcache_agent"
    read = {name for folder in ("load", "arena") for path in (source / folder).glob("*.py")
            for name in re.findall(r'"(WEIGHTCACHE_[A-Z_]+)"', path.read_text())}
    assert {"WEIGHTCACHE_READERS", "WEIGHTCACHE_MEMORY_LIMIT"} <= read
    helptext = weightcache("agent", "--help").stdout
    environment = helptext.split("\nenvironment:\n", 1)[1].split("\n\n", 1)[0]
    assert sorted(name for name in read if f"  {name} " not in environment) == [], environment


# -- what an agent leaves behind ---------------------------------------------------------------

def test_the_files_a_cleanly_stopped_agent_leaves_are_the_ones_install_md_names(model, run_dir):
    with AgentProcess(model, os.path.join(run_dir, "a.sock")) as served:
        pass
    assert served.proc.returncode == EXIT_OK
    left = sorted(os.listdir(run_dir))
    assert left == [".a.sock.digest", ".a.sock.lock", ".a.sock.prepared"], left
    install = (ROOT / "docs" / "install.md").read_text()
    paragraph = next(p for p in install.split("\n\n") if "on SIGTERM or Ctrl-C" in p)
    named = set(re.findall(r"`\.NAME(\.sock\.\w+)`", paragraph.split("After a SIGKILL")[0]))
    assert named == {".sock.state", ".sock.lock", ".sock.prepared", ".sock.digest"}
    assert {f".a{suffix}" for suffix in named} - set(left) == {".a.sock.state"}  # the one said to be removed
