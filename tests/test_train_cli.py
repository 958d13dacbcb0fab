"""`moe-lab train` end to end in subprocesses: the CLI, SIGTERM, SIGKILL + --resume (bitwise), the README
example on the built-in corpus."""

import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_core.cli import main
from moe_core.train import read_jsonl
from moe_core.train.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = [
    "--set",
    "data.source=synthetic",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.synthetic_blocks=128",
    "--set",
    "batch_size=4",
    "--set",
    "log.progress=lines",
]


def env(**extra):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def cli(*args):
    return [sys.executable, "-m", "moe_core.cli", "train", *args]


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_cli_trains_resumes_and_refuses_to_overwrite(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "--out", out, "--preset", "mixtral-tiny", "--set", "steps=4", *SYNTHETIC]) == 0
    assert "step 4" in capsys.readouterr().out
    assert main(["train", "--out", out, "--set", "steps=6", *SYNTHETIC]) == 2  # existing run, no --resume
    assert "pass --resume" in capsys.readouterr().err
    # --resume without --config takes the checkpoint's config; --set may extend the run
    assert main(["train", "--out", out, "--resume", "--set", "steps=6", "--set", "log.every=1"]) == 0
    rows = read_jsonl(Path(out) / "metrics.jsonl")
    assert [r["step"] for r in rows][-2:] == [5, 6]
    assert (Path(out) / "final" / "config.json").is_file()
    assert main(["train", "--out", out, "--set", "optim.lrr=1"]) == 2
    assert "unknown field 'optim.lrr'" in capsys.readouterr().err


def _run_until_step(cmd, step, sig, **popen):
    """Start `cmd`, wait for its log line of `step`, send `sig`; return (returncode, output)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), **popen
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.match(rf"step {step}/", line):
            proc.send_signal(sig)
            break
    rest, _ = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + rest


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_is_bitwise_identical(tmp_path):
    args = ["--set", "steps=40", "--set", "checkpoint.every=5", "--set", "log.every=1", *SYNTHETIC]
    subprocess.run(cli("--out", str(tmp_path / "full"), *args), env=env(), check=True, capture_output=True)
    kill_at = random.Random().randint(6, 30)  # after at least one checkpoint; the process runs on past it
    code, output = _run_until_step(cli("--out", str(tmp_path / "killed"), *args), kill_at, signal.SIGKILL)
    assert code == -signal.SIGKILL, output[-2000:]
    assert list_checkpoints(tmp_path / "killed" / "checkpoints"), "no checkpoint survived the kill"
    assert not (tmp_path / "killed" / "final").exists()
    subprocess.run(
        cli("--out", str(tmp_path / "killed"), "--resume"), env=env(), check=True, capture_output=True
    )
    full = load_file(tmp_path / "full" / "final" / "model.safetensors")
    resumed = load_file(tmp_path / "killed" / "final" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), f"{name} differs after kill at step {kill_at} + resume"


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path):
    out = tmp_path / "run"
    args = ["--set", "steps=500", "--set", "checkpoint.every=1000", "--set", "log.every=1", *SYNTHETIC]
    code, output = _run_until_step(cli("--out", str(out), *args), 3, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, output[-2000:]  # not 0: a scheduler sees the run did not finish
    assert "SIGTERM" in output and "--resume" in output
    (ckpt,) = list_checkpoints(out / "checkpoints")
    step = int(ckpt.name.split("_")[1])
    assert 3 <= step < 500


def test_ctrl_c_saves_a_checkpoint_says_so_and_exits_130(tmp_path):
    out = tmp_path / "run"
    args = ["--set", "steps=500", "--set", "checkpoint.every=1000", "--set", "log.every=5", *SYNTHETIC]
    proc = subprocess.Popen(
        cli("--out", str(out), *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env()
    )
    lines = []
    for line in proc.stdout:  # not a terminal: a first line once the first step is done, before step 5
        lines.append(line)
        if line.startswith("train: first step done, step 1/500"):
            proc.send_signal(signal.SIGINT)
            break
    output = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGINT, output[-2000:]
    assert "SIGINT: finishing this step, then saving a checkpoint" in output
    (ckpt,) = list_checkpoints(out / "checkpoints")
    step = int(ckpt.name.split("_")[1])
    assert f"SIGINT at step {step}: checkpoint {ckpt} saved; continue with --resume" in output
    assert "stopped by SIGINT" in output


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_stops_a_torchrun_group_with_a_checkpoint_and_exits_130(tmp_path):
    """Ctrl-C reaches every process of the terminal's foreground group: `moe-lab train`, torchrun's agent and
    its workers. The workers checkpoint (torchrun passing the signal on again is not a second Ctrl-C) and
    `moe-lab train` waits for them instead of killing torchrun."""
    out = tmp_path / "run"
    args = ["--nproc", "2", "--set", "parallel.ep_size=2", "--set", "steps=500", "--set", "log.every=1"]
    proc = subprocess.Popen(
        cli("--out", str(out), *args, "--set", "checkpoint.every=1000", *SYNTHETIC),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
        start_new_session=True,  # its own foreground group, as a terminal gives it
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            os.killpg(proc.pid, signal.SIGINT)
            break
    output = "".join(lines) + proc.communicate(timeout=180)[0]
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    (ckpt,) = list_checkpoints(out / "checkpoints")
    assert f"SIGINT at step {int(ckpt.name.split('_')[1])}: checkpoint {ckpt} saved" in output


README_EXAMPLE = re.compile(r"```python\n((?:(?!```).)*?from moe_core\.train import(?:(?!```).)*)```", re.S)


def example_code() -> str:
    """The README's training example, exactly as printed."""
    match = README_EXAMPLE.search((REPO / "README.md").read_text())
    assert match, "README.md lost its training example"
    return match.group(1)


@pytest.mark.slow
def test_readme_example_trains_a_tiny_switch_model_on_the_builtin_corpus(tmp_path):
    code = example_code()
    assert len([line for line in code.splitlines() if line.strip()]) < 10
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env(MOE_LAB_DATA_CACHE=str(tmp_path / "cache")),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    rows = read_jsonl(run / "metrics.jsonl")
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert model.config.vocab_size >= len(tokenizer)
