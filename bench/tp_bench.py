"""Tensor parallelism on one node of two GPUs: cold start, restart, failover and replicas, side by side.

One run, one synthetic Llama-shaped checkpoint, measured from the outside:
  cold      page cache dropped; the node supervisor (`weightcache agent --socket-dir --tp-size 2
            --devices all`) starts, and as soon as its sockets answer a TP=2 reference engine
            (two processes, NCCL) starts too: supervisor start -> both ranks Ready (the disk load),
            and supervisor start -> the engine's first token (a cold node, end to end)
  attach    each rank's first attach in a fresh process that starts as the engine does (CUDA
            context, then `prepare()`), with the attach's phases
  restart   a whole TP=2 reference engine from process start to the first token of POST
            /generate, the weights attached from the supervisor; each rank's start-up phases
            (seconds since its process started) from /healthz and its log. Also with
            WEIGHTCACHE_ENGINE_START=sequential (the steps one after another), side by side
  failover  a primary and a standby TP=2 group on the same GPUs: SIGKILL one rank of the
            primary, time until the standby group's rank 0 answers /generate (200)
  replicas  the supervisor with --tp-size 1 on both GPUs: replica 0 loads from disk (page
            cache dropped), replica 1 copies replica 0's arena GPU to GPU; arenas compared
Every engine rank runs with CUDA_VISIBLE_DEVICES reversed, so it finds its GPU by UUID.

Usage (on the GPU machine): python3 bench/tp_bench.py [--gib 64] [--shape 4096x11008x32] [--dir DIR] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "node_agent"))
sys.path.insert(0, HERE)

from gpu_bench import make_checkpoint  # noqa: E402
from page_cache import drop_cache  # noqa: E402
from report import bars_line, report  # noqa: E402
from weightcache_agent.engine.launch import free_rendezvous as rendezvous  # noqa: E402
from weightcache_agent import CacheSpec, agent_status, protocol  # noqa: E402
from weightcache_agent.client.session import map_arena  # noqa: E402
from weightcache_agent.load.checkpoint import open_checkpoint  # noqa: E402
from weightcache_agent.load.fingerprint import engine_request  # noqa: E402
from weightcache_agent.serve.process_group import ProcessGroup, http_json  # noqa: E402

PROMPT = [1, 17, 42, 255, 3, 99, 7, 300]
CHILDREN: list[subprocess.Popen] = []
LOGS_TO = [os.environ.get("OUT", ".")]  # where the logs' archive goes: --out, once parsed


class NodeSupervisor:
    def __init__(self, model: str, workdir: str, tp_size: int, backend: str = "cuda"):
        os.makedirs(workdir, exist_ok=True)
        self.socket_dir, port_file = os.path.join(workdir, "sockets"), os.path.join(workdir, "port")
        self.log_path = os.path.join(workdir, "node.log")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "weightcache_agent", "agent", "--model", model, "--socket-dir", self.socket_dir,
             "--tp-size", str(tp_size), "--devices", "all", "--backend", backend, "--http-port", "0",
             "--port-file", port_file, "--label-pods", "off"] + (["--replicas", "2"] if backend == "cpu" and tp_size == 1 else []),
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=os.environ)
        CHILDREN.append(self.proc)
        while not os.path.exists(port_file):
            self._alive()
            time.sleep(0.01)
        time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(open(port_file).read())}"

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise SystemExit(f"supervisor exited {self.proc.returncode}: {open(self.log_path).read()[-3000:]}")

    def wait_ready(self, timeout: float = 900) -> dict:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            self._alive()
            try:
                code, status = http_json("GET", self.url + "/status", timeout=5)
            except OSError:
                code, status = 0, {}
            if code == 200 and status.get("phase") == "Ready":
                status["wall_seconds"] = time.perf_counter() - self.started
                return status
            if status.get("phase") == "Failed":
                raise SystemExit(f"node failed: {status.get('message')}")
            time.sleep(0.02)
        raise SystemExit("node not ready in time")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def engine_env(status: dict) -> dict:
    env = {"WEIGHTCACHE_SOCKET_DIR": status["socketDir"], "WEIGHTCACHE_DEVICES": ",".join(status["gpuUUIDs"]),
           "NCCL_NVLS_ENABLE": "0"}
    if torch.cuda.is_available():  # reversed: each rank must find its GPU by UUID, not by ordinal
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in reversed(range(torch.cuda.device_count())))
    return env


def start_group(procs: ProcessGroup, model: str, status: dict, name: str, role: str, group: str) -> list:
    init = rendezvous()
    return [procs.start_engine(model, f"{name}-r{r}", role=role, group=group, env=engine_env(status),
                               extra=["--tp-size", "2", "--tp-rank", str(r), "--dist-init", init,
                                      "--max-context", "64"])
            for r in range(2)]


def first_token(rank0, started: float, timeout: float = 300, interval: float = 0.001) -> float:
    """Seconds from `started` until rank 0 answers /generate with a token."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        try:
            code, _ = rank0.generate(PROMPT, 1)
        except OSError:
            code = 0
        if code == 200:
            return time.perf_counter() - started
        if not rank0.alive():
            raise SystemExit(f"{rank0.name} exited: {rank0.log_tail(30)}")
        time.sleep(interval)
    raise SystemExit(f"{rank0.name}: no token in {timeout}s: {rank0.log_tail(30)}")


ATTACH = r"""
import json, sys, time, torch
from weightcache_agent import CacheSpec, attach
from weightcache_agent.arena.devices import cuda_uuid
from weightcache_agent.client.env import socket_from_env
from weightcache_agent.engine.server import _prepare_device, model_config
from weightcache_agent.engine.model import build_model
model, rank = sys.argv[1], int(sys.argv[2])
spec = CacheSpec(model=model, tp_size=2, tp_rank=rank)
sock = socket_from_env(rank)
t0 = time.perf_counter()
_prepare_device(sock)  # as the engine starts: the CUDA context, then prepare() (the attach path warmed)
start_up = time.perf_counter() - t0
m = build_model(model_config(spec))
t0 = time.perf_counter()
att = attach(m, spec, socket=sock)
seconds = time.perf_counter() - t0
w = m.model.layers[0].self_attn.q_proj.weight
uuid = cuda_uuid(w.device.index) if w.is_cuda else f"cpu-{rank}"
print(json.dumps({"seconds": seconds, "phases": att.phases, "device_start": start_up, "uuid": uuid,
                  "ordinal": w.device.index, "tensors": len(att.tensors)}), flush=True)
"""


def rank_phases(group: list) -> list[dict]:
    """Each rank's start-up steps: rank 0's from /healthz, the others' from their log line."""
    code, health = group[0].get("/healthz")
    out = [{"startup": health.get("startup"), "attach_phases": health.get("attach_phases"),
            "attach_seconds": health.get("attach_seconds")}]
    for e in group[1:]:
        line = next((ln for ln in reversed(e.log().splitlines()) if "start-up (seconds since process start)" in ln), "")
        try:
            out.append({"startup": json.loads(line.split("start-up (seconds since process start): ", 1)[1])})
        except (IndexError, ValueError):
            out.append({"startup": None})
    return out


def wait_sockets(node: "NodeSupervisor", timeout: float = 300) -> dict:
    """The supervisor's status once every rank's agent answers on its socket (they load after)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        node._alive()
        try:
            code, status = http_json("GET", node.url + "/status", timeout=5)
        except OSError:
            code, status = 0, {}
        uuids = status.get("gpuUUIDs") or []
        if code == 200 and uuids:
            try:
                for u in uuids:
                    agent_status(os.path.join(status["socketDir"], u + ".sock"), timeout=5)
                return status
            except Exception:  # noqa: BLE001 (not listening yet)
                pass
        time.sleep(0.02)
    raise SystemExit("sockets not answering in time")


def arena_of(sock: str, model: str) -> tuple[torch.Tensor, int]:
    conn = protocol.connect(sock)
    protocol.send_message(conn, {"type": "attach", "pid": os.getpid(), "role": "primary", "group": None, "pod": None,
                                 "request": engine_request(CacheSpec(model=model))})
    reply, fds = protocol.recv_message(conn, protocol.MAX_REPLY_BYTES, max_fds=protocol.MAX_FDS)
    assert reply["type"] == "manifest", reply
    base = map_arena(reply, fds)
    for fd in fds:
        os.close(fd)
    conn.close()
    return base, reply["bytes"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=64)
    p.add_argument("--dir", default="/tmp/wc-tp-bench")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--attaches", type=int, default=3)
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--failovers", type=int, default=6)
    p.add_argument("--min-tensors", type=int, default=2000)
    p.add_argument("--shape", default="2560x6912x20", help="hidden x intermediate x heads of the synthetic layers")
    p.add_argument("--sequential-restarts", type=int, default=2,
                   help="restarts with WEIGHTCACHE_ENGINE_START=sequential (the steps one after another)")
    p.add_argument("--backend", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the script's logic")
    args = p.parse_args()
    LOGS_TO[0] = args.out
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.backend == "cpu":
        from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

        model = write_llama_checkpoint(os.path.join(args.dir, "tiny"), LlamaShape(hidden_size=256, num_key_value_heads=8))
    else:
        hidden, inter, heads = (int(x) for x in args.shape.split("x"))
        model = make_checkpoint(os.path.join(args.dir, f"llama-{args.gib:g}g-{args.shape}"), args.gib,
                                args.min_tensors, hidden, inter, heads)
    ck = open_checkpoint(model)
    size = ck.nbytes
    work = tempfile.mkdtemp(prefix="wc-tp-")
    gpu = torch.cuda.get_device_name(0) if args.backend == "cuda" else "cpu"
    result: dict = {"bytes": size, "tensors": len(ck.tensors), "gpus": torch.cuda.device_count(), "gpu": gpu,
                    "torch": torch.__version__}
    rows: list[tuple[str, str, str]] = []

    # -- cold: the node supervisor loads both ranks from disk; an engine starts beside it ----------
    if args.backend == "cuda":
        drop_cache(ck.files)
    node = NodeSupervisor(model, os.path.join(work, "tp2"), 2, args.backend)
    procs = ProcessGroup(os.path.join(work, "engines"), remove_run_dir=False)
    early = wait_sockets(node)
    cold_group = start_group(procs, model, early, "cold", "primary", "cold")
    st = node.wait_ready()
    cold = st["wall_seconds"]
    cold_token = first_token(cold_group[0], node.started, timeout=900, interval=0.01)
    result["cold"] = {"wall_seconds": cold, "rank_load_seconds": [r["loadSeconds"] for r in st["ranks"]],
                      "first_token_seconds": cold_token, "engine_phases": rank_phases(cold_group)}
    for e in cold_group:
        e.stop()
    print(f"cold TP=2 load: {cold:.2f} s, first token {cold_token:.2f} s ({result['cold']})", file=sys.stderr)
    env = {**os.environ, **engine_env(st)}

    # -- per-rank first attach in fresh processes ---------------------------------------------------
    attaches: dict[int, list[float]] = {0: [], 1: []}
    attach_details: list[dict] = []
    for _ in range(args.attaches):
        for rank in range(2):
            out = subprocess.run([sys.executable, "-c", ATTACH, model, str(rank)], env=env, capture_output=True,
                                 text=True, timeout=300)
            if out.returncode:
                raise SystemExit(f"attach probe failed: {out.stderr[-3000:]}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            assert got["uuid"] == st["gpuUUIDs"][rank], (rank, got)
            attaches[rank].append(got["seconds"])
            attach_details.append({"rank": rank, **got})
    result["first_attach"], result["first_attach_details"] = attaches, attach_details

    try:
        # -- restart: a whole TP=2 engine, process start -> first token ---------------------------
        restarts, sequential, restart_phases = [], [], []
        plan = [("overlapped", k) for k in range(args.restarts)] + \
               [("sequential", k) for k in range(args.sequential_restarts)]
        for how, k in plan:
            t0 = time.perf_counter()
            os.environ["WEIGHTCACHE_ENGINE_START"] = how
            try:
                group = start_group(procs, model, st, f"restart-{how}{k}", "primary", f"restart-{how}{k}")
            finally:
                del os.environ["WEIGHTCACHE_ENGINE_START"]
            took = first_token(group[0], t0, interval=0.005)
            (restarts if how == "overlapped" else sequential).append(took)
            restart_phases.append({"how": how, "seconds": took, "ranks": rank_phases(group)})
            for e in group:
                e.stop()
        result["restart_seconds"], result["sequential_restart_seconds"] = restarts, sequential
        result["restart_phases"] = restart_phases
        print(f"restarts: {restarts}; sequential: {sequential}", file=sys.stderr)

        # -- failover: kill one rank of the primary group ----------------------------------------
        failovers, checks = [], []
        if args.failovers:
            primary = start_group(procs, model, st, "g0", "primary", "g")
            standby = start_group(procs, model, st, "g1", "standby", "g")
            for e in (primary[0], standby[0]):
                e.wait_serving(300)
        for t in range(args.failovers):
            victim = primary[t % 2]
            time.sleep(0.2)
            t0 = time.perf_counter()
            result.setdefault("kill_wallclock", []).append(time.time())  # to line up with the logs' timestamps
            victim.kill(signal.SIGKILL)
            failovers.append(first_token(standby[0], t0))
            survivor = primary[1 - t % 2]
            code = survivor.proc.wait(10)
            leases = [[(c["pid"], c["role"]) for c in agent_status(os.path.join(st["socketDir"], u + ".sock"))["clients"]
                       if c.get("group") == "g"] for u in st["gpuUUIDs"]]
            want = [[(standby[r].pid, "primary")] for r in range(2)]
            checks.append({"survivor_exit": code, "retired": "retiring:" in survivor.log(),
                           "leases_are_the_standby_group": leases == want})
            primary = standby
            standby = start_group(procs, model, st, f"g{t + 2}", "standby", "g")
            standby[0].wait_serving(300)
        result["failover_seconds"], result["failover_checks"] = failovers, checks
        print(f"failovers: {failovers}; {checks}", file=sys.stderr)
    finally:
        procs.close()
    node.stop()

    # -- replicas: TP=1 on both GPUs, the second filled by peer copy -----------------------------
    if args.backend == "cuda":
        drop_cache(ck.files)
    node = NodeSupervisor(model, os.path.join(work, "tp1"), 1, args.backend)
    st1 = node.wait_ready()
    first, second = st1["ranks"]
    b0 = agent_status(first["socket"])["load_breakdown"]
    b1 = agent_status(second["socket"])["load_breakdown"]
    a, n = arena_of(first["socket"], model)
    b, _ = arena_of(second["socket"], model)
    t0 = time.perf_counter()
    chunk, same = 1 << 30, True
    try:
        for i in range(0, n, chunk):
            same &= torch.equal(a[i:i + chunk], b[i:i + chunk].to(a.device))
    except RuntimeError as e:  # no context on the second GPU in this process: say so, do not guess
        same = f"not compared: {str(e).splitlines()[0]}"
    compare = time.perf_counter() - t0
    del a, b
    own = b1.get("prepare", 0) + b1.get("allocate", 0) + b1.get("fill", 0)
    result["replicas"] = {"devices": [first["device"], second["device"]], "filled_from": [first["filledFrom"],
                          second["filledFrom"]], "disk_load_seconds": first["loadSeconds"], "breakdown0": b0,
                          "breakdown1": b1, "peer_fill_seconds": own, "byte_identical": same,
                          "compare_seconds": compare, "wall_seconds": st1["wall_seconds"]}
    node.stop()

    # -- table -----------------------------------------------------------------------------------
    def ms(xs: list[float]) -> str:
        return ", ".join(f"{x * 1e3:.1f}" for x in xs)

    def phases_of(entry: dict) -> str:
        """Rank 0's and rank 1's start-up steps, seconds since each process started."""
        parts = []
        for r, rank in enumerate(entry["ranks"]):
            at = rank.get("startup") or {}
            parts.append(f"rank {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in at.items()))
        return "; ".join(parts)

    att_all = attaches[0] + attaches[1]
    restart = statistics.median(restarts)
    seq = statistics.median(sequential) if sequential else float("nan")
    disk = first["loadSeconds"]
    same_ok = same is True
    rows += [
        ("cold TP=2 load from disk: supervisor start -> both ranks Ready (page cache dropped)",
         f"{cold:.2f} s (ranks' load {', '.join(f'{s:.2f}' for s in result['cold']['rank_load_seconds'])} s)",
         f"{size / cold / 1e9:.2f} GB/s"),
        ("cold node, end to end: supervisor start -> first token of a TP=2 engine started beside it",
         f"{cold_token:.2f} s", ""),
        ("TP=2 engine restart: 2 processes start -> first token (median of "
         f"{len(restarts)}: {', '.join(f'{s:.2f}' for s in restarts)} s)", f"**{restart:.2f} s**",
         f"cold load is **{cold / restart:.1f}x**; cold node to first token is {cold_token / restart:.1f}x"),
        (f"same, steps one after another (WEIGHTCACHE_ENGINE_START=sequential; "
         f"{', '.join(f'{s:.2f}' for s in sequential)} s)", f"{seq:.2f} s", f"{seq / restart:.2f}x the overlapped"),
        (f"per-rank first attach in a fresh process, prepare() at start (rank 0: {ms(attaches[0])}; "
         f"rank 1: {ms(attaches[1])} ms; {attach_details[0].get('tensors')} tensors a rank)",
         f"median {statistics.median(att_all) * 1e3:.1f} ms, **max {max(att_all) * 1e3:.1f} ms**", ""),
    ]
    if failovers:
        fo = sorted(failovers)
        fo_med, fo_max = statistics.median(fo), fo[-1]
        rows.append((f"group failover: kill one primary rank -> first token of the standby group ({len(fo)} trials: "
                     f"{', '.join(f'{s * 1e3:.0f}' for s in failovers)} ms)",
                     f"median {fo_med * 1e3:.0f} ms, max {fo_max * 1e3:.0f} ms",
                     "whole groups: " + ("yes" if all(c["leases_are_the_standby_group"] for c in checks) else "NO")))
    rows += [
        ("replica 0 (TP=1, GPU 0) load from disk (page cache dropped)", f"{disk:.2f} s",
         f"{size / disk / 1e9:.2f} GB/s"),
        ("replica 1 (GPU 1) peer copy of replica 0's arena (prepare + allocate + copy; copy "
         f"{b1.get('peer_copy', float('nan')) * 1e3:.0f} ms)", f"{own * 1e3:.0f} ms",
         f"**{disk / own:.1f}x** faster; {size / b1.get('peer_copy', float('nan')) / 1e9:.0f} GB/s; "
         f"byte-identical: {same}"),
        (f"the fills alone: replica 1's copy vs replica 0's disk fill ({b0.get('fill', float('nan')):.2f} s); "
         f"each replica's own prepare (the plan: {b0.get('prepare', 0):.2f} / {b1.get('prepare', 0):.2f} s) "
         "ran side by side", f"{b1.get('fill', float('nan')) * 1e3:.0f} ms",
         f"{b0.get('fill', float('nan')) / b1.get('fill', float('nan')):.0f}x"),
    ]
    engine_attach = [e["ranks"][0].get("attach_seconds") or float("nan") for e in restart_phases]
    rows.insert(5, ("first attach inside the restarted engines (rank 0, while /generate is polled: "
                    f"{ms(engine_attach)} ms)", f"max {max(engine_attach) * 1e3:.1f} ms", ""))
    bars = {
        "per-rank first attach <= 15 ms": max(att_all) <= 0.015,
        "restart >= 20x faster than cold load": cold / restart >= 20,
        "second replica >= 20x faster than disk": disk / own >= 20 and same_ok and second["filledFrom"] == "peer",
    }
    if failovers:
        bars["failover <= 1 s"] = fo_max <= 1.0
        bars["failover goal 200 ms"] = fo_max <= 0.2
        bars["surviving primary rank retired (exit 0)"] = all(c["survivor_exit"] == 0 and c["retired"] for c in checks)
    phase_lines = ["", "start-up steps, seconds since each process started (first overlapped and sequential "
                       "restart; the cold engine):"]
    for entry in [next((e for e in restart_phases if e["how"] == h), None) for h in ("overlapped", "sequential")]:
        if entry:
            phase_lines.append(f"- {entry['how']} restart ({entry['seconds']:.2f} s): {phases_of(entry)}")
    phase_lines.append(f"- cold engine: {phases_of({'ranks': result['cold']['engine_phases']})}")
    phase_lines.append("- first attach phases (ms): " + "; ".join(
        f"rank {d['rank']}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in d["phases"].items())
        for d in attach_details))
    result["bars"] = bars
    lines = [f"{size / 2**30:.1f} GiB in {len(ck.tensors)} tensors, {result['gpus']}x {result['gpu']}, "
             f"torch {result['torch']}", "", "| step | time | ratio |", "| --- | ---: | ---: |"]
    lines += [f"| {x} | {y} | {z} |" for x, y, z in rows]
    report(args.out, "tp_bench", lines + ["", bars_line(bars)] + phase_lines, result)
    return 0


def save_logs(out: str) -> None:
    """Every log of this run (supervisors with their workers' lines, engine ranks) in one archive."""
    import glob
    import tarfile

    os.makedirs(out, exist_ok=True)
    with tarfile.open(os.path.join(out, "tp_logs.tar.gz"), "w:gz") as tar:
        for path in glob.glob("/tmp/wc-tp-*/**/*.log", recursive=True):
            tar.add(path, arcname=os.path.relpath(path, "/tmp"))


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        try:
            save_logs(LOGS_TO[0])
        except OSError as e:
            print(f"logs not saved: {e}", file=sys.stderr)
        for child in CHILDREN:
            if child.poll() is None:
                child.kill()
                child.wait()
