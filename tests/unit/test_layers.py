"""The package's layers import only downward: a new upward import fails here, naming the module and the import.

DESIGN.md §3: ``neurons -> base -> {validation, training, p2p, chain} -> config/protocol``, with the all-reduce
(``allreduce``, DESIGN.md §13) between ``training`` and ``p2p``; neurons, scripts and benchmarks import the package
and never each other. ``training`` trains a DiLoCo run between plain processes (no chain, no validators),
``validation`` scores tensors it is given (no hivemind, not even through what it imports), and ``config.py`` sits
under the chain facade. Read from the source with ``ast``: nothing is imported or run.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "template"
# the programs around the package: what each may import besides the package (never each other, never the tests)
PROGRAMS = {"neurons": {"neurons"}, "scripts": {"scripts"}, "benchmarks": {"benchmarks"}}

# layer -> the layers it may import (itself included). A layer is template/<name>/ or template/<name>.py.
ALLOWED = {
    "__init__": set(),
    "config": set(),
    "protocol": set(),
    "chain": {"chain", "config"},
    "p2p": {"p2p", "chain", "config", "protocol"},
    "allreduce": {"allreduce", "p2p", "config", "protocol"},
    "training": {"training", "allreduce", "p2p", "config", "protocol"},
    "validation": {"validation", "training", "config", "protocol"},
    "tools": {"tools", "training", "config"},
    "base": {"base", "validation", "training", "allreduce", "p2p", "chain", "config", "protocol", "__init__"},
    # the local network puts its neurons behind the simulated link of p2p (--link.mbit), as benchmarks do
    "localnet": {"localnet", "base", "training", "allreduce", "p2p", "chain", "config", "protocol"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from template import X`` counts as ``template.X``)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "template":
                found.update(f"template.{alias.name}" for alias in node.names)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    """The package's import graph, parsed once per test session (callers only read it)."""
    return {module_name(path): imports_of(path) for path in PACKAGE.rglob("*.py")}


def upward_imports(modules: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imported in modules.items():
        layer = layer_of(module)
        for target in imported:
            if target.startswith("template.") and layer_of(target) not in ALLOWED[layer]:
                found.append(f"{module} imports {target} ({layer} may import {sorted(ALLOWED[layer])})")
    return sorted(found)


def test_every_layer_imports_only_what_it_may():
    violations = upward_imports(graph())
    assert not violations, "\n".join(violations)


def test_every_layer_is_known():
    assert {layer_of(module) for module in graph()} <= set(ALLOWED)


def test_validation_reaches_no_hivemind_even_through_what_it_imports():
    modules = graph()
    seen: set[str] = set()
    frontier = [m for m in modules if layer_of(m) == "validation"]
    while frontier:
        module = frontier.pop()
        if module in seen:
            continue
        seen.add(module)
        for target in modules.get(module, set()):
            assert not (target == "hivemind" or target.startswith("hivemind.")), f"{module} imports {target}"
            package = target.rsplit(".", 1)[0]
            for candidate in (target, package):  # `from template.training import x` names a module or a name
                if candidate in modules:
                    frontier.append(candidate)
    assert any(layer_of(m) == "training" for m in seen)  # the walk did follow validation into training


def program_violations() -> list[str]:
    """Imports between the programs (neurons, scripts, benchmarks), of the tests, or of a program by the package."""
    found = []
    for folder, allowed in PROGRAMS.items():
        for path in (REPO / folder).rglob("*.py"):
            for target in imports_of(path):
                top = target.split(".")[0]
                if top in set(PROGRAMS) - allowed or top == "tests":
                    found.append(f"{path.relative_to(REPO)} imports {target}")
    for module, imported in graph().items():
        found += [f"{module} imports {t}" for t in imported if t.split(".")[0] in {*PROGRAMS, "tests"}]
    return sorted(found)


def test_neurons_scripts_and_benchmarks_import_the_package_not_each_other():
    violations = program_violations()
    assert not violations, "\n".join(violations)
    # and each of them does use the package (the walk above read real files)
    for folder in PROGRAMS:
        assert any(t.startswith("template.") for p in (REPO / folder).rglob("*.py") for t in imports_of(p)), folder


def test_the_check_catches_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from template.base.neuron import StopFlag\nimport template.chain.client\n")
    modules = {"template.training.bad": imports_of(bad), "template.config": {"template.chain.client"}}
    allowed = "['allreduce', 'config', 'p2p', 'protocol', 'training']"
    assert upward_imports(modules) == [
        "template.config imports template.chain.client (config may import [])",
        f"template.training.bad imports template.base.neuron (training may import {allowed})",
        f"template.training.bad imports template.chain.client (training may import {allowed})",
    ]
