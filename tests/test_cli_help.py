"""The command line starts fast and explains itself: help without heavy imports, presets and config fields
listed, "did you mean" for typos, "not found" for a missing model path, no empty output directory left."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moe_lab import cli

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "pydantic", "prefect", "mlflow", "pandas")


def _moe_lab(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "moe_lab", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def test_help_and_argument_errors_import_nothing_heavy():
    """`moe-lab --help`, each command's --help and its argument errors load neither torch, transformers,
    pydantic, Prefect nor MLflow (what made --help take 10 s); checked in one fresh interpreter."""
    script = textwrap.dedent(f"""
        import sys
        from moe_lab.cli import COMMANDS, main
        calls = [["--help"], ["trian"]] + [[c, "--help"] for c in COMMANDS] + [[c, "--no-such-option"] for c in COMMANDS]
        codes = {{}}
        for argv in calls:
            codes[" ".join(argv)] = main(argv)  # main returns argparse's status instead of raising SystemExit
        heavy = [m for m in {HEAVY!r} if m in sys.modules]
        print("RESULT", heavy, sorted(set(codes.values())), len(codes))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1]
    assert line == f"RESULT [] [0, 2] {2 + 2 * len(cli.COMMANDS)}", line


@pytest.mark.parametrize("table", ["moe_lab.cli", "moe_core.cli"])
def test_command_table_matches_the_modules(table):
    """COMMANDS (what --help lists without importing) names exactly the commands each module adds, in the
    moe-lab program and in the library's own (python -m moe_core)."""
    commands = importlib.import_module(table).COMMANDS
    for module in {module for module, _ in commands.values()}:
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).add_cli(sub)
        expected = sorted(name for name, (m, _) in commands.items() if m == module)
        assert sorted(sub.choices) == expected, module


def test_convert_choices_match_the_library():
    from moe_core import convert, convert_cli

    assert sorted(convert_cli.DTYPE_CHOICES) == sorted(convert.DTYPES)
    assert sorted(convert_cli.ARCH_CHOICES) == sorted(convert.ARCHITECTURES)


def test_help_lists_presets_config_fields_and_defaults(capsys):
    from moe_core.presets import PRESETS

    assert cli.main(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "families switch, mixtral, olmoe, shared, qwen3, gptoss, deepseek, glm4moe, dense; sizes tiny, small, base"
        in out
    )
    assert "(default: 1)" in out and "--help-config" in out  # defaults shown (nproc)
    assert all(p.partition("-")[0] in out for p in PRESETS)

    assert cli.main(["train", "--help-config"]) == 0
    fields = capsys.readouterr().out
    assert "  steps " in fields and "  optim.lr " in fields and "  model.preset " in fields
    assert "max global grad norm" in fields  # the field's help (its comment in TrainConfig)

    assert cli.main(["finetune", "--help-config"]) == 0
    assert "  lora." in capsys.readouterr().out

    for flow in ("lifecycle", "evaluate", "optimize"):
        assert cli.main(["run", flow, "--help-config"]) == 0
        assert "--set KEY=VALUE" in capsys.readouterr().out

    for command in ("ui", "deploy", "serve"):
        assert cli.main([command, "--help"]) == 0
        help_text = capsys.readouterr().out
        assert len(help_text.split("options:")[0]) > 150, command  # a description, not just usage


def test_typos_get_did_you_mean(capsys):
    assert cli.main(["train", "--set", "step=10", "--out", "unused"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err

    assert cli.main(["run", "lifecycle", "--size", "tiny", "--set", "trian.steps=5"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'train'" in err and "Extra inputs" not in err

    assert cli.main(["run", "evaluate"]) == 2
    err = capsys.readouterr().err
    assert "model_dir: required field missing" in err and "http" not in err

    assert cli.main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err

    assert cli.main(["train", "--out", "unused", "--sett", "steps=1"]) == 2
    assert "did you mean '--set'" in capsys.readouterr().err


NOT_FOUND_CASES = [
    ["generate", "runs/nope"],
    ["eval", "--model", "runs/nope", "--generate"],
    ["analyze", "--model", "runs/nope", "--out", "o"],
    ["export", "onnx", "runs/nope", "--out", "o"],
    ["quantize", "runs/nope", "--out", "o"],
    ["prune", "runs/nope", "--out", "o"],
    ["convert", "to-hf", "runs/nope", "--out", "o"],
    ["convert", "from-hf", "runs/nope", "--out", "o"],
    ["finetune", "--model", "runs/nope", "--out", "o"],
]


def test_missing_model_path_is_not_found_at_once(tmp_path):
    """`runs/nope` is also a valid hub id: every command that takes a model path fails on it as a missing
    local path, with no hub round trips and no traceback, and leaves no output directory (one interpreter
    runs all cases, to keep the test fast)."""
    (tmp_path / "runs").mkdir()
    script = textwrap.dedent(f"""
        import contextlib, io, json
        from moe_lab.cli import main
        results = []
        for argv in {NOT_FOUND_CASES!r}:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except SystemExit as exit:
                    code = exit.code
            results.append([argv, code, err.getvalue()])
        print("RESULT", json.dumps(results))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
    )
    results = json.loads(
        [x for x in proc.stdout.splitlines() if x.startswith("RESULT")][-1][len("RESULT ") :]
    )
    for argv, code, err in results:
        assert code == 2 and "runs/nope: not found" in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "o").exists()


def test_hub_id_offline_is_one_line(tmp_path):
    proc = _moe_lab("convert", "from-hf", "someone/not-cached", "--out", "o", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "HF_HUB_OFFLINE is set and the hub cache holds no copy" in proc.stderr
    assert proc.stderr.count("\n") <= 1 and not (tmp_path / "o").exists()


def test_failed_command_leaves_no_empty_output_dir(tmp_path, monkeypatch):
    """The dispatcher removes an --out directory that the failed command created and left empty."""
    from moe_core.errors import MoELabError

    out = tmp_path / "new"

    def fails(args):
        Path(args.out).mkdir(exist_ok=True)
        raise MoELabError("bad input")

    def build(command=None):
        parser = argparse.ArgumentParser()
        parser.add_argument("command")
        parser.add_argument("--out")
        parser.set_defaults(func=fails)
        return parser

    monkeypatch.setattr(cli, "build_parser", build)
    assert cli.main(["train", "--out", str(out)]) == 2
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert cli.main(["train", "--out", str(kept)]) == 2
    assert kept.exists()  # it existed before the command: not ours to remove


def _every_command(parser: argparse.ArgumentParser, prefix=()):
    """Every command path of the CLI, found by walking its subparsers (a new command is checked too)."""
    yield prefix
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _every_command(sub, (*prefix, name))


def test_help_speaks_to_users(capsys):
    """--help ended with developer notes ("Heavy imports happen inside the handlers ... tests/...") and named
    internal modules; `moe-lab run --help` said ~2.5 min for the lifecycle, the README 4m03s."""
    commands = list(_every_command(cli.build_parser())) + [("run", "lifecycle")]  # a flow: a positional
    assert ("train",) in commands and ("convert", "to-hf") in commands and len(commands) > 20
    for command in commands:
        assert cli.main([*command, "--help"]) == 0, command
        text = capsys.readouterr().out
        for internal in ("moe_core.", "moe_lab.", "tests/", "Heavy imports", "handler", ".py", "~2.5 min"):
            assert internal not in text, f"moe-lab {' '.join(command)} --help says {internal!r}"
