"""The package layering and module graph, read from the source (pure, no imports of the code).

Layers: accelerators <- mpicomm <- compressed <- zero <- ckpt <- bench; a package imports only
packages below it (ckpt nothing from compressed), and no two modules of the project import each
other, directly or around a circle (package ``__init__`` modules, which re-export, aside).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.once    # the same on any MPI: CI runs it on MPICH only

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = {
    "accelerators": set(),
    "mpicomm": {"accelerators"},
    "compressed": {"accelerators", "mpicomm"},
    "zero": {"accelerators", "mpicomm", "compressed"},
    "ckpt": {"accelerators", "mpicomm", "zero"},
    "elastic": {"accelerators", "mpicomm", "compressed", "zero", "ckpt"},
    "bench": {"accelerators", "mpicomm", "compressed", "zero", "ckpt", "elastic"},
    # Horovod's API lives in the mpicomm package (import mpicomm.horovod as hvd) but is an adapter
    # over the whole stack: 1-bit compression and hvd.elastic, imported lazily inside functions
    "mpicomm.horovod": {"accelerators", "mpicomm", "compressed", "zero", "ckpt", "elastic"},
}


def _layer(module: str) -> str:
    return "mpicomm.horovod" if module.startswith("mpicomm.horovod") else module.split(".")[0]


def _module(path: pathlib.Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _imports(path: pathlib.Path) -> set[str]:
    """Every module name an import statement of ``path`` names (function-level ones included)."""
    name, is_pkg = _module(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def _graph() -> tuple[dict[str, set[str]], set[str]]:
    files = [p for pkg in ALLOWED if "." not in pkg for p in sorted((ROOT / pkg).rglob("*.py"))]
    modules = {_module(p)[0]: p for p in files}
    packages = {_module(p)[0] for p in files if p.name == "__init__.py"}
    return {m: {d for d in _imports(p) if d in modules and d != m} for m, p in modules.items()}, packages


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_the_layers_below(package):
    graph, _ = _graph()
    wrong = sorted((m, d) for m, deps in graph.items() if _layer(m) == package
                   for d in deps if d.split(".")[0] not in ALLOWED[package] | {package.split(".")[0]})
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}; found {wrong}"


#: Known circles, to be broken (each pair's edge from the first to the second is left out): none.
KNOWN: set[tuple[str, str]] = set()


def test_no_import_circles_between_modules():
    graph, packages = _graph()
    graph = {m: deps - packages - {d for k, d in KNOWN if k == m}
             for m, deps in graph.items() if m not in packages}
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                circles.append(path[path.index(d):] + [m, d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not circles, f"import circles: {circles}"
