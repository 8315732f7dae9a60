"""Every Prometheus metric the code defines, read from the source as a reviewer would find them.

A metric is defined by a prometheus_client constructor (`Counter("name", ...)`, `Gauge`,
`Histogram`, `Summary`, `Info`, `Enum`), by a collector's `*MetricFamily("name", ...)`, or by
hand-written exposition text (`# TYPE name kind`). This module walks the Python source of
node_agent/ and operator/ for all three and answers, per metric, the names a scrape shows
(a counter's `_total`, a histogram's `_bucket`/`_sum`/`_count`) and its labels.
"""
from __future__ import annotations

import ast
import functools
import pathlib
import re
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "node_agent", ROOT / "operator")
_CLIENT = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary", "Info": "info",
           "Enum": "stateset"}
_FAMILY = {f"{name}MetricFamily": kind for name, kind in _CLIENT.items()}
_TYPE_LINE = re.compile(r"# TYPE (\w+) (\w+)")
_HAND_LABELS = re.compile(r"(\w+)\{(\w+)=")


@dataclass(frozen=True)
class Metric:
    name: str  # as defined
    kind: str  # counter, gauge, histogram, ...
    labels: tuple[str, ...]
    source: str  # file, relative to the repository

    @property
    def exposed(self) -> str:
        """The name a query uses: counters end in _total; the rest as defined."""
        if self.kind == "counter" and not self.name.endswith("_total"):
            return self.name + "_total"
        return self.name + "_info" if self.kind == "info" else self.name

    @property
    def series(self) -> set[str]:
        """Every sample name a scrape may show for it."""
        if self.kind == "histogram":
            return {self.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        if self.kind == "counter" and not self.name.endswith("_total"):
            return {self.exposed, self.name + "_created"}
        return {self.exposed}


def _constants(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    """Module-level NAME = ("a", "b") tuples and lists of strings."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List)):
            values = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(values) == len(node.value.elts):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = tuple(values)
    return out


def _labels(node: ast.AST | None, constants: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    if node is None:
        return ()
    if isinstance(node, ast.Name):
        return constants[node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(e.value for e in node.elts)  # type: ignore[attr-defined]
    raise ValueError(f"labels given as {ast.dump(node)}: name them in a literal or a module constant")


def _strings(node: ast.AST) -> list[str]:
    """The literal text of a str constant or of an f-string's constant parts."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)]
    return []


@functools.cache
def defined_metrics() -> dict[str, Metric]:
    """Every metric defined in the source, by exposed name."""
    found: dict[str, Metric] = {}
    for base in SOURCES:
        for path in sorted(base.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            constants, where = _constants(tree), str(path.relative_to(ROOT))
            typed: dict[str, str] = {}
            labelled: dict[str, set[str]] = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    kind = _CLIENT.get(func) or _FAMILY.get(func)
                    if kind and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                        keywords = {k.arg: k.value for k in node.keywords}
                        if func in _CLIENT:
                            given = node.args[2] if len(node.args) > 2 else keywords.get("labelnames")
                        else:
                            given = keywords.get("labels")
                        metric = Metric(node.args[0].value, kind, _labels(given, constants), where)
                        found[metric.exposed] = metric
                for text in _strings(node):
                    typed.update(_TYPE_LINE.findall(text))
                    for name, label in _HAND_LABELS.findall(text):
                        labelled.setdefault(name, set()).add(label)
            for name, kind in typed.items():
                found[name] = Metric(name, kind, tuple(sorted(labelled.get(name, ()))), where)
    return found
