"""Fixtures for the engine, promotion and demo tests: small checkpoints, real processes.

Every agent and engine here is a real subprocess started through
`weightcache_agent.supervise`; the `supervisor` fixture stops them all (and removes
their sockets) whatever the test's outcome. Import the fixtures into a test module by
name (there is deliberately no conftest.py).
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from typing import Callable, Iterator

import pytest

from weightcache_agent.serve.process_group import EngineChild, ProcessGroup
from weightcache_agent.testing.synthetic import LlamaShape, qwen2_shape, write_llama_checkpoint

# Small enough that a process attaches and warms up in well under a second on 2 cores.
SMALL_LLAMA = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
PROMPT = [1, 17, 42, 255, 3]


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-llama"), LlamaShape(**SMALL_LLAMA), seed=1)


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    shape = qwen2_shape(**SMALL_LLAMA, tie_word_embeddings=True)  # q/k/v biases and tied embeddings
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2"), shape, seed=2, shards=2)


def short_run_dir() -> str:
    # Unix socket paths are limited to 107 bytes; pytest's tmp paths can get long.
    path = tempfile.mkdtemp(prefix="wc-test-")
    atexit.register(shutil.rmtree, path, True)  # the worker's agents are gone by its exit
    return path


@pytest.fixture(scope="module")
def module_supervisor() -> Iterator[ProcessGroup]:
    sup = ProcessGroup(short_run_dir())
    try:
        yield sup
    finally:
        sup.close()


@pytest.fixture
def supervisor() -> Iterator[ProcessGroup]:
    sup = ProcessGroup(short_run_dir())
    try:
        yield sup
    finally:
        sup.close()


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.005) -> float:
    """Seconds until `condition()` held; raises AssertionError after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition():
            return time.monotonic() - start
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def readyz(engine: EngineChild) -> int:
    return engine.get("/readyz")[0]


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def processes_mentioning(text: str) -> list[int]:
    """Live pids whose command line contains `text` (a unique temp path catches orphans too)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and pid_alive(int(entry)):
            found.append(int(entry))
    return found
