"""The agent's socket as an attacker sees it: no poisoned weights, no file reads, no way in without the policy.

Every test runs real agent processes on real sockets; attackers are plain sockets or
processes under another uid. Each ends by checking that the agent still hands out
exactly the checkpoint's bytes.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
import time

import pytest

from abuse_fixtures import LoggedAgent, ask, no_traceback, raw, serves_correctly
from abuse_fixtures import disk, model  # noqa: F401 (fixtures)
from agent_fixtures import Probe, in_child_as, wait_for
from weightcache_agent import protocol
from weightcache_agent.errors import CheckpointError
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.load.sharding import _load_rules_file
from weightcache_agent.serve.agent import sidecar_path
from weightcache_agent.spec import CacheSpec

OTHER_UID = 54321  # no such user needs to exist: the kernel only checks numbers


def sealed_memfd(size: int, fill: int) -> int:
    fd = os.memfd_create("attacker", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    os.pwrite(fd, bytes([fill]) * size, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def answers(path: str) -> bool:
    try:
        raw(path).close()
        return True
    except OSError:
        return False


# -- critical: nobody but an engine that held a lease hands the agent an arena ---------------------------------


def test_a_foreign_rejoin_is_refused_and_the_served_weights_stay_correct(model, disk, tmp_path):
    sock = str(tmp_path / "run" / "agent.sock")
    first = LoggedAgent(model, sock, str(tmp_path / "first.log"))
    status = first.wait_ready()
    fields, layout_hash, size = status["fields"], status["layout_hash"], status["arena_bytes"]
    engine = Probe(model, sock)  # a real engine: it holds a lease and the token that proves it
    second = None
    try:
        state = os.stat(sidecar_path(sock, "state"))
        assert stat.S_IMODE(state.st_mode) == 0o600, "the state file is readable by others"
        first.proc.kill()
        first.proc.wait()
        second = LoggedAgent(model, sock, str(tmp_path / "second.log"), "--adopt-wait", "10")
        # The attacker knocks as soon as the socket is back, like the engine does.
        wait_for(lambda: answers(sock), 60, "the restarted agent's socket")
        offers = {
            "fields={} to learn the fields": dict(fields={}, layout_hash="", size=size),
            "everything right but the token": dict(fields=fields, layout_hash=layout_hash, size=size, token="0" * 64),
            "a 4 KiB arena": dict(fields=fields, layout_hash=layout_hash, size=4096, token="f" * 64),
        }
        for what, offer in offers.items():
            fd = sealed_memfd(offer["size"], 0x7F)
            try:
                message = {"type": "rejoin", "pid": 1, "role": "primary", "group": None, "fields": offer["fields"],
                           "fingerprint": status["fingerprint"], "layout_hash": offer["layout_hash"],
                           "arenas": [{"index": 0, "size": offer["size"], "backend": "cpu", "device": "cpu-0"}]}
                if "token" in offer:
                    message["token"] = offer["token"]
                reply = ask(sock, message, [fd])
            finally:
                os.close(fd)
            assert reply["type"] == "error" and reply["code"] == "rejoin_refused", (what, reply)
            assert set(reply) == {"type", "code", "message"}, f"{what}: the refusal tells more than no: {reply}"
        status = second.wait_ready()
        wait_for(lambda: engine.ask("status")["agent_alive"], 10, "the real engine's rejoin")
        assert status["adopted"] is True, "the real engine's arena was not adopted"
        assert [c["pid"] for c in second.status()["clients"]] == [engine.hello["pid"]]
        serves_correctly(second, disk, leases_left=1)
        assert engine.ask("verify") == {"identical": True}
        assert second.log().count("refused a rejoin") == len(offers)
        no_traceback(second)
    finally:
        engine.close()
        if second is not None:
            second.stop()
        first.stop()


# -- critical: the agent never opens a path a client names ---------------------------------------------------


@pytest.fixture(scope="module")
def agent(model, tmp_path_factory):
    base = tmp_path_factory.mktemp("sec")
    proc = LoggedAgent(model, str(base / "run" / "agent.sock"), str(base / "agent.log"), "--handshake-timeout", "1")
    proc.wait_ready()
    yield proc
    proc.stop()


def attach_request(model: str, sharding: str) -> dict:
    request = engine_request(CacheSpec(model=model))
    request["spec"]["sharding"] = sharding
    return {"type": "attach", "role": "primary", "group": None, "request": request}


def test_a_client_named_sharding_path_is_never_opened(model, disk, agent, tmp_path):
    fifo = str(tmp_path / "rules.fifo")
    os.mkfifo(fifo)
    secret = tmp_path / "rules.yaml"
    secret.write_text("preset: llama\nrules: []\n# SECRET-LINE-42\n")
    old = time.time() - 3600
    os.utime(secret, (old - 3600, old))  # atime before mtime: any read moves atime (relatime)
    t0 = time.monotonic()
    replies = {path: ask(agent.socket, attach_request(model, path))
               for path in (fifo, str(secret), str(tmp_path / "missing.yaml"), "/etc/shadow")}
    assert time.monotonic() - t0 < 5, "an attach naming a FIFO blocked: the agent opened it"
    with pytest.raises(OSError) as opened:  # ENXIO: nobody has the FIFO open for reading
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert opened.value.errno == errno.ENXIO
    assert os.stat(secret).st_atime == pytest.approx(old - 3600), "the agent read the client's file"
    messages = {json.dumps(r, sort_keys=True) for r in replies.values()}
    assert len(messages) == 1, f"replies differ by path, so they reveal what exists: {replies}"
    reply = next(iter(replies.values()))
    assert reply["code"] == "bad_request" and "plan identity" in reply["message"]
    assert "SECRET" not in json.dumps(reply) and "root:" not in json.dumps(reply)
    # the atime check itself works here: reading the file does move it
    secret.read_text()
    assert os.stat(secret).st_atime > old - 3600
    serves_correctly(agent, disk)
    no_traceback(agent)


def test_an_engine_with_a_rules_file_attaches_by_its_plan_identity(model, disk, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("preset: llama\nrules:\n  - {pattern: 'norm', mode: replicated}\n")
    sock = str(tmp_path / "run" / "agent.sock")
    agent = LoggedAgent(model, sock, str(tmp_path / "agent.log"), "--sharding", str(rules))
    try:
        assert agent.wait_ready()["fields"]["sharding"].startswith("rules:")
        request = engine_request(CacheSpec(model=model, sharding=str(rules)))
        assert request["sharding_identity"] == agent.status()["fields"]["sharding"]
        assert ask(sock, {"type": "attach", "role": "primary", "group": None, "request": request})["type"] == "manifest"
        request["sharding_identity"] = "rules:0123456789abcdef+preset:llama"  # another file's identity
        reply = ask(sock, {"type": "attach", "role": "primary", "group": None, "request": request})
        assert reply["code"] == "fingerprint_mismatch"
        no_traceback(agent)
    finally:
        agent.stop()


def test_rules_files_are_capped_and_refuse_yaml_aliases(model, tmp_path):
    bomb = tmp_path / "bomb.yaml"
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        lines.append(f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [*{prev},*{prev},*{prev},*{prev},*{prev},*{prev},"
                     f"*{prev},*{prev},*{prev}]")
    bomb.write_text("\n".join(lines) + "\nrules: []\n")
    assert bomb.stat().st_size < 1024
    checkpoint = open_checkpoint(model)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match="aliases are not allowed"):
        _load_rules_file(checkpoint, str(bomb))
    assert time.monotonic() - t0 < 1
    big = tmp_path / "big.yaml"
    big.write_text("rules: []\n" + "#" * (300 << 10))
    with pytest.raises(CheckpointError, match="larger than"):
        _load_rules_file(checkpoint, str(big))
    fifo = tmp_path / "rules.fifo"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="regular file"):
        _load_rules_file(checkpoint, str(fifo))


# -- access: modes, the state file, the lock -----------------------------------------------------------------


def test_socket_dir_socket_and_state_file_have_explicit_modes(agent, model, disk):
    sock = agent.socket
    assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o750
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(sidecar_path(sock, "lock")).st_mode) == 0o600
    probe_lease = raw(sock)
    protocol.send_message(probe_lease, attach_request(model, None))
    reply, fds = protocol.recv_message(probe_lease, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
    for fd in fds:
        os.close(fd)
    try:
        assert reply["type"] == "manifest"
        st = os.lstat(sidecar_path(sock, "state"))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    finally:
        probe_lease.close()
    serves_correctly(agent, disk)


def test_a_planted_link_at_the_state_tmp_path_is_not_followed(agent, model, disk, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.chmod(victim, 0o600)
    tmp = sidecar_path(agent.socket, "state") + ".tmp"
    os.symlink(victim, tmp)
    try:
        serves_correctly(agent, disk)  # an attach writes the state file
        assert victim.read_text() == "precious"
        assert not os.path.islink(tmp)
    finally:
        if os.path.islink(tmp):
            os.unlink(tmp)
    no_traceback(agent)


def test_a_deleted_lock_file_does_not_let_a_second_agent_take_the_socket(agent, model, disk, tmp_path):
    os.unlink(sidecar_path(agent.socket, "lock"))
    second = LoggedAgent(model, agent.socket, str(tmp_path / "second.log"))
    try:
        assert second.proc.wait(60) == 3
        assert "another agent is already serving" in second.log()
    finally:
        second.stop()
    assert os.path.exists(agent.socket)
    serves_correctly(agent, disk)


# -- access: a second uid ------------------------------------------------------------------------------------

def connect_as(uid: int, gid: int, path: str) -> dict:
    """Connect to `path` from a forked child running as uid:gid (no supplementary groups); what it saw."""
    def connect() -> dict:
        s = raw(path)
        result = {"connected": True}
        try:
            protocol.send_message(s, {"type": "status"})
            reply, _ = protocol.recv_message(s, protocol.MAX_REPLY_BYTES)
            result.update(reply=reply["type"], code=reply.get("code"))
        except (OSError, EOFError, protocol.ProtocolError):
            result.update(reply=None, code=None)
        return result

    def failed(e: BaseException) -> dict:
        return {"connected": False, "errno": e.errno} if isinstance(e, OSError) else {"error": repr(e)}

    return in_child_as(uid, gid, connect, failed)


def hold_lease_as(uid: int, gid: int, path: str, message: dict) -> tuple[int, dict, int]:
    """A forked child as uid:gid that attaches with `message` and holds the lease until told to go.

    Returns (child pid, its reply, a pipe fd: close it to end the child and its lease).
    """
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.close(go_w)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = raw(path)
            protocol.send_message(s, message)
            reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
            for fd in fds:
                os.close(fd)
            os.write(w, json.dumps({"type": reply["type"], "code": reply.get("code")}).encode() + b"\n")
            os.read(go_r, 1)  # until the parent closes its end
        except BaseException as e:  # noqa: BLE001 -- reported to the parent, never raised in a fork
            os.write(w, json.dumps({"type": "child-failed", "error": repr(e)}).encode() + b"\n")
        os._exit(0)
    os.close(w)
    os.close(go_r)
    with os.fdopen(r) as f:
        reply = json.loads(f.readline())
    return pid, reply, go_w


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a second uid needs root")
def test_a_second_uid_cannot_connect_by_default_and_can_with_the_socket_group(model, disk):
    base = tempfile.mkdtemp(prefix="wc-uid-")
    os.chmod(base, 0o755)  # only the socket directory the agent makes decides
    agents = []
    try:
        closed = LoggedAgent(model, os.path.join(base, "closed", "a.sock"), os.path.join(base, "closed.log"))
        agents.append(closed)
        grouped = LoggedAgent(model, os.path.join(base, "grouped", "a.sock"), os.path.join(base, "grouped.log"),
                              "--socket-group", str(OTHER_UID))
        agents.append(grouped)
        closed.wait_ready()
        grouped.wait_ready()
        refused = connect_as(OTHER_UID, OTHER_UID, closed.socket)
        assert refused == {"connected": False, "errno": errno.EACCES}
        allowed = connect_as(OTHER_UID, OTHER_UID, grouped.socket)
        assert allowed == {"connected": True, "reply": "status", "code": None}
        assert os.stat(grouped.socket).st_gid == OTHER_UID
        assert os.stat(os.path.dirname(grouped.socket)).st_gid == OTHER_UID
        # The agent checks the peer itself, not only the file mode: opened up by hand, still refused.
        os.chmod(os.path.dirname(closed.socket), 0o755)
        os.chmod(closed.socket, 0o666)
        forbidden = connect_as(OTHER_UID, OTHER_UID, closed.socket)
        assert forbidden["connected"] and forbidden["reply"] in ("error", None)
        assert "not allowed on this socket" in closed.log()
        # Off Kubernetes a group is keyed by uid and name: another uid naming it holds a group of its own
        # and takes no role in this one (tests/test_newcomer_groups.py: nor is it promoted in it); the
        # lease's pid is the kernel's.
        request = {"type": "attach", "pid": 1, "role": "primary", "group": "prod",
                   "request": engine_request(CacheSpec(model=model))}
        child, reply, release = hold_lease_as(OTHER_UID, OTHER_UID, grouped.socket, request)
        try:
            assert reply == {"type": "manifest", "code": None}, reply
            (lease,) = grouped.status()["clients"]
            assert (lease["pid"], lease["uid"], lease["group"]) == (child, OTHER_UID, "prod")
            pid, other_reply, other = hold_lease_as(OTHER_UID + 1, OTHER_UID, grouped.socket, request)
            try:
                assert other_reply == {"type": "manifest", "code": None}, other_reply
                roles = {c["uid"]: (c["group"], c["role"]) for c in grouped.status()["clients"]}
                assert roles == {OTHER_UID: ("prod", "primary"), OTHER_UID + 1: ("prod", "primary")}, roles
            finally:
                os.close(other)
                os.waitpid(pid, 0)
        finally:
            os.close(release)
            os.waitpid(child, 0)
        wait_for(lambda: grouped.status()["clients"] == [], 10, "the other uid's lease ending")
        # Root keeps being served by both.
        serves_correctly(closed, disk)
        serves_correctly(grouped, disk)
        for a in agents:
            no_traceback(a)
    finally:
        for a in agents:
            a.stop()
        shutil.rmtree(base, ignore_errors=True)


# -- the node supervisor's HTTP port -------------------------------------------------------------------------


def test_node_http_listens_on_the_pod_ip_only(model, tmp_path):
    import http.client
    import signal
    import subprocess
    import sys

    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if k not in ("WEIGHTCACHE_HTTP_HOST", "POD_IP")}
    env["POD_IP"] = "127.0.0.2"  # a loopback address other than 127.0.0.1 stands in for the pod's IP
    with open(tmp_path / "node.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket-dir",
                                 str(tmp_path / "run"), "--backend", "cpu", "--http-port", "0",
                                 "--port-file", str(port_file)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: port_file.exists() or proc.poll() is not None, 60, "the HTTP port")
        assert proc.poll() is None, (tmp_path / "node.log").read_text()
        port = int(port_file.read_text())
        conn = http.client.HTTPConnection("127.0.0.2", port, timeout=10)
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
        conn.close()
        with pytest.raises(ConnectionRefusedError):  # not every address: only the one it was given
            http.client.HTTPConnection("127.0.0.1", port, timeout=10).request("GET", "/healthz")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert "Traceback" not in (tmp_path / "node.log").read_text()
