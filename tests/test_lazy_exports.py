"""The packages that re-export names lazily (moe_core._lazy) keep their table, their `__all__` and their
`if TYPE_CHECKING:` imports (what readers and type checkers see) in agreement, and every name resolves."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import subprocess
import sys

import pytest

PACKAGES = ["moe_core", "moe_core.train", "moe_core.finetune", "moe_core.inference"]


def _type_checking_imports(package) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(package))
    names = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom), ast.unparse(stmt)
                names.update({alias.name: stmt.module for alias in stmt.names})
    return names


@pytest.mark.parametrize("name", PACKAGES)
def test_table_type_checking_block_and_all_agree(name):
    package = importlib.import_module(name)
    table = {key: importlib.util.resolve_name(module, name) for key, module in package._EXPORTS.items()}
    assert _type_checking_imports(package) == table
    assert sorted(package.__all__) == sorted(table)
    assert set(table) <= set(dir(package))


@pytest.mark.parametrize("name", PACKAGES)
def test_every_name_resolves_to_its_module_attribute(name):
    package = importlib.import_module(name)
    for key, module in package._EXPORTS.items():
        assert getattr(package, key) is getattr(importlib.import_module(module, name), key), key
    with pytest.raises(AttributeError, match="no_such_name"):
        package.no_such_name  # noqa: B018


def test_config_names_register_the_auto_classes_first():
    """`from moe_core import get_config` imports moe_core.model too (a config is only useful with
    model_type="moe_lab" registered with transformers' Auto classes); checked in a fresh interpreter."""
    script = (
        "import sys, moe_core; moe_core.get_config('switch-tiny'); print('moe_core.model' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split()[-1:] == ["True"], proc.stderr[-2000:]
