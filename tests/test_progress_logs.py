"""Load progress where operators look: `kubectl logs` has no terminal, so no bar.

A real agent process with its stderr on a pipe must log progress lines every few seconds
(here every few milliseconds, through `WEIGHTCACHE_PROGRESS_INTERVAL`), and the start
line, every progress line, the final summary and the status API must agree on what is
read (source tensors, bytes from disk) and what ends resident (tensors, bytes after
quantization).
"""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from weightcache_agent import agent_status
from weightcache_agent.errors import AgentUnavailable
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.load.progress import INTERVAL_ENV, LoadProgress, interval_problem, log_interval, size_text
from weightcache_agent.serve.status_cli import render
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

# ~130 MB of bf16: quantizing it to fp8-block takes long enough for several lines at 10 ms
SHAPE = LlamaShape(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=8192)
GIB = r"([\d.]+ (?:B|KiB|MiB|GiB|TiB))"  # a size in the unit that shows it (never "0.00 GiB")
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def size(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]
LINE = re.compile(rf"loading tiny: read {GIB} of {GIB} \((\d+)%\), [\d.]+ (?:MiB|GiB)/s, ETA (?:\S+), "
                  rf"(\d+)/(\d+) source tensors -> (\d+) tensors, {GIB} resident \(fp8-block\)")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny"), SHAPE)


def _wait_loaded(socket: str, proc: subprocess.Popen, seen: list[dict], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = agent_status(socket)
            if status["phase"] in ("ready", "failed"):
                return status
            seen.append(status)
        except AgentUnavailable:
            pass
        time.sleep(0.02)
    raise AssertionError(f"the agent did not finish loading (exit status {proc.poll()})")


def test_agent_without_a_terminal_logs_periodic_progress_lines(model, tmp_path):
    socket = str(tmp_path / "agent.sock")
    env = dict(os.environ, **{INTERVAL_ENV: "0.01"})
    # no --progress flag: the default decides by whether stderr is a terminal, as in a pod
    proc = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", socket,
                             "--quantization", "fp8-block"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        loading: list[dict] = []
        status = _wait_loaded(socket, proc, loading)
        assert status["phase"] == "ready", status["error"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "\r" not in err and "source tensors/s" not in err  # no tqdm bar in a log
    sources = len(open_checkpoint(model).tensors)
    resident = size_text(status["bytes"])
    assert not resident.startswith("0") and status["bytes"] < 2**30 and resident.endswith(" MiB")

    lines = [m for m in map(LINE.search, err.splitlines()) if m]
    assert len(lines) >= 2, err
    done = [size(m.group(1)) for m in lines]
    assert done == sorted(done) and done[-1] > 0
    for m in lines:
        assert size(m.group(1)) <= size(m.group(2))
        assert int(m.group(5)) == sources and int(m.group(4)) <= sources
        assert int(m.group(6)) == status["tensors"] > sources  # the scales fp8-block adds are counted
        assert m.group(7) == resident
    # the summary says the same thing in the same words, and matches what status reports
    summary = re.search(rf"loaded \S+: read (\d+) source tensors, {GIB} -> (\d+) tensors, {GIB} resident "
                        rf"\(fp8-block\) in [\d.]+s", err)
    assert summary, err
    assert int(summary.group(1)) == sources and summary.group(2) == lines[0].group(2)
    assert int(summary.group(3)) == status["tensors"] and summary.group(4) == resident
    assert re.search(rf"loading \S+: reading {sources} source tensors, {GIB} -> {status['tensors']} tensors", err)
    # `weightcache status` words it the same way, during the load (when a poll caught it) and after
    assert re.search(rf"RESIDENT +[\d.]+ MiB in {status['tensors']} tensors \(fp8-block\)", render(status))
    for during in (s for s in loading if s["phase"] == "loading" and s["progress"]["bytes_total"]):
        text = render(during)
        assert f"in {status['tensors']} tensors, once loaded (fp8-block)" in text
        assert re.search(rf"read [\d.]+ \w+/[\d.]+ MiB, \d+/{sources} source tensors", text), text
    progress = status["progress"]
    assert progress["tensors_total"] == sources and progress["tensors_resident"] == status["tensors"]
    assert progress["bytes_resident"] == status["bytes"] and progress["quantization"] == "fp8-block"


def test_interval_comes_from_the_environment(monkeypatch, caplog):
    monkeypatch.setenv(INTERVAL_ENV, "0")
    assert log_interval() == 0
    monkeypatch.setenv(INTERVAL_ENV, "2.5")
    assert log_interval() == 2.5
    monkeypatch.delenv(INTERVAL_ENV)
    assert log_interval() == 5.0
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    with caplog.at_level(logging.WARNING):
        assert log_interval() == 5.0
    assert f"${INTERVAL_ENV}='soon' is not a number of seconds" in caplog.text
    assert interval_problem() == (f"${INTERVAL_ENV}='soon' is not a number of seconds: set it to one like 5 "
                                  "(0: no progress lines), or unset it")
    monkeypatch.setenv(INTERVAL_ENV, "-1")
    assert interval_problem() is not None and log_interval() == 5.0
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert interval_problem() is None


def test_bar_and_lines_name_read_and_resident_apart(capsys, caplog):
    progress = LoadProgress()
    progress.start(2 * 2**30, 201, show_bar=True, bytes_resident=int(1.15 * 2**30), tensors_resident=355,
                   quantization="fp8-block")
    progress.advance(2**30, tensors=100)
    line = progress.line("m")
    progress.finish()
    assert line.startswith("loading m: read 1.00 GiB of 2.00 GiB (50%)")
    assert line.endswith("100/201 source tensors -> 355 tensors, 1.15 GiB resident (fp8-block)")
    bar = capsys.readouterr().err
    assert "reading" in bar and "100/201 source tensors" in bar


def test_lines_stop_when_the_load_ends(caplog):
    import threading

    progress = LoadProgress()
    with caplog.at_level(logging.INFO, logger="weightcache_agent.load.progress"):
        progress.start(100, 2, show_bar=False, log_every=0.01, what="m")
        progress.advance(50, tensors=1)
        time.sleep(0.1)
        progress.finish()
        logged = len(caplog.records)
        time.sleep(0.05)
    assert logged >= 2 and len(caplog.records) == logged
    # the logging thread may write one line before advance() runs (the 0% one): a line after it says 50%
    assert any(r.getMessage().startswith("loading m: read 50 B of 100 B (50%)") for r in caplog.records)
    assert not any(t.name == "progress" and t.is_alive() for t in threading.enumerate())


def test_agent_refuses_an_unusable_interval_before_binding(model, tmp_path):
    socket = tmp_path / "agent.sock"
    done = subprocess.run([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", str(socket)],
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, **{INTERVAL_ENV: "soon"}))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"weightcache agent: ${INTERVAL_ENV}='soon' is not a number of seconds: set it to one like 5 "
        "(0: no progress lines), or unset it"]
    assert list(tmp_path.iterdir()) == []  # nothing bound, no lock file
