"""The node supervisor against a neighbour and an absent token, as an attacker would try it.

Real supervisors (`weightcache agent --socket-dir ...`) in subprocesses, real sockets, real HTTP:

- a second node agent pointed at a socket directory another agent serves must, when it stops,
  leave that agent's socket and lock file alone (its own worker never bound them);
- a socket directory the kubelet made 0755 is narrowed to 0750;
- `/status` without a usable control token shows no lease holders (fails closed).
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import pytest

from weightcache_agent import agent_status, protocol
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.spec import CacheSpec
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

SHAPE = LlamaShape(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256)


class Node:
    """`weightcache agent --socket-dir ...` (tp 1, cpu) as a subprocess, asked over HTTP."""

    def __init__(self, model: str, socket_dir: str, workdir: str, *extra: str):
        self.socket_dir = socket_dir
        self.port_file = os.path.join(workdir, "port")
        self.log_path = os.path.join(workdir, "node.log")
        os.makedirs(workdir, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket-dir", socket_dir,
                 "--tp-size", "1", "--devices", "all", "--backend", "cpu", "--http-host", "127.0.0.1",
                 "--http-port", "0", "--port-file", self.port_file, "--node-name", "node-a", *extra],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self._port: int | None = None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    @property
    def port(self) -> int:
        deadline = time.monotonic() + 60
        while self._port is None:
            try:
                with open(self.port_file) as f:
                    self._port = int(f.read())
            except (FileNotFoundError, ValueError):
                assert self.proc.poll() is None, f"supervisor exited {self.proc.returncode}:\n{self.log()}"
                assert time.monotonic() < deadline, f"supervisor never listened:\n{self.log()}"
                time.sleep(0.05)
        return self._port

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path, headers=headers or {})
            response = conn.getresponse()
            return response.status, response.read().decode()
        finally:
            conn.close()

    def status(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        code, body = self.get("/status", headers)
        assert code == 200, body
        return json.loads(body)

    def wait(self, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"supervisor exited {self.proc.returncode}:\n{self.log()}"
            status = self.status()
            if predicate(status):
                return status
            assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s: {status}\n{self.log()}"
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def workdir():
    path = tempfile.mkdtemp(prefix="wc-snode-", dir="/tmp")  # short: socket paths are limited to 107 bytes
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def model(workdir) -> str:
    return write_llama_checkpoint(os.path.join(workdir, "model"), SHAPE)


def test_stopping_a_colliding_node_agent_leaves_the_serving_agents_socket(model, workdir):
    """Two caches' agents on one socket directory: the second's worker finds the path served and
    exits 3. Stopping the second supervisor must not remove the first's live socket or lock file
    (which would let the second, restarted, bind the path and serve the first's engines)."""
    sockets = os.path.join(workdir, "shared-sockets")
    victim = Node(model, sockets, os.path.join(workdir, "victim"))
    attacker = None
    try:
        ready = victim.wait(lambda s: s["phase"] == "Ready", "Ready victim")
        sock = ready["ranks"][0]["socket"]
        lock = os.path.join(sockets, "." + os.path.basename(sock) + ".lock")
        assert os.path.exists(lock), os.listdir(sockets)
        served_by = agent_status(sock)["pid"]

        attacker = Node(model, sockets, os.path.join(workdir, "attacker"))
        deadline = time.monotonic() + 60
        while "another agent is already serving" not in attacker.log():
            assert time.monotonic() < deadline, attacker.log()
            assert attacker.proc.poll() is None, attacker.log()
            time.sleep(0.1)
        assert attacker.stop() == 0, attacker.log()

        assert stat.S_ISSOCK(os.lstat(sock).st_mode), "the serving agent's socket was removed"
        assert os.path.exists(lock), "the serving agent's lock file was removed"
        assert agent_status(sock)["pid"] == served_by
        assert victim.status()["phase"] == "Ready"
    finally:
        if attacker is not None:
            attacker.stop()
        assert victim.stop() == 0
    # The victim's own stop still cleans up what it bound.
    assert not os.path.lexists(os.path.join(sockets, "cpu-0.sock")), os.listdir(sockets)


def _hold_lease(sock: str, model: str) -> socket.socket:
    """An engine's lease naming a group and a pod: what `/status` must not show to just anyone."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(sock)
    protocol.send_message(s, {"type": "attach", "role": "primary", "group": "ns/secret-group",
                              "pod": {"namespace": "ns", "name": "secret-engine", "uid": "uid-1"},
                              "request": engine_request(CacheSpec(model=model))})
    reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
    for fd in fds:
        os.close(fd)
    assert reply["type"] == "manifest", reply
    return s


@pytest.mark.parametrize("token", ["absent", "short", "none-given"])
def test_status_without_a_usable_control_token_shows_no_lease_holders(model, workdir, token):
    """The token file comes from an optional Secret: while it is absent (or too short to be a token),
    an unauthenticated `/status` must not show pods, groups or pids; a usable token, once it appears,
    shows them to its holder alone."""
    base = os.path.join(workdir, f"token-{token}")
    token_file = os.path.join(base, "control-token")
    os.makedirs(base, exist_ok=True)
    if token == "short":
        with open(token_file, "w") as f:
            f.write("fifteen-chars!!")
    extra = () if token == "none-given" else ("--control-token-file", token_file)
    node = Node(model, os.path.join(base, "sockets"), base, *extra)
    lease = None
    try:
        ready = node.wait(lambda s: s["phase"] == "Ready", "Ready node")
        lease = _hold_lease(ready["ranks"][0]["socket"], model)
        status = node.wait(lambda s: s["ranks"][0]["clients"] == 1, "one lease")
        assert status["ranks"][0]["leases"] == [{"role": "primary"}], status["ranks"][0]["leases"]
        shown = json.dumps(status)
        assert "secret-engine" not in shown and "secret-group" not in shown, shown
        # Guessing at the token gets nothing either, whatever is offered.
        _, body = node.get("/status", {"Authorization": "Bearer fifteen-chars!!"})
        assert "secret-engine" not in body
        _, body = node.get("/status", {"Authorization": "Bearer "})
        assert "secret-engine" not in body
        if token == "absent":  # the Secret arrives: its holder sees the pods, others still do not
            with open(token_file, "w") as f:
                f.write("a-real-control-token-0123456789")
            full = node.status({"Authorization": "Bearer a-real-control-token-0123456789"})
            assert full["ranks"][0]["leases"][0]["pod"]["name"] == "secret-engine"
            assert "secret-engine" not in node.get("/status")[1]
    finally:
        if lease is not None:
            lease.close()
        assert node.stop() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")
def test_socket_directory_the_kubelet_made_0755_is_narrowed_to_0750(model, workdir):
    """`hostPath: DirectoryOrCreate` makes the directory 0755, root's: before, every local user could
    list and reach the sockets in it. The node agent makes it 0750 with the socket group, so a
    local user outside that group cannot even traverse it, while a member still connects."""
    from agent_fixtures import in_child_as

    sockets = os.path.join(workdir, "kubelet-made")
    os.makedirs(sockets)
    os.chmod(sockets, 0o755)  # as the kubelet leaves it
    node = Node(model, sockets, os.path.join(workdir, "kubelet-node"), "--socket-group", "65534")
    try:
        ready = node.wait(lambda s: s["phase"] == "Ready", "Ready node")
        st = os.stat(sockets)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o750, 65534), oct(st.st_mode)
        sock = ready["ranks"][0]["socket"]

        def look() -> dict[str, Any]:
            out: dict[str, Any] = {}
            try:
                out["listing"] = os.listdir(sockets)
            except OSError as e:
                out["listing"] = e.errno
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(sock)
                out["connect"] = "ok"
            except OSError as e:
                out["connect"] = e.errno
            finally:
                s.close()
            return out

        def failed(e: BaseException) -> dict[str, Any]:
            return {"error": repr(e)}

        import errno
        outsider = in_child_as(12345, 12345, look, failed)
        assert outsider == {"listing": errno.EACCES, "connect": errno.EACCES}, outsider
        member = in_child_as(65534, 65534, look, failed)  # the socket group's member still gets in
        assert member["connect"] == "ok", member
    finally:
        assert node.stop() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")
def test_a_flood_of_refused_connections_is_counted_not_logged_line_by_line(model, workdir):
    """A uid the socket policy does not admit, reaching the socket (opened up by hand, chmod 666),
    connects in a loop. Before, every refusal wrote a WARNING line (158k lines in 10 s); now the
    log says it at most once a second with a count, and the metric counts every one."""
    from prometheus_client.parser import text_string_to_metric_families
    from security_fixtures import AsAttacker

    sockets = os.path.join(workdir, "flood-sockets")
    os.makedirs(sockets)
    with open(os.path.join(sockets, "README"), "w") as f:  # not the agent's own directory: its mode is left alone
        f.write("shared\n")
    node = Node(model, sockets, os.path.join(workdir, "flood"))
    try:
        sock = node.wait(lambda s: s["phase"] == "Ready", "Ready node")["ranks"][0]["socket"]
        os.chmod(sock, 0o666)

        def flood(command: dict) -> dict:
            done, deadline = 0, time.monotonic() + command["seconds"]
            while time.monotonic() < deadline:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(command["socket"])
                    done += 1
                except OSError:
                    pass
                finally:
                    s.close()
            return {"connects": done}

        attacker = AsAttacker(flood)
        try:
            t0 = time.monotonic()
            connects = attacker.ask(socket=sock, seconds=3.0)["connects"]
            seconds = time.monotonic() - t0
        finally:
            attacker.close()
        assert connects >= 100, connects

        def refused() -> float:
            _, body = node.get("/metrics")
            for family in text_string_to_metric_families(body):
                for sample in family.samples:
                    if sample.name == "weightcache_refused_connections_total" and sample.labels["reason"] == "forbidden":
                        return sample.value
            return -1.0

        deadline = time.monotonic() + 30
        while refused() < connects:
            assert time.monotonic() < deadline, (refused(), connects)
            time.sleep(0.2)
        assert refused() == connects
        time.sleep(1.2)  # the last held-back count is said with the next refusal, not later
        lines = [l for l in node.log().splitlines() if "not allowed on this socket" in l]
        assert 1 <= len(lines) <= seconds + 3, (len(lines), connects)
        assert agent_status(sock)["phase"] == "ready"  # root still gets answers
    finally:
        assert node.stop() == 0
