"""docs/architecture.md stays the map of the tree: every module listed under "Every module" exists,
every module that exists is listed, and every message type of the agent's socket protocol (as
protocol.py's docstring gives them) is named on the page."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = {"node_agent/weightcache_agent": "The node agent", "operator/weightcache_operator": "The operator"}


def listed(doc: str, title: str) -> set[str]:
    """The module paths in the first column of the table under the `### <title>...` heading."""
    section = doc.split("## Every module", 1)[1]
    table = section.split(f"### {title}", 1)[1].split("\n### ", 1)[0]
    return set(re.findall(r"^\| `([^`]+\.py)` \|", table, re.M))


def modules(package: str) -> set[str]:
    root = ROOT / package
    return {p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.name != "__init__.py"}


def test_every_module_is_listed_and_every_listed_module_exists():
    doc = DOC.read_text()
    for package, title in PACKAGES.items():
        have, named = modules(package), listed(doc, title)
        assert have, package
        assert not have - named, f"modules of {package} missing from docs/architecture.md: {sorted(have - named)}"
        assert not named - have, f"docs/architecture.md lists modules {package} does not have: {sorted(named - have)}"


def test_every_socket_message_type_is_named():
    protocol = (ROOT / "node_agent" / "weightcache_agent" / "protocol.py").read_text()
    header = protocol.split('"""', 2)[1]
    types = set(re.findall(r'"type": "([a-z_]+)"', header))
    assert {"status", "attach", "manifest", "rejoin", "promote", "switchover", "group_claim"} <= types, types
    doc = DOC.read_text()
    missing = sorted(t for t in types if f"`{t}`" not in doc)
    assert not missing, f"socket message types docs/architecture.md does not name: {missing}"
