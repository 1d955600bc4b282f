"""The house: imports run one way.

Walks every ``import`` statement of ``compile_ops``, ``cases`` and ``bench``
(module level and inside functions alike: a lazy import is still a dependency)
and fails on a circle, naming it. A package's ``__init__`` counts as the module
of the package's name; importing a submodule does not count as importing its parent
package (Python does that for every module, which would make everything one
circle), but ``from pkg import name`` counts as importing ``pkg.name`` when
that is a module, else ``pkg`` itself.

Why it matters: ``_library`` (the registration helper, the lowest layer)
imported the DTensor rules table, which imported every op, which imported
``_library``; and ``bench/run.py`` imported the runners that imported it back.
Such loops make the import order decide whether a name exists yet.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_files(package: str) -> dict:
    """``{module name: path}`` of every ``.py`` file of ``package``."""
    files = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _absolute(module: str, is_package: bool, level: int, name) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def all_imports(package: str) -> dict:
    """``{module: set of every module it imports}``, other packages' included."""
    files = module_files(package)
    imports = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, is_package, node.level, node.module)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.add(submodule if submodule in files else base)
        imports[module] = targets
    return imports


def import_graph(package: str) -> dict:
    """``{module: set of modules of the same package it imports}``."""
    files = module_files(package)
    return {
        module: {t for t in targets if t in files and t != module} for module, targets in all_imports(package).items()
    }


def find_cycle(graph: dict):
    """One import circle as a list of modules (first == last), or None."""
    state = {}  # module -> "open" while on the DFS stack, "done" after

    def visit(module, stack):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state:
                cycle = visit(target, stack)
                if cycle:
                    return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [])
            if cycle:
                return cycle
    return None


@pytest.mark.parametrize("package", ["compile_ops", "cases", "bench"])
def test_no_import_circles(package):
    graph = import_graph(package)
    assert len(graph) > 5, graph  # the walk found the package's modules
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_walk_sees_the_arrows_it_must_see():
    """The checker is not vacuous: known arrows appear, and a planted circle is found."""
    graph = import_graph("compile_ops")
    assert "compile_ops._dtensor" in graph["compile_ops._library"]
    assert "compile_ops._library" in graph["compile_ops.ops.norm"]
    assert "compile_ops.ops.attention" in graph["compile_ops.distributed"]
    # function-level imports count: __init__.patch imports the diffusers integration lazily
    assert "compile_ops.integrations.diffusers" in graph["compile_ops"]
    planted = {name: set(targets) for name, targets in graph.items()}
    planted["compile_ops._dtensor"].add("compile_ops.distributed")
    cycle = find_cycle(planted)
    assert cycle is not None and "compile_ops._dtensor" in cycle and "compile_ops.distributed" in cycle


def test_the_lowest_layers_import_no_op():
    """``_dtensor`` and ``_library`` sit under every op: neither reaches ``ops`` or the rules table."""
    graph = import_graph("compile_ops")

    def reachable(module):
        seen, todo = set(), [module]
        while todo:
            for target in graph[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    for low in ("compile_ops._dtensor", "compile_ops._library"):
        above = {m for m in reachable(low) if m.startswith("compile_ops.ops") or m == "compile_ops.distributed"}
        assert not above, f"{low} reaches {sorted(above)}"


#: Which layers each layer of ``compile_ops`` may import (docs/design.md): the
#: Triton kernels, the fakes and the PyTorch references under the ops, the ops
#: under the modules, the modules under the integrations, the package's
#: ``__init__`` over everything. A layer may always import itself.
LAYER_IMPORTS = {
    "kernels": set(),
    "meta": set(),
    "_dtensor": set(),
    "_replay": set(),
    "_cache_key": set(),
    "reference": {"meta"},
    "_library": {"_dtensor", "_replay", "meta"},
    "ops": {"kernels", "meta", "reference", "_library", "_dtensor", "_replay"},
    "modules": {"ops", "meta", "_library"},
    "distributed": {"ops", "meta", "_library", "_dtensor"},
    "integrations": {"modules", "ops", "meta", "reference", "_library", "_dtensor"},
    "quality": {"integrations", "modules", "ops", "meta", "reference", "_library", "_dtensor"},
}


def layer_of(module: str) -> str:
    """``compile_ops.ops.norm`` -> ``ops``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(graph: dict) -> list:
    """``(importer, imported)`` arrows that go up or sideways across layers."""
    wrong = []
    for module, targets in graph.items():
        layer = layer_of(module)
        if layer == "__init__":
            continue
        for target in targets:
            if layer_of(target) != layer and layer_of(target) not in LAYER_IMPORTS[layer]:
                wrong.append((module, target))
    return sorted(wrong)


def test_layers_import_downward_only():
    """kernels/meta/reference below ops, ops below modules and integrations: no
    kernel reaches an op, no op a module, no module an integration."""
    graph = import_graph("compile_ops")
    assert {layer_of(m) for m in graph} - {"__init__"} <= set(LAYER_IMPORTS), "a new layer needs its row"
    assert layer_violations(graph) == []


def test_the_layer_check_finds_an_arrow_upward():
    graph = {name: set(targets) for name, targets in import_graph("compile_ops").items()}
    graph["compile_ops.kernels.norm"].add("compile_ops.ops.norm")
    graph["compile_ops.ops.norm"].add("compile_ops.modules.norm")
    assert layer_violations(graph) == [
        ("compile_ops.kernels.norm", "compile_ops.ops.norm"),
        ("compile_ops.ops.norm", "compile_ops.modules.norm"),
    ]


#: The repository's packages above ``compile_ops``: the op table (``cases``) and the
#: benchmark. They import ``compile_ops``; it imports neither, as neither is
#: installed with it.
ABOVE_COMPILE_OPS = ("cases", "bench")


def imports_from_above(imports: dict) -> list:
    """``(importer, imported)`` arrows from ``compile_ops`` to a package above it."""
    return sorted(
        (module, target)
        for module, targets in imports.items()
        for target in targets
        if target.split(".")[0] in ABOVE_COMPILE_OPS
    )


def test_compile_ops_imports_no_package_above_it():
    imports = all_imports("compile_ops")
    assert imports_from_above(imports) == []
    # The check is not vacuous: a planted arrow is found, and cases' own arrow into compile_ops is seen.
    planted = dict(imports, **{"compile_ops.ops.norm": imports["compile_ops.ops.norm"] | {"cases.norm"}})
    assert imports_from_above(planted) == [("compile_ops.ops.norm", "cases.norm")]
    assert "compile_ops" in all_imports("cases")["cases"]
