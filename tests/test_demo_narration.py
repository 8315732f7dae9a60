"""`weightcache demo` never leaves its user staring at a silent terminal, and refuses
`--backend cuda` on a machine without a GPU before it spends a minute on the steps
that come first."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from weightcache_agent.arena.devices import cuda_available

DEMO = [sys.executable, "-m", "weightcache_agent", "demo", "--size", "small", "--timeout", "60"]
BEAT = 0.3  # seconds: WEIGHTCACHE_PROGRESS_INTERVAL paces the demo's "still waiting" lines
LONGEST_QUIET = 3.0  # ten beats: generous for a loaded CI machine, far below the seconds a bare wait takes


def test_demo_says_what_it_waits_for(tmp_path):
    env = dict(os.environ, WEIGHTCACHE_PROGRESS_INTERVAL=str(BEAT))
    proc = subprocess.Popen([*DEMO, "--backend", "cpu", "--dir", str(tmp_path / "cache")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    stamped: list[tuple[float, str]] = []
    try:
        for line in proc.stdout:  # not a terminal: no bars, so only these lines show progress
            stamped.append((time.monotonic(), line.rstrip()))
        err = proc.stderr.read()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "\n".join(line for _, line in stamped)
    assert proc.returncode == 0, err[-3000:]
    gaps = [(b - a, line) for (a, _), (b, line) in zip(stamped, stamped[1:])]
    longest, before = max(gaps)
    assert longest < LONGEST_QUIET, f"silent for {longest:.1f}s before {before!r}:\n{text}"
    # the waits that take seconds say what they are
    assert "creating the demo checkpoint once" in text
    assert "it reads the checkpoint's headers, plans the arena, then loads" in text
    assert "builds the model on the meta device and attaches" in text
    assert "done: no process or socket left behind." in text
    assert "... " in text  # at least one heartbeat: the torch import alone takes longer than a beat
    # the write is timed on its ticker's clock: no tick later than the time reported at its end
    ticks = [float(t) for t in re.findall(r"\.\.\. writing the checkpoint \((\d+) s\)", text)]
    written = re.search(r"written in ([\d.]+) (m?s)", text)
    seconds = float(written.group(1)) / (1000 if written.group(2) == "ms" else 1)
    assert all(t <= seconds + 0.5 for t in ticks), (ticks, written.group(0))  # ticks print rounded to a second

    # A second run reuses the checkpoint: it says so, and never that it is writing one.
    again = subprocess.run([*DEMO, "--backend", "cpu", "--dir", str(tmp_path / "cache")], capture_output=True,
                           text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(cached: written by an earlier run, reused)" in again.stdout
    assert "writing the checkpoint" not in again.stdout and "creating the demo checkpoint" not in again.stdout


@pytest.mark.skipif(cuda_available(), reason="a GPU is visible: --backend cuda is valid here")
def test_demo_refuses_cuda_without_a_gpu_before_any_step(tmp_path):
    cache = tmp_path / "cache"
    started = time.monotonic()
    done = subprocess.run([*DEMO, "--backend", "cuda", "--dir", str(cache)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "weightcache demo: --backend cuda: no CUDA device is visible to this process (torch.cuda.is_available() is "
        "False); run with --backend cpu, or auto to use a GPU only when there is one"]
    assert "[1/6]" not in done.stdout  # no checkpoint written, no disk load timed
    assert not (cache / "llama-small").exists()
    assert time.monotonic() - started < 30


def test_demo_refuses_an_unusable_progress_interval_at_once(tmp_path):
    done = subprocess.run([*DEMO, "--backend", "cpu", "--dir", str(tmp_path / "cache")], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, WEIGHTCACHE_PROGRESS_INTERVAL="soon"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "weightcache demo: $WEIGHTCACHE_PROGRESS_INTERVAL='soon' is not a number of seconds: set it to one like 5 "
        "(0: no progress lines), or unset it"]
    assert not (tmp_path / "cache" / "llama-small").exists()
