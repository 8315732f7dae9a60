"""`attach(fallback=True)` loads from disk whenever the agent cannot serve, whatever the way it fails.

The misbehaving agents are real listeners on real Unix sockets: one that never answers,
one that hangs up at once, one that answers garbage, one that answers a frame missing
what a manifest needs. Each time the engine gets the checkpoint's weights from disk and
the log says why.
"""
from __future__ import annotations

import logging
import os
import socket
import threading

import pytest
import torch

from abuse_fixtures import disk_tensors
from agent_fixtures import FakeAgent
from weightcache_agent import CacheSpec, attach, protocol
from weightcache_agent.errors import WeightCacheError
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), LlamaShape(num_hidden_layers=1))


def silent(conn: socket.socket) -> None:
    conn.recv(1 << 16)
    threading.Event().wait(5)  # holds the connection open without a word


def hang_up(conn: socket.socket) -> None:
    conn.recv(1 << 16)


def garbage(conn: socket.socket) -> None:
    conn.recv(1 << 16)
    conn.sendall(b"HTTP/1.1 200 OK\r\n\r\nnot an agent")


def half_manifest(conn: socket.socket) -> None:
    conn.recv(1 << 16)
    protocol.send_message(conn, {"type": "manifest", "arenas": "none"})


@pytest.mark.parametrize("behaviour,reason", [
    (silent, "TimeoutError"), (hang_up, "EOFError"), (garbage, "ProtocolError"), (half_manifest, "ProtocolError"),
])
def test_fallback_loads_from_disk_and_logs_why(model, tmp_path, caplog, behaviour, reason):
    path = str(tmp_path / "agent.sock")
    fake = FakeAgent(path, behaviour)
    shapes = {n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()}
    try:
        with pytest.raises((WeightCacheError, TimeoutError, EOFError, OSError)):
            attach(skeleton_module(shapes), CacheSpec(model=model), socket=path, timeout=0.5)
        module = skeleton_module(shapes)
        with caplog.at_level(logging.WARNING):
            att = attach(module, CacheSpec(model=model), socket=path, fallback=True, timeout=0.5)
        assert att.source == "disk"
        disk = disk_tensors(model)
        params = dict(module.named_parameters())
        assert all(torch.equal(params[n].cpu(), disk[n]) for n in disk)
        assert any(reason in r.getMessage() and "loading from disk instead" in r.getMessage() for r in caplog.records)
        att.close()
    finally:
        fake.close()
        os.unlink(path)
