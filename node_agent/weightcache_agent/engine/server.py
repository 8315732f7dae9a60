"""The reference inference engine: one model, attached through the public client, over HTTP.

It exists to show (and test) what an engine gains from the cache: build the model on the
meta device, `attach()` it to the agent's arena, serve. Flow: `Engine` holds the model
and its state (starting -> attaching -> warming -> serving, or failed); `Engine.load()`
runs attach + RoPE tables + one warm-up pass; `make_server()` wraps it in the stdlib
`ThreadingHTTPServer` (started before the load, so /healthz answers while weights
arrive). Readiness is role-aware: a primary is ready once warmed up, a standby is
attached and warm but answers 503 until the agent promotes it, at which point the
client's callback flips `role` and the very next request is served.

Endpoints: `POST /generate` {"tokens": [int], "max_tokens": int} -> {"tokens": [int]};
`GET /healthz` (the process is alive; details as JSON); `GET /readyz` (200 only when
this engine should take traffic). Every error is JSON {"error": message} with a 4xx/5xx.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any


from ..client.env import socket_from_env
from ..client.session import Attachment, attach
from ..errors import WeightCacheError
from ..protocol import agent_status, parse_json
from ..load.checkpoint import open_checkpoint
from ..load.dtypes import torch_dtype
from ..load.fingerprint import resolved_dtype
from .hf_model import load_transformers_model, native
from .model import CausalLM, ModelConfig, build_model
from .startup import PHASES, early_device, overlapped, warm_local
from .tp_engine import LeaderStart, TensorParallelLeader, abandon_pending, check_tp_options
from ..spec import CacheSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger("weightcache.engine")

MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT = 30.0  # seconds a client may leave a request unfinished
ROLES = ("primary", "standby", "auto")
RANKS_WAIT = 0.5  # seconds a promoted rank 0 waits for the other ranks' promotions (under the agent's 1 s)


@dataclass(frozen=True)
class EngineOptions:
    model: str
    socket: str | None = None
    mode: str = "client"  # client | daemon | off
    role: str = "primary"
    group: str | None = None
    fallback: bool = False
    tp_size: int = 1
    tp_rank: int = 0
    quantization: str = "none"
    dtype: str = "auto"
    max_context: int | None = None  # prompt + new tokens; default: the model's max_position_embeddings
    max_new_tokens: int = 256
    dist_init: str | None = None  # tcp://HOST:PORT of the tensor-parallel rendezvous (tp_size > 1)
    engine_id: str | None = None  # names the engine across its ranks (default: dist_init when tp_size > 1)
    sharding: str | None = None  # the cache's sharding preset or rules file (default: chosen from config.json)

    @property
    def engine(self) -> str | None:
        """What the agents know this engine by on every rank: one id for all its ranks (group promotion)."""
        return self.engine_id or (self.dist_init if self.tp_size > 1 else None)

    def spec(self) -> CacheSpec:
        return CacheSpec(model=self.model, tp_size=self.tp_size, tp_rank=self.tp_rank,
                         quantization=self.quantization, dtype=self.dtype, sharding=self.sharding)


class BadRequest(Exception):
    """A request the engine refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.status = int(status)


def model_config(spec: CacheSpec) -> ModelConfig:
    """The model's config, with the dtype the loader will give non-quantized tensors."""
    dtype = torch_dtype(resolved_dtype(spec, open_checkpoint(spec.model)))
    return ModelConfig.from_pretrained(spec.model, dtype=dtype, quantization=spec.quantization, tp_size=spec.tp_size)


def load_model(spec: CacheSpec, mode: str = "off", socket: str | None = None, **attach_args: Any) -> tuple[CausalLM, Attachment]:
    """Build the model on meta, attach it, compute RoPE tables: the engine's load path, reusable in-process.
    An architecture the engine does not implement is transformers' (`hf_model`)."""
    if not native(spec.model):
        return load_transformers_model(spec, mode=mode, socket=socket, **attach_args)
    model = build_model(model_config(spec))
    attachment = attach(model, spec, socket=socket, mode=mode, **attach_args)
    try:
        model.prepare()
    except BaseException:
        attachment.close()
        raise
    return model, attachment


def _prepare_device(socket: str | None) -> "torch.device | None":
    """Make the GPU's context, warm the attach path and map the agent's arena (`prepare()`)
    before attaching; returns the device the agent serves (None: no agent answered).

    Both are once-per-process start-up costs (the context hundreds of ms, the attach path's
    first use ~20 ms), not part of getting the weights; paid first, the attach is as fast as
    a later one. The agent's answer and the context may already have been found beside
    torch's import (`startup.begin`). An agent that does not answer is left to `attach` to
    report (or fall back from).
    """
    import torch

    from ..client.warmup import prepare

    early = early_device(socket) if socket else None
    if early is not None:
        status = early.status or {}
    else:
        try:
            status = agent_status(socket) if socket else {}
        except WeightCacheError:
            return None
    if status.get("backend") != "cuda" or not status.get("device"):
        if status.get("backend") == "cpu":
            prepare("cpu", socket=socket)
            PHASES.mark("attach path prepared")
            return torch.device("cpu")
        return None
    from ..arena.devices import local_ordinal

    ordinal = early.ordinal if early is not None and early.ordinal is not None else local_ordinal(status["device"])
    torch.cuda.set_device(ordinal)
    torch.empty(1, device=f"cuda:{ordinal}")
    PHASES.mark("context current")
    prepare(ordinal, socket=socket)
    PHASES.mark("attach path prepared")
    return torch.device(f"cuda:{ordinal}")


class Engine:
    def __init__(self, options: EngineOptions):
        if options.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {options.role!r}")
        if options.tp_size > 1:
            check_tp_options(options)
        self.options = options
        self.spec = options.spec()
        self.role = options.role  # "auto" until the agent says which
        self.draining = False  # demoted by a planned switchover: finish what comes, take no new role
        self.in_flight = 0
        self.state = "starting"
        self.error: str | None = None
        self.model: CausalLM | None = None
        self.attachment: Attachment | None = None
        self.started = time.monotonic()
        self.promoted_at: float | None = None
        self.requests = 0
        self._lock = threading.Lock()  # one forward at a time: CPU threads are shared anyway
        self._roles = threading.Condition()  # the tensor-parallel role, as the ranks report theirs
        self.tp: TensorParallelLeader | None = None  # rank 0 of a tensor-parallel engine: its peers
        self._start: LeaderStart | None = None  # rank 0, until its peers joined

    # -- lifecycle -----------------------------------------------------------------------------

    def load(self) -> None:
        """Attach the weights and warm up. On failure `state` is "failed" and the error is re-raised."""
        try:
            self.state = "attaching"
            opts = self.options
            device = None
            if opts.mode != "off":
                try:
                    device = _prepare_device(opts.socket or socket_from_env(opts.tp_rank))
                except ValueError:
                    pass  # no socket anywhere: attach says so
            PHASES.mark("device ready")
            if opts.tp_size > 1 and overlapped():
                import torch

                self._start = LeaderStart(opts, device or torch.device("cpu"))
            model, self.attachment = load_model(self.spec, mode=opts.mode, socket=opts.socket, fallback=opts.fallback,
                                                role=opts.role, group=opts.group, on_promote=self._on_promote,
                                                on_demote=self._on_demote, engine=opts.engine)
            PHASES.mark("attached")
            self.role = self.attachment.role
            log.info("attached %s from %s in %.2f ms (%d tensors, %.1f MiB, role=%s, group=%s); phases %s",
                     os.path.basename(os.path.abspath(opts.model)), self.attachment.source,
                     self.attachment.seconds * 1e3, len(self.attachment.tensors), self.attachment.bytes / 2**20,
                     self.role, opts.group, {k: round(v * 1e3, 2) for k, v in self.attachment.phases.items()})
            if self.role == "standby" and self.attachment.source == "agent":
                self._warn_without_primary()
            if opts.tp_size > 1:
                if self._start is not None:
                    warm_local(model)
                    PHASES.mark("local warm-up")
                self.tp = TensorParallelLeader(model, self.attachment, opts, on_change=self._update_role,
                                               start=self._start)
                self._start = None
                self._update_role()
            self.state = "warming"
            t0 = time.perf_counter()
            # First-call costs (allocator, kernel selection, the collectives' set-up) are paid before
            # traffic, for both shapes a request takes: a multi-token prefill and one-token decode steps.
            if self.tp is not None:
                self.tp.link.run([0] * 8, 3)
            model.generate([0] * 8, 3)
            self.model = model
            self.state = "serving"
            PHASES.mark("serving")
            log.info("warmed up in %.1f ms; %s", (time.perf_counter() - t0) * 1e3,
                     "ready for traffic" if self.ready else "standing by for promotion")
            PHASES.log("rank 0" if opts.tp_size > 1 else "engine")
        except BaseException as e:
            self.state, self.error = "failed", str(e) or type(e).__name__
            raise

    def _warn_without_primary(self) -> None:
        """One line when this standby's group has no primary yet: engines may start in any order, but a
        standby whose primary was started in no group (or another) would never be promoted."""
        group, socket = self.options.group, self.options.socket or socket_from_env(self.options.tp_rank)
        try:
            clients = agent_status(socket)["clients"]
        except (WeightCacheError, KeyError, TypeError):
            return  # the attach itself worked: a status that does not is no reason to stop
        if not any(c.get("role") == "primary" and c.get("group") == group for c in clients):
            log.warning("standby of group %r: the group has no primary on %s yet; this engine is promoted only when "
                        "a primary started with --group %s attaches and then goes", group, socket, group)

    def close(self) -> None:
        if self._start is not None:  # failed between the start of the collectives and the rank link
            self._start.close()
            abandon_pending(self._start.pending, 1)
        if self.tp is not None:
            self.tp.close()  # the other ranks see the link close and retire
        if self.attachment is not None:
            self.attachment.close()

    def _update_role(self) -> None:
        if self.tp is not None and self.attachment is not None:
            with self._roles:
                previous, self.role = self.role, self.tp.role()
                self._roles.notify_all()
            if previous != self.role:
                log.warning("tensor-parallel engine is %s now (primary only while every rank is); %s", self.role,
                            "serving traffic" if self.ready else "not serving")

    def _on_promote(self, attachment: Attachment) -> None:
        # Runs on the client's lease thread the moment the agent's message arrives.
        previous = self.role
        self.role = attachment.role
        self._update_role()  # tensor parallel: primary only once every rank is
        if self.tp is not None and self.role != "primary":
            # A group promotion promotes the other ranks first, so their reports are on the way over the
            # rank link: wait for them, so that this rank's acknowledgement -- after which the agent moves
            # the serving label -- means the whole engine serves.
            deadline = time.monotonic() + RANKS_WAIT
            with self._roles:
                while self.role != "primary" and (left := deadline - time.monotonic()) > 0:
                    self._roles.wait(left)
        self.promoted_at = time.monotonic()
        if self.role != attachment.role:  # tensor parallel, other ranks still standby
            log.warning("PROMOTED: rank 0 of group %s; serving once every rank is primary", self.options.group)
            return
        log.warning("PROMOTED: %s -> %s of group %s; now %s", previous, self.role, self.options.group,
                    "serving traffic" if self.ready else f"ready once {self.state} finishes")

    def _on_demote(self, attachment: Attachment) -> None:
        # A planned switchover made another engine primary. Requests routed here until the
        # cluster stops routing are still answered (make before break); /readyz says no.
        self.role, self.draining = attachment.role, True
        self._update_role()
        log.warning("DEMOTED: standby of group %s; draining (still answering until traffic moves)",
                    self.options.group)

    def drain(self, timeout: float) -> int:
        """Wait until no request is in flight (at most `timeout` s); returns how many still are."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.in_flight

    # -- state ---------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == "serving" and self.role == "primary"

    def not_ready_reason(self) -> str:
        if self.state == "failed":
            return f"failed: {self.error}"
        if self.state != "serving":
            return f"{self.state}: weights not ready yet"
        if self.role == "standby":
            return "standby: attached and warm, waiting for promotion"
        return ""

    def health(self) -> dict[str, Any]:
        att = self.attachment
        return {
            "status": "ok",
            "pid": os.getpid(),
            "state": self.state,
            "role": self.role,
            "group": self.options.group,
            "ready": self.ready,
            "draining": self.draining,
            "error": self.error,
            "model": os.path.abspath(self.options.model),
            "mode": self.options.mode,
            "source": att.source if att else None,
            "attach_seconds": att.seconds if att else None,
            "attach_phases": att.phases if att else None,
            "startup": PHASES.as_dict(),
            "bytes": att.bytes if att else 0,
            "fingerprint": att.fingerprint if att else None,
            "cache_miss": att.fallback_reason if att else None,
            "agent_connected": bool(att and att.agent_alive),
            "uptime_seconds": time.monotonic() - self.started,
            "requests": self.requests,
        }

    def metrics_text(self) -> str:
        """Prometheus text: where the weights came from, and cache misses (disk loads after a failed attach)."""
        att = self.attachment
        misses = int(att is not None and att.fallback_reason is not None)
        lines = ["# HELP weightcache_engine_cache_misses_total Attaches that fell back to a disk load (fallback=True)",
                 "# TYPE weightcache_engine_cache_misses_total counter",
                 f"weightcache_engine_cache_misses_total {misses}",
                 "# HELP weightcache_engine_weights_source Where this engine's weights came from (1 for the source)",
                 "# TYPE weightcache_engine_weights_source gauge"]
        lines += [f'weightcache_engine_weights_source{{source="{source}"}} {int(att is not None and att.source == source)}'
                  for source in ("agent", "disk")]
        lines += ["# HELP weightcache_engine_requests_total Generate requests served",
                  "# TYPE weightcache_engine_requests_total counter", f"weightcache_engine_requests_total {self.requests}"]
        return "\n".join(lines) + "\n"

    # -- requests ------------------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        limit = self.model.config.max_position_embeddings if self.model else 0
        return min(limit, self.options.max_context) if self.options.max_context else limit

    def parse_generate(self, body: bytes) -> tuple[list[int], int]:
        """Validate a /generate body; every refusal names what is wrong."""
        try:
            request = parse_json(body)
        except ValueError as e:
            raise BadRequest(f"body {e}") from None
        if not isinstance(request, dict):
            raise BadRequest(f"body must be a JSON object, got {type(request).__name__}")
        unknown = sorted(set(request) - {"tokens", "max_tokens"})
        if unknown:
            text = {"prompt", "text", "messages"} & set(unknown)
            raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))}; expected 'tokens' and 'max_tokens'"
                             + (" (this engine has no tokenizer: send token ids)" if text else ""))
        assert self.model is not None
        tokens, vocab = request.get("tokens"), self.model.config.vocab_size
        if not isinstance(tokens, list):
            raise BadRequest("'tokens' must be a list of token ids")
        if not tokens:
            raise BadRequest("'tokens' is empty: give at least one token id")
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or isinstance(t, bool):
                raise BadRequest(f"'tokens'[{i}] is {t!r}: token ids must be integers")
            if not 0 <= t < vocab:
                raise BadRequest(f"'tokens'[{i}] is {t}: outside the vocabulary [0, {vocab})")
        max_tokens = request.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise BadRequest(f"'max_tokens' must be an integer, got {max_tokens!r}")
        if not 1 <= max_tokens <= self.options.max_new_tokens:
            raise BadRequest(f"'max_tokens' must be in [1, {self.options.max_new_tokens}], got {max_tokens}")
        if len(tokens) + max_tokens > self.max_context:
            raise BadRequest(f"prompt of {len(tokens)} tokens + max_tokens {max_tokens} exceeds the context limit "
                             f"of {self.max_context}")
        return tokens, max_tokens

    def generate(self, body: bytes) -> dict[str, Any]:
        if not (self.ready or (self.draining and self.state == "serving")):
            raise BadRequest(f"not serving: {self.not_ready_reason()}", HTTPStatus.SERVICE_UNAVAILABLE)
        tokens, max_tokens = self.parse_generate(body)
        assert self.model is not None
        t0 = time.perf_counter()
        self.in_flight += 1  # read by drain(); the GIL makes += on an int safe enough for a gauge
        try:
            with self._lock:
                if self.tp is not None:
                    self.tp.link.run(tokens, max_tokens)  # every rank runs the same steps, in this order
                out = self.model.generate(tokens, max_tokens)
        finally:
            self.in_flight -= 1
        self.requests += 1
        return {"tokens": out, "seconds": time.perf_counter() - t0, "role": self.role,
                "fingerprint": self.attachment.fingerprint if self.attachment else None}


# -- HTTP ------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    server_version = "weightcache-engine"
    timeout = REQUEST_TIMEOUT  # a client that stops sending mid-request is dropped, not waited on forever
    protocol_version = "HTTP/1.1"  # keep-alive: pollers and load balancers reuse connections
    engine: Engine  # set on the subclass made by make_server

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._reply(200, self.engine.health())
        elif path == "/readyz":
            engine = self.engine
            # ?role=any: attached and warm in either role. It is the readiness probe for engine
            # pods: a standby must already count as ready when a promotion makes it serving.
            if engine.ready or ("role=any" in self.path and engine.state == "serving"):
                self._reply(200, {"ready": True, "role": engine.role})
            else:
                self._reply(503, {"ready": False, "role": engine.role, "reason": engine.not_ready_reason()})
        elif path == "/metrics":
            self._reply_text(200, self.engine.metrics_text(), "text/plain; version=0.0.4")
        elif path == "/generate":
            self._reply(405, {"error": "use POST /generate"}, allow="POST")
        else:
            self._reply(404, {"error": f"no such endpoint {path!r}; try POST /generate, GET /healthz, GET /readyz, "
                                       "GET /metrics"})

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path != "/generate":
            self._discard_body()
            if path in ("/healthz", "/readyz"):
                self._reply(405, {"error": f"use GET {path}"}, allow="GET")
            else:
                self._reply(404, {"error": f"no such endpoint {path!r}; try POST /generate"})
            return
        try:
            body = self._read_body()
            result = self.engine.generate(body)
        except BadRequest as e:
            self._reply(e.status, {"error": str(e)})
            return
        except (ConnectionError, TimeoutError):  # the client went away or stalled mid-body
            self.close_connection = True
            return
        except Exception as e:  # a bug must not take the server down; it is logged with its traceback
            log.exception("generate failed")
            self._reply(500, {"error": f"internal error: {type(e).__name__}: {e}"})
            return
        self._reply(200, result)

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise BadRequest("missing Content-Length", HTTPStatus.LENGTH_REQUIRED)
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise BadRequest(f"bad Content-Length {length!r}") from None
        if n > MAX_BODY_BYTES:
            self.close_connection = True  # the body stays unread: this connection cannot be reused
            raise BadRequest(f"body of {n} bytes exceeds {MAX_BODY_BYTES}", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        return self.rfile.read(n)

    def _discard_body(self) -> None:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if 0 <= n <= MAX_BODY_BYTES:
            self.rfile.read(n)
        else:
            self.close_connection = True

    def _reply(self, status: int, payload: dict[str, Any], **headers: str) -> None:
        self._reply_text(status, json.dumps(payload), "application/json", **headers)

    def _reply_text(self, status: int, text: str, content_type: str, **headers: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key.capitalize(), value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        log.debug("%s %s", self.address_string(), format % args)


class EngineServer(ThreadingHTTPServer):
    daemon_threads = True  # a hung client must not block shutdown
    allow_reuse_address = True
    request_queue_size = 1024  # the listen backlog: bursts of clients queue instead of being refused

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up or timed out mid-request is routine, not a traceback.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("client %s went away: %s", client_address, exc)
            return
        log.exception("request from %s failed", client_address)


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 0) -> EngineServer:
    """Bind the HTTP server (port 0: any free port; read it from `server.server_address`)."""
    handler = type("EngineHandler", (_Handler,), {"engine": engine})
    return EngineServer((host, port), handler)
