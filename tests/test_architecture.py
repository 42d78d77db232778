"""Architecture: the modules of ``minisparse`` import each other in one direction only.

Every ``import`` and ``from ... import`` statement of every module is read with ``ast``, at
module level and inside functions alike (a deferred import is still a dependency, only a later
one), and resolved to a module of the package: ``minisparse.x``, ``.x``, ``..x``, and
``from . import x`` where ``x`` is a module. The modules and these edges form a graph that must
have no cycle: a cycle means two ideas that cannot be read (or tested) one before the other.

An import of ``a.b.c`` first runs the ``__init__`` of ``a`` and of ``a.b``: those packages are
edges too, except the packages the importing module itself lies in (their ``__init__`` has
started before the importing module runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "minisparse"
ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    """Dotted name of a source file: ``minisparse/kernels/cpu.py`` -> ``minisparse.kernels.cpu``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package (``__init__`` files name their package), by dotted name."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def absolute_base(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The module a (possibly relative) ``from`` names.

    ``from ..x import y`` names ``a.x`` in the module ``a.b.c`` and in the package ``a.b`` (its
    ``__init__``, for which ``.`` is the package itself).
    """
    if level == 0:
        return target or ""
    here = module.split(".") if is_package else module.split(".")[:-1]
    base = here[: len(here) - (level - 1)]
    return ".".join([*base, target] if target else base)


def nearest_module(name: str, modules: set[str]) -> str | None:
    """``name`` if it is a module, else its longest dotted prefix that is: ``a.b.f`` -> ``a.b``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules that ``module`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(module, is_package, node.level, node.module)
            # ``from pkg import sub`` imports the module pkg.sub; ``from mod import name`` mod.
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = nearest_module(name, modules)
            if target is not None:
                found |= {target, *initialised_first(target, module, modules)}
    found.discard(module)
    return found


def initialised_first(target: str, importer: str, modules: set[str]) -> set[str]:
    """The packages whose ``__init__`` an import of ``target`` by ``importer`` may run first:
    those above ``target`` that do not hold ``importer`` too."""
    parts = target.split(".")
    above = {".".join(parts[:n]) for n in range(1, len(parts))}
    return {p for p in above if p in modules and not importer.startswith(p + ".")}


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = package_modules(root, package)
    return {m: imports_of(m, p, set(modules)) for m, p in modules.items()}


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): the
    modules that all reach each other through imports. An acyclic graph has none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A shortest cycle through each module of each tangle, each written as a path that returns
    to its first module (a tangle of three or more modules may hold several cycles)."""
    cycles: list[list[str]] = []
    for component in tangles(graph):
        for start in sorted(component):
            cycle = smallest_first(cycle_in(graph, component, start))
            if not any(is_rotation(cycle, c) for c in cycles):
                cycles.append(cycle)
    return cycles


def smallest_first(cycle: list[str]) -> list[str]:
    """The same closed path, started at its alphabetically first module."""
    path = cycle[:-1]
    i = path.index(min(path))
    return [*path[i:], *path[:i], path[i]]


def is_rotation(a: list[str], b: list[str]) -> bool:
    """Whether two closed paths are the same cycle started at different modules."""
    a, b = a[:-1], b[:-1]
    return len(a) == len(b) and any(a == b[i:] + b[:i] for i in range(len(b)))


def cycle_in(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest cycle through ``start`` inside its strongly connected component (BFS)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in the component {sorted(component)}")


def write_package(root: Path, sources: dict[str, str]) -> None:
    for name, text in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_import_resolution(tmp_path):
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from .a import f\n",
            "pkg/a.py": "def f():\n    from .sub import b\n    import pkg.sub.c\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "from ..a import f\nfrom . import c\nfrom .. import sub\n",
            "pkg/sub/c.py": "from pkg import a\nimport os\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.sub", "pkg.sub.b", "pkg.sub.c"},  # pkg.sub's __init__ runs first
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.a", "pkg.sub.c", "pkg.sub"},  # explicitly: from .. import sub
        "pkg.sub.c": {"pkg.a"},
    }
    assert tangles(graph) == [{"pkg.a", "pkg.sub.b", "pkg.sub.c"}]
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.a", "pkg.sub.c", "pkg.a"]]
    assert find_cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []


def test_cycle_through_a_package_init(tmp_path):
    """m imports sub.t only, but sub's __init__ runs first and imports u, which imports m."""
    write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/m.py": "def f():\n    from .sub.t import g\n",
            "pkg/sub/__init__.py": "from .u import h\n",
            "pkg/sub/t.py": "def g():\n    pass\n",
            "pkg/sub/u.py": "from ..m import f\n",
        },
    )
    assert find_cycles(import_graph(tmp_path, "pkg")) == [
        ["pkg.m", "pkg.sub", "pkg.sub.u", "pkg.m"]
    ]


def test_graph_sees_the_package():
    graph = import_graph()
    assert "minisparse.kernels.cpu" in graph
    assert "minisparse.core.model" in graph["minisparse.quant.apply"]
    assert "minisparse.kernels.cpu" in graph["minisparse.core.model"]  # an import inside a function


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    report = "\n".join(" -> ".join(c) for c in cycles)
    assert not cycles, f"import cycles inside {PACKAGE}:\n{report}"


#: The library's floors, from the ground up: a package imports only packages on lower floors
#: (and its own modules). Packages on one floor are rooms that never import each other.
FLOORS = (
    ("files", "deprecated"),  # the cache folder and atomic writes; old names, by string
    ("kernels",),  # the C fast path and the Triton kernels: tensors in, tensors out
    ("measure",),  # timing, machine facts, intervals
    ("core",),  # the Llama decoder itself (ch. 00-01)
    ("io", "kvcache"),  # weights and text in and out; the KV caches (ch. 02)
    ("runtime",),  # the compiled decode step, and generation on it
    ("sparsity", "quant"),  # ch. 03 and 05; ch. 09
    ("relufy", "sparse"),  # ch. 04; ch. 07
    ("predictors", "pruning"),  # ch. 06; ch. 12
    ("offload", "speculative", "moe", "peft"),  # ch. 08; ch. 10; ch. 12
    ("engine",),  # ch. 11: everything composed
    ("course",),  # the learner's builds, grading, the tour
    ("commands",),  # the commands that stand on everything, and the options they share
    ("bench",),  # the benchmarks (they take the commands' model options)
    ("cli",),
    ("__main__",),
)


def floor_of(module: str) -> int:
    """The floor of ``minisparse.<package>...``."""
    package = module.split(".")[1]
    for level, rooms in enumerate(FLOORS):
        if package in rooms:
            return level
    raise AssertionError(f"{module}: its package {package!r} is on no floor of FLOORS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports that reach a package on the same floor or a higher one (the package itself
    aside), each written ``importer -> imported``."""
    found = []
    for module, targets in sorted(graph.items()):
        if module == PACKAGE:  # the face: it runs before any of its modules
            continue
        for target in sorted(targets):
            if target == PACKAGE or target.split(".")[1] == module.split(".")[1]:
                continue
            if floor_of(target) >= floor_of(module):
                found.append(f"{module} -> {target}")
    return found


def test_floor_check_sees_an_import_that_runs_up(tmp_path):
    graph = {
        "minisparse.core.model": {"minisparse.kernels.cpu", "minisparse.core.layers"},
        "minisparse.core.layers": set(),
        "minisparse.kernels.cpu": set(),
    }
    assert upward_imports(graph) == []
    graph["minisparse.core.model"].add("minisparse.runtime.decoder")
    graph["minisparse.io.eval"] = {"minisparse.kvcache.paged"}  # a room beside, same floor
    assert upward_imports(graph) == [
        "minisparse.core.model -> minisparse.runtime.decoder",
        "minisparse.io.eval -> minisparse.kvcache.paged",
    ]


def test_every_package_is_on_a_floor():
    on_floors = {room for rooms in FLOORS for room in rooms}
    packages = {m.split(".")[1] for m in import_graph() if m != PACKAGE}
    assert packages == on_floors, (
        f"not on a floor: {sorted(packages - on_floors)}; gone: {sorted(on_floors - packages)}"
    )


def test_no_import_runs_up_a_floor():
    up = upward_imports(import_graph())
    report = "\n".join(up)
    assert not up, f"imports that run up (see FLOORS):\n{report}"


def test_every_module_declares_its_public_names():
    import importlib

    from api_doc import module_names

    missing = [
        name
        for name in module_names()
        if not hasattr(importlib.import_module(name), "__all__")
        and not name.endswith(("cli", "__main__"))
    ]
    assert not missing, f"modules without __all__: {missing}"


def test_the_api_page_matches_the_code():
    from pathlib import Path

    from api_doc import api_markdown

    page = Path(__file__).parent.parent / "docs" / "API.md"
    assert page.read_text() == api_markdown(), (
        "docs/API.md is out of date: python tests/api_doc.py > docs/API.md"
    )


def test_old_module_paths_import_the_new_modules_with_a_warning():
    import importlib
    import sys

    import pytest

    from minisparse.deprecated import RENAMED_MODULES

    for old, new in RENAMED_MODULES.items():
        sys.modules.pop(f"minisparse.{old}", None)
        with pytest.warns(DeprecationWarning, match=f"minisparse.{new}"):
            module = importlib.import_module(f"minisparse.{old}")
        assert module is importlib.import_module(f"minisparse.{new}")
        assert not (ROOT / PACKAGE / f"{old.replace('.', '/')}.py").exists()


def test_old_names_give_the_new_objects_with_a_warning():
    """Every entry of the one list of old names: read from its old module it is the new object,
    with a warning that names the new place; a name never defined stays an AttributeError."""
    import importlib

    import pytest

    from minisparse.deprecated import RENAMED_NAMES

    for old, new in RENAMED_NAMES.items():
        old_module, _, old_attr = old.rpartition(".")
        new_module, _, new_attr = new.rpartition(".")
        host = importlib.import_module(f"minisparse.{old_module}")
        assert old_attr not in vars(host), f"minisparse.{old} is still defined: drop its alias"
        with pytest.warns(DeprecationWarning, match=f"minisparse.{new}"):
            value = getattr(host, old_attr)
        assert value is getattr(importlib.import_module(f"minisparse.{new_module}"), new_attr)
        with pytest.raises(AttributeError, match="no_such_name"):
            host.no_such_name  # noqa: B018
    kernels = importlib.import_module("minisparse.kernels")
    with pytest.warns(DeprecationWarning):
        from minisparse.kernels import sparse_input_gemv  # the from-import form too
    assert sparse_input_gemv is kernels.scatter_gemv


def test_import_minisparse_loads_no_technique_chapter():
    """``import minisparse`` and ``minisparse.generate`` stand on the core model, its I/O and the
    compiled step: no module of chapters 03-10 loads until one is used (each technique
    registers its own lowering when it is imported)."""
    import subprocess
    import sys

    code = (
        "import sys, minisparse\n"
        "from minisparse import generate\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('minisparse'))))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    techniques = ("sparsity", "relufy", "predictors", "sparse", "offload", "quant", "speculative")
    assert "minisparse.runtime.lowering" in loaded and "minisparse.runtime.generate" in loaded
    early = [m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in techniques]
    assert not early, f"import minisparse loads technique modules: {early}"


def test_the_runtime_imports_no_technique():
    graph = import_graph()
    techniques = ("sparsity", "relufy", "predictors", "sparse", "offload", "quant", "speculative")
    for module, targets in graph.items():
        if module.startswith("minisparse.runtime"):
            reached = [t for t in targets if t.split(".")[1:2] and t.split(".")[1] in techniques]
            assert not reached, f"{module} imports {reached}"


def test_each_technique_registers_its_lowering_by_exact_type():
    from torch import nn

    from minisparse.predictors import LayerSelect
    from minisparse.quant import Int4Linear, Int8Linear
    from minisparse.runtime.lowering import lowered_types
    from minisparse.sparse import SparseMLP
    from minisparse.sparsity import MagnitudeThreshold

    assert {Int8Linear, Int4Linear, nn.Linear} <= set(lowered_types("linear"))
    assert MagnitudeThreshold in lowered_types("slot")
    assert MagnitudeThreshold in lowered_types("activation")
    assert SparseMLP in lowered_types("mlp")
    assert LayerSelect in lowered_types("selector")


def test_no_module_is_longer_than_400_lines():
    """One concept per module: a Python module, C file or header past 400 lines is two ideas
    that want their own file."""
    sources = sorted((ROOT / PACKAGE).rglob("*.py"))
    sources += sorted((ROOT / PACKAGE).rglob("*.c")) + sorted((ROOT / PACKAGE).rglob("*.h"))
    long = {
        str(path.relative_to(ROOT)): n
        for path in sources
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, f"files over 400 lines: {long}"


def test_the_library_never_imports_the_benchmarks():
    """``minisparse.bench`` measures the library; the library (bench and the CLI aside) never
    reaches up into it."""
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith(("minisparse.bench", "minisparse.cli", "minisparse.__main__")):
            continue
        up = sorted(t for t in targets if t.startswith("minisparse.bench"))
        assert not up, f"{module} imports {up}"
