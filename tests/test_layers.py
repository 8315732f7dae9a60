"""The package's layers: a lower layer never imports a higher one, and no module imports
itself back through a circle. Read from the source with `ast`, so a lazy import inside a
function counts as much as one at the top of a file."""
from __future__ import annotations

import ast
import pathlib

import weightcache_agent

PACKAGE = pathlib.Path(weightcache_agent.__file__).parent
NAME = "weightcache_agent"

# Lowest first; see the package docstring. Top-level modules not listed are `cli` level.
# A unit is a subpackage, or a group of top-level modules; units of one rank never import each other.
LAYERS = [
    {"base": {"errors", "spec", "quantization", "protocol", "packed_rows", "logs", "usage"}},
    {"arena": {"arena"}},
    {"load": {"load"}},
    {"client": {"client"}, "serve": {"serve"}, "testing": {"testing"}},
    {"integrations": {"integrations"}},
    {"engine": {"engine"}},
    {"cli": {"cli", "__init__", "__main__"}},
]


def layer_of(module: str) -> tuple[int, str]:
    """(rank, unit) of a dotted module under the package."""
    top = module.split(".")[1] if "." in module else "__init__"
    for rank, units in enumerate(LAYERS):
        for unit, members in units.items():
            if top in members:
                return rank, unit
    raise AssertionError(f"{module}: not placed in a layer; add it to LAYERS and the package docstring")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: pathlib.Path, here: str | None = None) -> set[str]:
    """Dotted names of package modules that `path` (module `here`) imports, relative imports resolved."""
    here = here or module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != NAME:
                continue
            for alias in node.names:  # `from . import protocol` names a module
                candidate = f"{target}.{alias.name}"
                found.add(candidate if _exists(candidate) else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == NAME}
    return {t for t in found if t != NAME}


def _exists(module: str) -> bool:
    rel = pathlib.Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists() or \
        any((PACKAGE / rel.parent).glob(rel.name + ".*.so"))


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def test_every_module_is_in_a_layer():
    for module in graph():
        if module != NAME:
            layer_of(module)


def test_lower_layers_never_import_higher_ones():
    wrong = []
    for module, targets in graph().items():
        if module == NAME:
            continue
        rank, unit = layer_of(module)
        for target in targets:
            t_rank, t_unit = layer_of(target)
            if t_unit != unit and t_rank >= rank:
                wrong.append(f"{module} imports {target} ({unit} is layer {rank}, {t_unit} is layer {t_rank})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle():
    edges = graph()
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


def test_the_checker_resolves_relative_and_lazy_imports(tmp_path):
    """A module of `arena` that imports `serve` inside a function is found, at its real name."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ..errors import OutOfMemory\n\ndef later():\n    from ..serve import agent\n")
    found = imports_of(probe, f"{NAME}.arena.probe")
    assert found == {f"{NAME}.errors", f"{NAME}.serve.agent"}
    assert layer_of(f"{NAME}.serve.agent")[0] > layer_of(f"{NAME}.arena.probe")[0]
