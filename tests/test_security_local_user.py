"""A local user on the node against an engine and an agent: real uids, real sockets, real files.

The attacker is a forked child running as uid 65534 (tests/security_fixtures.py); the engine
and the agent run as root, as in a cluster.

- `attach(mode="daemon")` with its socket in a directory others may write: a symlink planted
  at `<socket>.log` must not make root append to the attacker's chosen file, and a listener
  of the attacker's own at the socket path must fail the attach at once, by name, instead of
  after the whole timeout;
- a flood of refused connections must not write a log line each, and is counted in the
  metrics.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time

import pytest

from security_fixtures import ATTACKER, AsAttacker, needs_root
from weightcache_agent import CacheSpec, agent_status, attach
from weightcache_agent.errors import AgentUnavailable, UntrustedAgent, WeightCacheError
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint

SHAPE = LlamaShape(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("m") / "m"), SHAPE)


@pytest.fixture
def shared_dir():
    """A directory like /tmp: root's, sticky, everyone may create entries in it."""
    base = tempfile.mkdtemp(prefix="wc-shared-", dir="/tmp")
    os.chmod(base, 0o755)
    shared = os.path.join(base, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    yield shared
    shutil.rmtree(base, ignore_errors=True)


def meta_module(model: str):
    return skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})


def stop_agent_at(sock: str) -> None:
    try:
        os.kill(agent_status(sock)["pid"], signal.SIGTERM)
    except (WeightCacheError, ProcessLookupError, OSError):
        pass


@needs_root
def test_daemon_mode_never_appends_to_a_file_a_planted_symlink_names(model, shared_dir):
    victim = os.path.join(os.path.dirname(shared_dir), "victim")
    with open(victim, "w") as f:
        f.write("root's file\n")
    sock = os.path.join(shared_dir, "agent.sock")

    def plant(command: dict) -> dict:
        os.symlink(command["target"], command["at"])
        return {"planted": os.readlink(command["at"])}

    attacker = AsAttacker(plant)
    try:
        assert attacker.ask(target=victim, at=sock + ".log")["planted"] == victim
    finally:
        attacker.close()
    assert os.lstat(sock + ".log").st_uid == ATTACKER
    try:
        with pytest.raises(AgentUnavailable, match=r"agent\.sock\.log.*symbolic link"):
            attach(meta_module(model), CacheSpec(model=model), socket=sock, mode="daemon", timeout=30)
        time.sleep(1.0)  # an agent started anyway would have written its first lines by now
        with open(victim) as f:
            assert f.read() == "root's file\n", "root appended to the file the attacker's link names"
    finally:
        stop_agent_at(sock)


@needs_root
def test_daemon_mode_refuses_a_foreign_listener_at_once_by_name(model, shared_dir):
    sock = os.path.join(shared_dir, "agent.sock")

    def listen(command: dict) -> dict:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(command["at"])
        os.chmod(command["at"], 0o777)
        s.listen(64)
        listen.__dict__["held"] = s  # kept open (and accepting into its backlog) until the child exits
        return {"listening": True}

    attacker = AsAttacker(listen)
    try:
        assert attacker.ask(at=sock)["listening"]
        t0 = time.monotonic()
        with pytest.raises(UntrustedAgent, match=rf"{sock}.*uid {ATTACKER}"):
            attach(meta_module(model), CacheSpec(model=model), socket=sock, mode="daemon", timeout=60)
        assert time.monotonic() - t0 < 10, "the engine waited for an agent that could never take the path"
    finally:
        attacker.close()
        stop_agent_at(sock)
