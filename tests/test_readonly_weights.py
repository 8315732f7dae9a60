"""Attached weights are read-only, and a write to one says so; copy_on_write=True lets an
engine change its own copy, paying only for the pages it writes.

Real engine processes attach to a real agent (cpu backend): one writes to a weight in
place and must die with a message naming the cause (and faulthandler's traceback of the
write); one attaches copy-on-write, changes a weight, and its memory map shows that only
the pages written became private while the agent's bytes stayed as they were.
"""
from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import textwrap

import pytest

from weightcache_agent.testing.agent_process import AgentProcess
from weightcache_agent.testing.synthetic import LlamaShape, write_llama_checkpoint

ENGINE = textwrap.dedent("""
    import json, sys
    import torch
    from weightcache_agent import CacheSpec, attach
    from weightcache_agent.load.checkpoint import open_checkpoint
    from weightcache_agent.testing.synthetic import skeleton_module

    model, sock, cow = sys.argv[1], sys.argv[2], sys.argv[3] == "cow"

    def skeleton():
        return skeleton_module({n: (r.shape, r.dtype) for n, r in open_checkpoint(model).tensors.items()})

    def anonymous_bytes(address):
        # The mapping that holds `address`: its size and the bytes that became private to us.
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                if start <= address < end:
                    fields = {}
                    for entry in lines[i + 1:]:
                        if entry.split()[0].rstrip(":") in ("Anonymous", "Size"):
                            fields[entry.split()[0].rstrip(":")] = int(entry.split()[1]) * 1024
                        if "-" in entry.split()[0] and ":" not in entry.split()[0]:
                            break
                    return fields
        raise AssertionError("no mapping holds the weight")

    module = skeleton()
    att = attach(module, CacheSpec(model=model), socket=sock, copy_on_write=cow)
    name, weight = max(module.named_parameters(), key=lambda p: p[1].numel())
    before = weight.detach().clone()
    print("writing", name, flush=True)
    with torch.no_grad():
        weight.mul_(2)  # in place: what engines do when they post-process weights
    mapped = anonymous_bytes(weight.data_ptr())
    other = skeleton()
    with attach(other, CacheSpec(model=model), socket=sock) as shared:
        untouched = dict(other.named_parameters())[name]
        print(json.dumps({"changed": torch.equal(weight, before * 2), "shared_unchanged": torch.equal(untouched, before),
                          "weight_bytes": weight.numel() * weight.element_size(), **mapped}))
""")


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    root = tmp_path_factory.mktemp("ro")
    model = write_llama_checkpoint(str(root / "m"), LlamaShape(num_hidden_layers=2))
    with AgentProcess(model, str(root / "a.sock"), "--backend", "cpu") as served:
        yield model, served


def engine(model: str, sock: str, how: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ENGINE, model, sock, how], capture_output=True, text=True, timeout=120)


def test_a_write_to_an_attached_weight_dies_naming_the_cause(agent):
    model, served = agent
    out = engine(model, served.socket, "shared")
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stderr[-2000:])
    assert "writing" in out.stdout
    # faulthandler's report follows; a thread whose fault comes late, under load, may cut it short.
    assert "Fatal Python error" in out.stderr
    if importlib.util.find_spec("weightcache_agent.client._rofault") is None:
        pytest.skip("the optional _rofault extension is not built: only faulthandler's traceback")
    assert ("weightcache: the process wrote to a weight attached from the agent's arena, which is mapped read-only"
            in out.stderr), out.stderr[-2000:]
    assert "copy_on_write=True" in out.stderr
    assert out.stderr.count("weightcache: the process wrote") == 1  # once, however many threads faulted
    assert served.status()["phase"] == "ready"  # the agent keeps serving


def test_copy_on_write_pays_only_for_the_pages_written(agent):
    model, served = agent
    out = engine(model, served.socket, "cow")
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["changed"] and result["shared_unchanged"], result
    page = 4096
    # The written tensor's pages (plus at most one partial page at each end) became private; the rest stays shared.
    assert result["weight_bytes"] <= result["Anonymous"] <= result["weight_bytes"] + 2 * page, result
    assert result["Size"] > result["Anonymous"] + page, result
