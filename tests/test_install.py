"""The install: pyproject.toml declares ranges (the lab installs beside a user's environment), constraints.txt
the exact versions CI tests, and every command that installs the lab for a fresh clone uses it."""

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + [r for group in extras.values() for r in group]]


def _constraints() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin NAME==VERSION"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_pyproject_declares_ranges_not_exact_versions():
    exact = [
        str(r) for r in _pyproject_requirements() if any(s.operator in ("==", "===") for s in r.specifier)
    ]
    # ruff formats differently across releases: CI's format check needs the one version (a test tool, not a
    # dependency a user's environment shares)
    assert exact == ["ruff==0.17.6"], f"exact pins in pyproject.toml (put them in constraints.txt): {exact}"


def test_every_requirement_is_pinned_inside_its_range():
    pins = _constraints()
    for requirement in _pyproject_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"constraints.txt pins no version of {requirement.name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )


def test_the_environment_running_the_tests_is_the_pinned_one():
    """What CI installed is what constraints.txt says (a regenerated or hand-edited file that drifted from what
    was tested fails here); torch's local build label (+cpu) aside."""
    drifted = []
    for name, version in _constraints().items():
        try:
            installed = Version(md.version(name))
        except md.PackageNotFoundError:
            continue  # a platform-specific dependency of another machine
        if Version(installed.public) != version:
            drifted.append(f"{name}: installed {installed}, pinned {version}")
    assert not drifted, drifted


def test_fresh_clone_installs_use_the_constraints():
    for path in ("README.md", ".ci/run", "infra/Dockerfile", ".github/workflows/retrain.yml"):
        text = (ROOT / path).read_text()
        installs = re.findall(r"pip install[^\n`]*-e [^\n`]*", text)
        assert installs, f"{path}: no `pip install ... -e` found"
        for command in installs:
            assert "-c constraints.txt" in command, f"{path}: {command!r} installs without -c constraints.txt"
