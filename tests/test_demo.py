"""`weightcache demo` end to end, as a user runs it: real agent, real engines, real kill.

What matters besides the numbers: when the demo exits -- normally or on Ctrl-C -- no
process it started is alive and no socket file is left.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from engine_fixtures import pid_alive, processes_mentioning

# cpu backend: the path CI has, and the one whose tokens the demo checks against its in-process reference
DEMO = [sys.executable, "-m", "weightcache_agent", "demo", "--size", "small", "--backend", "cpu", "--timeout", "60"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("demo-cache"))


def assert_nothing_left(pids: list[int], run_dir: str) -> None:
    assert pids and all(isinstance(p, int) for p in pids)
    alive = [p for p in pids if pid_alive(p)]
    assert not alive, f"still running: {alive}"
    assert processes_mentioning(run_dir) == []
    leftovers = glob.glob(os.path.join(run_dir, "*.sock")) + glob.glob(os.path.join(run_dir, ".*.lock"))
    assert leftovers == []


def test_demo_runs_end_to_end_and_leaves_nothing(cache_dir, time_bar):
    done = subprocess.run([*DEMO, "--dir", cache_dir, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["same_tokens"] and summary["failover_same_tokens"]
    assert summary["promoted_role"] == "primary"
    assert summary["failover_seconds"] > 0 and summary["attach_seconds"]["primary"] > 0
    assert summary["attach_seconds"]["standby"] > 0
    time_bar("the demo's failover", summary["failover_seconds"], 1.0)
    time_bar("the demo's primary attach", summary["attach_seconds"]["primary"], 1.0)
    time_bar("the demo's standby attach", summary["attach_seconds"]["standby"], 1.0)
    assert summary["disk_load_seconds"] > 0 and summary["agent_load_seconds"] > 0
    assert summary["backend"] == "cpu"
    assert os.path.isfile(os.path.join(summary["model"], "config.json"))
    assert summary["model"].startswith(cache_dir)
    assert_nothing_left(list(summary["pids"].values()), summary["run_dir"])
    assert not os.path.exists(summary["run_dir"])  # a run dir the demo made is removed whole


def test_demo_ctrl_c_stops_everything(cache_dir, tmp_path):
    run_dir = str(tmp_path / "run")  # given by the user: the demo keeps the directory, removes its sockets
    proc = subprocess.Popen([*DEMO, "--dir", cache_dir, "--run-dir", run_dir], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        output = []
        for line in proc.stdout:  # human output, step by step
            output.append(line)
            pids += [int(p) for p in re.findall(r"\bpid (\d+)", line)]
            if "standby pid" in line:
                break
        assert len(pids) == 3, "".join(output)  # agent, primary, standby
        assert "(cached: written by an earlier run, reused)" in "".join(output)  # the first test's checkpoint
        time.sleep(0.5)  # engines importing/attaching: the awkward moment to be interrupted
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "SIGINT received" in err
    assert_nothing_left(pids, run_dir)
