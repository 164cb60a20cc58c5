"""The package's shape: no import cycles among its modules, counting imports inside functions,
and nothing below training imports the training module."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "captioning"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package modules that ``path`` imports anywhere in its body, functions included.
    ``from a.b import c`` counts as an import of ``a.b.c`` when that is a module, else
    of ``a.b``."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path.parent)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: imported_modules(path, modules) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_function_level_imports_are_counted(tmp_path, monkeypatch):
    package = tmp_path / "captioning"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from captioning.b import g\n")
    (package / "b.py").write_text("from captioning import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert find_cycle(import_graph()) == ["captioning.a", "captioning.b", "captioning.a"]


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert len(graph) > 20  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


# the layers below training, serving and the command line
BELOW_TRAINING = [
    "captioning.runtime",
    "captioning.distributed",
    "captioning.data.feature_cache",
    "captioning.inference.caption",
    "captioning.evaluate",
    "captioning.inference.decoding",
    "captioning.models",
    "captioning.data",
    "captioning.metrics",
    "captioning.prepare",
    "captioning.progress",
    "captioning.api",
    "captioning.serve.app",
    "captioning.serve.server",
    "captioning.training.run_state",
    "captioning.training.run_folder",
]


@pytest.mark.parametrize("module", BELOW_TRAINING)
def test_the_layers_below_training_do_not_import_it(module):
    graph = import_graph()
    reachable, todo = set(), [module]
    while todo:
        for target in graph[todo.pop()] - reachable:
            reachable.add(target)
            todo.append(target)
    assert not reachable & {"captioning.training.train", "captioning.cli", "captioning.quickstart"}


def test_no_function_in_the_package_is_over_80_lines():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{module_name(path)}.{node.name}: {lines} lines")
    assert not long, long


RUNTIME_READERS = [
    "inference/caption.py",
    "inference/decoding.py",
    "evaluate.py",
    "api.py",
    "cli.py",
    "serve/app.py",
    "serve/server.py",
    "serve/batching.py",
    "serve/limits.py",
]


@pytest.mark.parametrize("name", RUNTIME_READERS)
def test_what_runs_a_trained_model_reads_no_training_settings(name):
    """Decoding, evaluation, the API, the command line and the server take precision, batch
    size and seed from the ``runtime`` section (or arguments), never from ``cfg.train``."""
    tree = ast.parse((PACKAGE / name).read_text())
    reads = [
        f"line {node.lineno}: .train.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "train"
    ]
    assert not reads, reads


def test_every_objective_has_the_objective_protocols_methods_and_signature():
    import inspect

    from captioning.objectives import (
        CrossEntropyObjective,
        HardAttentionObjective,
        Objective,
        SelfCriticalObjective,
    )

    expected = inspect.signature(Objective.loss)
    for cls in (CrossEntropyObjective, HardAttentionObjective, SelfCriticalObjective):
        assert issubclass(cls, Objective), cls.__name__
        assert list(inspect.signature(cls.loss).parameters) == list(expected.parameters), cls
