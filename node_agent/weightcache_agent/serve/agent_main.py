"""`weightcache agent`: parse flags, load the model, serve until SIGTERM.

With `--socket` this process is one agent serving one rank; with `--socket-dir` it is the
node supervisor (supervisor.py), which runs one `--socket` agent per rank as a worker.

Exit status: 0 after a clean shutdown (SIGTERM), 1 when the checkpoint, memory or the
socket's place says no (model directory missing, path too long, directory unusable), 2 for
a refused spec (bad flag, refused quantization method, bad environment variable), 3 when
another agent already serves the socket, 130 after Ctrl-C (SIGINT). Everything a person
can get wrong is checked before the socket is bound or a directory created.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedQuantization, WeightCacheError
from ..logs import configure
from .integrity import SCRUB_INTERVAL
from ..quantization import ALLOWED, quantization_arg
from ..spec import DTYPE_CHOICES, CacheSpec
from ..usage import (EXIT_BUSY, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, TORCH_INSTALL,
                     parser as usage_parser, refuse)

if TYPE_CHECKING:  # devices is imported where a backend is chosen, after the flags are checked
    from ..arena.devices import Device
    from ..load.prefetch import Prefetch

log = logging.getLogger("weightcache.agent")
PROG = "weightcache agent"
SWITCH_INTERVAL = 0.0005
AGENT_NICE = -10  # CFS weight ~9x a default process: status and attaches stay prompt while engines bind at once


# The environment variables the agent reads, for its --help.
ENVIRONMENT = {
    "WEIGHTCACHE_SOCKET_GROUP": "default of --socket-group",
    "WEIGHTCACHE_HTTP_HOST, POD_IP": "default of --http-host (node mode)",
    "WEIGHTCACHE_CONTROL_TOKEN_FILE": "default of --control-token-file (node mode)",
    "NODE_NAME": "default of --node-name (node mode); a pod token of another node is refused",
    "WEIGHTCACHE_DIRECT_IO": "auto | on | off: O_DIRECT reads of the checkpoint (default auto)",
    "WEIGHTCACHE_READERS": "reader threads of a cold load (default 2: more only interleave the disk's stream)",
    "WEIGHTCACHE_MEMORY_LIMIT": "most host memory a cpu arena may take, e.g. 64Gi (default: what the host "
                                "and its cgroup have available)",
    "WEIGHTCACHE_PROGRESS_INTERVAL": "seconds between progress log lines without a terminal (default 5; 0: "
                                     "none)",
    "WEIGHTCACHE_KUBE_API": "API server URL, https://HOST[:PORT], for the serving-label write and the "
                            "TokenReviews of engines' pod tokens (default: in a pod, "
                            "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT); with it set, "
                            "--label-pods auto and --pod-identity auto are on outside a pod too",
    "WEIGHTCACHE_KUBE_TOKEN": "file with the agent's bearer token for that API server, read again when it "
                              "changes (default: the pod's service-account token, "
                              "/var/run/secrets/kubernetes.io/serviceaccount/token)",
    "WEIGHTCACHE_KUBE_CA": "CA bundle (PEM file) that the API server's certificate is checked against "
                           "(default: the pod's /var/run/secrets/kubernetes.io/serviceaccount/ca.crt)"}


def build_parser() -> argparse.ArgumentParser:
    p = usage_parser(
        PROG, "Load a model once and serve it zero-copy to engines.",
        examples=["weightcache agent --model /models/llama-3-8b --socket /run/weightcache/llama.sock",
                  "weightcache agent --model /models/qwen --socket-dir /run/weightcache/qwen --tp-size 2 "
                  "--quantization fp8-block"],
        env=ENVIRONMENT,
        codes=(EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BUSY, EXIT_INTERRUPTED))
    p.add_argument("--model", required=True, help="checkpoint directory (*.safetensors + config.json)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="Unix socket path to serve one rank on")
    where.add_argument("--socket-dir", help="node mode: run one worker per rank, each serving <dir>/<GPU-UUID>.sock")
    _add_node_flags(p)
    _add_weight_flags(p)
    _add_limit_flags(p)
    _add_cluster_flags(p)
    _add_output_flags(p)
    return p


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    """Node mode: the rank workers, the devices they take, and the HTTP endpoints."""
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
    node.add_argument("--cache", help="NAMESPACE/NAME[/UID] of the WeightCache served (the operator passes it): "
                                      "recorded in the socket directory, and an agent of another cache that finds "
                                      "the directory recorded as not its own refuses to serve")


def _add_weight_flags(p: argparse.ArgumentParser) -> None:
    """What is served: device, dtype, quantization, tensor parallelism, revision."""
    p.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when a GPU is visible")
    p.add_argument("--device", default=None, help="GPU ordinal (0, or cuda:0) or UUID (cuda backend; default: 0)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="dtype of the served weights (auto: the checkpoint's)")
    add_quantization_flag(p)
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size: ranks the weights are split over")
    p.add_argument("--tp-rank", type=int, default=0, help="the rank this agent serves (with --socket)")
    p.add_argument("--peer-socket", help="another replica's socket for this rank: copy its arena (device to device) "
                                         "instead of reading the checkpoint; the disk if that fails")
    p.add_argument("--rank-sockets", help="with --socket and --tp-size > 1: every rank's socket of this replica, "
                                          "comma-separated in rank order (this one included), so that all ranks "
                                          "promote the same engine; rank 0's agent decides (node mode passes it)")
    p.add_argument("--sharding", help="sharding preset name or YAML rules file (default: chosen from config.json)")
    p.add_argument("--expert-parallel", action="store_true", help="place whole experts per rank")
    # Accepted from older manifests and scripts, and ignored: every arena now serves both namings.
    p.add_argument("--layout", choices=("file", "vllm"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--revision", help="revision label, part of the fingerprint: an engine that names another "
                                      "revision is refused")


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Who may connect and how much each may hold: the bounds a hostile client meets."""
    p.add_argument("--handshake-timeout", type=float, default=10.0,
                   help="seconds a new connection may take to send its first complete request")
    p.add_argument("--socket-group", default=os.environ.get("WEIGHTCACHE_SOCKET_GROUP") or None,
                   help="group (name or gid) whose members may connect to the socket, besides root "
                        "(default: $WEIGHTCACHE_SOCKET_GROUP, else none)")
    p.add_argument("--max-leases", type=int, default=256, help="engines one socket serves at most")
    p.add_argument("--max-leases-per-uid", type=int, default=None,
                   help="leases one uid may hold (and arenas handed out ahead of its attaches); default: half of "
                        "--max-leases")
    p.add_argument("--max-pending-per-uid", type=int, default=None,
                   help="connections one uid may have in their first request; default: a quarter of --max-pending")
    p.add_argument("--max-connections-per-uid", type=int, default=None,
                   help="connections one uid may hold open; default: its lease cap plus its pending cap")
    p.add_argument("--scrub-interval", type=float, default=SCRUB_INTERVAL, metavar="SECONDS",
                   help="start a check of the arena's bytes against its keyed digest this often, paced to 1%% of "
                        "the device's time (0: only on demand)")
    p.add_argument("--max-pending", type=int, default=64,
                   help="connections still sending their first request; past it the oldest is dropped")
    p.add_argument("--nice", type=int, default=AGENT_NICE, metavar="N",
                   help=f"scheduling niceness to run at (default {AGENT_NICE}), so engines busy on every core cannot keep "
                        "the agent from answering them; needs root or CAP_SYS_NICE, else the inherited priority stays")
    p.add_argument("--adopt-wait", type=float, default=3.0,
                   help="after a restart with engines still attached, seconds to wait for one to hand the arena back")


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """In a cluster: the serving label on a promotion, engines' pods proven by their tokens."""
    p.add_argument("--label-pods", choices=("auto", "on", "off"), default="auto",
                   help="on a promotion, label the engine's pod weightcache.io/serving=true through the API server "
                        "(auto: when running in a cluster; rank 0 only)")
    p.add_argument("--pod-identity", choices=("auto", "on", "off"), default="auto",
                   help="engines that name a pod or a group prove which pod they are with a projected service-account "
                        "token, checked by a TokenReview (auto: when running in a cluster)")
    p.add_argument("--identity-audience", default="weightcache.io",
                   help="the audience engine pods' projected tokens are minted for (default weightcache.io)")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """What the agent prints: log lines and the progress bar."""
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="log lines for people or collectors")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal); without a bar, a log line every "
                        "$WEIGHTCACHE_PROGRESS_INTERVAL seconds (default 5; 0: none)")


def add_quantization_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", type=quantization_arg, choices=ALLOWED, default="none",
                   help="none: the checkpoint's dtype; fp8-block: block-scaled FP8, quantized on load or taken "
                        "from an FP8 checkpoint (what 'fp8' means here)")


def preflight(args: argparse.Namespace) -> str | None:
    """The first mistake in the flags and environment that no load could survive, or None.

    Checked before a socket is bound or a directory made: a mistake leaves nothing behind.
    """
    if not os.environ.get("WEIGHTCACHE_DIRECT_IO", "").strip():
        return None  # the common case: no import of the loader (and torch) just to check nothing
    from ..load.reading import DIRECT_IO_ENV, DIRECT_IO_MODES

    direct = os.environ.get(DIRECT_IO_ENV, "").strip().lower()
    if direct not in DIRECT_IO_MODES:
        return (f"${DIRECT_IO_ENV}={os.environ[DIRECT_IO_ENV]!r} is not a mode: set it to one of "
                f"{', '.join(DIRECT_IO_MODES)}, or unset it")
    return None


def raise_priority(nice: int) -> None:
    """Run at `nice` where that is higher priority than the inherited one. Before any thread starts: on
    Linux a thread's niceness is its own, and new threads inherit their creator's."""
    try:
        if nice < os.getpriority(os.PRIO_PROCESS, 0):
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        log.debug("cannot raise the scheduling priority to nice %d without CAP_SYS_NICE; keeping it", nice)


def model_problem(path: str) -> str | None:
    """Why `path` cannot be a checkpoint directory, or None."""
    if not os.path.exists(path):
        return f"model directory not found: {path}: pass the checkpoint directory (*.safetensors + config.json) with --model"
    if not os.path.isdir(path):
        return f"--model {path} is a file, not a directory: pass the directory that holds it"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return (f"no config.json in {path}: a checkpoint needs the model's config.json beside its *.safetensors "
                "(engines build the model from it, the agent checks shapes and shards by it); copy it from where the "
                "weights came from")
    return None


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from ..load.progress import interval_problem  # no torch: a refusal stays instant

    if (problem := interval_problem()) is not None:  # before any worker: each would refuse it alike
        return refuse(PROG, problem, EXIT_USAGE)
    configure(args.log_format)
    problem = preflight(args)
    if problem:
        return refuse(PROG, problem, EXIT_USAGE)
    problem = model_problem(args.model)
    if problem:  # a node agent's workers would each refuse it alike
        return refuse(PROG, problem, EXIT_FAILED)
    if args.socket_dir is not None:
        raise_priority(args.nice)
        from .node_main import run_node

        return run_node(args, parser)
    try:
        spec = CacheSpec(model=args.model, tp_size=args.tp_size, tp_rank=args.tp_rank, quantization=args.quantization,
                         dtype=args.dtype, sharding=args.sharding, expert_parallel=args.expert_parallel,
                         revision=args.revision)
    except UnsupportedQuantization as e:
        return refuse(PROG, str(e), EXIT_USAGE)
    except ValueError as e:
        return refuse(PROG, f"bad spec: {e}", EXIT_USAGE)
    from .access import AccessError, check_socket_place

    try:
        check_socket_place(args.socket)
    except AccessError as e:
        return refuse(PROG, str(e), EXIT_FAILED)
    read_ahead = start_read_ahead(args)  # before the priority is raised: this thread keeps the one it was born with
    try:
        return _serve(args, spec, read_ahead)
    finally:
        if read_ahead is not None:  # a refusal, or the load is over (it stopped it then)
            read_ahead.stop()


def start_read_ahead(args: argparse.Namespace) -> "Prefetch | None":
    """The checkpoint's files read into the page cache from now on, while this process goes on
    starting (its imports, the GPU's context, the plan), for the load to read behind
    (load/prefetch.py). None where a load from disk of whole files is not coming: a
    tensor-parallel rank (it reads only its shards), a replica that copies a peer's arena, an agent
    whose predecessor's state file is beside the socket (it may adopt an engine's arena)."""
    from .sidecar import sidecar_path

    if args.tp_size != 1 or args.peer_socket or os.path.lexists(sidecar_path(os.path.abspath(args.socket), "state")):
        return None
    from ..load.prefetch import Prefetch, lead_for, shard_paths

    paths = shard_paths(os.path.abspath(args.model))
    # The backend is not known yet (that needs the driver): bound the lead as for a host arena until the load says.
    return Prefetch(paths, lead=lead_for(paths, host_arena=True)) if paths else None


def _serve(args: argparse.Namespace, spec: CacheSpec, read_ahead: "Prefetch | None") -> int:
    raise_priority(args.nice)
    # A thread per client: when dozens attach at once, a status request waits for the GIL behind
    # them, up to one switch interval per hand-over (5 ms by default).
    sys.setswitchinterval(SWITCH_INTERVAL)
    from .access import AccessError, SocketPolicy
    from .agent import Agent  # after the spec and path checks: refusals stay instant
    from .stop import StopFlag

    show = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
    try:
        device = _device(args)
        policy = SocketPolicy.from_group(args.socket_group)
    except (ValueError, AccessError) as e:  # a bad --backend/--device value, an unknown --socket-group
        return refuse(PROG, str(e), EXIT_USAGE)
    rank_sockets = [os.path.abspath(p) for p in (args.rank_sockets or "").split(",") if p]
    if rank_sockets and (len(rank_sockets) != args.tp_size or rank_sockets[args.tp_rank] != os.path.abspath(args.socket)):
        return refuse(PROG, f"--rank-sockets names {len(rank_sockets)} socket(s) for --tp-size {args.tp_size}, and "
                            f"entry {args.tp_rank} (this rank) must be --socket {args.socket}", EXIT_USAGE)
    writer = _serving_label_writer(args.label_pods) if spec.tp_rank == 0 else None
    try:
        verifier = _pod_verifier(args.pod_identity, args.identity_audience)
    except WeightCacheError as e:
        return refuse(PROG, str(e), EXIT_USAGE)
    agent = Agent(spec, args.socket, show_progress=show, handshake_timeout=args.handshake_timeout, device=device,
                  adopt_wait=args.adopt_wait, policy=policy, max_leases=args.max_leases, max_pending=args.max_pending,
                  max_leases_per_uid=args.max_leases_per_uid, max_pending_per_uid=args.max_pending_per_uid,
                  max_connections_per_uid=args.max_connections_per_uid, scrub_interval=args.scrub_interval,
                  on_promote=_promotion_hook(writer),
                  peer=args.peer_socket, read_ahead=read_ahead, pod_verifier=verifier,
                  rank_sockets=rank_sockets)
    try:
        agent.bind()
    except AccessError as e:
        return refuse(PROG, str(e), EXIT_FAILED)
    except OSError as e:
        return refuse(PROG, f"cannot serve {args.socket}: {e.strerror or e}", EXIT_FAILED)
    except WeightCacheError as e:  # another agent serves the socket
        return refuse(PROG, str(e), EXIT_BUSY)
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
        if isinstance(e, ModuleNotFoundError) and e.name == "torch":  # a load that casts or quantizes on the CPU
            return refuse(PROG, f"load failed: this load casts or quantizes, which needs torch, not installed here: "
                                f"{TORCH_INSTALL}", EXIT_FAILED)
        return refuse(PROG, str(e) if isinstance(e, WeightCacheError) else
                      f"load failed: {type(e).__name__}: {e}", EXIT_FAILED)
    if stop.signal == signal.SIGINT:
        log.info("interrupted (Ctrl-C); shut down")
        return EXIT_INTERRUPTED
    log.info("shut down cleanly")
    return EXIT_OK


def _serving_label_writer(mode: str) -> Any:
    """The node-side label writer, when asked for (or, with auto, when in a cluster)."""
    if mode == "off":
        return None
    from .serving_label import ServingLabelWriter, in_cluster_api_url

    if mode == "on" and not in_cluster_api_url():
        raise SystemExit("weightcache agent: --label-pods on needs the API server: $KUBERNETES_SERVICE_HOST "
                         "(in a pod) or $WEIGHTCACHE_KUBE_API")
    return ServingLabelWriter.from_environment()


def _promotion_hook(writer: Any) -> Any:
    """What the agent calls on a promotion: hand the pod to the coalescing label writer."""
    if writer is None:
        return None
    from .serving_label import PromotionLabels

    labels = PromotionLabels(writer)
    return lambda lease: labels.promoted(lease.group or "", lease.pod, lambda: lease.serving)


def _pod_verifier(mode: str, audience: str) -> Any:
    """The TokenReview client that proves engines' pods, when asked for (or, with auto, in a cluster)."""
    if mode == "off":
        return None
    from .pod_identity import PodVerifier
    from .serving_label import in_cluster_api_url

    if not in_cluster_api_url():
        if mode == "on":
            raise WeightCacheError("--pod-identity on needs the API server: $KUBERNETES_SERVICE_HOST (in a pod) or "
                                   "$WEIGHTCACHE_KUBE_API")
        return None
    return PodVerifier(audience=audience, node=os.environ.get("NODE_NAME"))


def _device(args: argparse.Namespace) -> "Device":
    from ..arena.devices import Device, resolve_backend, select_devices

    backend = resolve_backend(args.backend)
    if backend == "cpu":
        if args.device is not None:  # a GPU named where none is used: refused, never served from memory instead
            where = ("--backend cpu uses none" if args.backend == "cpu" else
                     "this machine shows no GPU (the cuda backend needs a visible GPU and cuda-bindings), so the "
                     "cpu backend is what is available")
            raise ValueError(f"--device {args.device} names a GPU, but {where}: leave --device out")
        return Device("cpu", f"cpu-{args.tp_rank}", args.tp_rank)
    device = args.device or "0"
    if device.startswith("cuda:"):  # torch's spelling of an ordinal
        device = device[len("cuda:"):]
    return select_devices("cuda", device)[0]
