"""What a new user of the agent reads, read as they read it: `weightcache agent --help`, the
message of a refused attach, and a terminal where the progress bar and log lines share stderr.
Each runs the command as a real process."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shutil
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from test_cli_mistakes import weightcache
from weightcache_agent import CacheSpec, FingerprintMismatch, agent_status, attach
from weightcache_agent.errors import AgentUnavailable
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.serve import serving_label
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint

SERVE = Path(serving_label.__file__).resolve().parent


# -- `weightcache agent --help` ----------------------------------------------------------------

def test_agent_help_names_the_api_server_variables_the_agent_reads():
    read = {name for path in SERVE.glob("*.py")
            for name in re.findall(r'environ(?:\.get)?[(\[]"(WEIGHTCACHE_KUBE_[A-Z_]+)"', path.read_text())}
    assert read == {"WEIGHTCACHE_KUBE_API", "WEIGHTCACHE_KUBE_TOKEN", "WEIGHTCACHE_KUBE_CA"}
    helptext = weightcache("agent", "--help").stdout
    environment = helptext.split("\nenvironment:\n", 1)[1].split("\n\n", 1)[0]
    described = dict(re.findall(r"^  (WEIGHTCACHE_KUBE_\w+) +(.+)$", environment, re.MULTILINE))
    assert set(described) == read, environment
    # Each says what it is for and what stands in when it is unset: the pod's own, as the code reads it.
    assert "https://" in described["WEIGHTCACHE_KUBE_API"] and "$KUBERNETES_SERVICE_HOST" in described[
        "WEIGHTCACHE_KUBE_API"] and "--label-pods" in described["WEIGHTCACHE_KUBE_API"]
    assert str(serving_label.SA_DIR / "token") in described["WEIGHTCACHE_KUBE_TOKEN"]
    assert str(serving_label.SA_DIR / "ca.crt") in described["WEIGHTCACHE_KUBE_CA"]


# -- a refused attach names what the agent holds ----------------------------------------------

def test_a_fingerprint_mismatch_names_the_agents_model_path_revision_quantization_and_tp(tmp_path):
    shape = LlamaShape(num_hidden_layers=1)
    held = write_llama_checkpoint(str(tmp_path / "served" / "tiny-llama"), shape, seed=1)
    other = str(shutil.copytree(held, tmp_path / "mine" / "tiny-llama"))
    with open(os.path.join(other, "config.json"), "a") as f:  # another checkpoint by content
        f.write(" ")
    module = skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(other).tensors.items()})
    with AgentProcess(held, str(tmp_path / "a.sock"), "--revision", "v1") as agent:
        with pytest.raises(FingerprintMismatch) as refused:
            attach(module, CacheSpec(model=other, revision="v2", dtype="float16"), socket=agent.socket)
        assert agent.status()["clients"] == [] and agent.proc.poll() is None
    message = str(refused.value)
    assert set(refused.value.differences) == {"content", "revision", "dtype"}
    for field in ("revision: cache=v1 engine=v2", "dtype: cache=bfloat16 engine=float16", "content: cache="):
        assert field in message, message
    assert f"the agent holds {held}: revision v1, quantization none, dtype bfloat16, tp 1, rank 0" \
        in message, message
    assert "\n" not in message


# -- the progress bar and log lines on one terminal --------------------------------------------

TIMESTAMP = re.compile(rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?:INFO|WARNING|ERROR) ")


def screen(raw: bytes) -> list[bytes]:
    """The lines a terminal shows for `raw`: a carriage return goes back to column 0, what follows
    overwrites; a newline ends the line. A column holds one character (a bar's block is three bytes
    of UTF-8). (Anything that moves the cursor up fails the test.)"""
    assert b"\x1b[A" not in raw, "the output moves the cursor up"
    lines: list[bytes] = []
    line: list[str] = []
    col = 0
    for char in raw.decode("utf-8", errors="replace"):
        if char == "\r":
            col = 0
        elif char == "\n":
            lines.append("".join(line).rstrip().encode())
            line, col = [], 0
        else:
            if col < len(line):
                line[col] = char
            else:
                line.append(char)
            col += 1
    lines.append("".join(line).rstrip().encode())
    return lines


def test_log_lines_on_a_terminal_start_at_column_0_and_the_bar_never_overwrites_them(tmp_path):
    # ~130 MB quantized to fp8-block: the bar is drawn while the load logs and bad clients are logged
    shape = LlamaShape(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=8192)
    model = write_llama_checkpoint(str(tmp_path / "tiny"), shape)
    sock = str(tmp_path / "a.sock")
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal's size
    # No --progress flag: stderr is a terminal, so the bar is drawn, as for a person at a shell.
    proc = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", sock,
                             "--quantization", "fp8-block"], stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    raw = bytearray()
    done = threading.Event()

    def read() -> None:
        while True:
            if select.select([leader], [], [], 0.05)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the agent closed the terminal
                    return
                if not chunk:
                    return
                raw.extend(chunk)
            elif done.is_set():
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline, phase = time.monotonic() + 60, None
        while phase != "ready" and time.monotonic() < deadline and proc.poll() is None:
            try:
                phase = agent_status(sock)["phase"]
            except AgentUnavailable:
                continue
            if phase == "loading":  # a bad client while the bar is drawn: the agent logs a warning
                with socket.socket(socket.AF_UNIX) as bad:
                    bad.connect(sock)
                    bad.sendall(b"garbage\n")
        assert phase == "ready", bytes(raw).decode(errors="replace")[-3000:]
    finally:
        proc.terminate()
        proc.wait(30)
        done.set()
        reader.join(10)
        os.close(leader)
    out = bytes(raw)
    assert b"reading: " in out and b"%|" in out, "no progress bar was drawn"
    records = len(TIMESTAMP.findall(out))
    shown = screen(out)
    at_column_0 = [line for line in shown if TIMESTAMP.match(line) and len(TIMESTAMP.findall(line)) == 1]
    misplaced = [line for line in shown if TIMESTAMP.search(line) and line not in at_column_0]
    assert misplaced == [], b"\n".join(misplaced).decode(errors="replace")
    assert len(at_column_0) == records, "a log line was overwritten"
    assert any(b" loading " in line for line in at_column_0) and any(b" loaded " in line for line in at_column_0)


# Many threads log while progress bars start, advance and finish on the same stream: every record
# must come out as one whole line from column 0. A handler swapped at a bar's start or end (what
# tqdm's logging redirect does) lets a line land inside another line or a bar; this loop makes
# that happen on every run of such code.
LOG_STORM = r"""
import logging, sys, threading
from weightcache_agent.logs import configure
from weightcache_agent.load.progress import LoadProgress

configure()
stop = threading.Event()

def talk(i):
    n = 0
    while not stop.is_set():
        logging.getLogger("storm").warning("thread %d line %d", i, n)
        n += 1

threads = [threading.Thread(target=talk, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for _ in range(100):
    progress = LoadProgress()
    progress.start(4096, 8, show_bar=True)
    for _ in range(8):
        progress.advance(512, 1)
    progress.finish()
stop.set()
for t in threads:
    t.join()
"""


def test_log_lines_from_many_threads_stay_whole_while_bars_start_and_finish(tmp_path):
    err = tmp_path / "stderr"
    with open(err, "wb") as f:
        done = subprocess.run([sys.executable, "-c", LOG_STORM], stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                              timeout=120)
    out = err.read_bytes()
    assert done.returncode == 0, out[-2000:].decode(errors="replace")
    assert out.count(b"reading: ") >= 100, "no progress bar was drawn"
    records = len(TIMESTAMP.findall(out))
    assert records > 100, f"only {records} lines were logged"
    shown = screen(out)
    whole = [line for line in shown if TIMESTAMP.match(line) and len(TIMESTAMP.findall(line)) == 1
             and re.fullmatch(rb".* WARNING storm: thread \d+ line \d+", line)]
    broken = [line for line in shown if TIMESTAMP.search(line) and line not in whole]
    assert broken == [], b"\n".join(broken[:5]).decode(errors="replace")
    assert len(whole) == records, f"{records - len(whole)} of {records} lines were overwritten"
