"""`weightcache agent`: parse flags, load the model, serve until SIGTERM.

With `--socket` this process is one agent serving one rank; with `--socket-dir` it is the
node supervisor (supervisor.py), which runs one `--socket` agent per rank as a worker.

Exit status: 0 after a clean shutdown, 1 when the checkpoint, memory or the socket's
place says no (path too long, directory unusable), 2 for a refused spec (bad flag, refused
quantization method), 3 when another agent already serves the socket.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import Any

from ..errors import UnsupportedQuantization, WeightCacheError
from ..logs import configure
from ..spec import DTYPE_CHOICES, CacheSpec

log = logging.getLogger("weightcache.agent")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache agent", description="Load a model once and serve it zero-copy to engines.")
    p.add_argument("--model", required=True, help="checkpoint directory (*.safetensors + config.json)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="Unix socket path to serve one rank on")
    where.add_argument("--socket-dir", help="node mode: run one worker per rank, each serving <dir>/<GPU-UUID>.sock")
    node = p.add_argument_group("node mode (with --socket-dir)")
    node.add_argument("--devices", default="all", help='"all", or a comma list of GPU ordinals and/or UUIDs')
    node.add_argument("--replicas", type=int, default=0,
                      help="replicas of the cache on this node, --tp-size GPUs each (default: as many as fit; "
                           "cpu backend: 1)")
    node.add_argument("--http-port", type=int, default=9464, help="health, metrics and status over HTTP (0: any free port)")
    node.add_argument("--http-host", default=None,
                      help="address for health, metrics and status (default: $WEIGHTCACHE_HTTP_HOST, else $POD_IP, "
                           "else 127.0.0.1; '' or '::' for every address)")
    node.add_argument("--port-file", help="write the HTTP port here once listening")
    node.add_argument("--control-token-file",
                      help="enables POST /switchover for holders of this bearer token (default: "
                           "$WEIGHTCACHE_CONTROL_TOKEN_FILE; without one, switchover is only on the sockets)")
    node.add_argument("--node-name", help="name in the published state (default: $NODE_NAME or the hostname)")
    p.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when a GPU is visible")
    p.add_argument("--device", default="0", help="GPU ordinal or UUID (cuda backend)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    p.add_argument("--quantization", default="none", help="none | fp8-block")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--peer-socket", help="another replica's socket for this rank: copy its arena (device to device) "
                                         "instead of reading the checkpoint; the disk if that fails")
    p.add_argument("--sharding", help="sharding preset name or YAML rules file")
    p.add_argument("--expert-parallel", action="store_true", help="place whole experts per rank")
    p.add_argument("--revision", help="revision label shown in status")
    p.add_argument("--handshake-timeout", type=float, default=10.0,
                   help="seconds a new connection may take to send its first complete request")
    p.add_argument("--socket-group", default=os.environ.get("WEIGHTCACHE_SOCKET_GROUP") or None,
                   help="group (name or gid) whose members may connect to the socket, besides root "
                        "(default: $WEIGHTCACHE_SOCKET_GROUP, else none)")
    p.add_argument("--max-leases", type=int, default=256, help="engines one socket serves at most")
    p.add_argument("--max-pending", type=int, default=64,
                   help="connections still sending their first request; past it the oldest is dropped")
    p.add_argument("--adopt-wait", type=float, default=3.0,
                   help="after a restart with engines still attached, seconds to wait for one to hand the arena back")
    p.add_argument("--label-pods", choices=("auto", "on", "off"), default="auto",
                   help="on a promotion, label the engine's pod weightcache.io/serving=true through the API server "
                        "(auto: when running in a cluster; rank 0 only)")
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure(args.log_format)
    if args.socket_dir is not None:
        from .supervisor import run_node

        return run_node(args, parser)
    try:
        spec = CacheSpec(model=args.model, tp_size=args.tp_size, tp_rank=args.tp_rank, quantization=args.quantization,
                         dtype=args.dtype, sharding=args.sharding, expert_parallel=args.expert_parallel,
                         revision=args.revision)
    except UnsupportedQuantization as e:
        print(f"weightcache agent: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"weightcache agent: bad spec: {e}", file=sys.stderr)
        return 2

    from .access import AccessError, SocketPolicy
    from .agent import Agent  # after the spec checks: refusals stay instant
    from .stop import StopFlag

    show = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
    try:
        device = _device(args)
    except ValueError as e:
        print(f"weightcache agent: {e}", file=sys.stderr)
        return 2
    try:
        policy = SocketPolicy.from_group(args.socket_group)
    except AccessError as e:
        print(f"weightcache agent: {e}", file=sys.stderr)
        return 2
    writer = _serving_label_writer(args.label_pods) if spec.tp_rank == 0 else None
    agent = Agent(spec, args.socket, show_progress=show, handshake_timeout=args.handshake_timeout, device=device,
                  adopt_wait=args.adopt_wait, policy=policy, max_leases=args.max_leases, max_pending=args.max_pending,
                  on_promote=(lambda lease: writer.label_promoted(lease.pod)) if writer is not None else None,
                  peer=args.peer_socket)
    try:
        agent.bind()
    except AccessError as e:
        print(f"weightcache agent: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"weightcache agent: cannot serve {args.socket}: {e.strerror or e}", file=sys.stderr)
        return 1
    except WeightCacheError as e:
        print(f"weightcache agent: {e}", file=sys.stderr)
        return 3
    stop = StopFlag().on_signals()
    failure: list[BaseException] = []

    def load() -> None:
        try:
            agent.load()
        except BaseException as e:  # reported by the main thread
            failure.append(e)
            stop.set()

    agent.start()
    threading.Thread(target=load, name="load", daemon=True).start()
    while not stop.wait(0.5):
        pass
    agent.close()
    if failure:
        e = failure[0]
        print(f"weightcache agent: {e}" if isinstance(e, WeightCacheError) else f"weightcache agent: load failed: {e!r}",
              file=sys.stderr)
        return 1
    log.info("shut down cleanly")
    return 0


def _serving_label_writer(mode: str) -> Any:
    """The node-side label writer, when asked for (or, with auto, when in a cluster)."""
    if mode == "off":
        return None
    from .serving_label import ServingLabelWriter, in_cluster_api_url

    if mode == "on" and not in_cluster_api_url():
        raise SystemExit("weightcache agent: --label-pods on needs the API server: $KUBERNETES_SERVICE_HOST "
                         "(in a pod) or $WEIGHTCACHE_KUBE_API")
    return ServingLabelWriter.from_environment()


def _device(args: argparse.Namespace) -> "Device":
    from ..arena.devices import Device, resolve_backend, select_devices

    backend = resolve_backend(args.backend)
    if backend == "cpu":
        return Device("cpu", f"cpu-{args.tp_rank}", args.tp_rank)
    return select_devices("cuda", args.device)[0]
