"""Abuse of the agent's socket: floods, trickles, squatting, oversize names, poison JSON, random frames.

One real agent process serves the whole module; every case talks to it over its real
socket and ends with the same checks: the agent still hands out exactly the checkpoint's
bytes, its fds and RSS stay bounded, and its log holds no traceback.

The random frames are seeded (WEIGHTCACHE_FUZZ_SEED, default fixed) and counted
(WEIGHTCACHE_FUZZ_FRAMES, default 10 000), bounded in time; the counts are printed.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import threading
import time

import pytest

from abuse_fixtures import LoggedAgent, ask, drain, frame, no_traceback, raw, right_bytes, serves_correctly
from abuse_fixtures import disk, model  # noqa: F401 (fixtures)
from agent_fixtures import wait_for
from weightcache_agent import protocol
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.serve.agent import sidecar_path
from weightcache_agent.spec import CacheSpec

HANDSHAKE = 1.0
MAX_PENDING = 16
MAX_LEASES = 24
FUZZ_FRAMES = int(os.environ.get("WEIGHTCACHE_FUZZ_FRAMES", "10000"))
FUZZ_SEED = int(os.environ.get("WEIGHTCACHE_FUZZ_SEED", "20261130"))
FUZZ_SECONDS = 60.0


@pytest.fixture(scope="module")
def agent(model, disk, tmp_path_factory):
    base = tmp_path_factory.mktemp("abuse")
    proc = LoggedAgent(model, str(base / "run" / "agent.sock"), str(base / "agent.log"),
                       "--handshake-timeout", str(HANDSHAKE), "--max-pending", str(MAX_PENDING),
                       "--max-leases", str(MAX_LEASES),
                       # one uid plays every part here: the caps under test are the agent's, not a uid's share
                       "--max-leases-per-uid", str(MAX_LEASES), "--max-pending-per-uid", str(MAX_PENDING),
                       "--max-connections-per-uid", "100000")
    proc.wait_ready()
    serves_correctly(proc, disk)  # warm: the first attach's allocations are not a leak
    proc.baseline_fds = proc.fds()
    proc.baseline_rss = proc.rss()
    yield proc
    proc.stop()


@pytest.fixture
def healthy_after(agent, disk):
    """Every case ends the same way: fds back to where they were, right bytes served, no traceback."""
    yield
    wait_for(lambda: agent.fds() <= agent.baseline_fds + 4, 15, "the agent's fds back to the baseline")
    serves_correctly(agent, disk)
    no_traceback(agent)


def attach_message(model: str, **overrides) -> dict:
    message = {"type": "attach", "role": "primary", "group": None, "request": engine_request(CacheSpec(model=model))}
    message.update(overrides)
    return message


# -- fds ------------------------------------------------------------------------------------------------------


def test_fds_on_every_byte_of_a_trickled_frame_are_not_held(agent, healthy_after, capsys):
    r, w = os.pipe()
    conns = [raw(agent.socket) for _ in range(32)]
    try:
        for s in conns:  # 64 fds on the first byte: more than a request may carry, all refused
            try:
                socket.send_fds(s, [protocol.MAGIC[:1]], [r] * 64)
            except OSError:  # already dropped: past MAX_PENDING the agent drops the oldest at once
                pass
        answers = [drain(s) for s in conns]
        # each is refused, or was dropped unread as the oldest pending connection (closed, no answer)
        assert all(a.startswith(protocol.MAGIC) or a == b"" for a in answers), "no refusal for 64 fds on a frame"
        assert any(answers), "no refusal for 64 fds on a frame"
        conns = [raw(agent.socket) for _ in range(32)]
        for s in conns:  # the allowed count on the first byte, then more on every later byte
            try:
                socket.send_fds(s, [protocol.MAGIC[:1]], [r] * protocol.MAX_REQUEST_FDS)
            except OSError:  # already dropped: past MAX_PENDING the agent drops the oldest at once
                pass
        time.sleep(0.3)  # the agent has them all by now
        peak = agent.fds()
        for s in conns:
            try:
                socket.send_fds(s, [protocol.MAGIC[1:2]], [r] * 64)
            except OSError:
                pass
        for s in conns:
            drain(s)
        # a pending connection holds its socket and at most MAX_REQUEST_FDS fds, however the frame
        # arrives, and at most MAX_PENDING connections are pending
        assert peak <= agent.baseline_fds + MAX_PENDING * (1 + protocol.MAX_REQUEST_FDS) + 8, peak
        with capsys.disabled():
            print(f"\nfd flood: baseline {agent.baseline_fds} fds, peak {peak} with 32 connections sending "
                  f"{protocol.MAX_REQUEST_FDS} fds each, then 64 on the next byte")
    finally:
        for s in conns:
            s.close()
        os.close(r)
        os.close(w)


def test_a_frame_trickled_byte_by_byte_meets_one_deadline(agent, healthy_after):
    s = raw(agent.socket, timeout=10)
    data = frame(b'{"type":"status"}')
    t0 = time.monotonic()
    closed_after = None
    try:
        for byte in data:
            s.sendall(bytes([byte]))
            time.sleep(0.3)
            if time.monotonic() - t0 > 5:
                break
    except OSError:
        closed_after = time.monotonic() - t0
    if closed_after is None:
        drain(s)
        closed_after = time.monotonic() - t0
    s.close()
    assert closed_after < HANDSHAKE + 2.0, f"a trickling client was kept {closed_after:.1f}s"


def test_pending_connections_are_capped_and_a_status_still_gets_through(agent, healthy_after):
    silent = [raw(agent.socket) for _ in range(3 * MAX_PENDING)]
    try:
        t0 = time.monotonic()
        assert ask(agent.socket, {"type": "status"})["phase"] == "ready"
        assert time.monotonic() - t0 < 2.0
        time.sleep(0.2)
        assert agent.fds() <= agent.baseline_fds + MAX_PENDING + 8
        assert "dropping the oldest" in agent.log()
    finally:
        for s in silent:
            s.close()


# -- leases ---------------------------------------------------------------------------------------------------


def test_oversize_group_names_are_refused(agent, model, healthy_after):
    for group in ("g" * (1 << 19), "", "bad name\n", "x" * 254):
        s = raw(agent.socket)
        protocol.send_message(s, attach_message(model, group=group))
        reply, _ = protocol.recv_message(s, protocol.MAX_REPLY_BYTES)
        s.close()
        assert reply["code"] == "protocol" and "group null or a name" in reply["message"]
        assert len(reply["message"]) < 400
    assert agent.status()["clients"] == []


def test_leases_are_capped_and_status_stays_small(agent, model, healthy_after):
    held = []
    try:
        for i in range(MAX_LEASES):
            s = raw(agent.socket)
            protocol.send_message(s, attach_message(model, group=f"g{i}"))
            reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
            for fd in fds:
                os.close(fd)
            assert reply["type"] == "manifest", reply
            held.append(s)
        reply = ask(agent.socket, attach_message(model, group="one-too-many"))
        assert reply["code"] == "too_many_leases"
        s = raw(agent.socket)
        protocol.send_message(s, {"type": "status"})
        header = s.recv(protocol.HEADER.size, socket.MSG_WAITALL)
        size = protocol.HEADER.unpack(header)[3]
        s.close()
        assert size < 64 << 10, f"status of {size} bytes with {MAX_LEASES} leases"
        assert len(agent.status()["clients"]) == MAX_LEASES
    finally:
        for s in held:
            s.close()
    wait_for(lambda: agent.status()["clients"] == [], 10, "the leases ending")


def test_the_lease_pid_is_the_kernels_not_the_requests(agent, model, healthy_after):
    s = raw(agent.socket)
    protocol.send_message(s, attach_message(model, pid=1, group="prod"))
    reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
    for fd in fds:
        os.close(fd)
    try:
        assert reply["type"] == "manifest"
        (client,) = agent.status()["clients"]
        assert client["pid"] == os.getpid() and client["uid"] == os.geteuid()
    finally:
        s.close()


def test_a_lease_whose_state_cannot_be_written_is_rolled_back(agent, model, healthy_after):
    blocker = sidecar_path(agent.socket, "state") + ".tmp"
    os.mkdir(blocker)  # the state file cannot be replaced: as good as a full disk for the agent
    try:
        reply = ask(agent.socket, attach_message(model))
        assert reply["type"] == "error" and reply["code"] == "state_unwritable"
        assert agent.status()["clients"] == [], "a lease the state file does not know stayed"
    finally:
        os.rmdir(blocker)
    assert ask(agent.socket, attach_message(model))["type"] == "manifest"


# -- poison JSON ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body,expected", [
    # more brackets than a request may build: refused before it is parsed
    (b'{"type":"status","x":' + b"[" * 5000 + b"]" * 5000 + b"}", "too many elements"),
    # deep enough to refuse, shallow enough that every interpreter's parser accepts it
    (b'{"type":"status","x":' + b"[" * 100 + b"]" * 100 + b"}", "nests too deeply"),
    (b'{"type":"attach","pid":' + b"9" * 5000 + b"}", "not acceptable JSON"),
    (b'{"type":"attach","role":"primary","group":null,"request":{"spec":' + b'{"a":' * 5000 + b"1"
     + b"}" * 5000 + b"}}", "too many elements"),
    (b'{"type":"attach","role":"primary","group":null,"request":{"spec":' + b'{"a":' * 200 + b"1"
     + b"}" * 200 + b"}}", "nests too deeply"),
])
def test_deep_nesting_and_huge_integers_get_a_protocol_error(agent, body, expected, healthy_after):
    s = raw(agent.socket)
    s.sendall(frame(body))
    reply, _ = protocol.recv_message(s, protocol.MAX_REPLY_BYTES)
    s.close()
    assert reply["code"] == "protocol" and expected in reply["message"], reply


# -- random frames --------------------------------------------------------------------------------------------

TYPES = ("status", "attach", "arena", "rejoin", "detach", "promote", "switchover", "manifest", "", "x" * 300)


def random_value(rng: random.Random, depth: int = 0):
    pick = rng.random()
    if depth > 3 or pick < 0.3:
        return rng.choice([None, True, False, 0, -1, 2**31, 2**64, 1.5, float("1e308"), "", "primary", "standby",
                           "auto", "x" * rng.randint(0, 300), "\u0000\ud7ff", "/etc/shadow", "../../x"])
    if pick < 0.6:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return random_members(rng, depth + 1)


def random_members(rng: random.Random, depth: int = 0) -> dict:
    keys = ["pid", "role", "group", "request", "spec", "fields", "arenas", "size", "token", "pod", "sharding",
            "model", "files", "torch", "revision", "layout_hash", "tp_size", "dtype", "quantization"]
    return {rng.choice(keys): random_value(rng, depth) for _ in range(rng.randint(0, 5))}


def random_frame(rng: random.Random, model_request: dict) -> tuple[bytes, int]:
    """(bytes to send, fds to attach to the first byte)."""
    kind = rng.randrange(10)
    if kind == 0:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40))), 0
    if kind == 1:
        header = protocol.HEADER.pack(rng.choice([protocol.MAGIC, b"WCAQ", b"\0\0\0\0"]),
                                      rng.choice([protocol.PROTOCOL_VERSION, 0, 1, 3, 65535]), rng.getrandbits(16),
                                      rng.choice([0, 1, 17, protocol.MAX_REQUEST_BYTES + 1, 2**32 - 1]))
        return header + bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 20))), 0
    if kind == 2:
        return frame(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))), 0
    if kind == 3:
        return frame(json.dumps(random_value(rng)).encode()), 0
    if kind == 4:
        message = {"type": rng.choice(TYPES), **random_members(rng)}
        return frame(json.dumps(message).encode()), rng.choice([0, 0, 1, protocol.MAX_REQUEST_FDS])
    if kind == 5:
        depth = rng.randint(900, 6000)
        body = b'{"type":"status","x":' + b"[" * depth + b"]" * depth + b"}"
        return frame(body), 0
    if kind == 6:
        body = json.dumps({"type": "status"}).encode()
        return frame(body, length=len(body) + rng.randint(1, 100)), 0  # promises more than it sends
    if kind == 7:
        return frame(b'{"type":"status"}') + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 30))), 0
    if kind == 8:
        message = {"type": "rejoin", "role": rng.choice(["primary", "standby"]), "group": None,
                   "token": "%064x" % rng.getrandbits(256), "fields": random_value(rng), "layout_hash": "",
                   "arenas": [{"size": rng.choice([0, 4096, 2**40]), "backend": "cpu"}]}
        return frame(json.dumps(message).encode()), 1
    message = {"type": "attach", "role": rng.choice(["primary", "standby", "auto"]),
               "group": rng.choice([None, "g", "prod"]), "request": model_request}
    pick = rng.random()
    if pick < 0.4:  # the engine's spec with random members over it
        message["request"] = {**model_request, "spec": {**model_request["spec"], **random_members(rng)}}
    elif pick < 0.6:
        message["request"] = random_value(rng)
    return frame(json.dumps(message).encode()), 0


def fuzz_worker(agent: LoggedAgent, rng: random.Random, count: int, deadline: float, model_request: dict,
                fd: int, counts: dict, lock: threading.Lock) -> None:
    local = {"tried": 0, "handled": 0, "replied": 0, "hung": 0}
    for _ in range(count):
        if time.monotonic() > deadline:
            break
        data, nfds = random_frame(rng, model_request)
        local["tried"] += 1
        try:
            s = raw(agent.socket, timeout=HANDSHAKE + 4)
        except OSError:  # the backlog is full for an instant: a refusal is handling too
            local["handled"] += 1
            continue
        try:
            if nfds:
                sent = socket.send_fds(s, [data[:1]], [fd] * nfds)
                s.sendall(data[sent:])
            else:
                s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the agent hung up first: it already answered
        try:
            answer = drain(s)
            local["handled"] += 1
            local["replied"] += answer.startswith(protocol.MAGIC)
        except socket.timeout:
            local["hung"] += 1
        finally:
            s.close()
    with lock:
        for key, value in local.items():
            counts[key] += value


def test_random_frames(agent, model, disk, capsys):
    rng = random.Random(FUZZ_SEED)
    r, w = os.pipe()
    counts = {"tried": 0, "handled": 0, "replied": 0, "hung": 0}
    lock = threading.Lock()
    workers = 4
    deadline = time.monotonic() + FUZZ_SECONDS
    model_request = engine_request(CacheSpec(model=model))
    t0 = time.monotonic()
    threads = [threading.Thread(target=fuzz_worker, args=(agent, random.Random(rng.getrandbits(64)),
                                                          FUZZ_FRAMES // workers, deadline, model_request, r,
                                                          counts, lock))
               for _ in range(workers)]
    checks = {"attaches": 0}

    def keep_checking() -> None:  # all through the storm, a real engine's attach gets the right bytes
        try:
            while any(t.is_alive() for t in threads):
                right_bytes(agent, disk)
                checks["attaches"] += 1
        except BaseException as e:  # noqa: BLE001 -- reported by the test's own assertion below
            checks["error"] = repr(e)

    for t in threads:
        t.start()
    checker = threading.Thread(target=keep_checking)
    checker.start()
    for t in threads:
        t.join()
    checker.join()
    seconds = time.monotonic() - t0
    os.close(r)
    os.close(w)
    wait_for(lambda: agent.fds() <= agent.baseline_fds + 4, 15, "the agent's fds back to the baseline")
    fds, rss = agent.fds(), agent.rss()
    with capsys.disabled():  # the counts belong in every run's output, not only a failing one's
        print(f"\nrandom frames (seed {FUZZ_SEED}): tried {counts['tried']}, handled {counts['handled']} "
              f"({counts['replied']} answered, {counts['handled'] - counts['replied']} closed), hung {counts['hung']}, "
              f"in {seconds:.1f}s; agent fds {agent.baseline_fds} -> {fds}, "
              f"RSS {agent.baseline_rss / 2**20:.1f} -> {rss / 2**20:.1f} MiB; {checks['attaches']} correct attaches "
              "meanwhile")
    assert "error" not in checks, checks
    assert checks["attaches"] > 0
    assert counts["hung"] == 0
    assert counts["tried"] == counts["handled"]
    assert counts["tried"] >= min(FUZZ_FRAMES, 10000) or seconds >= FUZZ_SECONDS
    assert rss - agent.baseline_rss < 64 << 20, "the agent's RSS grew by more than 64 MiB"
    serves_correctly(agent, disk)
    no_traceback(agent)


# -- status requests waiting at accept -------------------------------------------------------------------------
@contextlib.contextmanager
def stopped(agent: LoggedAgent):
    """The agent process stopped while the block runs: what clients connect and send meanwhile
    waits whole in the socket's backlog, as under a burst the agent has not caught up with."""
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)


def test_status_requests_found_waiting_at_accept_are_answered_like_any_other(agent, model, healthy_after):
    """Status requests already whole when the agent accepts them are answered on the agent's
    status thread, not a thread of their own: behind connections that fill every pending slot
    they are still answered; one carrying fds gets the same refusal as anywhere; a connection
    that asks for status and then attaches gets its manifest."""
    r, w = os.pipe()
    with stopped(agent):
        silent = [raw(agent.socket, timeout=10) for _ in range(MAX_PENDING + 4)]
        asking = [raw(agent.socket, timeout=10) for _ in range(8)]
        for s in asking:
            protocol.send_message(s, {"type": "status"})
        with_fds = raw(agent.socket, timeout=10)
        protocol.send_message(with_fds, {"type": "status"}, [r])
        then_attach = raw(agent.socket, timeout=10)
        protocol.send_message(then_attach, {"type": "status"})
        protocol.send_message(then_attach, attach_message(model))
    try:
        for s in asking:
            message, _ = protocol.recv_message(s, protocol.MAX_REPLY_BYTES)
            assert message["type"] == "status" and message["phase"] == "ready"
        refusal = drain(with_fds)
        assert b"file descriptors sent with a 'status' message" in refusal, refusal
        status, _ = protocol.recv_message(then_attach, protocol.MAX_REPLY_BYTES)
        manifest, fds = protocol.recv_message(then_attach, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
        assert status["type"] == "status" and manifest["type"] == "manifest" and len(fds) == 1, manifest
        for fd in fds:
            os.close(fd)
    finally:
        for s in silent + asking + [with_fds, then_attach]:
            s.close()
        os.close(r)
        os.close(w)


def test_status_requests_whose_answers_are_never_read_cost_nothing(agent, healthy_after):
    """Clients that ask for status and never read the answer: each answer fits the socket's
    buffer, so none holds the status thread; a real status request right after is answered."""
    with stopped(agent):
        idle = [raw(agent.socket) for _ in range(4 * MAX_PENDING)]
        for s in idle:
            protocol.send_message(s, {"type": "status"})
    try:
        t0 = time.monotonic()
        assert ask(agent.socket, {"type": "status"})["phase"] == "ready"
        assert time.monotonic() - t0 < 2.0
    finally:
        for s in idle:
            s.close()


def test_arena_requests_hand_out_the_arena_and_hold_nothing(agent, healthy_after):
    """The arena without a lease (what an engine maps while it starts): asked 200 times over, and
    left unread by 50 clients that hang up, it costs the agent no fd and no lease; one carrying
    fds gets the refusal every request does."""
    before = agent.status()["clients"]
    for _ in range(200):
        with raw(agent.socket) as s:
            protocol.send_message(s, {"type": "arena"})
            reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
            assert reply["type"] == "arena" and len(fds) == 1 and reply["arenas"][0]["size"] > 0, reply
            for fd in fds:
                os.close(fd)
    for _ in range(50):
        with raw(agent.socket) as s:
            protocol.send_message(s, {"type": "arena"})
    r, w = os.pipe()
    try:
        with raw(agent.socket) as s:
            protocol.send_message(s, {"type": "arena"}, [r])
            assert b"file descriptors sent with a 'arena' message" in drain(s)
    finally:
        os.close(r)
        os.close(w)
    assert agent.status()["clients"] == before
