"""Bad clients on the agent's socket get a clear error and are dropped; everyone else is served."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from agent_fixtures import Probe, wait_for
from weightcache_agent import CacheSpec, attach, protocol
from weightcache_agent.errors import ProtocolError
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, skeleton_module, write_llama_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "m"), LlamaShape(num_hidden_layers=1))


@pytest.fixture(scope="module")
def agent(model, tmp_path_factory):
    proc = AgentProcess(model, str(tmp_path_factory.mktemp("sock") / "agent.sock"), "--handshake-timeout", "0.5")
    proc.wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def bystander(model, agent):
    """An engine attached for the whole module: it must be unaffected by every bad client."""
    probe = Probe(model, agent.socket)
    yield probe
    probe.close()


def raw(agent: AgentProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(agent.socket)
    s.settimeout(5)
    return s


def reply_and_close(s: socket.socket) -> dict:
    message, _ = protocol.recv_message(s, protocol.MAX_REPLY_BYTES)
    assert closed_by_agent(s), "agent kept the connection of a bad client open"
    return message


def closed_by_agent(s: socket.socket) -> bool:
    """True once the agent hangs up (EOF, or a reset when it closed with our bytes unread)."""
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    finally:
        s.close()
    return True


def still_serving(model: str, agent: AgentProcess, bystander: Probe) -> None:
    assert bystander.ask("verify") == {"identical": True}
    module = skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})
    attach(module, CacheSpec(model=model), socket=agent.socket).close()
    # the agent ends a lease on its own thread after the hang-up
    wait_for(lambda: len(agent.status()["clients"]) <= 1, 5, "the test's own lease ending")
    status = agent.status()
    assert status["phase"] == "ready"
    assert [c["pid"] for c in status["clients"]] == [bystander.hello["pid"]]


def test_garbage_gets_bad_magic(model, agent, bystander):
    s = raw(agent)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = reply_and_close(s)
    assert reply["type"] == "error" and "bad magic" in reply["message"]
    still_serving(model, agent, bystander)


def test_wrong_protocol_version(model, agent, bystander):
    s = raw(agent)
    body = b'{"type":"status"}'
    s.sendall(protocol.HEADER.pack(protocol.MAGIC, 99, 0, len(body)) + body)
    reply = reply_and_close(s)
    assert "protocol version 99 is not supported" in reply["message"]
    still_serving(model, agent, bystander)


def test_oversize_frame_is_refused_before_reading_it(model, agent, bystander):
    s = raw(agent)
    s.sendall(protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, 0, 2**31))
    reply = reply_and_close(s)
    assert f"exceeds the cap of {protocol.MAX_REQUEST_BYTES} bytes" in reply["message"]
    still_serving(model, agent, bystander)


@pytest.mark.parametrize("body,expected", [
    (b"\xff\xfenot json", "not valid JSON"),
    (b"[1, 2, 3]", "JSON object with a string 'type'"),
    (b'{"type": "launch-missiles"}', "unexpected message type 'launch-missiles'"),
    (b'{"type": "attach", "role": "leader", "fields": {}}', "attach needs role in"),
])
def test_malformed_bodies(model, agent, bystander, body, expected):
    s = raw(agent)
    s.sendall(protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, 0, len(body)) + body)
    assert expected in reply_and_close(s)["message"]
    still_serving(model, agent, bystander)


def test_fds_pushed_at_the_agent_are_refused_and_closed(model, agent, bystander):
    s = raw(agent)
    r, w = os.pipe()
    body = b'{"type":"status"}'
    socket.send_fds(s, [protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, 0, len(body)) + body], [r])
    assert "file descriptors sent with a 'status' message" in reply_and_close(s)["message"]
    os.close(r)
    os.close(w)
    still_serving(model, agent, bystander)


def test_silent_and_half_frame_clients_are_dropped(model, agent, bystander):
    silent, half = raw(agent), raw(agent)
    half.sendall(protocol.MAGIC + b"\x00")
    t0 = time.monotonic()
    assert closed_by_agent(silent) and closed_by_agent(half)
    assert 0.4 < time.monotonic() - t0 < 5  # the agent's handshake timeout is 0.5 s
    still_serving(model, agent, bystander)


def test_client_killed_mid_attach(model, agent, bystander):
    # A real process sends an attach and dies before reading the manifest and its fd.
    script = textwrap.dedent(f"""
        import os, signal, socket
        from weightcache_agent import protocol
        from weightcache_agent.load.fingerprint import engine_request
        from weightcache_agent.spec import CacheSpec
        request = engine_request(CacheSpec(model={model!r}))
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect({agent.socket!r})
        protocol.send_message(s, {{"type": "attach", "pid": os.getpid(), "role": "primary", "group": None, "request": request}})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == -9
    for _ in range(3):  # and a client that hangs up right after asking
        s = raw(agent)
        protocol.send_message(s, {"type": "attach", "role": "primary", "group": None,
                                  "request": {"spec": {"model": model}, "content": "x", "torch": "0"}})
        s.close()
    still_serving(model, agent, bystander)


def test_a_status_connection_may_ask_repeatedly(agent):
    s = raw(agent)
    for _ in range(3):
        protocol.send_message(s, {"type": "status"})
        message, _ = protocol.recv_message(s, protocol.MAX_REPLY_BYTES)
        assert message["type"] == "status" and message["phase"] == "ready"
    s.close()


def test_files_the_agent_read_are_vouched_for_by_signature_a_copy_must_send_its_revision(model, agent, tmp_path):
    import shutil

    from weightcache_agent.load.fingerprint import engine_request

    def ask(request: dict) -> dict:
        s = raw(agent)
        protocol.send_message(s, {"type": "attach", "role": "primary", "group": None, "request": request})
        reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
        for fd in fds:
            os.close(fd)
        s.close()
        return reply

    assert "content" not in engine_request(CacheSpec(model=model))
    assert ask(engine_request(CacheSpec(model=model)))["type"] == "manifest"
    copy = str(shutil.copytree(model, tmp_path / os.path.basename(model)))  # same bytes, other inodes
    refused = ask(engine_request(CacheSpec(model=copy)))
    assert (refused["type"], refused["code"]) == ("error", "revision_required"), refused
    assert ask(engine_request(CacheSpec(model=copy), with_revision=True))["type"] == "manifest"
    with open(os.path.join(copy, "config.json"), "a") as f:
        f.write(" ")  # an edit: signature and content identity both change
    changed = ask(engine_request(CacheSpec(model=copy), with_revision=True))
    assert changed["code"] == "fingerprint_mismatch" and changed["engine_fields"]["content"] != changed["fields"]["content"]


@pytest.mark.parametrize("sent,expected", [
    (protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, 0, 17) + b'{"type":"status"}', True),
    (protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, 0, 17) + b'{"type":"sta', False),  # not whole yet
    (protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, 0, 17) + b'{"type":"attach"}', False),
    (protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION + 1, 0, 17) + b'{"type":"status"}', False),
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False),
    (b"", False),
])
def test_a_waiting_status_request_is_recognised_without_reading_it(sent, expected):
    """The agent routes a connection by its first frame only when that frame is a whole status
    request already there; the peek never blocks and leaves every byte to be read."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        theirs.sendall(sent)
        t0 = time.monotonic()
        assert protocol.waiting_status_request(ours) is expected
        assert time.monotonic() - t0 < 0.5
        ours.setblocking(False)
        left = ours.recv(4096) if sent else b""
        assert left == sent
    finally:
        ours.close()
        theirs.close()


def test_nesting_is_capped_for_what_peers_send_and_not_for_the_agents_manifest():
    deep = b'{"type":"status","x":' + b"[" * 40 + b"]" * 40 + b"}"
    wide = b'{"type":"manifest","forms":[' + b",".join([b'["bfloat16",[4,4],[4,1]]'] * 200) + b"]}"
    with pytest.raises(ProtocolError, match="nests too deeply"):
        protocol.decode_body(deep)
    assert protocol.decode_body(deep, max_depth=None)["type"] == "status"
    assert len(protocol.decode_body(wide)["forms"]) == 200  # many brackets, shallow: walked and accepted
