"""The README's commands run as written, in order, as one sequence: data prepare -> train (MoE, dense, from
examples/train.yaml) -> fine-tune (examples/ft.yaml) -> eval -> analyze -> export / quantize / prune /
generate -> convert / GGUF. The commands are read from the README's bash blocks; the test only makes them
tiny (small presets -> tiny, few steps, fewer documents) and drops what needs a server or a long run."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from moe_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]

# what the test does not run, and why
SKIP = (
    ("moe-lab run ", "the lifecycle flow: tests/test_flows*.py run it on the tiny size"),
    ("moe-lab dashboard", "a server"),
    ("--dashboard", "a server"),
    ("moe-lab ui", "a server"),
    ("--nproc", "torchrun: tests/test_train_parallel*.py"),
    ("runs/b", "the dashboard block's own run"),
    ("--events runs/serving", "the dashboard block"),
)
# make the README's settings tiny, keep the command structure
SUBSTITUTE = (
    (r"-small\b", "-tiny"),
    (r"--max-documents 200", "--max-documents 40"),
    (r" --compile\b", ""),
)  # torch.compile on CPU builds C++ for minutes: tests/test_inference_* cover it
STEPS = "steps=3"


def readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("moe-lab ") and not any(marker in line for marker, _ in SKIP):
                commands.append(line)
    return commands


def tiny(command: str) -> list[str]:
    for pattern, replacement in SUBSTITUTE:
        command = re.sub(pattern, replacement, command)
    argv = shlex.split(command)[1:]
    if argv[0] in ("train", "finetune"):
        argv += ["--set", STEPS]
    if argv[0] == "train" and "--config" in argv:
        argv += ["--set", "model.preset=mixtral-tiny"]  # examples/train.yaml names mixtral-small
    if argv[0] == "train" and "--config" not in argv and not any(a.startswith("data.") for a in argv):
        # the built-in corpus prepared from scratch (40 s here): tests/test_train_cli.py's README example does it
        argv += ["--set", "data.path=runs/data"]
    return argv


def test_readme_lists_the_connected_sequence():
    commands = readme_commands()
    names = [" ".join(shlex.split(c)[1:3]) for c in commands]
    for expected in (
        "data prepare",
        "train --preset",
        "finetune --config",
        "eval --model",
        "analyze --model",
        "export onnx",
        "quantize runs/a/final",
        "prune runs/a/final",
        "generate runs/a/final",
        "convert to-hf",
        "export gguf",
    ):
        assert any(n.startswith(expected) for n in names), expected
    # every referenced example file ships with the repository
    for path in re.findall(r"examples/[\w./-]+", (ROOT / "README.md").read_text()):
        assert (ROOT / path.rstrip(".")).exists(), path


@pytest.mark.slow
def test_readme_commands_run_in_order(tmp_path, monkeypatch, capsys):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOE_LAB_DATA_CACHE", str(tmp_path / "data-cache"))
    for command in readme_commands():
        argv = tiny(command)
        code = main(argv)
        captured = capsys.readouterr()
        assert code == 0, f"{command}\n-> moe-lab {shlex.join(argv)}\n{captured.err[-2000:]}"
        if argv[0] == "train" and "data.path=runs/data" in argv:
            assert "data (with its tokenizer) in runs/data" in captured.out  # TrainResult.data_dir, printed
        if argv[0] == "eval" and "--compare" in argv:
            assert "dense" in captured.out  # the comparison table names the dense baseline
        if argv[0] == "eval" and "--preferences" in argv:
            assert "pairwise_accuracy" in captured.out  # a reward model's held-out accuracy
    assert (tmp_path / "runs/a/final/tokenizer.json").is_file()
    assert (tmp_path / "runs/ft").is_dir() and (tmp_path / "runs/a/analysis/profile").is_dir()
    assert (tmp_path / "runs/a/model.gguf").is_file()
