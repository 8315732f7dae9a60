"""`weightcache engine`: run the reference engine until SIGTERM/SIGINT.

Order matters for operators: the HTTP server binds first (so /healthz answers and the
chosen port is known while weights arrive), then the weights are attached, then the
engine warms up and /readyz turns 200 (a primary) or stays 503 until promotion (a
standby). Exit status: 0 after a clean shutdown, 1 when loading or attaching failed
(including a refused second primary), 2 for bad flags. With `--tp-size N` and no
`--tp-rank`, this process is the launcher of all N ranks (engine/launch.py).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from ..errors import WeightCacheError
from ..logs import configure
from ..serve.agent_main import add_quantization_flag, model_problem, preflight
from ..spec import DTYPE_CHOICES
from ..usage import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, EXIT_FAILED, parser as usage_parser, refuse, torch_problem

log = logging.getLogger("weightcache.engine")


def build_parser() -> argparse.ArgumentParser:
    p = usage_parser(
        "weightcache engine", "Reference engine that attaches its weights from a weightcache agent: its own "
        "Llama/Qwen2/Mistral decoder, any other causal LM through transformers. POST /generate takes and returns "
        "token ids (it has no tokenizer).",
        examples=["weightcache engine --model /models/llama-3-8b --socket /run/weightcache/llama.sock --port 8000",
                  "weightcache engine --model /models/qwen --tp-size 2 --port 8000  # one process per rank",
                  "curl -s localhost:8000/generate -d '{\"tokens\": [1, 450, 4996], \"max_tokens\": 16}'  "
                  "# token ids in and out: the reference engine has no tokenizer"],
        env={"WEIGHTCACHE_MODEL": "the checkpoint directory, when --model is not given (set in EngineSet pods)",
             "WEIGHTCACHE_SOCKET": "the agent's socket, when --socket is not given",
             "WEIGHTCACHE_SOCKET_DIR, WEIGHTCACHE_DEVICES": "else: the socket of this rank's GPU (set in EngineSet pods)",
             "WEIGHTCACHE_ROLE, WEIGHTCACHE_GROUP": "defaults of --role and --group",
             "WEIGHTCACHE_ENGINE_ID": "default of --engine-id",
             "WEIGHTCACHE_SHARDING": "default of --sharding (set in EngineSet pods)",
             "WEIGHTCACHE_POD_NAMESPACE, _NAME, _UID": "this pod, for the agent's serving label (set in EngineSet pods)",
             "WEIGHTCACHE_DIRECT_IO": "auto | on | off: O_DIRECT reads of the checkpoint (--mode off, --fallback)",
             "WEIGHTCACHE_ENGINE_START": "overlapped (default) | sequential: start-up steps side by side, or one "
                                         "after another (to measure what overlapping saves)"},
        codes=(EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED))
    p.add_argument("--model", default=os.environ.get("WEIGHTCACHE_MODEL") or None,
                   help="checkpoint directory (*.safetensors + config.json; default: $WEIGHTCACHE_MODEL, which an "
                        "EngineSet sets to its cache's model). A model_type other than llama/qwen2/mistral is served "
                        "with transformers (the transformers extra)")
    p.add_argument("--socket", help="the agent's Unix socket (default: $WEIGHTCACHE_SOCKET, else this rank's device "
                                    "socket in $WEIGHTCACHE_SOCKET_DIR); not needed with --mode off")
    p.add_argument("--mode", choices=("client", "daemon", "off"), default="client",
                   help="client: attach to a running agent; daemon: start one if none answers; off: load from disk in-process")
    p.add_argument("--fallback", action="store_true", help="load from disk if the agent is missing or holds other weights")
    p.add_argument("--role", choices=("primary", "standby", "auto"), default=os.environ.get("WEIGHTCACHE_ROLE") or "primary",
                   help="auto: primary when the group has none, else standby (default: $WEIGHTCACHE_ROLE or primary)")
    p.add_argument("--group", default=os.environ.get("WEIGHTCACHE_GROUP") or None,
                   help="hot-standby group: a standby takes over when its group's primary dies (default: $WEIGHTCACHE_GROUP)")
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long requests in flight may take to finish")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address ('0.0.0.0' for every IPv4 address)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port, see --port-file)")
    p.add_argument("--port-file", help="write the bound HTTP port here once listening")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size the agent serves")
    p.add_argument("--tp-rank", type=int, default=None,
                   help="this process's rank; left out with --tp-size > 1, this process starts every rank (one "
                        "process each, as in a pod) and keeps them together")
    p.add_argument("--sharding", default=os.environ.get("WEIGHTCACHE_SHARDING") or None,
                   help="the cache's sharding preset or rules file, as the agent was given it (default: "
                        "$WEIGHTCACHE_SHARDING, which an EngineSet sets from its cache; else chosen from config.json)")
    p.add_argument("--engine-id", default=os.environ.get("WEIGHTCACHE_ENGINE_ID") or None,
                   help="names this engine on every rank, so that the ranks' agents promote it together (default: "
                        "$WEIGHTCACHE_ENGINE_ID, else --dist-init with --tp-size > 1; in a pod its uid is used)")
    p.add_argument("--dist-init", help="tcp://HOST:PORT where the ranks of a tensor-parallel engine meet (PORT+1 "
                                       "carries rank 0's requests to the others); the same on every rank")
    add_quantization_flag(p)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="dtype of the weights (auto: the checkpoint's)")
    p.add_argument("--max-context", type=int, help="prompt + new tokens limit (default: the model's)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="upper bound for a request's max_tokens")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="log lines for people or collectors")
    p.add_argument("--log-level", choices=("debug", "info", "warning"), default="info", help="least severe level logged")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure(args.log_format, getattr(logging, args.log_level.upper()))
    refused = _check_flags(parser, args)
    if refused is not None:
        return refused
    if args.tp_size > 1 and args.tp_rank is None:
        from .launch import launch

        return launch(argv, args.tp_size, args.dist_init, args.drain_seconds)
    args.tp_rank = args.tp_rank or 0
    server = _start_up(args)
    options = server.EngineOptions(
        model=args.model, socket=args.socket, mode=args.mode, role=args.role, group=args.group, fallback=args.fallback,
        tp_size=args.tp_size, tp_rank=args.tp_rank, quantization=args.quantization, dtype=args.dtype,
        max_context=args.max_context, max_new_tokens=args.max_new_tokens, dist_init=args.dist_init,
        engine_id=args.engine_id, sharding=args.sharding)
    if args.tp_size > 1 and args.tp_rank > 0:
        return _follow(options)  # no HTTP: rank 0 takes the requests for the whole engine
    return _serve(args, options, server)


def _check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    """The exit status of a refusal, or None: the flags, the model and torch are fit to start with."""
    if not args.model:
        parser.error("--model (or $WEIGHTCACHE_MODEL) is required")
    if args.mode != "off" and not (args.socket or os.environ.get("WEIGHTCACHE_SOCKET")
                                   or os.environ.get("WEIGHTCACHE_SOCKET_DIR")):
        parser.error(f"--mode {args.mode} needs --socket (or $WEIGHTCACHE_SOCKET, or $WEIGHTCACHE_SOCKET_DIR)")
    if args.role == "standby" and not args.group:
        return refuse("weightcache engine", "--role standby needs --group (or $WEIGHTCACHE_GROUP): a standby takes "
                      "over only from the primary of its group; start that primary with the same --group", EXIT_USAGE)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    problem = preflight(args)
    if problem:
        return refuse("weightcache engine", problem, EXIT_USAGE)
    problem = model_problem(args.model) or torch_problem("the engine")
    if problem:
        return refuse("weightcache engine", problem, EXIT_FAILED)
    return None


def _start_up(args: argparse.Namespace) -> Any:
    """The agent's GPU found while torch imports (engine/startup.py), then torch; engine/server.py, imported
    before start-up's "imports done" mark, as it counts among them."""
    from .startup import begin

    if args.mode != "off":
        from ..client.env import socket_from_env

        try:
            begin(args.socket or socket_from_env(args.tp_rank))  # the agent's GPU, found while torch imports
        except ValueError:
            begin(None)  # attach names what is missing
    import torch  # after flag checks: a typo costs no torch import

    from . import server

    from .startup import PHASES

    PHASES.mark("imports done")
    if args.threads:
        torch.set_num_threads(args.threads)
    return server


def _serve(args: argparse.Namespace, options: Any, server_module: Any) -> int:
    """Rank 0 (or the only rank): HTTP, the attach, and serving until SIGTERM/SIGINT."""
    from ..serve.stop import StopFlag

    try:
        engine = server_module.Engine(options)
    except (ValueError, WeightCacheError) as e:
        print(f"weightcache engine: {e}", file=sys.stderr)
        return 2

    stop = StopFlag().on_signals()  # a self-pipe: safe to raise from a signal handler, unlike Event.set
    try:
        server = server_module.make_server(engine, args.host, args.port)
    except OSError as e:
        print(f"weightcache engine: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    host, port = server.server_address[:2]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, args.port_file)  # readers never see a half-written file
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="http", daemon=True).start()
    log.info("pid %d listening on http://%s:%d (role=%s, group=%s, mode=%s)", os.getpid(), host, port, args.role,
             args.group, args.mode)

    code = 0
    try:
        engine.load()
    except (WeightCacheError, ValueError, OSError) as e:
        log.error("cannot serve: %s", e)
        code = 1
    except Exception:
        log.exception("cannot serve: load failed")
        code = 1
    if code == 0:
        while not stop.wait(0.5):
            pass
        left = engine.drain(args.drain_seconds)
        log.info("shutting down (served %d requests%s)", engine.requests,
                 f"; {left} still in flight after {args.drain_seconds:g}s" if left else "")
    server.shutdown()
    server.server_close()
    engine.close()
    if code == 0 and stop.signal == signal.SIGINT:
        return EXIT_INTERRUPTED
    return code


def _follow(options: "object") -> int:
    from .server import _prepare_device, load_model
    from .tp_engine import check_tp_options, follow

    try:
        check_tp_options(options)
    except ValueError as e:
        return refuse("weightcache engine", str(e), EXIT_USAGE)
    try:
        return follow(options, load_model, _prepare_device)
    except (WeightCacheError, ValueError, OSError) as e:
        log.error("cannot serve: %s", e)
        return EXIT_FAILED
