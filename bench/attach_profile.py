import cProfile, pstats, os, sys, time, subprocess, statistics, socket as S
sys.path.insert(0, os.path.join(os.getcwd(), "node_agent"))
import torch
from weightcache_agent import attach, CacheSpec, agent_status, protocol
from weightcache_agent.client import _views, _connect
from weightcache_agent.fingerprint import engine_request
from weightcache_agent.rebind import rebind
from weightcache_agent.checkpoint import open_checkpoint
from weightcache_agent.errors import AgentUnavailable
from weightcache_agent.synthetic import LlamaShape, write_llama_checkpoint, skeleton_module
backend = sys.argv[1]
m = "/tmp/prof2001"
if not os.path.exists(m):
    write_llama_checkpoint(m, LlamaShape(hidden_size=256, intermediate_size=512, num_hidden_layers=222, num_attention_heads=8, num_key_value_heads=8, vocab_size=1024), shards=16)
sock = f"/tmp/prof-{backend}.sock"
agent = subprocess.Popen([sys.executable, "-m", "weightcache_agent", "agent", "--model", m, "--socket", sock, "--backend", backend, "--progress", "never"], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
try:
    while True:
        try:
            if agent_status(sock)["phase"] == "ready": break
        except AgentUnavailable: pass
        time.sleep(0.05)
    ck = open_checkpoint(m); spec = {n: (r.shape, r.dtype) for n, r in ck.tensors.items()}
    print("tensors", len(spec))
    if backend == "cuda": torch.empty(1, device="cuda")
    phases = {k: [] for k in ("request", "roundtrip", "views", "rebind", "total")}
    for i in range(12):
        mod = skeleton_module(spec)
        t0 = time.perf_counter(); req = engine_request(CacheSpec(model=m)); t1 = time.perf_counter()
        c = _connect(sock); protocol.send_message(c, {"type": "attach", "pid": os.getpid(), "role": "primary", "group": None, "request": req})
        reply, fds = protocol.recv_message(c, protocol.MAX_REPLY_BYTES, max_fds=8); t2 = time.perf_counter()
        views = _views(reply, fds); t3 = time.perf_counter()
        rebind(mod, views); t4 = time.perf_counter()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)): phases[k].append(v * 1e3)
        c.close(); [os.close(f) for f in fds]; del views, mod
    print({k: round(statistics.median(v[2:]), 2) for k, v in phases.items()})
    mods = [skeleton_module(spec) for _ in range(3)]
    ts = []
    for mm in mods[:2]:
        t0 = time.perf_counter(); a = attach(mm, CacheSpec(model=m), socket=sock); ts.append(time.perf_counter() - t0); a.close()
    print("attach()", [round(t * 1e3, 2) for t in ts])
    cProfile.run("attach(mods[2], CacheSpec(model=m), socket=sock).close()", "/tmp/ap.prof")
    pstats.Stats("/tmp/ap.prof").sort_stats("tottime").print_stats(14)
finally:
    agent.kill()
