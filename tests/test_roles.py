"""Roles on a node with two replicas of a cache, as engine pods see it: real supervisor,
real workers, engines that find their socket from the environment the operator injects.

- `--replicas 2` runs one worker per device and reports each replica with its devices;
- an engine with only `WEIGHTCACHE_SOCKET_DIR` and `WEIGHTCACHE_DEVICES` attaches to the
  socket of its device, and its pod identity shows in the node's /status;
- role `auto`: the first engine of a group is primary, the next a standby;
- a planned switchover promotes the named standby and demotes the primary in one
  acknowledged step; an unprivileged peer cannot ask for one; over HTTP only with the
  control token; `weightcache switchover` does the same from the node.
"""
from __future__ import annotations

import http.client
import json
import os
import pwd
import shutil
import signal
import socket as socket_module
import subprocess
import sys
import threading
import time

import pytest

from agent_fixtures import Probe, in_child_as, wait_for
from weightcache_agent import CacheSpec, agent_status, protocol
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

TOKEN = "a-control-token-for-tests"
SHAPE = LlamaShape(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    work = tmp_path_factory.mktemp("roles")
    model = write_llama_checkpoint(str(work / "model"), SHAPE, seed=3)
    socket_dir = f"/tmp/wc-roles-{os.getpid()}"
    port_file = str(work / "port")
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket-dir", socket_dir,
                             "--backend", "cpu", "--tp-size", "1", "--replicas", "2", "--http-port", "0",
                             "--http-host", "127.0.0.1", "--port-file", port_file,
                             "--control-token-file", str(token_file),
                             # nobody's group may connect: switchover's own privilege check is what is tested
                             "--socket-group", str(nobody_gid())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.exists(port_file) or proc.poll() is not None, 30, "the HTTP port")
        assert proc.poll() is None, proc.stderr.read()
        port = int(open(port_file).read())

        def status() -> dict:
            """What the operator reads: with the control token, the leases name their pods."""
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/status", headers={"Authorization": f"Bearer {TOKEN}"})
            body = json.loads(conn.getresponse().read())
            conn.close()
            return body

        wait_for(lambda: status()["phase"] == "Ready", 60, "a ready node")
        status.port = port
        yield model, socket_dir, status
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(socket_dir, ignore_errors=True)


def engine(model: str, socket_dir: str, device: str, pod: str, role: str = "auto", group: str = "ns/chat-0") -> Probe:
    env = {"WEIGHTCACHE_SOCKET_DIR": socket_dir, "WEIGHTCACHE_DEVICES": device, "WEIGHTCACHE_ROLE": role,
           "WEIGHTCACHE_GROUP": group, "WEIGHTCACHE_POD_NAMESPACE": "ns", "WEIGHTCACHE_POD_NAME": pod,
           "WEIGHTCACHE_POD_UID": f"uid-{pod}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return Probe(model, "-")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def nobody_gid() -> int:
    try:
        return pwd.getpwnam("nobody").pw_gid
    except KeyError:
        return 65534


def switchover(socket: str, group: str, to_pod: str, as_user: str | None = None) -> dict:
    if as_user is None:
        conn = protocol.connect(socket)
        try:
            conn.settimeout(5)
            protocol.send_message(conn, {"type": "switchover", "group": group, "to_pod": to_pod})
            return protocol.recv_message(conn, protocol.MAX_REPLY_BYTES)[0]
        finally:
            conn.close()
    user = pwd.getpwnam(as_user)

    def ask() -> dict:
        conn = protocol.connect(socket)
        conn.settimeout(5)
        protocol.send_message(conn, {"type": "switchover", "group": group, "to_pod": to_pod})
        try:
            return protocol.recv_message(conn, protocol.MAX_REPLY_BYTES)[0]
        except (EOFError, OSError, protocol.ProtocolError) as e:
            return {"type": "closed", "error": str(e)}

    return in_child_as(user.pw_uid, user.pw_gid, ask, lambda e: {"type": "child-failed", "error": repr(e)})


def test_two_replicas_each_with_its_own_device_and_socket(node):
    _, socket_dir, status = node
    body = status()
    assert [r["gpus"] for r in body["replicas"]] == [["cpu-0"], ["cpu-1"]]
    assert all(r["phase"] == "Ready" for r in body["replicas"])
    assert {"cpu-0.sock", "cpu-1.sock"} <= set(os.listdir(socket_dir))


def test_auto_roles_pod_identity_and_a_planned_switchover(node, time_bar):
    model, socket_dir, status = node
    first = engine(model, socket_dir, "cpu-1", "chat-0-0")
    second = engine(model, socket_dir, "cpu-1", "chat-0-1")
    other = engine(model, socket_dir, "cpu-0", "chat-1-0", group="ns/chat-1")
    try:
        assert (first.hello["role"], second.hello["role"], other.hello["role"]) == ("primary", "standby", "primary")

        def leases(device: str) -> dict[str, str]:
            rank = next(r for r in status()["ranks"] if r["device"] == device)
            return {lease["pod"]["name"]: lease["role"] for lease in rank["leases"]}

        wait_for(lambda: leases("cpu-1") == {"chat-0-0": "primary", "chat-0-1": "standby"}, 10, "leases in /status")
        # The other replica's engine is on its own socket.
        wait_for(lambda: leases("cpu-0") == {"chat-1-0": "primary"}, 10, "the other replica's lease")

        started = time.perf_counter()
        reply = switchover(os.path.join(socket_dir, "cpu-1.sock"), "ns/chat-0", "chat-0-1")
        assert reply["type"] == "switched" and reply["ok"], reply
        assert reply["primary"]["pod"]["name"] == "chat-0-1"
        assert [d["pod"]["name"] for d in reply["demoted"]] == ["chat-0-0"]
        time_bar("a planned switchover's reply", time.perf_counter() - started, 1.0)
        wait_for(lambda: second.ask("status")["role"] == "primary" and first.ask("status")["role"] == "standby", 5,
                 "engines told of the switch")
        assert second.ask("status")["events"] == [{"event": "promote", "role": "primary"}]
        assert first.ask("status")["events"] == [{"event": "demote", "role": "standby"}]
        wait_for(lambda: leases("cpu-1") == {"chat-0-0": "standby", "chat-0-1": "primary"}, 10, "roles in /status")

        missing = switchover(os.path.join(socket_dir, "cpu-1.sock"), "ns/chat-0", "no-such-pod")
        assert missing["type"] == "error" and missing["code"] == "no_such_standby"
    finally:
        for probe in (first, second, other):
            probe.close()


def raw_lease(socket: str, model: str, role: str, group: str, pod: str) -> socket_module.socket:
    """An engine's lease spoken by hand: attach, drop the arena's fd, keep the connection."""
    conn = protocol.connect(socket)
    conn.settimeout(10)
    protocol.send_message(conn, {"type": "attach", "pid": os.getpid(), "role": role, "group": group,
                                 "pod": {"namespace": "ns", "name": pod, "uid": f"uid-{pod}"},
                                 "request": engine_request(CacheSpec(model=model))})
    reply, fds = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
    for fd in fds:
        os.close(fd)
    assert reply["type"] == "manifest" and reply["role"] == role, reply
    return conn


def test_a_group_shows_a_primary_throughout_a_switchover(node):
    """Until the successor acknowledges its promotion, the old primary has not been told to step
    down and still serves: status says so, never a group with no primary."""
    model, socket_dir, _ = node
    sock, group = os.path.join(socket_dir, "cpu-0.sock"), "ns/chat-9"
    old = raw_lease(sock, model, "primary", group, "slow-0")
    new = raw_lease(sock, model, "standby", group, "slow-1")
    replies: list[dict] = []
    try:
        asker = threading.Thread(target=lambda: replies.append(switchover(sock, group, "slow-1")))
        asker.start()
        told, _ = protocol.recv_message(new, protocol.MAX_REPLY_BYTES)
        assert told["type"] == "promote" and told["planned"], told

        def roles() -> dict[str, str]:
            return {c["pod"]["name"]: c["role"] for c in agent_status(sock)["clients"] if c["group"] == group}

        assert roles() == {"slow-0": "primary", "slow-1": "promoting"}  # the successor does not serve yet
        old.settimeout(0.2)
        with pytest.raises(socket_module.timeout):  # and the old primary has not been told anything
            protocol.recv_message(old, protocol.MAX_REPLY_BYTES)
        protocol.send_message(new, {"type": "promoted", "group": group})
        asker.join(10)
        assert replies and replies[0]["ok"], replies
        old.settimeout(10)
        assert protocol.recv_message(old, protocol.MAX_REPLY_BYTES)[0]["type"] == "demote"
        assert roles() == {"slow-0": "standby", "slow-1": "primary"}
    finally:
        old.close()
        new.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another uid")
def test_an_unprivileged_peer_cannot_switch_over(node):
    model, socket_dir, status = node
    os.chmod(socket_dir, 0o755)
    sock = os.path.join(socket_dir, "cpu-0.sock")
    os.chmod(sock, 0o777)  # let it connect: the check under test is the agent's, not the file mode's
    primary = engine(model, socket_dir, "cpu-0", "x-0", group="ns/x")
    standby = engine(model, socket_dir, "cpu-0", "x-1", group="ns/x")
    try:
        reply = switchover(sock, "ns/x", "x-1", as_user="nobody")
        assert reply["type"] == "error" and "privileged" in reply["message"], reply
        assert (primary.ask("status")["role"], standby.ask("status")["role"]) == ("primary", "standby")
    finally:
        primary.close()
        standby.close()


def post_switchover(port: int, body: dict, token: str | None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn.request("POST", "/switchover", json.dumps(body), headers)
    response = conn.getresponse()
    answer = response.status, json.loads(response.read())
    conn.close()
    return answer


def test_switchover_over_http_needs_the_token_and_the_cli_switches_back(node):
    model, socket_dir, status = node
    primary = engine(model, socket_dir, "cpu-0", "h-0", group="ns/h")
    standby = engine(model, socket_dir, "cpu-0", "h-1", group="ns/h")
    try:
        wait_for(lambda: any(lease["group"] == "ns/h" for r in status()["ranks"] for lease in r["leases"]), 10,
                 "the group in /status")
        for token in (None, "wrong-token-of-some-length"):
            code, body = post_switchover(status.port, {"group": "ns/h", "toPod": "h-1"}, token)
            assert code == 401, body
        assert standby.ask("status")["role"] == "standby"
        code, body = post_switchover(status.port, {"group": "ns/h", "toPod": "h-1"}, TOKEN)
        assert code == 200 and body["ok"], body
        assert [r["primary"]["pod"]["name"] for r in body["ranks"]] == ["h-1"]
        wait_for(lambda: standby.ask("status")["role"] == "primary", 5, "the promotion")
        code, body = post_switchover(status.port, {"group": "ns/nope", "toPod": "h-1"}, TOKEN)
        assert code == 409 and "no engine of group" in body["message"]
        code, body = post_switchover(status.port, {"group": ["not", "a", "string"]}, TOKEN)
        assert code == 400

        cli = subprocess.run([sys.executable, "-m", "weightcache_agent", "switchover", "--socket-dir", socket_dir,
                              "--devices", "cpu-0", "--group", "ns/h", "--to-pod", "h-0"],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert "h-0 is primary on 1 rank(s)" in cli.stdout
        wait_for(lambda: primary.ask("status")["role"] == "primary" and standby.ask("status")["role"] == "standby", 5,
                 "the switch back")
        refused = subprocess.run([sys.executable, "-m", "weightcache_agent", "switchover", "--socket-dir", socket_dir,
                                  "--devices", "cpu-0", "--group", "ns/h", "--to-pod", "nobody-here"],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "has no standby 'nobody-here'" in refused.stderr
        assert "Traceback" not in refused.stderr
    finally:
        primary.close()
        standby.close()
