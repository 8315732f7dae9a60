"""The operator's DaemonSet command line is one the agent accepts, meaning what the spec says.

Two packages meet at this command line; a flag renamed on one side must fail here, not in
a cluster. Every example WeightCache is rendered and parsed with the agent's own parser.
"""
from __future__ import annotations

import glob
import os

import pytest
import yaml

from weightcache_agent.serve.agent_main import build_parser
from weightcache_agent.spec import CacheSpec
from weightcache_operator.api.v1alpha1.weightcache_types import parse_spec
from weightcache_operator.config import OperatorConfig
from weightcache_operator.controller.weightcache.manifests import AGENT_HTTP_PORT, render_daemonset, socket_dir

EXAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "*.yaml")))


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_every_example_renders_an_agent_command_the_agent_accepts(path):
    with open(path) as f:
        caches = [d for d in yaml.safe_load_all(f) if d and d.get("kind") == "WeightCache"]
    if not caches:
        pytest.skip("no WeightCache in this example")
    (wc,) = caches
    name, namespace = wc["metadata"]["name"], wc["metadata"].get("namespace", "default")
    cs = parse_spec(wc["spec"])
    ds = render_daemonset(cs, namespace, name, OperatorConfig())
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["weightcache"] and container["args"][0] == "agent"
    args = build_parser().parse_args(container["args"][1:])  # exits (fails the test) on an unknown flag
    assert args.socket_dir == socket_dir(namespace, name)
    assert args.tp_size == cs.tensor
    assert args.quantization == cs.quantization and args.dtype == cs.dtype
    assert args.http_port == AGENT_HTTP_PORT
    assert args.expert_parallel == (cs.expert > 1)
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert ports.get("http") == args.http_port
    # and the agent would accept the spec itself (quantization allowlist, dtype, ranks)
    CacheSpec(model=args.model, tp_size=args.tp_size, tp_rank=args.tp_size - 1, quantization=args.quantization,
              dtype=args.dtype, sharding=args.sharding, expert_parallel=args.expert_parallel)
