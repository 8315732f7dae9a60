"""An agent that cannot serve says why in one line and exits 1: no hang, no traceback."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), LlamaShape(num_hidden_layers=1))


def run_agent(model: str, sock: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", sock,
                           "--progress", "never"], capture_output=True, text=True, timeout=timeout)


def one_line_refusal(out: subprocess.CompletedProcess, *words: str) -> str:
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("weightcache agent: "), out.stderr
    for word in words:
        assert word in last, last
    return last


def test_a_fifo_in_place_of_a_shard_is_refused_not_read(model, tmp_path):
    broken = str(tmp_path / "m")
    shutil.copytree(model, broken)
    shard = os.path.join(broken, "model.safetensors")
    os.unlink(shard)
    os.mkfifo(shard)  # reading it would block until someone writes: forever
    one_line_refusal(run_agent(broken, str(tmp_path / "a.sock"), timeout=60), "not a regular file")


def test_a_socket_path_over_the_limit(model, tmp_path):
    sock = str(tmp_path / ("x" * 120 + ".sock"))
    one_line_refusal(run_agent(model, sock), "bytes", "at most 107")


def test_a_socket_dir_whose_parent_is_a_file(model, tmp_path):
    (tmp_path / "file").write_text("")
    one_line_refusal(run_agent(model, str(tmp_path / "file" / "run" / "a.sock")), "not a directory")


def test_an_unwritable_socket_dir(model, tmp_path):
    if os.geteuid() == 0:
        where = "/proc/weightcache-test/a.sock"  # not even root may create anything in /proc
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        where = str(locked / "run" / "a.sock")
    one_line_refusal(run_agent(model, where), "cannot")


def test_node_mode_refuses_a_socket_dir_whose_parent_is_a_file(model, tmp_path):
    (tmp_path / "file").write_text("")
    out = subprocess.run([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket-dir",
                          str(tmp_path / "file" / "run"), "--backend", "cpu", "--http-port", "0"],
                         capture_output=True, text=True, timeout=60)
    one_line_refusal(out, "not a directory")


def test_node_mode_refuses_a_socket_dir_too_deep_for_its_worker_sockets(model, tmp_path):
    deep = str(tmp_path / ("d" * (110 - len(str(tmp_path)))))
    out = subprocess.run([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket-dir", deep,
                          "--backend", "cpu", "--http-port", "0"], capture_output=True, text=True, timeout=60)
    one_line_refusal(out, "cpu-0.sock", "at most 107")
