"""`weightcache demo`: the whole product on one machine, in one command, in under a minute.

Flow: make (once, cached) a deterministic Llama-shaped checkpoint; time a plain disk load
in this process (what every engine restart pays today); start an agent (its cold load,
with a progress bar fed by its status), then a primary and a standby engine that attach
to it (milliseconds); send a request; SIGKILL the primary and time until the standby
answers; print a summary. Every child runs under a `ProcessGroup`, so whatever happens --
success, an error, Ctrl-C, SIGTERM -- the children are stopped and the sockets removed
before the demo exits.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import WeightCacheError
from ..usage import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, parser as usage_parser, refuse, torch_problem

log = logging.getLogger("weightcache.demo")

GROUP = "demo"
PROMPT = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278]  # the reference engine takes token ids
NEW_TOKENS = 12
STEPS = 6  # what the demo shows, one numbered line each
# Seconds of quiet after which a waiting step says it is still at it (the agent's
# WEIGHTCACHE_PROGRESS_INTERVAL, when set, paces these lines too).
HEARTBEAT = 2.0


@dataclass(frozen=True)
class DemoSize:
    description: str
    shape: dict[str, int]


SIZES = {
    # for tests and a first look: loads in milliseconds, so timings mean little
    "small": DemoSize("17 MB, for tests", dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=32000)),
    # the default: big enough that a disk load is visibly slower than an attach
    "medium": DemoSize("320 MB, the default", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                       num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)),
    "large": DemoSize("1.1B parameters, 2.2 GB", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20,
                                                          num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)),
}


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# -- output --------------------------------------------------------------------------------------


class Console:
    """Step lines for people (bold when stdout is a terminal), or nothing but JSON with --json."""

    def __init__(self, quiet: bool):
        from ..load.progress import interval_problem, log_interval

        self.quiet = quiet
        self.color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        self.bars = sys.stderr.isatty() and not quiet
        self.heartbeat = HEARTBEAT if interval_problem() else log_interval(HEARTBEAT)  # refused in `preflight`
        self._lock = threading.Lock()  # the heartbeat thread prints too

    def style(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def say(self, text: str = "") -> None:
        if not self.quiet:
            with self._lock:
                sys.stdout.write(text + "\n")
                sys.stdout.flush()

    def step(self, n: int, total: int, text: str) -> None:
        self.say(self.style(f"[{n}/{total}] ", "1;36") + self.style(text, "1"))

    def detail(self, text: str) -> None:
        self.say("      " + text)

    @contextlib.contextmanager
    def waiting(self, what: str | Callable[[], str]) -> Iterator[float]:
        """While the block runs, say every few seconds what it is waiting for: a demo is never silent for long.

        Yields when the block started (perf_counter): a duration reported after it is on the ticker's clock."""
        stop, started = threading.Event(), time.perf_counter()
        if self.quiet or self.heartbeat <= 0:
            yield started
            return

        def beat() -> None:
            while not stop.wait(self.heartbeat):
                text = what() if callable(what) else what
                if text:
                    self.detail(self.style(f"... {text} ({time.perf_counter() - started:.0f} s)", "2"))

        thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        thread.start()
        try:
            yield started
        finally:
            stop.set()
            thread.join()


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


# -- the checkpoint ----------------------------------------------------------------------------


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "weightcache", "demo")


def ensure_checkpoint(cache_dir: str, size: str, console: Console) -> tuple[str, bool]:
    """The demo checkpoint for `size`, written once (atomically) and reused. Returns (dir, created)."""
    from ..testing.synthetic import LlamaShape, write_llama_checkpoint, write_word_tokenizer  # imports torch

    shape = LlamaShape(**SIZES[size].shape, max_position_embeddings=2048)
    target = os.path.join(cache_dir, f"llama-{size}")
    marker = os.path.join(target, ".weightcache-demo.json")
    identity = {"shape": shape.config(_bf16()), "seed": 0, "version": 2}  # 2: with a tokenizer
    try:
        with open(marker) as f:
            if json.load(f) == identity:
                return target, False
    except (OSError, ValueError):
        pass
    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".llama-{size}-", dir=cache_dir)
    try:
        console.detail(f"creating the demo checkpoint once (deterministic random weights) in {target}")
        with console.waiting("writing the checkpoint") as started:
            write_llama_checkpoint(staging, shape, seed=0, shards=2)
            write_word_tokenizer(staging, shape.vocab_size)  # so that vLLM's OpenAI server serves it too
            with open(os.path.join(staging, ".weightcache-demo.json"), "w") as f:
                json.dump(identity, f)
            if os.path.exists(target):  # a stale or different version: replace it
                import shutil

                shutil.rmtree(target)
            os.rename(staging, target)
        console.detail(f"written in {fmt_seconds(time.perf_counter() - started)}")
    except BaseException:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target, True


def _bf16() -> Any:
    import torch

    return torch.bfloat16


def drop_page_cache(directory: str) -> bool:
    """Ask the kernel to forget the checkpoint's pages so the next read comes from the disk.

    Works without privileges for clean pages of files we can open; on tmpfs or overlay
    storage it may do nothing, which only makes the disk numbers look better.
    """
    dropped = True
    for name in os.listdir(directory):
        if not name.endswith(".safetensors"):
            continue
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            dropped = False
        finally:
            os.close(fd)
    return dropped


# -- the run -------------------------------------------------------------------------------------


def _progress_bar(console: Console, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="      agent starting", file=sys.stderr,
                disable=not console.bars, leave=False, bar_format="{desc} {bar} {n_fmt}/{total_fmt} {rate_fmt}")


def preflight(args: argparse.Namespace) -> None:
    """What would fail a later step fails now: an unusable progress interval (the agent would
    refuse it), --backend cuda on a machine without a visible GPU (after the disk-load step)."""
    from ..load.progress import interval_problem

    if (problem := interval_problem()) is not None:
        raise UsageError(problem)
    if args.backend != "cuda":
        return
    from ..arena.devices import cuda_available

    if not cuda_available():
        raise UsageError("--backend cuda: no CUDA device is visible to this process (torch.cuda.is_available() is "
                         "False); run with --backend cpu, or auto to use a GPU only when there is one")


class UsageError(WeightCacheError):
    """A flag this machine cannot honour (exit status 2)."""


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The six steps, each printed as it goes; what was measured, for the summary and `--json`."""
    console.say(console.style("weightcache demo", "1") + " - weights loaded once, attached in milliseconds, "
                "a hot standby that takes over when the primary dies")
    console.say()
    with console.waiting("importing torch"):
        preflight(args)
        from ..serve.process_group import ProcessGroup
        from ..testing import synthetic  # noqa: F401  torch, for the checkpoint: imported under this ticker
    model_dir, nbytes, prompt = _checkpoint_step(args, console)
    disk_seconds, reference = _disk_step(model_dir, nbytes, prompt, console)
    summary: dict[str, Any] = {"model": model_dir, "bytes": nbytes, "disk_load_seconds": disk_seconds,
                               "run_dir": args.run_dir, "pids": {}}
    # the outer stack closes after the ProcessGroup: its heartbeat covers the children's shutdown
    with contextlib.ExitStack() as shutdown, ProcessGroup(args.run_dir, remove_run_dir=args.remove_run_dir) as sup:
        agent, status = _agent_step(sup, args, model_dir, nbytes, console, summary)
        primary, standby = _engines_step(sup, args, model_dir, agent, console, summary)
        reply = _request_step(primary, prompt, reference, status["backend"], console, summary)
        _failover_step(agent, primary, standby, prompt, reply, args.timeout, console, summary)
        console.say()
        _print_summary(console, summary)
        console.say()
        console.say("stopping the standby and the agent ...")
        shutdown.enter_context(console.waiting("stopping"))
    console.say("done: no process or socket left behind.")
    return summary


def _checkpoint_step(args: argparse.Namespace, console: Console) -> tuple[str, int, list[int]]:
    """Step 1: the synthetic checkpoint (written once, then reused): its directory, bytes, the prompt."""
    console.step(1, STEPS, "checkpoint")
    model_dir, created = ensure_checkpoint(args.dir or default_cache_dir(), args.size, console)  # says when it writes
    from ..load.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(model_dir)
    nbytes = checkpoint.nbytes
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    prompt = [t for t in PROMPT if t < config["vocab_size"]]
    console.detail(f"{model_dir}{'' if created else '  (cached: written by an earlier run, reused)'}")
    console.detail(f"Llama, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
                   f"{fmt_bytes(nbytes)} of bf16 in {len(checkpoint.tensors)} tensors")
    return model_dir, nbytes, prompt


def _disk_step(model_dir: str, nbytes: int, prompt: list[int], console: Console) -> tuple[float, list[int]]:
    """Step 2: the load every restart pays without weightcache, in this process: (seconds, reference tokens)."""
    console.step(2, STEPS, "disk load in this process (what every engine restart pays without weightcache)")
    cold = drop_page_cache(model_dir)
    console.detail("building the model and reading every tensor from disk ...")
    with console.waiting("loading from disk, then a reference request"):
        from .server import load_model
        from ..spec import CacheSpec

        model, attachment = load_model(CacheSpec(model=model_dir), mode="off")
        disk_seconds = attachment.seconds
        reference = model.generate(prompt, NEW_TOKENS)
    attachment.close()
    del model, attachment
    console.detail(f"{fmt_seconds(disk_seconds)}  ({fmt_bytes(nbytes / disk_seconds)}/s"
                   f"{', page cache dropped first' if cold else ''})")
    return disk_seconds, reference


def _agent_step(sup: Any, args: argparse.Namespace, model_dir: str, nbytes: int, console: Console,
                summary: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Step 3: the agent's cold load, its progress as a bar: (the agent, its ready status)."""
    console.step(3, STEPS, "agent: cold load into shared memory (once per node)")
    drop_page_cache(model_dir)
    agent = sup.start_agent(model_dir, backend=args.backend)
    summary["pids"]["agent"] = agent.pid
    console.detail(f"agent pid {agent.pid}, socket {agent.socket}: a new process: it reads the checkpoint's "
                   "headers, plans the arena, then loads")
    bar = _progress_bar(console, nbytes)
    latest: dict[str, Any] = {}

    def seen(s: dict[str, Any]) -> None:
        if s["phase"] != latest.get("phase"):
            bar.set_description_str(f"      agent {s['phase']}", refresh=False)
        latest.update(s)
        bar.update(s["progress"]["bytes_done"] - bar.n)

    try:
        with console.waiting(lambda: "" if console.bars else _agent_phase(latest)):
            status = agent.wait_ready(timeout=args.timeout, on_status=seen)
    finally:
        bar.close()
    summary["agent_load_seconds"] = status["load_seconds"]
    summary["backend"] = status["backend"]
    console.detail(f"{fmt_seconds(status['load_seconds'])}  ({fmt_bytes(status['bytes'])} resident, backend "
                   f"{status['backend']}{_gpu_note(status['backend'])})")
    return agent, status


def _engines_step(sup: Any, args: argparse.Namespace, model_dir: str, agent: Any, console: Console,
                  summary: dict[str, Any]) -> tuple[Any, Any]:
    """Step 4: a primary and a standby engine attached to the agent's arena."""
    console.step(4, STEPS, "primary and standby engines attach to the same weights")
    primary = sup.start_engine(model_dir, "primary", socket=agent.socket, group=GROUP, role="primary")
    standby = sup.start_engine(model_dir, "standby", socket=agent.socket, group=GROUP, role="standby")
    summary["pids"].update(primary=primary.pid, standby=standby.pid)
    console.detail(f"primary pid {primary.pid}, standby pid {standby.pid} (group {GROUP!r}): each imports torch, "
                   "builds the model on the meta device and attaches")
    with console.waiting("engines starting; the primary is not ready yet"):
        p_health = primary.wait_state(lambda h: h["ready"], timeout=args.timeout, what="readiness")
    with console.waiting("the standby is still starting"):
        s_health = standby.wait_serving(timeout=args.timeout)
    summary["attach_seconds"] = {"primary": p_health["attach_seconds"], "standby": s_health["attach_seconds"]}
    console.detail(f"primary attached in {fmt_seconds(p_health['attach_seconds'])} and is ready on {primary.url}")
    console.detail(f"standby attached in {fmt_seconds(s_health['attach_seconds'])}, warm, /readyz 503 until promoted")
    console.detail("both map the agent's memory read-only: one copy of the weights, not three")
    return primary, standby


def _request_step(primary: Any, prompt: list[int], reference: list[int], backend: str, console: Console,
                  summary: dict[str, Any]) -> dict[str, Any]:
    """Step 5: one request to the primary, its tokens compared with step 2's where that means something."""
    console.step(5, STEPS, "a request to the primary")
    t0 = time.perf_counter()
    with console.waiting("generating"):
        code, reply = primary.generate(prompt, NEW_TOKENS)
    if code != 200:
        raise WeightCacheError(f"the primary answered {code}: {reply.get('error')}")
    summary["request_seconds"] = time.perf_counter() - t0
    console.detail(f"POST /generate {{tokens: {prompt}, max_tokens: {NEW_TOKENS}}}")
    console.detail(f"-> {reply['tokens']}  in {fmt_seconds(summary['request_seconds'])}")
    if backend == "cpu":  # the step-2 reference ran on the cpu: comparable bit for bit
        same = reply["tokens"] == reference
        console.detail("same tokens as the model loaded from disk in step 2" if same else
                       console.style("DIFFERENT tokens from the model loaded from disk in step 2", "1;31"))
    else:
        same = True
        console.detail(f"(step 2 ran on the cpu, the engines on {backend}: tokens are not compared)")
    summary["same_tokens"] = same
    return reply


def _failover_step(agent: Any, primary: Any, standby: Any, prompt: list[int], reply: dict[str, Any],
                   timeout: float, console: Console, summary: dict[str, Any]) -> None:
    """Step 6: SIGKILL the primary; the standby, promoted by the agent, answers the same request."""
    console.step(6, STEPS, f"SIGKILL the primary (pid {primary.pid}); the agent promotes the standby")
    with console.waiting("waiting for the standby's answer"):
        failover = _failover(primary, standby, prompt, timeout)
        summary["failover_seconds"] = failover
        code, again = standby.generate(prompt, NEW_TOKENS)
    summary["failover_same_tokens"] = code == 200 and again["tokens"] == reply["tokens"]
    roles = {c["pid"]: c["role"] for c in agent.status()["clients"]}
    console.detail(f"the standby answered {fmt_seconds(failover)} after the kill; agent now lists pid {standby.pid} "
                   f"as {roles.get(standby.pid, '?')}")
    console.detail("the same request to the new primary gives the same tokens" if summary["failover_same_tokens"]
                   else console.style(f"the new primary answered differently: {code} {again}", "1;31"))
    summary["promoted_role"] = roles.get(standby.pid)


def _failover(primary: Any, standby: Any, prompt: list[int], timeout: float) -> float:
    """Seconds from SIGKILL of the primary to the standby's first successful (1-token) answer."""
    primary.kill(signal.SIGKILL)
    killed = time.perf_counter()
    while True:
        try:
            code, reply = standby.generate(prompt, 1)
        except OSError:
            code, reply = 0, {}
        if code == 200:
            return time.perf_counter() - killed
        if time.perf_counter() - killed > timeout:
            raise WeightCacheError(f"the standby did not take over within {timeout:.0f}s (last answer {code}: {reply})")
        standby.check_alive()
        time.sleep(0.001)


def _agent_phase(status: dict[str, Any]) -> str:
    """What the agent is doing, from its latest status (none yet: still starting)."""
    if not status:
        return "the agent is starting"
    p = status["progress"]
    if status["phase"] == "loading" and p["bytes_total"]:
        return (f"the agent is loading: {p['fraction']:.0%}, {fmt_bytes(p['bytes_done'])} of "
                f"{fmt_bytes(p['bytes_total'])}, {fmt_bytes(p['bytes_per_second'])}/s")
    return f"the agent is {status['phase']}"


def _gpu_note(backend: str) -> str:
    if backend != "cpu":
        return ""
    import torch

    return "; a GPU is visible: try --backend cuda" if torch.cuda.is_available() else "; no GPU here"


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    disk = s["disk_load_seconds"]
    rows = [
        ("disk load, in-process", fmt_seconds(disk), "every restart, without weightcache"),
        ("agent cold load", fmt_seconds(s["agent_load_seconds"]), "once per node"),
        ("attach, primary", fmt_seconds(s["attach_seconds"]["primary"]),
         f"{disk / max(s['attach_seconds']['primary'], 1e-9):,.0f}x faster than the disk load"),
        ("attach, standby", fmt_seconds(s["attach_seconds"]["standby"]), "same weights, no extra memory"),
        ("request", fmt_seconds(s["request_seconds"]), f"{NEW_TOKENS} tokens, greedy"),
        ("failover", fmt_seconds(s["failover_seconds"]), "SIGKILL of the primary -> first answer from the standby"),
    ]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    console.say(console.style(f"{'step':<{w0}}  {'time':>{w1}}  note", "1"))
    console.say("-" * (w0 + w1 + 4 + max(len(r[2]) for r in rows)))
    for name, value, note in rows:
        console.say(f"{name:<{w0}}  {value:>{w1}}  {note}")


# -- entry point ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = usage_parser("weightcache demo",
                     "Load a model once, attach two engines in milliseconds, kill the primary, watch the standby take "
                     "over. No GPU or cluster needed.",
                     examples=["weightcache demo", "weightcache demo --size small --backend cpu --json",
                               "MODEL=$(weightcache demo --size small --checkpoint-only)   # a model for vLLM"],
                     env={"XDG_CACHE_HOME": "where the default --dir lives ($XDG_CACHE_HOME/weightcache/demo)"},
                     codes=(EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED))
    p.add_argument("--size", choices=tuple(SIZES), default="medium",
                   help="demo model size: " + ", ".join(f"{k} ({v.description})" for k, v in SIZES.items()))
    p.add_argument("--dir", help=f"where the demo checkpoint is cached (default: {default_cache_dir()})")
    p.add_argument("--run-dir", help="sockets and logs of this run (default: a fresh temporary directory, removed at exit)")
    p.add_argument("--keep-run-dir", action="store_true", help="keep the run directory (logs) after exit")
    p.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the agent keeps the weights (auto: cuda when a GPU is visible)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for any one step")
    p.add_argument("--json", action="store_true", help="print only a JSON summary on stdout")
    p.add_argument("--checkpoint-only", action="store_true",
                   help="write the demo checkpoint (safetensors, config.json, a word-level tokenizer) if it is not "
                        "there yet, print its directory and stop: a model that vLLM serves too")
    return p


def writable_dir_problem(flag: str, path: str) -> str | None:
    """Why the demo cannot write under `path` (creating it if need be), or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot create {flag} {path}: {e.strerror or e}; pass a writable directory with {flag}"
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        return f"{flag} {path} is not a writable directory; pass a writable directory with {flag}"
    return None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    problem = torch_problem("the demo (its engines and its checkpoint writer)")
    if problem:  # before any directory is made
        return refuse("weightcache demo", problem, EXIT_FAILED)
    for flag, path in (("--dir", args.dir or default_cache_dir()), ("--run-dir", args.run_dir)):
        problem = path and writable_dir_problem(flag, path)
        if problem:
            return refuse("weightcache demo", problem, EXIT_USAGE)
    if args.checkpoint_only:
        directory, _ = ensure_checkpoint(args.dir or default_cache_dir(), args.size, Console(quiet=True))
        print(directory)
        return EXIT_OK
    console = Console(quiet=args.json)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    created_run_dir = args.run_dir is None
    # Only a directory the demo made is removed whole; in one given with --run-dir, only sockets go.
    args.remove_run_dir = created_run_dir and not args.keep_run_dir
    args.run_dir = args.run_dir or tempfile.mkdtemp(prefix="weightcache-demo-")

    def interrupt(signum: int, _frame: Any) -> None:
        # Ignore further signals while the ProcessGroup's cleanup runs, then unwind through it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)
    try:
        summary = run(args, console)
    except UsageError as e:
        print(f"weightcache demo: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"\nweightcache demo: {e} received; stopped every process and removed the sockets.", file=sys.stderr)
        return 128 + e.signum
    except WeightCacheError as e:
        print(f"weightcache demo: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from ..serve.process_group import ChildFailed

        if isinstance(e, ChildFailed):
            print(f"weightcache demo: {e}", file=sys.stderr)
            return 1
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if args.remove_run_dir:
            import shutil

            shutil.rmtree(args.run_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["same_tokens"] and summary["failover_same_tokens"] else 1

