"""A minimal engine process for the tests: attach, then answer commands on stdin.

Each line on stdin is a command; each answer is one JSON line on stdout. Running as its
own process is the point: sharing, write protection and agent death are only meaningful
across real process boundaries.
"""
from __future__ import annotations

import json
import mmap
import os
import sys

import torch
from safetensors.torch import load_file

from weightcache_agent import CacheSpec, attach
from weightcache_agent.load.checkpoint import open_checkpoint
from weightcache_agent.testing.synthetic import skeleton_module


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon")


def memfd_ranges() -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:weightcache" in line:
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def main() -> None:
    model, socket = sys.argv[1], sys.argv[2]
    ckpt = open_checkpoint(model)
    module = skeleton_module({n: (r.shape, r.dtype) for n, r in ckpt.tensors.items()})
    before = rss_anon()
    events: list[dict] = []  # promote / demote, as the lease thread saw them
    att = attach(module, CacheSpec(model=model), socket=None if socket == "-" else socket,  # "-": from the environment
                 on_promote=lambda a: events.append({"event": "promote", "role": a.role}),
                 on_demote=lambda a: events.append({"event": "demote", "role": a.role}))
    params = dict(module.named_parameters())
    reply = {"attached": True, "bytes": att.bytes, "source": att.source, "pid": os.getpid(), "role": att.role}
    print(json.dumps(reply), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "touch":
            # Reads every byte, in small chunks so temporaries do not blur the RSS measurement.
            total = sum(float(chunk.float().sum()) for p in params.values() for chunk in p.reshape(-1).split(1 << 18))
            ranges = memfd_ranges()
            inside = all(any(lo <= p.data_ptr() < hi for lo, hi in ranges) for p in params.values() if p.numel())
            out = {"checksum": total, "rss_anon_growth": rss_anon() - before, "inside_memfd": inside,
                   "read_only": all(not p.requires_grad for p in params.values())}
        elif cmd == "verify":
            disk = load_file(os.path.join(model, "model.safetensors"))
            out = {"identical": all(torch.equal(disk[n], params[n].cpu()) for n in disk) and set(disk) == set(params)}
        elif cmd == "write":
            first = next(iter(params.values()))
            print(json.dumps({"writing": True}), flush=True)
            first.data.add_(1)  # must fault: the arena is mapped read-only
            out = {"wrote": True}
        elif cmd == "map-writable":
            fd = att._fds[0]
            try:
                mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                out = {"writable_map": True}
            except PermissionError as e:
                out = {"writable_map": False, "error": str(e)}
        elif cmd == "status":
            out = {"agent_alive": att.agent_alive, "role": att.role, "rejoins": att.rejoins, "events": events}
        elif cmd == "exit":
            att.close()
            out = {"closed": True}
            print(json.dumps(out), flush=True)
            return
        else:
            out = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
