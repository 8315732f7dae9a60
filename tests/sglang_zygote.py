"""One process under SGLang's python that imports SGLang once and forks a process per driver run.

A run of tests/sglang_driver.py spends most of its CPU importing torch, transformers and SGLang
(whose model registry imports every model module SGLang has) before a few seconds of real work.
tests/test_sglang.py starts this process once per module instead, with its stdin a pipe, and:
  1. it makes itself ready as the driver does (`sglang_driver.prepare`: this checkout's agent on
     `sys.path`, the plugin's distribution in a private directory) and imports what the runs use,
     calling no plugin: SGLang's `load_plugins` runs in each run that asks for it, so a run without
     the plugin finds SGLang's parser as SGLang ships it;
  2. it listens on a Unix socket in that private directory and prints `READY <socket path>`;
  3. per connection it forks one process, which writes `PID <pid>` on the connection, reads one
     JSON run from it and runs it as `sglang_driver.py '<json run>'` does, its stdout the
     connection (`LOADED`, `IDLE`, `RESULT` lines arrive as they are printed), its stderr a file in
     the private directory. Runs that must meet (a tensor-parallel group's ranks, a primary and its
     standby) are as many connections, so as many processes at once;
  4. when a run's process ends, by its own exit or killed by the test, it writes on the connection
     `EXIT <status>` (a signal as subprocess reports one: negative) and the end of that stderr,
     then closes it;
  5. it ends when its stdin closes (the module is done, or the pytest process died) or when its
     parent dies: it kills the runs still going, reaps them and removes its directory.
The runs are its children, reaped: their CPU counts where the tests count their processes'.
Fork after these imports is safe because nothing before it runs a torch op: torch's thread pools
(OpenMP's, its own) are created by a first parallel op, in each run, and gloo starts its threads in
the runs; an import that started an interpreter thread stops the zygote before it serves.
`python tests/sglang_zygote.py` alone prints READY and serves until its stdin closes.
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import traceback
from typing import NoReturn

import sglang_driver

# What the runs import, at the path each takes (sglang_driver's parse, load and standby, and the
# loader and standby modules SGLang's plugin names); SGLang's own model registry imports every model.
PRELOAD = (
    "torch.distributed",
    "sglang.srt.plugins",
    "sglang.srt.server_args",
    "sglang.srt.configs.device_config",
    "sglang.srt.configs.load_config",
    "sglang.srt.configs.model_config",
    "sglang.srt.distributed",
    "sglang.srt.distributed.device_communicators.pynccl",
    "sglang.srt.layers.dp_attention",
    "sglang.srt.model_loader.loader",
    "sglang.srt.models.registry",
    "sglang.srt.managers.io_struct",
    "weightcache_agent.integrations.sglang",
    "weightcache_agent.integrations.sglang_loader",
    "weightcache_agent.integrations.sglang_standby",
)
STDERR_TAIL = 8192  # bytes of a run's stderr after its EXIT line; a socket's buffer takes them unread
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, parent: int) -> None:
    """`sig` to this process when `parent`, the one that started it, ends (Linux's PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # it ended before the request took effect
        os.kill(os.getpid(), sig)


def run_forked(conn: socket.socket, home: str, zygote: int, inherited: list[socket.socket],
               fds: list[int]) -> NoReturn:
    """The forked process: one run on `conn`, then exit without unwinding what SGLang started."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        die_with_parent(signal.SIGKILL, zygote)
        for other in inherited:
            other.close()
        for fd in fds:
            os.close(fd)
        conn.sendall(f"PID {os.getpid()}\n".encode())
        with conn.makefile("rb") as f:
            run = json.loads(f.readline())
        null = os.open(os.devnull, os.O_RDONLY)
        err = os.open(os.path.join(home, f"{os.getpid()}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((null, 0), (conn.fileno(), 1), (err, 2)):
            os.dup2(fd, target)
        for fd in (null, err):
            os.close(fd)
        conn.close()
        sglang_driver.execute(run)
        code = 0
    except BaseException:  # noqa: BLE001 -- any end of a run is reported as the driver's would be
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass
        os._exit(code)


def report(conn: socket.socket, home: str, pid: int, status: int) -> None:
    """A run's end on its connection: its exit status, then its stderr's end."""
    path = os.path.join(home, f"{pid}.err")
    tail = b""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - STDERR_TAIL))
            tail = f.read()
        os.unlink(path)
    except FileNotFoundError:  # killed before it opened one
        pass
    conn.setblocking(False)  # a test that stopped reading must not stop the others' runs
    try:
        conn.sendall(f"\nEXIT {os.waitstatus_to_exitcode(status)}\n".encode() + tail)
        while conn.recv(4096):  # a run killed before it read its request: closed unread, the test would
            pass                # read a reset instead of the end of the stream
    except OSError:
        pass
    conn.close()


def reap(runs: dict[int, socket.socket], home: str) -> None:
    while runs:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = runs.pop(pid, None)
        if conn is not None:
            print(f"run {pid}: exit {os.waitstatus_to_exitcode(status)}, "
                  f"{usage.ru_utime + usage.ru_stime:.1f} CPU-s", file=sys.stderr, flush=True)
            report(conn, home, pid, status)


def serve(home: str) -> None:
    site = os.path.join(home, "site")
    os.mkdir(site)
    sglang_driver.prepare(site)
    for name in PRELOAD:
        importlib.import_module(name)
    # a run gets no copy of an interpreter thread, and would wait forever on any lock one held at the fork
    if threading.active_count() != 1:
        raise RuntimeError(f"threads started by SGLang's imports, unsafe to fork: {threading.enumerate()}")
    spent = os.times()
    print(f"imported in {spent.user + spent.system:.1f} CPU-s", file=sys.stderr, flush=True)
    runs: dict[int, socket.socket] = {}
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # its wakeup byte ends select at once
    signal.set_wakeup_fd(wake_w)
    path = os.path.join(home, "zygote.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(16)
        print(f"READY {path}", flush=True)
        while True:
            ready = select.select([listener, wake_r, 0], [], [])[0]
            if wake_r in ready:
                os.read(wake_r, 4096)
            reap(runs, home)
            if 0 in ready and not os.read(0, 4096):
                return
            if listener in ready:
                conn, _ = listener.accept()
                sys.stdout.flush()
                sys.stderr.flush()
                zygote = os.getpid()
                pid = os.fork()
                if pid == 0:
                    run_forked(conn, home, zygote, [listener, *runs.values()], [wake_r, wake_w])
                runs[pid] = conn
    finally:
        for pid in runs:
            os.kill(pid, signal.SIGKILL)
        for pid, conn in runs.items():
            report(conn, home, pid, os.waitpid(pid, 0)[1])
        listener.close()


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))  # unwinds through the cleanup below
    die_with_parent(signal.SIGTERM, os.getppid())
    home = tempfile.mkdtemp(prefix="wc-sglang-zygote-")
    try:
        serve(home)
    except SystemExit:  # SIGTERM, SIGHUP
        pass
    finally:
        shutil.rmtree(home, ignore_errors=True)
    os._exit(0)  # finalizing SGLang's thousands of modules costs seconds and frees nothing the system would not


if __name__ == "__main__":
    main()
