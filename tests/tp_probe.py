"""One rank of a tensor-parallel forward, for tests and the GPU suite: prints nothing, writes logits.

Usage: python tp_probe.py MODEL QUANTS RANK SIZE tcp://HOST:PORT OUT.pt [SOCKET]
For each quantization in the comma list QUANTS: loads rank RANK's shard (from disk, or
attached through SOCKET), joins the process group once (gloo on CPU, NCCL when the shard
is on a GPU), runs the forward of a fixed prompt and a greedy continuation; rank 0 saves
{quant: {"logits", "tokens"}} to OUT.pt.
"""
import sys

import torch

from weightcache_agent.engine.server import _prepare_device, load_model
from weightcache_agent.engine.tensor_parallel import Collectives, parallelize, rank_device
from weightcache_agent.spec import CacheSpec

PROMPT = [1, 17, 42, 255, 3, 99, 7, 300]


def run_rank(model: str, quants: "tuple[str, ...]", rank: int, size: int, init: str,
             sock: "str | None" = None) -> dict:
    """This rank's part of the forward for each quantization; {quant: {"logits", "tokens"}} (rank 0's are whole)."""
    if sock:
        _prepare_device(sock)
    comm, results = None, {}
    try:
        for quant in quants:
            spec = CacheSpec(model=model, tp_size=size, tp_rank=rank, quantization=quant)
            m, att = load_model(spec, mode="client" if sock else "off", socket=sock)
            comm = comm or Collectives(rank, size, init, rank_device(m))
            parallelize(m, comm)
            with torch.inference_mode():
                logits = m(torch.tensor([PROMPT], device=rank_device(m)))
            results[quant] = {"logits": logits.cpu(), "tokens": m.generate(PROMPT, 6)}
            att.close()
    finally:
        if comm is not None:
            comm.close()
    return results


def main() -> None:
    model, quants, rank, size, init, out = sys.argv[1:7]
    sock = sys.argv[7] if len(sys.argv) > 7 else None
    results = run_rank(model, tuple(quants.split(",")), int(rank), int(size), init, sock)
    if int(rank) == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
