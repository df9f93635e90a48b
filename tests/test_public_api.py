"""The public surface: every exported name resolves, is documented, and `import distkit` is light."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import distkit

INIT = Path(distkit.__file__)


@pytest.mark.parametrize("name", sorted(distkit.__all__))
def test_every_exported_name_resolves_and_is_documented(name: str) -> None:
    value = getattr(distkit, name)
    if inspect.isfunction(value) or inspect.isclass(value):
        doc = inspect.getdoc(value) or ""
        assert doc.strip(), f"distkit.{name} has no docstring"


def test_every_public_module_name_is_exported_from_distkit() -> None:
    # A name a module lists in __all__ but distkit does not export is a name users cannot find.
    tree = ast.parse(INIT.read_text())
    modules = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("distkit.")
    }
    missing = []
    for module_name in sorted(modules):
        module = importlib.import_module(module_name)
        # Constants (ALL_CAPS) may stay in their module: distkit.DEFAULT_FILE_MODE would not say whose.
        missing += [
            f"{module_name}.{n}"
            for n in getattr(module, "__all__", [])
            if n not in distkit.__all__ and not n.isupper()
        ]
    assert not missing, missing


def test_type_checkers_see_every_lazy_name() -> None:
    tree = ast.parse(INIT.read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom):
                    typed.update({alias.name: stmt.module or "" for alias in stmt.names})
    modules = {name for name, module in typed.items() if module == "distkit"}
    assert modules == distkit._MODULES
    assert {name: module for name, module in typed.items() if name not in modules} == distkit._LAZY


def test_import_distkit_alone_does_not_import_torch() -> None:
    code = "import sys, distkit; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_public_module_is_an_attribute_after_a_plain_import() -> None:
    # As the docs write them (distkit.trainer.accuracy, distkit.testing.run_ranks), before any
    # other use of distkit has imported the module; and every public module is listed.
    public = {
        path.stem
        for path in INIT.parent.iterdir()
        if not path.name.startswith("_") and (path.suffix == ".py" or (path / "__init__.py").exists())
    }
    assert public == distkit._MODULES
    code = (
        "import distkit, importlib\n"
        "assert callable(distkit.trainer.ModelCheckpoint) and callable(distkit.testing.run_ranks)\n"
        f"for name in {sorted(public)!r}:\n"
        "    assert getattr(distkit, name) is importlib.import_module('distkit.' + name), name\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
