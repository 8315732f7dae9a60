"""The packages' layers: a lower layer never imports a higher one, and no module imports
itself back through a circle. Read from the source with `ast`, so a lazy import inside a
function counts as much as one at the top of a file."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

import weightcache_agent
import weightcache_operator


@dataclasses.dataclass(frozen=True)
class Package:
    """An import package and its layers, lowest first (see its package docstring).

    A unit is a subpackage (dotted for a deeper one: ``controller.weightcache``) or a group of
    modules; a module belongs to the unit with the longest member its dotted path starts with.
    Units of one rank never import each other."""

    name: str
    root: pathlib.Path
    layers: tuple[dict[str, set[str]], ...]


AGENT = Package("weightcache_agent", pathlib.Path(weightcache_agent.__file__).parent, (
    {"base": {"errors", "spec", "quantization", "protocol", "packed_rows", "logs", "usage", "path_owners"}},
    {"arena": {"arena"}},
    {"load": {"load"}},
    {"client": {"client"}, "serve": {"serve"}, "testing": {"testing"}},
    {"integrations": {"integrations"}},
    {"engine": {"engine"}},
    {"cli": {"cli", "compile_cache_prune", "__init__", "__main__"}},
))
# By resource: an EngineSet runs on a WeightCache's agents, so its controller reads the cache's;
# the WeightCache's never reads the EngineSet's.
OPERATOR = Package("weightcache_operator", pathlib.Path(weightcache_operator.__file__).parent, (
    {"api": {"api"}},
    {"shared": {"config", "kube", "conditions", "owned_status", "reconciler"}},
    {"weightcache": {"controller.weightcache"}},
    {"engineset": {"controller.engineset"}},
    {"registry": {"registry", "cli", "__init__", "controller"}},
))
PACKAGES = [AGENT, OPERATOR]


def layer_of(package: Package, module: str) -> tuple[int, str]:
    """(rank, unit) of a dotted module under the package."""
    parts = module.split(".")[1:] or ["__init__"]
    for depth in range(len(parts), 0, -1):
        prefix = ".".join(parts[:depth])
        for rank, units in enumerate(package.layers):
            for unit, members in units.items():
                if prefix in members:
                    return rank, unit
    raise AssertionError(f"{module}: not placed in a layer; add it to the layers here and to the package docstring")


def module_name(package: Package, path: pathlib.Path) -> str:
    parts = list(path.relative_to(package.root.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(package: Package, path: pathlib.Path, here: str | None = None) -> set[str]:
    """Dotted names of package modules that `path` (module `here`) imports, relative imports resolved."""
    here = here or module_name(package, path)
    within = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = within.split(".")[: len(within.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != package.name:
                continue
            for alias in node.names:  # `from . import protocol` names a module
                candidate = f"{target}.{alias.name}"
                found.add(candidate if _exists(package, candidate) else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == package.name}
    return {t for t in found if t != package.name}


def _exists(package: Package, module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    return (package.root / rel).with_suffix(".py").exists() or (package.root / rel / "__init__.py").exists() or \
        any((package.root / rel.parent).glob(rel.name + ".*.so"))


def graph(package: Package) -> dict[str, set[str]]:
    return {module_name(package, p): imports_of(package, p) for p in package.root.rglob("*.py")}


by_name = pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)


@by_name
def test_every_module_is_in_a_layer(package: Package):
    for module in graph(package):
        if module != package.name:
            layer_of(package, module)


@by_name
def test_lower_layers_never_import_higher_ones(package: Package):
    wrong = []
    for module, targets in graph(package).items():
        if module == package.name:
            continue
        rank, unit = layer_of(package, module)
        for target in targets:
            t_rank, t_unit = layer_of(package, target)
            if t_unit != unit and t_rank >= rank:
                wrong.append(f"{module} imports {target} ({unit} is layer {rank}, {t_unit} is layer {t_rank})")
    assert not wrong, "\n".join(sorted(wrong))


@by_name
def test_no_import_circle(package: Package):
    edges = graph(package)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt in edges and not state.get(nxt):
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if not state.get(node):
            visit(node)


# The agent worker is a façade (serve/agent.py) over single-job parts handed what they need: no part
# imports the façade back, and only the command that runs a worker imports it at all.
AGENT_FACADE = "weightcache_agent.serve.agent"
FACADE_IMPORTERS = {"weightcache_agent.serve.agent_main"}


def test_only_the_worker_command_imports_the_agent_facade():
    importers = {module for module, targets in graph(AGENT).items() if AGENT_FACADE in targets}
    assert importers <= FACADE_IMPORTERS, sorted(importers - FACADE_IMPORTERS)


def test_the_checker_resolves_relative_and_lazy_imports(tmp_path):
    """A module of `arena` that imports `serve` inside a function is found, at its real name."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ..errors import OutOfMemory\n\ndef later():\n    from ..serve import agent\n")
    found = imports_of(AGENT, probe, "weightcache_agent.arena.probe")
    assert found == {"weightcache_agent.errors", "weightcache_agent.serve.agent"}
    assert layer_of(AGENT, "weightcache_agent.serve.agent")[0] > layer_of(AGENT, "weightcache_agent.arena.probe")[0]


def test_the_checker_places_modules_of_nested_subpackages(tmp_path):
    """Three levels down: the WeightCache controller reaching for the EngineSet's (lazily) is a
    higher layer, and one `from ... import` names a shared module, not the package."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ... import owned_status\nfrom ...api.v1alpha1 import API_GROUP\n\n"
                     "def later():\n    from ..engineset.leases import primaries\n")
    found = imports_of(OPERATOR, probe, "weightcache_operator.controller.weightcache.probe")
    assert found == {"weightcache_operator.owned_status", "weightcache_operator.api.v1alpha1",
                     "weightcache_operator.controller.engineset.leases"}
    here = layer_of(OPERATOR, "weightcache_operator.controller.weightcache.probe")
    assert here == (2, "weightcache")
    assert layer_of(OPERATOR, "weightcache_operator.controller.engineset.leases")[0] > here[0]
    assert layer_of(OPERATOR, "weightcache_operator.api.v1alpha1")[0] < here[0]
