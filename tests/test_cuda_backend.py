"""The cuda backend. GPU tests skip without CUDA; `bench/gpu_suite.sh` runs them on an H200.

The quantizer equality test runs everywhere: the GPU path's vectorised FP8 must give the
same bytes as the cpu loader's, and that is a property of the arithmetic, checkable on cpu.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch

from agent_fixtures import maps_libtorch
from weightcache_agent.load import fp8
from weightcache_agent.load.cuda_fill import quantize_blocks
from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint


def _has_cuda() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


cuda = pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU and cuda-bindings")


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (128, 100), (384, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_vectorised_quantizer_matches_the_cpu_loader_bit_for_bit(shape, dtype):
    g = torch.Generator().manual_seed(1)
    src = (torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[1])).to(dtype)
    rb, cb = fp8.scale_shape(shape)
    ref_out, ref_scale = torch.empty(shape, dtype=torch.float8_e4m3fn), torch.empty(rb, cb)
    fp8.quantize_rows(src, ref_out, ref_scale, "w")
    out, scale = torch.empty_like(ref_out), torch.empty_like(ref_scale)
    assert not bool(quantize_blocks(src, out, scale))
    assert torch.equal(out.view(torch.uint8), ref_out.view(torch.uint8))
    assert torch.equal(scale, ref_scale)


def test_vectorised_quantizer_flags_non_finite_values():
    src = torch.ones(128, 128, dtype=torch.bfloat16)
    src[5, 7] = float("nan")
    assert bool(quantize_blocks(src, torch.empty(128, 128, dtype=torch.float8_e4m3fn), torch.empty(1, 1)))


# ---- on a GPU ---------------------------------------------------------------------------------

ENGINE = textwrap.dedent("""
    import json, os, sys, time, torch
    from weightcache_agent import CacheSpec, attach
    from weightcache_agent.load.checkpoint import open_checkpoint
    from weightcache_agent.testing.synthetic import skeleton_module
    model, sock, quant = sys.argv[1], sys.argv[2], sys.argv[3]
    ck = open_checkpoint(model)
    dtype_of = lambda n, r: torch.float8_e4m3fn if quant == "fp8-block" and n.endswith("_proj.weight") else r.dtype
    module = skeleton_module({n: (r.shape, dtype_of(n, r)) for n, r in ck.tensors.items()})
    att = attach(module, CacheSpec(model=model, quantization=quant), socket=sock, strict=False)
    p = dict(module.named_parameters()); p.update(dict(module.named_buffers()))
    def matmul_sum():  # a function, so no view outlives the call in a global
        w = p["model.layers.0.mlp.down_proj.weight"]
        x = torch.ones(w.shape[1], 4, device=w.device, dtype=torch.float32)
        return float((w.float() @ x).sum())
    print(json.dumps({"pid": os.getpid(), "device": str(next(iter(p.values())).device), "seconds": att.seconds}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "dump":
            torch.save({n: t.cpu().clone() for n, t in p.items()}, sys.argv[4]); out = {"dumped": True}
        elif cmd == "matmul":
            out = {"sum": matmul_sum()}
        elif cmd == "write":
            next(iter(p.values())).data.add_(1); torch.cuda.synchronize(); out = {"wrote": True}
        elif cmd == "free":
            torch.cuda.synchronize(); out = {"free": torch.cuda.mem_get_info()[0]}
        elif cmd == "status":
            out = {"alive": att.agent_alive, "rejoins": att.rejoins}
        elif cmd == "close":
            att.close(); del module, p, att; import gc; gc.collect(); torch.cuda.synchronize()
            out = {"free": torch.cuda.mem_get_info()[0]}
        print(json.dumps(out), flush=True)
""")


class Engine:
    def __init__(self, model: str, sock: str, quant: str = "none", dump: str = "/dev/null", wrap: list[str] = ()):
        self.proc = subprocess.Popen([*wrap, sys.executable, "-c", ENGINE, model, sock, quant, dump],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, f"engine died with {self.proc.wait()}"
        import json

        self.hello = json.loads(line)

    def ask(self, cmd: str) -> dict:
        import json

        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"engine died with {self.proc.wait()}"
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory) -> str:
    shape = LlamaShape(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=16384)
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("gpu") / "m"), shape)


def _arena(model: str, sock: str, backend: str, quant: str, tmp_path, name: str) -> tuple[dict, bool]:
    """The arena's tensors as an engine sees them, and whether the agent imported torch to load it."""
    agent = AgentProcess(model, sock, "--backend", backend, "--quantization", quant)
    try:
        agent.wait_ready(300)
        loaded_torch = maps_libtorch(agent.proc.pid)
        engine = Engine(model, sock, quant, dump=str(tmp_path / f"{name}.pt"))
        assert engine.ask("dump") == {"dumped": True}
        engine.stop()
        return torch.load(tmp_path / f"{name}.pt"), loaded_torch
    finally:
        agent.stop()


@cuda
@pytest.mark.parametrize("quant", ["none", "fp8-block"])
def test_cuda_arena_holds_the_same_bytes_as_the_cpu_arena(gpu_model, tmp_path, quant):
    on_gpu, gpu_agent_torch = _arena(gpu_model, str(tmp_path / "g.sock"), "cuda", quant, tmp_path, "gpu")
    on_cpu, _ = _arena(gpu_model, str(tmp_path / "c.sock"), "cpu", quant, tmp_path, "cpu")
    # copied as they are, or quantized from bf16 on the host by the C quantizer: through the driver alone, no torch
    from weightcache_agent.load import fp8

    assert not gpu_agent_torch, ("the cuda agent imported torch" if fp8._fp8cpu is not None else
                                 "the cuda agent imported torch: the C quantizer _fp8cpu is not built (setup.py build_ext)")
    assert on_gpu.keys() == on_cpu.keys()
    for name in on_cpu:
        assert torch.equal(on_gpu[name].view(torch.uint8), on_cpu[name].view(torch.uint8)), name


@cuda
@pytest.mark.parametrize("source,quant,dtype", [
    (torch.bfloat16, "none", "auto"),  # the driver's copies
    (torch.bfloat16, "fp8-block", "auto"),  # the C quantizer on the readers, then the driver's copies
    (torch.bfloat16, "none", "float16"),  # torch kernels: a cast
    (torch.float16, "fp8-block", "auto"),  # torch kernels: FP8 from another dtype than bf16
])
def test_each_gpu_fill_writes_the_bytes_of_the_cpu_loader(tmp_path, source, quant, dtype):
    from weightcache_agent.arena.cpu import map_readonly
    from weightcache_agent.arena.cuda import CudaArena, map_readonly_cuda
    from weightcache_agent.arena.devices import cuda_uuid
    from weightcache_agent.load.loader import fill_cache, load_cache, prepare_cache
    from weightcache_agent.spec import CacheSpec

    shape = LlamaShape(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=4096)
    spec = CacheSpec(model=write_llama_checkpoint(str(tmp_path / "m"), shape, dtype=source, shards=2),
                     quantization=quant, dtype=dtype)
    prepared = prepare_cache(spec)
    uuid = cuda_uuid(0)
    on_gpu = fill_cache(prepared, CudaArena(prepared.layout.size, 0, uuid))
    on_cpu = load_cache(spec)
    try:
        assert on_gpu.layout.layout_hash == on_cpu.layout.layout_hash
        gpu = map_readonly_cuda(on_gpu.arena.fd, on_gpu.arena.size, uuid).cpu()
        cpu = map_readonly(on_cpu.arena.fd, on_cpu.layout.size)
        for slot in on_cpu.layout.slots:
            span = slice(slot.offset, slot.offset + slot.nbytes)
            assert torch.equal(gpu[span], cpu[span]), slot.name
    finally:
        on_gpu.arena.close()
        on_cpu.arena.close()


@cuda
def test_engine_computes_after_agent_sigkill_and_memory_returns_when_the_last_engine_goes(gpu_model, tmp_path):
    import gc

    torch.cuda.init()
    gc.collect()  # what earlier tests left to the collector or torch's cache is freed before the baseline, not during
    torch.cuda.empty_cache()
    baseline = torch.cuda.mem_get_info()[0]
    sock = str(tmp_path / "a.sock")
    agent = AgentProcess(gpu_model, sock, "--backend", "cuda")
    status = agent.wait_ready(300)
    engine = Engine(gpu_model, sock)
    try:
        assert engine.hello["device"].startswith("cuda")
        before = engine.ask("matmul")["sum"]
        agent.proc.kill()
        agent.proc.wait()
        assert engine.ask("matmul")["sum"] == before
        time.sleep(1)  # the agent's own context is torn down with it
        held = torch.cuda.mem_get_info()[0]
        assert baseline - held >= status["arena_bytes"], "the arena was freed while an engine still maps it"
        released = engine.ask("close")["free"]  # the engine process lives on, without the mapping
        assert released - held >= status["arena_bytes"] - 64 * 2**20, "arena memory not freed after the last mapping"
    finally:
        engine.stop()
        agent.stop()


@cuda
def test_write_through_a_read_only_mapping_fails_in_that_engine_only(gpu_model, tmp_path):
    sock = str(tmp_path / "a.sock")
    agent = AgentProcess(gpu_model, sock, "--backend", "cuda")
    agent.wait_ready(300)
    writer, reader = Engine(gpu_model, sock), Engine(gpu_model, sock)
    try:
        before = reader.ask("matmul")["sum"]
        writer.proc.stdin.write("write\n")
        writer.proc.stdin.flush()
        assert writer.proc.wait(60) != 0
        assert reader.ask("matmul")["sum"] == before
    finally:
        writer.stop()
        reader.stop()
        agent.stop()


@cuda
def test_200_attach_detach_cycles_leave_no_memory_or_fds(gpu_model, tmp_path):
    sock = str(tmp_path / "a.sock")
    agent = AgentProcess(gpu_model, sock, "--backend", "cuda")
    agent.wait_ready(300)
    script = textwrap.dedent(f"""
        import gc, json, os, torch
        from weightcache_agent import CacheSpec, attach
        from weightcache_agent.load.checkpoint import open_checkpoint
        from weightcache_agent.testing.synthetic import skeleton_module
        ck = open_checkpoint({gpu_model!r})
        def once():
            m = skeleton_module({{n: (r.shape, r.dtype) for n, r in ck.tensors.items()}})
            attach(m, CacheSpec(model={gpu_model!r}), socket={sock!r}).close()
        once(); gc.collect(); torch.cuda.synchronize()
        free0, fds0 = torch.cuda.mem_get_info()[0], len(os.listdir("/proc/self/fd"))
        for _ in range(200):
            once()
        gc.collect(); torch.cuda.synchronize()
        print(json.dumps({{"free0": free0, "free1": torch.cuda.mem_get_info()[0], "fds0": fds0,
                          "fds1": len(os.listdir("/proc/self/fd"))}}))
    """)
    try:
        fds_agent = len(os.listdir(f"/proc/{agent.proc.pid}/fd"))
        import json

        run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, f"engine exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-6000:]}"
        out = json.loads(run.stdout)
        assert out["fds1"] <= out["fds0"]
        assert out["free1"] >= out["free0"] - 4 * 2**20
        time.sleep(0.2)
        assert len(os.listdir(f"/proc/{agent.proc.pid}/fd")) <= fds_agent
    finally:
        agent.stop()


@cuda
def test_engine_in_its_own_pid_and_ipc_namespace_attaches(gpu_model, tmp_path):
    if subprocess.run(["unshare", "--pid", "--ipc", "--fork", "--mount-proc", "true"]).returncode != 0:
        pytest.skip("unshare into new PID/IPC namespaces is not permitted here")
    sock = str(tmp_path / "a.sock")
    agent = AgentProcess(gpu_model, sock, "--backend", "cuda")
    agent.wait_ready(300)
    engine = Engine(gpu_model, sock, wrap=["unshare", "--pid", "--ipc", "--fork", "--mount-proc"])
    try:
        assert engine.hello["pid"] == 1 or engine.hello["pid"] < 10  # it sees its own PID namespace
        assert engine.ask("matmul")["sum"] != 0
    finally:
        engine.stop()
        agent.stop()


@cuda
def test_restarted_agent_adopts_the_gpu_arena_from_an_engine(gpu_model, tmp_path):
    sock = str(tmp_path / "a.sock")
    first = AgentProcess(gpu_model, sock, "--backend", "cuda")
    first.wait_ready(300)
    engine = Engine(gpu_model, sock)
    second = None
    try:
        before = engine.ask("matmul")["sum"]
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        second = AgentProcess(gpu_model, sock, "--backend", "cuda")
        status = second.wait_ready(300)
        assert status["adopted"] is True and status["progress"]["bytes_done"] == 0
        newcomer = Engine(gpu_model, sock)
        assert newcomer.ask("matmul")["sum"] == before
        newcomer.stop()
    finally:
        engine.stop()
        if second is not None:
            second.stop()


@cuda
def test_driver_names_devices_and_marks_as_torch_does():
    """The agent asks the driver, not torch: same UUIDs per ordinal, same fingerprint device mark."""
    from weightcache_agent.arena.cuda import device_mark
    from weightcache_agent.arena.devices import _driver_uuids, cuda_uuid

    assert _driver_uuids() == [cuda_uuid(i) for i in range(torch.cuda.device_count())]
    major, minor = torch.cuda.get_device_capability(0)
    assert device_mark(0) == f"sm_{major}{minor}/cuda-{torch.version.cuda}"


@cuda
def test_prepare_then_attach_binds_on_the_gpu(tmp_path):
    """`prepare()` warms the path on a small arena of its own; the real attach after it is unaffected."""
    import weightcache_agent
    from weightcache_agent import CacheSpec, attach
    from weightcache_agent.load.checkpoint import open_checkpoint
    from weightcache_agent.testing.synthetic import skeleton_module

    model = write_llama_checkpoint(str(tmp_path / "m"), LlamaShape(num_hidden_layers=2))
    sock = str(tmp_path / "a.sock")
    agent = AgentProcess(model, sock, "--backend", "cuda")
    try:
        agent.wait_ready()
        took = weightcache_agent.prepare(0)
        assert set(took) == {"cpu", "cuda"}
        module = skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})
        with attach(module, CacheSpec(model=model), socket=sock) as att:
            assert set(att.phases) == {"request", "round trip", "map", "bind"}
            w = dict(module.named_parameters())["model.layers.0.mlp.down_proj.weight"]
            assert w.is_cuda and not w.is_meta
    finally:
        agent.stop()


@cuda
def test_an_arena_filled_from_a_peer_view_holds_the_sources_bytes():
    """A replica's fill: the source arena's fd mapped for this device, one driver copy into ours."""
    from weightcache_agent.arena.cuda import CudaArena, PeerView
    from weightcache_agent.arena.devices import cuda_uuid

    uuid, size = cuda_uuid(0), 64 << 20
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0", generator=None)
    source, target = CudaArena(size, 0, uuid), CudaArena(size, 0, uuid)
    try:
        source.device_tensor().copy_(data)
        source.seal()
        view = PeerView(source.fd, source.size, uuid, readers=[0])
        try:
            target.copy_from(view, size - 4096)  # the layout's bytes: less than the granule-rounded arena
        finally:
            view.release()
        target.seal()
        check = PeerView(target.fd, target.size, uuid, readers=[0])
        try:
            copied = check.tensor()
            assert torch.equal(copied[: size - 4096], data[: size - 4096])
            assert not torch.equal(copied[size - 4096 : size], data[size - 4096 :]), "copied past the count"
            del copied
        finally:
            check.release()
    finally:
        source.close()
        target.close()


@cuda
def test_access_granted_meanwhile_reads_the_arenas_bytes_and_a_mapping_may_go_before_the_wait(monkeypatch):
    """An engine's mapping: read access is set on the granter thread while the engine binds; the
    wait comes before any read. A mapping dropped before the wait is released once its grant is
    done."""
    from weightcache_agent.arena import cuda as cuda_arena
    from weightcache_agent.arena.devices import cuda_uuid

    failures = []
    release = cuda_arena._Mapping.release

    def recorded(mapping) -> None:  # __del__ swallows what a release raises: keep it here
        try:
            release(mapping)
        except BaseException as e:
            failures.append(e)
            raise

    monkeypatch.setattr(cuda_arena._Mapping, "release", recorded)
    uuid, size = cuda_uuid(0), 64 << 20
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0")
    arena = cuda_arena.CudaArena(size, 0, uuid)
    try:
        arena.device_tensor().copy_(data)
        arena.seal()
        base, granted = cuda_arena.map_readonly_cuda_meanwhile(arena.fd, arena.size, uuid)
        granted()
        assert torch.equal(base[:size], data)
        del base, granted
        gone = []
        for _ in range(50):
            base, granted = cuda_arena.map_readonly_cuda_meanwhile(arena.fd, arena.size, uuid)
            gone.append(weakref.ref(granted.__self__))
            del base, granted
        deadline = time.monotonic() + 10
        while any(ref() is not None for ref in gone) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(ref() is None for ref in gone) and failures == []
        assert [t.name for t in threading.enumerate()].count("weightcache-map") == 1  # one granter for them all
    finally:
        arena.close()
