"""The house rules the code keeps: no import cycle, imports only downwards through the layers of
docs/architecture.md, and the Trainer's private state reached from fewer places over time.

The imports are read from the source with ``ast`` (nothing is imported): module-level imports,
imports inside functions (lazy) and ``if TYPE_CHECKING:`` imports all count for the layer order; a
cycle is a cycle of the imports that run (module-level and lazy), since those are what can fail at
import time or hide a tangle behind a function-level import.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "distkit"

# docs/architecture.md draws these layers. A module may import its own layer and the ones above it
# in this list (lower layers), never one further down. The longest matching prefix places a module.
LAYERS: list[tuple[str, ...]] = [
    ("distkit.errors", "distkit.env", "distkit._version"),
    ("distkit._utils",),
    ("distkit._doctor",),
    ("distkit.runtime",),
    ("distkit.collectives", "distkit.seeding"),
    (
        "distkit.coordination",
        "distkit.data",
        "distkit.optim",
        "distkit.checkpoint",
        "distkit.storage",
        "distkit.monitor",
        "distkit.stragglers",
        "distkit.sharding",
    ),
    ("distkit.trainer",),
    ("distkit.cli", "distkit.testing", "distkit.bench"),
    ("distkit",),  # the lazy facade: nothing inside the package imports it
]

# Who may import the Trainer: its facade, and the CLI that builds one from a config. The loop, the
# strategies, set-up and the callbacks take the run state (trainer/_run.py) or a TrainerView
# (issue 25: before it, 14 modules took the whole Trainer while trainer.py imported them).
IMPORTS_TRAINER = {"distkit.trainer", "distkit.trainer.config.cli"}


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    kind: str  # "module", "lazy" (inside a function) or "typing" (under TYPE_CHECKING)
    line: int


def _module_name(path: Path) -> str:
    parts = ["distkit", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in SRC.rglob("*.py")}


def _resolve(name: str) -> str:
    """The distkit module ``name`` refers to (``distkit.a.b.func`` -> ``distkit.a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> Iterator[Import]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def walk(node: ast.AST, kind: str) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inner = kind
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "typing"
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and kind == "module":
                inner = "lazy"
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "distkit":
                        yield Import(module, _resolve(alias.name), inner, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    origin = ".".join(base + ([child.module] if child.module else []))
                else:
                    origin = child.module or ""
                if origin.split(".")[0] == "distkit":
                    for alias in child.names:
                        full = f"{origin}.{alias.name}"
                        yield Import(
                            module, full if full in MODULES else _resolve(origin), inner, child.lineno
                        )
            yield from walk(child, inner)

    yield from walk(ast.parse(path.read_text(encoding="utf-8")), "module")


IMPORTS = [imp for module in sorted(MODULES) for imp in _imports(module) if imp.target != imp.source]


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[1]
            ):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_import_reader_sees_every_kind_of_import() -> None:
    # The rules below are only as good as the reader: it must see module-level, lazy and
    # TYPE_CHECKING imports, absolute and relative, of modules known to have them.
    seen = {(imp.source, imp.target, imp.kind) for imp in IMPORTS}
    assert ("distkit.trainer._loop.setup", "distkit.runtime", "module") in seen
    assert ("distkit.trainer._loop.setup", "distkit.trainer.strategies", "typing") in seen
    assert ("distkit.trainer.callbacks", "distkit.checkpoint", "lazy") in seen
    assert len(MODULES) > 70


def test_distkit_has_no_import_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for imp in IMPORTS:
        if imp.kind != "typing":
            edges.setdefault(imp.source, set()).add(imp.target)
    cycles = _cycles(edges)
    assert not cycles, (
        f"import cycles: {cycles}. Move what both modules need into a module below both (as "
        f"trainer/_batches.py holds the batch readers that _step and _evaluate share), or pass it in."
    )


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(module for module in MODULES if _layer(module) is None)
    assert not unplaced, f"modules without a layer: {unplaced}; add them to LAYERS and docs/architecture.md"


def test_imports_go_only_downwards_through_the_layers() -> None:
    upward = [
        f"{imp.source} (layer {_layer(imp.source)}) imports {imp.target} (layer {_layer(imp.target)}) "
        f"at line {imp.line} ({imp.kind})"
        for imp in IMPORTS
        if (_layer(imp.target) or 0) > (_layer(imp.source) or 0)
    ]
    assert not upward, "imports against the layer order of docs/architecture.md:\n" + "\n".join(upward)


def test_the_layers_in_the_docs_are_the_ones_enforced() -> None:
    text = (SRC.parent.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    for prefixes in LAYERS:
        for prefix in prefixes:
            if prefix != "distkit":
                assert f"`{prefix.removeprefix('distkit.')}" in text, (
                    f"docs/architecture.md does not place {prefix}"
                )


# `trainer._x` (also `run.trainer._x`); not the private subpackages `distkit.trainer._loop`, `._run`.
PRIVATE = re.compile(r"(?<!\w)trainer\._(?!loop\b|run\b)[a-z_]+")


def test_only_the_facade_and_the_cli_import_the_trainer() -> None:
    importing = {imp.source for imp in IMPORTS if imp.target == "distkit.trainer.trainer"}
    assert importing == IMPORTS_TRAINER, (
        f"{sorted(importing - IMPORTS_TRAINER)} import the Trainer: take what the function needs (the "
        f"run state of trainer/_run.py, a TrainerView) instead of the whole Trainer"
    )


def test_nothing_outside_trainer_py_reaches_the_trainers_private_state() -> None:
    found = {
        str(path.relative_to(SRC)): sorted(set(PRIVATE.findall(path.read_text(encoding="utf-8"))))
        for path in SRC.rglob("*.py")
        if path != SRC / "trainer" / "trainer.py"
    }
    reached = {name: names for name, names in found.items() if names}
    assert not reached, (
        f"the Trainer's private attributes are read or written outside trainer.py: {reached}. Put "
        f"what the loop needs on the run state (trainer/_run.py), or add a public property"
    )


def test_the_reader_of_private_state_sees_it() -> None:
    text = "trainer._shown.model; trainer.model; run.trainer._x; from distkit.trainer._loop import epoch"
    assert PRIVATE.findall(text) == ["trainer._shown", "trainer._x"]


# The built-ins a user could have written: they use only what TrainerView lists (docs/trainer.md).
BUILT_INS = ("callbacks.py", "progress.py", "loggers.py", "tracking.py", "metrics.py", "schedules.py")


def test_the_built_in_callbacks_loggers_and_progress_read_no_private_trainer_state() -> None:
    pattern = re.compile(r"(?<![\w.])trainer\._[a-z_]+")
    found = {
        name: sorted(set(pattern.findall((SRC / "trainer" / name).read_text(encoding="utf-8"))))
        for name in BUILT_INS
    }
    reached = {name: names for name, names in found.items() if names}
    assert not reached, (
        f"built-in callbacks, loggers or progress displays read the Trainer's private state: {reached}. "
        f"Add a read-only property to Trainer and to TrainerView instead."
    )
