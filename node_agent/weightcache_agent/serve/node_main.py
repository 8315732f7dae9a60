"""`weightcache agent --socket-dir DIR`: the node's command, from flags to a supervised node.

Where agent_main.py runs one worker (`--socket`), this module runs the DaemonSet pod's
process: it checks the socket directory and the cache's claim on it, picks the devices
(`--tp-size` per replica), reads the control token for `POST /switchover`, starts the HTTP
endpoints (agent_http.py) on the pod's address, and hands the main thread to the
`NodeSupervisor` (supervisor.py) until SIGTERM.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import Callable

from ..arena.devices import Device, resolve_backend, select_devices
from .stop import StopFlag
from .supervisor import NodeConfig, NodeSupervisor

log = logging.getLogger("weightcache.supervisor")  # one logger name for the node process, whichever module logs


def http_host(flag: str | None) -> str:
    """Where the HTTP endpoints listen: the flag, else $WEIGHTCACHE_HTTP_HOST, else the pod's IP, else loopback.

    Never every address by default: a node's other interfaces have no business with the agent.
    """
    if flag is not None:
        return flag
    return os.environ.get("WEIGHTCACHE_HTTP_HOST") or os.environ.get("POD_IP") or "127.0.0.1"


def replica_devices(backend: str, spec: str, tp_size: int, replicas: int = 0) -> list[Device]:
    """The devices this node serves, `tp_size` per replica of the cache.

    `replicas` 0 means as many as the selected GPUs hold (8 GPUs, TP 2: 4 replicas); GPUs
    beyond the last whole replica stay unused. The cpu backend has no hardware to count:
    there 0 means one replica.
    """
    if replicas < 0:
        raise ValueError(f"--replicas must be 0 (as many as fit) or more, got {replicas}")
    if backend == "cpu":
        return select_devices("cpu", spec, tp_size * max(replicas, 1))
    chosen = select_devices(backend, spec)
    fit = len(chosen) // tp_size
    if fit == 0:
        raise ValueError(f"tensor-parallel size {tp_size} needs {tp_size} GPUs on this node, only {len(chosen)} selected")
    if replicas > fit:
        raise ValueError(f"{replicas} replicas of tensor-parallel size {tp_size} need {replicas * tp_size} GPUs, "
                         f"only {len(chosen)} selected")
    return chosen[:(replicas or fit) * tp_size]


MIN_CONTROL_TOKEN = 16  # characters; a shorter token is no token


def _control_token_reader(path: str | None) -> Callable[[], str | None] | None:
    """Reads the bearer token `POST /switchover` and the lease holders in `/status` require, at each
    request: the file comes from a Secret that may appear, or change, while the agent runs. None
    (no file named), or a read answering None (file absent or too short): switchover over HTTP is
    off and `/status` shows no lease holders to anyone."""
    path = path or os.environ.get("WEIGHTCACHE_CONTROL_TOKEN_FILE")
    if not path:
        log.info("no control token file: /status shows leases as roles only, switchover over HTTP is off")
        return None
    warned: list[str] = []

    def read() -> str | None:
        try:
            with open(path) as f:
                token = f.read(4096).strip()
        except OSError as e:
            why = f"cannot read {path}: {e.strerror or e}"
            token = ""
        else:
            why = f"{path} holds fewer than {MIN_CONTROL_TOKEN} characters"
        if len(token) >= MIN_CONTROL_TOKEN:
            warned.clear()
            return token
        if warned != [why]:  # once per cause, not per request
            log.warning("control token unusable (%s): /status shows leases as roles only, switchover over HTTP "
                        "is off", why)
            warned[:] = [why]
        return None

    return read


def run_node(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`weightcache agent --socket-dir ...`: supervise this node's ranks and serve HTTP until SIGTERM."""
    from .agent_http import AgentHTTPServer, AgentMetrics

    if args.tp_size < 1:
        parser.error(f"--tp-size must be at least 1, got {args.tp_size}")
    if args.tp_rank != 0:
        parser.error("--tp-rank names one worker's rank; with --socket-dir every rank runs here")
    from .access import AccessError, SocketPolicy, check_socket_path, prepare_dir

    node_name = args.node_name or os.environ.get("NODE_NAME") or socket.gethostname()
    socket_dir = os.path.abspath(args.socket_dir)
    try:
        policy = SocketPolicy.from_group(args.socket_group)
        prepare_dir(socket_dir, policy)
        if args.cache:
            # Before any worker binds: an agent of another cache in this directory serves nobody.
            from .cache_claim import CacheIdentity, claim_socket_dir

            try:
                identity = CacheIdentity.parse(args.cache)
            except ValueError as e:
                parser.error(str(e))
            claim_socket_dir(socket_dir, identity)
    except AccessError as e:
        print(f"weightcache agent: {e}", file=sys.stderr)
        return 1
    setup_error = None
    try:
        backend = resolve_backend(args.backend)
        devices = replica_devices(backend, args.devices, args.tp_size, args.replicas)
    except ValueError as e:
        # Stay up and say why: the operator reads this from /status, a crash loop says less.
        backend, devices, setup_error = args.backend, [], f"no devices to serve: {e}"
        log.error("%s", setup_error)
    try:
        # Every worker's socket path, checked now: a directory too deep for them is one line, not a restart loop.
        for device in devices:
            check_socket_path(os.path.join(socket_dir, device.socket_name))
    except AccessError as e:
        print(f"weightcache agent: {e}", file=sys.stderr)
        return 1
    config = NodeConfig(model=os.path.abspath(args.model), socket_dir=socket_dir, tp_size=args.tp_size,
                        backend=backend, quantization=args.quantization, dtype=args.dtype, revision=args.revision,
                        sharding=args.sharding, expert_parallel=args.expert_parallel,
                        handshake_timeout=args.handshake_timeout, log_format=args.log_format, node_name=node_name,
                        socket_group=args.socket_group, max_leases=args.max_leases, max_pending=args.max_pending,
                        max_leases_per_uid=args.max_leases_per_uid, max_pending_per_uid=args.max_pending_per_uid,
                        max_connections_per_uid=args.max_connections_per_uid, scrub_interval=args.scrub_interval,
                        label_pods=args.label_pods, pod_identity=args.pod_identity,
                        identity_audience=args.identity_audience)
    metrics = AgentMetrics()
    supervisor = NodeSupervisor(config, devices, setup_error, on_attach=metrics.observe_attach)
    metrics.watch(supervisor.snapshot, [(w.rank, w.device.uuid) for w in supervisor.workers])

    stop = StopFlag().on_signals()
    host = http_host(args.http_host)
    try:
        server = AgentHTTPServer(host, args.http_port, supervisor, metrics.registry,
                                 control_token=_control_token_reader(args.control_token_file))
    except OSError as e:
        print(f"weightcache agent: cannot serve HTTP on {host or '*'}:{args.http_port}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    server.start()
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(server.port))
        os.replace(tmp, args.port_file)
    try:
        supervisor.run(stop)
    finally:
        server.close()
    if stop.signal == signal.SIGINT:
        log.info("interrupted (Ctrl-C); shut down")
        return 130  # 128 + SIGINT, as a shell reports it
    log.info("shut down cleanly")
    return 0
