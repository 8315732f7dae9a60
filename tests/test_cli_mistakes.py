"""Each mistake a person makes with `weightcache` is one line naming the problem and the fix,
with the documented exit code (usage.EXIT_*); and every subcommand's help says its defaults,
examples, environment and exit codes. Every case runs the command as a real process."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint
from weightcache_agent.usage import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

SUBCOMMANDS = ("agent", "status", "switchover", "engine", "demo", "operator")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), LlamaShape(num_hidden_layers=1))


def weightcache(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightcache_agent", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_line(out: subprocess.CompletedProcess, code: int, prog: str, *words: str) -> str:
    """The process failed with `code` and said why in exactly one line that names `words`."""
    assert out.returncode == code, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"{prog}: "), lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def agent(model: str, sock: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return weightcache("agent", "--model", model, "--socket", sock, "--progress", "never", *extra, env=env)


def test_a_missing_model_is_named_before_anything_is_created(tmp_path):
    out = agent(str(tmp_path / "nowhere"), str(tmp_path / "run" / "a.sock"))
    one_line(out, EXIT_FAILED, "weightcache agent", f"model directory not found: {tmp_path / 'nowhere'}", "--model")
    assert not (tmp_path / "run").exists()  # no socket directory, no socket: checked first


def test_the_engine_checks_its_model_and_environment_before_listening(tmp_path):
    out = weightcache("engine", "--model", str(tmp_path / "nowhere"), "--mode", "off")
    one_line(out, EXIT_FAILED, "weightcache engine", "model directory not found")
    out = weightcache("engine", "--model", str(tmp_path), "--mode", "off", env={"WEIGHTCACHE_DIRECT_IO": "yes"})
    one_line(out, EXIT_USAGE, "weightcache engine", "$WEIGHTCACHE_DIRECT_IO='yes'")


def test_a_socket_path_under_a_file(model, tmp_path):
    (tmp_path / "file").write_text("")
    one_line(agent(model, str(tmp_path / "file" / "a.sock")), EXIT_FAILED, "weightcache agent",
             "a file is in the way", "choose a socket path in a directory")


def test_a_socket_path_that_is_a_file_is_refused_and_the_file_kept(model, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    one_line(agent(model, str(tmp_path / "notes.txt")), EXIT_FAILED, "weightcache agent",
             "is a file, not a socket", "choose another --socket")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_socket_path_too_long(model, tmp_path):
    one_line(agent(model, str(tmp_path / ("x" * 120 + ".sock"))), EXIT_FAILED, "weightcache agent",
             "at most 107", "use a shorter --socket")


def test_a_bad_direct_io_value(model, tmp_path):
    out = agent(model, str(tmp_path / "a.sock"), env={"WEIGHTCACHE_DIRECT_IO": "yes"})
    one_line(out, EXIT_USAGE, "weightcache agent", "$WEIGHTCACHE_DIRECT_IO='yes'", "auto, on, off")
    assert not (tmp_path / "a.sock").exists()


def test_fp8_suggests_fp8_block(model, tmp_path):
    one_line(agent(model, str(tmp_path / "a.sock"), "--quantization", "fp8"), EXIT_USAGE, "weightcache agent",
             "did you mean 'fp8-block'?")


def test_an_unwritable_demo_dir(tmp_path):
    (tmp_path / "file").write_text("")
    one_line(weightcache("demo", "--dir", str(tmp_path / "file" / "demo")), EXIT_USAGE, "weightcache demo",
             "cannot create --dir", "pass a writable directory with --dir")


def test_the_operator_without_its_extra_names_the_extra():
    block = textwrap.dedent("""
        import sys
        class NoKopf:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "kopf":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, NoKopf())
        from weightcache_agent.cli import main
        sys.exit(main(["operator"]))
    """)
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=60)
    one_line(out, EXIT_FAILED, "weightcache operator", "kopf", "pip install 'weightcache[operator]'")


def test_status_without_a_socket():
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTCACHE_SOCKET"}
    out = subprocess.run([sys.executable, "-m", "weightcache_agent", "status"], capture_output=True, text=True,
                         timeout=60, env=env)
    one_line(out, EXIT_USAGE, "weightcache status", "--socket", "$WEIGHTCACHE_SOCKET")


def test_status_reads_the_socket_from_the_environment_without_torch_and_ctrl_c_exits_130(model, tmp_path):
    served = AgentProcess(model, str(tmp_path / "a.sock"))
    try:
        served.wait_ready()
        out = weightcache("status", env={"WEIGHTCACHE_SOCKET": served.socket})
        assert out.returncode == EXIT_OK, out.stderr
        assert re.search(r"PHASE\s+ready", out.stdout), out.stdout
        # The same call, watched from inside: the status path never imports torch.
        probe = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from weightcache_agent.cli import main
            code = main(["status", "--socket", {served.socket!r}, "--json"])
            print("torch imported:", "torch" in sys.modules, file=sys.stderr)
            sys.exit(code)
        """)], capture_output=True, text=True, timeout=60)
        assert probe.returncode == 0, probe.stderr
        assert "torch imported: False" in probe.stderr
        served.proc.send_signal(signal.SIGINT)
        assert served.proc.wait(30) == EXIT_INTERRUPTED
        assert "Traceback" not in served.proc.stderr.read()
    finally:
        served.stop()


def test_status_wait_returns_once_an_agent_started_later_holds_its_weights(model, tmp_path):
    """`--wait` outlasts a socket that does not exist yet and an agent still loading; it exits 0 with
    the agent ready, and names the socket in one line when the time runs out."""
    sock = str(tmp_path / "later.sock")
    waiting = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "status", "--socket", sock, "--wait", "120"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    served = None
    try:
        assert waiting.poll() is None
        served = AgentProcess(model, sock)
        out, err = waiting.communicate(timeout=150)
        assert waiting.returncode == EXIT_OK, err
        assert re.search(r"^PHASE\s+ready$", out, re.MULTILINE), out
    finally:
        waiting.kill()
        if served is not None:
            served.stop()
    one_line(weightcache("status", "--socket", str(tmp_path / "none.sock"), "--wait", "0.5"), EXIT_FAILED,
             "weightcache status", "none.sock")
    one_line(weightcache("status", "--socket", sock, "--wait", "-1"), EXIT_USAGE, "weightcache status", "--wait")


def test_version():
    out = weightcache("--version")
    assert out.returncode == EXIT_OK and re.fullmatch(r"weightcache \d+\.\d+\.\d+\S*", out.stdout.strip()), out


def option_blocks(help_text: str) -> dict[str, str]:
    """Each option's help block, keyed by its first flag, from argparse's layout."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.split("\n\n", 1)[1].splitlines():
        match = re.match(r"^  (-{1,2}[\w-]+)", line)
        if match:
            current = match.group(1)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


REQUIRED = {"agent": {"--model"}, "engine": {"--model"}, "switchover": {"--group"}}


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_shows_every_default_then_examples_environment_and_exit_codes(command):
    out = weightcache(command, "--help")
    assert out.returncode == EXIT_OK, out.stderr
    text = out.stdout
    blocks = option_blocks(text)
    assert len(blocks) > 2, text
    for flag, block in blocks.items():
        if flag in ("-h", "--help") or flag in REQUIRED.get(command, ()):
            continue
        assert "default" in block, f"{command} {flag}: no default in its help: {block}"
    tail = text[text.index("\nexamples:\n"):]
    assert f"weightcache {command}" in tail.split("\n\n")[0]
    assert re.search(r"\nexit codes:\n(  \d+ +\S.*\n?)+$", tail), tail
    if command != "switchover":  # every other command reads the environment
        assert "\nenvironment:\n" in tail
    if command in ("agent", "engine"):
        assert re.search(r"--quantization \{none,fp8-block\}", text)
