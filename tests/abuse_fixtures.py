"""Helpers for the socket security and abuse tests: an agent whose log is a file, raw frames,
and the check every case ends with -- the agent still hands out the right weights.

The fixtures `model` (a one-layer Llama checkpoint) and `disk` (its tensors as read from the
file) are imported into a test module by name; each module gets its own."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from agent_fixtures import fd_count, wait_for
from weightcache_agent import CacheSpec, attach, protocol
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), LlamaShape(num_hidden_layers=1))


@pytest.fixture(scope="module")
def disk(model: str) -> dict[str, torch.Tensor]:
    return disk_tensors(model)


class LoggedAgent(AgentProcess):
    """`weightcache agent --socket` with stdout and stderr in a file (a pipe nobody reads would fill and block it)."""

    def __init__(self, model: str, sock: str, log_path: str, *extra: str):
        self.model, self.socket, self.log_path = model, sock, log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket", sock,
             "--progress", "never", *extra],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)

    def exit_output(self) -> str:
        return self.log()[-2000:]

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def fds(self) -> int:
        return fd_count(self.proc.pid)

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> int:
        code = super().stop()
        self._log.close()
        return code


def raw(path: str, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.settimeout(timeout)
    return s


def frame(body: bytes, version: int = protocol.PROTOCOL_VERSION, length: int | None = None) -> bytes:
    return protocol.HEADER.pack(protocol.MAGIC, version, 0, len(body) if length is None else length) + body


def ask(path: str, message: dict[str, Any], fds: list[int] = ()) -> dict[str, Any]:
    """One request on a fresh connection; the reply (fds it carries closed)."""
    s = raw(path)
    try:
        protocol.send_message(s, message, fds)
        reply, got = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
        for fd in got:
            os.close(fd)
        return reply
    finally:
        s.close()


def drain(s: socket.socket) -> bytes:
    """Everything the agent sends until it hangs up (a reset counts as hanging up)."""
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except ConnectionResetError:
        pass
    return out


def disk_tensors(model: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(model, "model.safetensors"))


def right_bytes(agent: LoggedAgent, disk: dict[str, torch.Tensor]) -> None:
    """A fresh attach gets exactly the checkpoint's bytes (its lease ends at once)."""
    module = skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(agent.model).tensors.items()})
    with attach(module, CacheSpec(model=agent.model), socket=agent.socket, timeout=30) as att:
        assert att.source == "agent"
        params = dict(module.named_parameters())
        assert set(params) == set(disk)
        assert all(torch.equal(params[n].cpu(), disk[n]) for n in disk), "the agent served bytes that differ from disk"


def serves_correctly(agent: LoggedAgent, disk: dict[str, torch.Tensor], leases_left: int = 0) -> None:
    """A fresh attach gets exactly the checkpoint's bytes; then the agent is back to `leases_left` leases."""
    right_bytes(agent, disk)
    wait_for(lambda: len(agent.status()["clients"]) <= leases_left, 10, "the check's own lease ending")
    assert agent.proc.poll() is None


def no_traceback(agent: LoggedAgent) -> None:
    log = agent.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]
