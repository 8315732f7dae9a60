"""CUDA: a peer that maps the arena's handle read-write and writes is caught by the scrub, and no new
attach receives the changed arena. Needs a GPU and cuda-bindings; skips cleanly without.

The attacker is an engine like any other: it attaches (so it holds the VMM fd), imports the
handle, maps it with READWRITE access (the driver allows it: read-only is only the client's own
choice) and overwrites one byte. The agent runs with the default scrub interval; the write must
be reported within two scrub periods (10 s), the agent must refill, and an engine attaching
afterwards must read the checkpoint's bytes. Also printed: the kernel's digest throughput
(an on-demand verify) and the scrub's share of the GPU.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import socket
import tempfile
import time

import pytest

from abuse_fixtures import LoggedAgent, no_traceback, right_bytes
from abuse_fixtures import disk, model  # noqa: F401 (fixtures)
from agent_fixtures import wait_for
from weightcache_agent import protocol
from weightcache_agent.load.fingerprint import engine_request
from weightcache_agent.spec import CacheSpec

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.bindings")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

DETECT_WITHIN = 10.0


def write_through_the_handle(path: str, model: str) -> tuple[socket.socket, float]:
    """Attach, map the arena read-write through its handle, change one byte; (the lease, when written)."""
    from weightcache_agent.arena.cuda import _access, _activate, checked, driver
    from weightcache_agent.arena.devices import local_ordinal

    cu = driver()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    protocol.send_message(s, {"type": "attach", "role": "primary", "group": None,
                              "request": engine_request(CacheSpec(model=model))})
    reply, fds = protocol.recv_message(s, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
    assert reply["type"] == "manifest", reply
    arena = reply["arenas"][0]
    ordinal = local_ordinal(arena["device"])
    _activate(ordinal)
    handle = checked(cu.cuMemImportFromShareableHandle(
        fds[0], cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "import")
    ptr = checked(cu.cuMemAddressReserve(arena["size"], 0, 0, 0), "reserve")
    checked(cu.cuMemMap(ptr, arena["size"], 0, handle, 0), "map")
    checked(cu.cuMemSetAccess(ptr, arena["size"], [_access(ordinal, True)], 1), "set access READWRITE")
    byte = ctypes.c_uint8()
    checked(cu.cuMemcpyDtoH(ctypes.addressof(byte), int(ptr) + 100, 1), "read")
    checked(cu.cuMemsetD8(int(ptr) + 100, byte.value ^ 0x5A, 1), "write")
    checked(cu.cuCtxSynchronize(), "sync")
    for fd in fds:
        os.close(fd)
    return s, time.monotonic()


def test_a_write_through_the_handle_is_caught_and_the_arena_replaced(model, disk, capsys):
    base = tempfile.mkdtemp(prefix="wc-cuda-sec-")
    agent = LoggedAgent(model, os.path.join(base, "run", "a.sock"), os.path.join(base, "agent.log"),
                        "--backend", "cuda", "--device", "0")
    lease = None
    try:
        status = agent.wait_ready(120)
        assert status["integrity"]["state"] == "verified", status["integrity"]
        assert status["integrity"]["algorithm"] == "poly61-keyed-gpu/v1"
        verified = protocol.agent_request(agent.socket, {"type": "verify"}, timeout=120)
        assert verified["ok"] is True
        before = status["load_breakdown"].get("digest")
        lease, written = write_through_the_handle(agent.socket, model)
        wait_for(lambda: agent.status()["integrity"]["tampered"] >= 1, DETECT_WITHIN, "the scrub catching the write")
        detected = time.monotonic() - written
        wait_for(lambda: agent.status()["phase"] == "ready" and agent.status()["integrity"]["refills"] == 1, 120,
                 "the refill")
        right_bytes(agent, disk)
        integrity = agent.status()["integrity"]
        assert "changed since this agent filled it" in agent.log()
        # A bigger arena's throughput: the verify of this one, however small, is printed with its size.
        with capsys.disabled():
            gbps = verified["bytes"] / verified["seconds"] / 1e9
            print(f"\ncuda: write caught {detected:.2f}s after it landed (bar {DETECT_WITHIN:.0f}s); digest at fill "
                  f"{before}s; verify of {verified['bytes'] / 2**20:.0f} MiB in {verified['seconds'] * 1e3:.2f} ms "
                  f"({gbps:.1f} GB/s); scrub duty {integrity['duty']:.0%}, interval {integrity['interval_seconds']}s")
        no_traceback(agent)
    finally:
        if lease is not None:
            lease.close()
        agent.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_gpu_digest_throughput_and_sensitivity(capsys):
    """The kernel on a 4 GiB arena of this process: same bytes same digest, one byte changes it, speed."""
    from weightcache_agent.arena.cuda import CudaArena, checked, driver
    from weightcache_agent.arena.devices import cuda_devices
    from weightcache_agent.arena.digest import new_key

    device = next(d for d in cuda_devices() if d.ordinal == 0)
    arena = CudaArena(4 << 30, 0, device.uuid)
    try:
        ptr = arena.writable_ptr()
        checked(driver().cuMemsetD8(ptr, 7, arena.size), "fill")
        arena.seal()
        key = new_key()
        first = arena.digest(key)
        t0 = time.perf_counter()
        again = arena.digest(key)
        seconds = time.perf_counter() - t0
        assert again == first and len(set(first.values)) == len(first.values)
        assert arena.digest(new_key()).values != first.values
        ptr = arena.writable_ptr()
        checked(driver().cuMemsetD8(ptr + (3 << 30) + 12345, 8, 1), "one byte")
        arena.seal()
        changed = arena.digest(key).values
        assert [i for i, (a, b) in enumerate(zip(changed, first.values)) if a != b] == [3]
        with capsys.disabled():
            gbps = arena.size / seconds / 1e9
            print(f"\ncuda digest: {gbps:.0f} GB/s over {arena.size >> 30} GiB; a 141 GB arena's pass is "
                  f"{141e9 / gbps / 1e9 * 1e3:.0f} ms of GPU time, so 1% duty checks it every "
                  f"{141e9 / gbps / 1e9 * 100:.1f}s")
    finally:
        arena.close()
