"""The library stands on its own: `moe_core` imports and runs its commands with Prefect, MLflow, the flows,
the tasks, the deployments, the dashboard and the ``moe-lab`` program all unimportable, and no file in it
names them (not even inside a function or through importlib). The folders above it do not import each other
in a circle either: flows never import the deployments or the program above them."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABOVE_THE_LIBRARY = ("prefect", "mlflow", "flows", "tasks", "deployments", "dashboard", "moe_lab")


def _imported_roots(path: Path) -> set[str]:
    """Top-level package names a file imports anywhere (module level, functions, ``importlib`` strings)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _names_a_module(node.value):
            roots.add(node.value.split(".")[0])  # how importlib reached upwards before ("flows.cli")
    return roots


def _names_a_module(text: str) -> bool:
    """``flows.cli``: a dotted name of one of this repository's modules (not a logger or suite name)."""
    parts = text.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return False
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_no_library_file_names_a_package_above_it():
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_roots(path) & set(ABOVE_THE_LIBRARY))
        for path in sorted((ROOT / "moe_core").rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("flows", {"deployments", "dashboard", "moe_lab"}),
        ("tasks", {"flows", "deployments", "dashboard", "moe_lab"}),
        ("dashboard", {"flows", "deployments", "moe_lab"}),
    ],
)
def test_no_folder_imports_one_above_it(folder, forbidden):
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_roots(path) & forbidden)
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "node_modules" not in path.parts
    }
    assert {k: v for k, v in offenders.items() if v} == {}


BLOCKED = textwrap.dedent(f"""
    import importlib, importlib.abc, importlib.util, pkgutil, runpy, sys

    BLOCKED = {ABOVE_THE_LIBRARY!r}

    class Blocked(importlib.abc.MetaPathFinder):  # as if they were not installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"{{name}} is blocked: the library must not need it", name=name)
            return None

    probe = importlib.util.find_spec  # third-party packages probe for optional ones (accelerate: mlflow)
    importlib.util.find_spec = lambda name, package=None: (
        None if name.split(".")[0] in BLOCKED else probe(name, package)
    )
    sys.meta_path.insert(0, Blocked())
    sys.argv = ["moe_core", "train", "--help"]
    try:
        runpy.run_module("moe_core", run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        assert exit_.code in (0, None), exit_.code
    import moe_core
    names = [m.name for m in pkgutil.walk_packages(moe_core.__path__, "moe_core.")]
    for name in names:
        if name not in ("moe_core.__main__",):
            importlib.import_module(name)
    print("IMPORTED", len(names))
""")


@pytest.mark.slow
def test_library_runs_and_imports_with_orchestration_blocked():
    """``python -m moe_core train --help`` and an import of every `moe_core` module, in a fresh interpreter
    where importing Prefect, MLflow, flows, tasks, deployments, the dashboard or moe_lab raises."""
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[--set KEY=VALUE]" in proc.stdout and "[--dashboard]" not in proc.stdout  # the library's train
    imported = int(proc.stdout.split("IMPORTED")[-1])
    assert imported > 50  # the walk saw the whole package


def test_library_command_table_lists_only_library_commands():
    from moe_core import cli as library
    from moe_lab import cli as program

    assert all(module.startswith("moe_core.") for module, _ in library.COMMANDS.values())
    assert set(library.COMMANDS) < set(program.COMMANDS)
    assert {"run", "ui", "sync", "deploy", "serve", "dashboard"} == set(program.COMMANDS) - set(
        library.COMMANDS
    )
