"""The node supervisor's HTTP port under abuse, and the socket bounds it hands its workers.

The supervisor runs as `weightcache agent --socket-dir ...` (a real process). An attacker
on the pod network opens a thousand connections that send their request a byte at a time,
or hang up mid-request: the supervisor's thread count stays flat, `/healthz` answers at
once throughout, and a well-behaved engine (root) attaches and reads the checkpoint's
bytes. `/status` gives pod identities only to the holder of the control token. And the
per-uid caps and scrub interval given to the supervisor reach every worker: a second uid
is held to its share of leases on a worker's socket.
"""
from __future__ import annotations

import http.client
import json
import os
import select
import shutil
import socket
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import pytest

from abuse_fixtures import right_bytes
from abuse_fixtures import disk  # noqa: F401 (fixture)
from security_fixtures import ATTACKER, AsAttacker, needs_root
from test_supervisor import Node
from weightcache_agent import protocol
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.spec import CacheSpec
from weightcache_agent.testing.synthetic import write_llama_checkpoint
from test_supervisor import SHAPE

TOKEN = "t" * 40


@pytest.fixture(scope="module")
def base():
    path = tempfile.mkdtemp(prefix="wc-http-", dir="/tmp")
    os.chmod(path, 0o755)  # the second uid reaches the sockets through it
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def model(base) -> str:
    return write_llama_checkpoint(os.path.join(base, "model"), SHAPE)


@pytest.fixture(scope="module")
def node(model, base):
    token_file = os.path.join(base, "control-token")
    with open(token_file, "w") as f:
        f.write(TOKEN)
    node = Node(model, os.path.join(base, "node"), "--control-token-file", token_file, "--socket-group",
                str(ATTACKER), "--max-leases", "8", "--max-leases-per-uid", "2", "--scrub-interval", "7",
                tp_size=1)
    node.wait(lambda s: s["phase"] == "Ready", "Ready node")
    yield node
    node.stop()


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def timed_get(node: Node, path: str, token: str | None = None) -> tuple[int, Any, float]:
    began = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        return response.status, json.loads(response.read()), time.monotonic() - began
    finally:
        conn.close()


def test_a_thousand_slow_connections_cost_no_threads_and_probes_still_answer(node, disk, time_bar):
    before = threads(node.proc.pid)
    slow, tooks = [], []
    try:
        for i in range(1000):
            s = socket.create_connection(("127.0.0.1", node.port), timeout=5)
            s.send(b"G")  # a request that never finishes
            slow.append(s)
            if i % 100 == 99:
                code, body, took = timed_get(node, "/healthz")
                assert code == 200 and body["ok"], (i, code, body, took)
                tooks.append(took)
        time.sleep(0.5)
        assert threads(node.proc.pid) <= before + 2, "threads grew with slow connections"
        for _ in range(5):
            code, _, took = timed_get(node, "/healthz")
            assert code == 200, code
            tooks.append(took)
        time_bar("the slowest /healthz among 1,000 slow connections", max(tooks), 1.0)
        # A well-behaved engine attaches and reads the right bytes meanwhile.
        status = node.status()
        right_bytes(SimpleNamespace(model=node.model, socket=status["ranks"][0]["socket"]), disk)
    finally:
        for s in slow:
            s.close()
    # Clients that hang up mid-request, or mid-reply (reset, not closed), are debug lines.
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", node.port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.send(b"GET /metrics HTTP/1.0\r\n\r\n")
        s.close()
    assert timed_get(node, "/healthz")[0] == 200
    assert threads(node.proc.pid) <= before + 2
    assert "Traceback" not in node.log(), node.log()[-3000:]


def test_oversized_and_slow_requests_are_closed(node):
    big = socket.create_connection(("127.0.0.1", node.port), timeout=5)
    big.sendall(b"GET /status HTTP/1.0\r\nX: " + b"a" * 20000)
    assert big.recv(100) == b"", "a request head over 16 KiB is closed unanswered"
    big.close()
    dribble = socket.create_connection(("127.0.0.1", node.port), timeout=15)
    began = time.monotonic()
    for byte in b"GET /healthz HTTP/1.0\r\nX-Slow: " + b"a" * 100:
        try:
            dribble.send(bytes([byte]))  # each byte well inside any per-read timeout
        except OSError:
            break
        time.sleep(0.5)
        if select.select([dribble], [], [], 0)[0] and dribble.recv(1) == b"":
            break
    else:
        pytest.fail("a request dribbled in over a minute was never cut off")
    assert 9 < time.monotonic() - began < 13, "the whole request has one deadline, however its bytes come"
    dribble.close()


@needs_root
def test_status_shows_pod_identities_only_with_the_control_token_and_workers_get_the_caps(node, disk):
    sock = node.status()["ranks"][0]["socket"]
    request = engine_request(CacheSpec(model=node.model))

    def take(command: dict) -> dict:
        state = take.__dict__.setdefault("held", [])
        codes = []
        for i in range(command["tries"]):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(command["socket"])
            protocol.send_message(s, {"type": "attach", "role": "primary", "group": f"ns/g{i}",
                                      "pod": {"namespace": "ns", "name": f"engine-{i}", "uid": f"uid-{i}"},
                                      "request": command["request"]})
            reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
            for fd in fds:
                os.close(fd)
            codes.append(reply.get("code") or reply["type"])
            (state.append(s) if reply["type"] == "manifest" else s.close())
        return {"codes": codes}

    other = AsAttacker(take)
    try:
        # --max-leases-per-uid 2 given to the supervisor holds on the worker's socket.
        assert other.ask(socket=sock, request=request, tries=4)["codes"] == ["manifest"] * 2 + ["too_many_leases"] * 2
        status = node.wait(lambda s: s["ranks"][0]["clients"] == 2, "two leases")
        assert status["ranks"][0]["leases"] == [{"role": "primary"}, {"role": "primary"}], \
            "pods, groups and pids need the control token"
        assert "engine-" not in json.dumps(status)
        code, full, _ = timed_get(node, "/status", token=TOKEN)
        assert code == 200
        assert sorted(lease["pod"]["name"] for lease in full["ranks"][0]["leases"]) == ["engine-0", "engine-1"]
        assert all(lease["pid"] and lease["group"] for lease in full["ranks"][0]["leases"])
        assert timed_get(node, "/status", token="wrong" * 8)[1]["ranks"][0]["leases"] == [{"role": "primary"}] * 2
        # Root, another uid, still attaches and reads the right bytes.
        right_bytes(SimpleNamespace(model=node.model, socket=sock), disk)
    finally:
        other.close()
    with open(f"/proc/{node.status()['ranks'][0]['pid']}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert argv[argv.index(b"--scrub-interval") + 1] == b"7.0"
    assert argv[argv.index(b"--max-leases-per-uid") + 1] == b"2"
