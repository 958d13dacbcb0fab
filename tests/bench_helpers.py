"""The benchmark scripts under test: each loaded as a module from its file (benchmarks/ is not a package), and
the environment their child processes need to import this checkout's lab."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def benchmark_path(name: str) -> Path:
    return ROOT / "benchmarks" / f"{name}.py"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", benchmark_path(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def repo_env() -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH, for a benchmark run as a script."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
