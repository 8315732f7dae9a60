"""What a platform team reads before adopting, held to the code: which engines have an
integration, the metrics reference, memory sizing, the compatibility matrix. Each page's
claims are checked against what the package registers, defines, lays out or pins."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGE = ROOT / "node_agent" / "weightcache_agent"


def table(page: pathlib.Path, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table under `heading`, header and rule left out."""
    body = page.read_text().split(f"\n{heading}\n", 1)[1]
    rows = []
    for line in body.splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return [r for r in rows[1:] if not set("".join(r)) <= set("-: ")]


# -- engines.md: the integrations the package really has ---------------------------------------

def integrations() -> set[str]:
    """Engines the package integrates with: its plugin entry points' owners (`vllm.general_plugins`
    -> vllm) and its integration modules (`integrations/vllm_loader.py` -> vllm)."""
    groups = re.findall(r'^\[project\.entry-points\."([^"]+)"\]', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    owners = {group.split(".")[0] for group in groups}
    modules = {p.stem.split("_")[0] for p in (PACKAGE / "integrations").glob("*.py") if not p.stem.startswith("_")}
    return owners | modules


def test_engines_page_lists_every_integration_the_package_registers_and_no_other():
    rows = table(DOCS / "engines.md", "## Which engines have an integration")
    found = integrations()
    assert {"vllm", "transformers"} <= found
    for name in found:
        (row,) = [r for r in rows if name in r[0].lower()]  # one row names it
        assert row[1].startswith("integrated"), row
    for engine, status in rows:
        if status.startswith("no integration"):
            listed = {e.strip().lower() for e in engine.split(",")}
            assert not listed & found, (engine, listed & found)  # "no integration" for one we have
        elif "weightcache engine" not in engine:
            assert any(name in engine.lower() for name in found), engine  # "integrated" with nothing behind it


def test_the_vllm_plugin_the_docs_promise_is_registered_in_the_installed_package():
    from importlib.metadata import entry_points

    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.dist and ep.dist.name == "weightcache"]
    assert plugin.name == "weightcache" and callable(plugin.load())
    readme, engines = (ROOT / "README.md").read_text(), (DOCS / "engines.md").read_text()
    for page in (engines, (DOCS / "vllm.md").read_text()):
        assert "--load-format weightcache" in page and "vllm.general_plugins" in page
    assert "--load-format weightcache" in readme
    assert "[`vllm.md`](vllm.md)" in engines


def test_no_page_says_the_reference_engine_generates_only_without_tensor_parallelism():
    """The reference engine generates with tensor parallelism (tests/test_tensor_parallel.py checks
    its tokens equal one rank's): its flags exist, and no page restricts generation to one rank."""
    help_text = subprocess.run([sys.executable, "-m", "weightcache_agent", "engine", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "--tp-size" in help_text and "--dist-init" in help_text
    restrictive = re.compile(r"generat\w*[^.|]{0,40}(only )?(for|with|needs) `?(tp_size|--tp-size)[ =]?`? ?1\b",
                             re.IGNORECASE)
    pages = [ROOT / "README.md", *DOCS.glob("*.md")]
    assert [p.name for p in pages if restrictive.search(p.read_text())] == []
    (reference,) = [r for r in table(DOCS / "engines.md", "## Which engines have an integration")
                    if "weightcache engine" in r[0]]
    assert "tensor parallelism" in reference[1] and "--tp-size N" in reference[1]
    # the check has teeth: the sentence engines.md used to carry is caught
    assert restrictive.search("HTTP `/generate`; generation for `tp_size=1`")


# -- metrics.md: exactly the metrics the code defines ----------------------------------------------

METRIC_SECTIONS = {"## Node agent": "/serve/", "## Reference engine": "/engine/", "## vLLM": "/integrations/vllm"}


def documented_metrics() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """metric -> (section, type, labels) from the tables of docs/metrics.md."""
    out = {}
    for heading in METRIC_SECTIONS:
        for name, kind, labels, _ in table(DOCS / "metrics.md", heading):
            assert name.strip("`") not in out, name
            out[name.strip("`")] = (heading, kind, tuple(sorted(re.findall(r"`(\w+)`", labels))))
    return out


def test_metrics_page_lists_exactly_the_metrics_the_code_defines():
    from metrics_catalog import defined_metrics

    defined = defined_metrics()
    documented = documented_metrics()
    assert set(documented) == set(defined)
    for name, metric in defined.items():
        heading, kind, labels = documented[name]
        assert METRIC_SECTIONS[heading] in metric.source, (name, heading, metric.source)
        assert (kind, labels) == (metric.kind, tuple(sorted(metric.labels))), name
    # the operator exports none, as the page says
    assert not [m for m in defined.values() if m.source.startswith("operator/")]
    assert "| operator | no `/metrics`" in (DOCS / "metrics.md").read_text()


def scraped(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Prometheus text -> name a query uses -> (type, labels), as a scrape parses it."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {label for sample in family.samples for label in sample.labels if label != "le"}
        out[name] = (family.type, tuple(sorted(labels)))
    return out


def test_what_the_agent_and_the_engine_serve_on_metrics_is_what_the_page_says():
    """The agent's registry and the reference engine's text, produced by their own code and parsed
    as Prometheus parses a scrape, against the page's tables."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from weightcache_agent.engine.server import Engine
    from weightcache_agent.serve.agent_http import AgentMetrics

    metrics = AgentMetrics()
    rank = {"rank": 0, "device": "GPU-0", "bytes": 1 << 30, "clients": 2, "loadSeconds": 3.5, "phase": "Ready",
            "restarts": 1, "misses": 0, "integrity": "verified", "integrityFailures": 0}
    metrics.watch(lambda: {"ranks": [rank]}, [(0, "GPU-0")])
    metrics.observe_attach(0, "GPU-0", 0.003)
    served = scraped(generate_latest(metrics.registry).decode())
    served.pop("weightcache_attach_seconds_created", None)  # prometheus_client's timestamp of the histogram
    served.update(scraped(Engine.metrics_text(SimpleNamespace(attachment=None, requests=3))))
    documented = {name: (kind, labels) for name, (heading, kind, labels) in documented_metrics().items()
                  if heading != "## vLLM"}  # vLLM's registry lives in vLLM's processes (tests/test_vllm.py)
    assert served == documented


def test_metrics_page_queries_parse_and_name_defined_metrics():
    from test_chart_monitoring import undefined

    (block,) = re.findall(r"```promql\n(.*?)```", (DOCS / "metrics.md").read_text(), re.DOTALL)
    queries = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(queries) >= 4 and undefined(queries) == {}
