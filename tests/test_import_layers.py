"""The loader stands below the commands that use it: `moe_core.loading` reads every checkpoint format without
importing the fine-tuning or inference stacks, and nothing it imports imports it back (not even inside a
function, the usual way a cycle is hidden); and no module of the library takes part in an import cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import moe_core

PACKAGE_DIR = Path(moe_core.__file__).parent
ABOVE_THE_LOADER = ("moe_core.finetune", "moe_core.inference")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _targets(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The moe_core modules an import statement runs: each named module and the packages above it (the
    package imports absolutely; a relative import would show here as an unknown name)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        assert node.level == 0, ast.unparse(node)
        names = [
            f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
            for a in node.names
        ]
    found = set()
    for name in names:
        parts = name.split(".")
        found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES}
    return found


def _imports(module: str, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            inside_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and (top or not top_level_only):
                found.update(_targets(child))
            visit(child, top and not inside_function)

    visit(tree, True)
    return found - {module}


def _reachable_at_import(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(_imports(module, top_level_only=True))
    return seen


def test_importing_the_loader_imports_neither_finetune_nor_inference():
    script = (
        "import sys, moe_core.loading\n"
        f"print('\\n'.join(sorted(m for m in sys.modules if m.startswith({ABOVE_THE_LOADER!r}))))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.split() == []


def test_the_import_graph_below_the_loader_points_down():
    below = _reachable_at_import("moe_core.loading")
    assert {"moe_core.convert", "moe_core.model"} <= below  # the walk follows the loader's imports
    assert sorted(m for m in below if m.startswith(ABOVE_THE_LOADER)) == []
    back = {
        m for m in below - {"moe_core.loading"} if "moe_core.loading" in _imports(m, top_level_only=False)
    }
    assert back == set(), f"imported by the loader and importing it back (a cycle): {sorted(back)}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``graph`` closes (each as the path from a module back to it)."""
    state: dict[str, str] = {}
    found: list[list[str]] = []

    def walk(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return found


def test_no_import_cycle_anywhere_in_the_library_even_through_function_local_imports():
    """A module importing a submodule runs its package first; that edge up to an ancestor is no cycle."""

    def ancestors(module: str) -> set[str]:
        parts = module.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}

    graph = {m: _imports(m, top_level_only=False) - ancestors(m) for m in MODULES}
    assert [" -> ".join(cycle) for cycle in _cycles(graph)] == []


def test_the_graph_walk_sees_a_function_local_import(tmp_path, monkeypatch):
    """The cycle check is not vacuous: a function-local import of the loader is found."""
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from moe_core.loading import load\n")
    monkeypatch.setitem(MODULES, "moe_core.fake", fake)
    assert "moe_core.loading" in _imports("moe_core.fake", top_level_only=False)
    assert "moe_core.loading" not in _imports("moe_core.fake", top_level_only=True)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def _unexplained_local_imports(path: Path) -> list[str]:
    """Function-local imports of ``path`` with no reason: no comment on the import, in the run of import lines
    just above it, or at module level in a ``# Lazy:`` line (the policy of a command module, whose commands
    import the library when they run so that ``--help`` answers at once)."""
    source = path.read_text()
    lines = source.splitlines()
    if any(line.startswith("# Lazy:") for line in lines):
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for sub in ast.walk(node):
            if not isinstance(sub, ast.Import | ast.ImportFrom):
                continue
            row = sub.lineno - 1
            explained = "#" in lines[row]
            while not explained and row > 0:
                row -= 1
                above = lines[row].strip()
                if above.startswith("#") or ("#" in above and above.startswith(("import ", "from ", "try:"))):
                    explained = True
                elif above and not above.startswith(("import ", "from ", ")", "try:")) and "," not in above:
                    break  # the code above the run of imports (blank lines inside the run are passed)
            if not explained:
                found.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{sub.lineno}: {ast.unparse(sub)}")
    return found


def test_every_function_local_import_says_why():
    """Imports belong at the top (issue 28 §6); one inside a function names its reason: an optional or heavy
    dependency, a cycle it avoids, a command module's lazy policy."""
    roots = [PACKAGE_DIR, *(PACKAGE_DIR.parent / name for name in ("moe_lab", "tasks", "flows", "dashboard"))]
    found = [
        hit
        for root in roots
        for path in sorted(root.rglob("*.py"))
        for hit in _unexplained_local_imports(path)
    ]
    assert not found, "function-local imports without a reason:\n" + "\n".join(found)
