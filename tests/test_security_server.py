"""Clients check who serves the socket; the agent checks every directory on its path.

The attack: a directory on the socket's path that others may write (made under umask 000,
or handed out by mistake) lets a second uid rename the agent's socket directory aside and
put one of its own in its place, with its own agent serving its own weights. Here the
second uid (the attacker) does exactly that; the client refuses its socket before sending
a byte (the kernel says who listens: SO_PEERCRED), and the agent refuses to serve under
such a directory at all. A well-behaved engine of another uid still attaches to the real
agent and reads the checkpoint's bytes.
"""
from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading

import pytest

from abuse_fixtures import LoggedAgent, no_traceback, right_bytes
from abuse_fixtures import disk, model  # noqa: F401 (fixtures)
from security_fixtures import ATTACKER, AsAttacker, agent_dir, needs_root, open_agent
from weightcache_agent import CacheSpec, attach, protocol
from weightcache_agent.errors import UntrustedAgent
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.synthetic import skeleton_module


def impostor(command: dict) -> dict:
    """In the attacker: move the directory aside and serve a socket of its own in its place,
    counting the bytes any client sends it."""
    state = impostor.__dict__.setdefault("state", {"received": 0})
    if command["do"] == "replace":
        directory = command["directory"]
        os.rename(directory, directory + ".moved")
        os.mkdir(directory, 0o755)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(os.path.join(directory, "agent.sock"))
        server.listen(8)

        def serve() -> None:
            while True:
                conn, _ = server.accept()
                while chunk := conn.recv(65536):
                    state["received"] += len(chunk)
                conn.close()
        threading.Thread(target=serve, daemon=True).start()
        return {"uid": os.geteuid()}
    if command["do"] == "attach":  # the attacker's own client trusts its own uid, and root
        protocol.connect(command["socket"]).close()
        return {"ok": True}
    return {"received": state["received"]}


def module_for(model: str):
    return skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})


@needs_root
def test_an_impostor_in_a_renamed_directory_is_refused_by_the_client(model, disk, monkeypatch):
    base = agent_dir()
    shared = os.path.join(base, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)  # writable by everyone, no sticky bit: what umask 000 used to make
    real = open_agent(model, base, "agent")
    child = AsAttacker(impostor)
    try:
        # The agent no longer serves under such a directory: one line, exit 1, nothing created.
        refused = LoggedAgent(model, os.path.join(shared, "run", "agent.sock"), os.path.join(base, "refused.log"))
        assert refused.proc.wait(30) == 1
        assert f"{shared}, on the socket's path, is writable by others (mode 777) without the sticky bit" in \
            refused.log()
        assert not os.path.exists(os.path.join(shared, "run"))
        # Where one was made before (root's directory in it), the attacker swaps in its own.
        victim = os.path.join(shared, "run")
        os.mkdir(victim, 0o750)
        assert child.ask(do="replace", directory=victim)["uid"] == ATTACKER
        path = os.path.join(victim, "agent.sock")
        with pytest.raises(UntrustedAgent, match=rf"refusing the agent at {path}: it runs as uid {ATTACKER} .*only "
                                                 r"uid 0 may serve weights"):
            attach(module_for(model), CacheSpec(model=model), socket=path, timeout=10)
        # With fallback the engine loads its own weights from disk, saying why.
        att = attach(module_for(model), CacheSpec(model=model), socket=path, fallback=True, timeout=10)
        assert att.source == "disk" and "UntrustedAgent" in att.fallback_reason
        att.close()
        assert child.ask(do="count")["received"] == 0  # not one byte of a request reached the impostor
        # An agent that runs as another uid on purpose is trusted when configured.
        monkeypatch.setenv("WEIGHTCACHE_AGENT_UID", str(ATTACKER))
        protocol.connect(path).close()
        monkeypatch.setenv("WEIGHTCACHE_AGENT_UID", "nobody")
        with pytest.raises(ValueError, match="WEIGHTCACHE_AGENT_UID='nobody' is not a uid"):
            protocol.connect(path)
        monkeypatch.delenv("WEIGHTCACHE_AGENT_UID")
        # The real agent (root) is trusted by root and by the other uid alike, and serves the right bytes.
        real.wait_ready()
        assert child.ask(do="attach", socket=real.socket)["ok"]
        right_bytes(real, disk)
    finally:
        child.close()
        real.stop()
    no_traceback(real)


@needs_root
def test_missing_directories_are_made_0755_whatever_the_umask(model, disk):
    base = agent_dir()
    sock = os.path.join(base, "a", "b", "run", "agent.sock")
    old = os.umask(0)
    try:
        agent = LoggedAgent(model, sock, os.path.join(base, "agent.log"))
    finally:
        os.umask(old)
    try:
        agent.wait_ready()
        modes = {p: stat.S_IMODE(os.stat(os.path.join(base, p)).st_mode) for p in ("a", "a/b", "a/b/run")}
        assert modes == {"a": 0o755, "a/b": 0o755, "a/b/run": 0o750}
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
        right_bytes(agent, disk)
    finally:
        agent.stop()


@needs_root
def test_an_ancestor_of_another_uid_is_refused(model):
    base = agent_dir()
    theirs = os.path.join(base, "theirs")
    os.mkdir(theirs, 0o755)
    os.chown(theirs, ATTACKER, ATTACKER)  # its owner could rename what is inside
    agent = LoggedAgent(model, os.path.join(theirs, "run", "agent.sock"), os.path.join(base, "agent.log"))
    assert agent.proc.wait(30) == 1
    assert f"{theirs}, on the socket's path, belongs to uid {ATTACKER}" in agent.log()
    assert "Traceback" not in agent.log()


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_read_only_mount_of_the_socket_directory_connects_but_cannot_replace_files(model, tmp_path):
    """What an engine pod gets (its socket volume is mounted read-only): connect() works, while
    the socket, the lock and the state files can be neither removed, renamed nor planted."""
    base = agent_dir()
    agent = open_agent(model, base, "agent")
    view = tmp_path / "view"
    view.mkdir()
    probe = f"""
import os, sys
sys.path[:0] = {sys.path!r}
from weightcache_agent import protocol
d = {str(view)!r}
print("status", protocol.agent_status(os.path.join(d, "agent.sock"))["type"])
for what, act in (("unlink", lambda: os.unlink(os.path.join(d, "agent.sock"))),
                  ("rename", lambda: os.rename(os.path.join(d, ".agent.sock.lock"), os.path.join(d, "x"))),
                  ("plant", lambda: open(os.path.join(d, ".agent.sock.state.tmp"), "w"))):
    try:
        act()
        print(what, "done")
    except OSError as e:
        print(what, e.errno)
"""
    try:
        agent.wait_ready()
        run_dir = os.path.dirname(agent.socket)
        script = (f"mount --bind {run_dir} {view} && mount -o remount,bind,ro {view} && "
                  f"{sys.executable} -c \"$PROBE\"")
        out = subprocess.run(["unshare", "-m", "sh", "-c", script], env={**os.environ, "PROBE": probe},
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0 and "mount" in out.stderr:
            pytest.skip(f"cannot make a mount namespace here: {out.stderr.strip()[:200]}")
        lines = dict(line.split(" ", 1) for line in out.stdout.split("\n") if line)
        assert lines == {"status": "status", "unlink": str(errno.EROFS), "rename": str(errno.EROFS),
                         "plant": str(errno.EROFS)}, (out.stdout, out.stderr)
        assert agent.status()["phase"] == "ready"
    finally:
        agent.stop()
