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
