"""A reference tool's own Python environment for a benchmark, built once and cached (standard library only:
the benchmarks import it before anything else).

A benchmark that measures the lab against another tool (transformers 4 + PEFT in `finetune_scale.py`, datatrove
in `data_prep.py`) runs that tool in a child process under this environment's interpreter, so the tool's pins
never meet the project's (``pip install -c constraints.txt -e .``).
"""

from __future__ import annotations

import subprocess
import tempfile
import venv
from pathlib import Path

ENVS_ROOT = Path.home() / ".cache" / "moe-lab" / "envs"


def cached_env(home: Path, requirements: list[str], *, system_site_packages: bool) -> str:
    """The interpreter of the virtual environment ``home``, built on first use with ``pip install
    requirements`` from the package index (``home``'s name should say what is pinned in it: a new pin, a new
    directory). ``system_site_packages``: the environment also sees this interpreter's packages (a shared torch
    build) and its own installs shadow them. Built in a temporary directory beside ``home`` and renamed, so a
    killed build leaves nothing that would be used."""
    python = home / "bin" / "python"
    if python.exists():
        return str(python)
    home.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{home.name}-", dir=home.parent))
    print(f"building the environment {home} (once) ...", flush=True)
    venv.EnvBuilder(system_site_packages=system_site_packages, with_pip=True).create(tmp)
    subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", *requirements], check=True)
    # pip and the interpreter run by path from bin/; nothing they use records the venv's own path
    tmp.rename(home)
    return str(python)
