"""The one progress display (moe_core.progress): plain lines with rate and ETA off a terminal, a bar that
moves every training step, and fine-tuning driving the same display through a Trainer callback."""

from __future__ import annotations

import io
import re

import pytest

from moe_core.progress import Progress, format_seconds, progress, resolve_mode
from moe_core.train.telemetry import ConsoleSink


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_off_a_terminal_carry_rate_eta_and_postfix():
    stream = io.StringIO()
    bar = Progress(10, "train", unit="step", stream=stream, every_s=0)
    assert bar.mode == "lines"
    bar.update(3, loss=3.14159, lr=3e-4)
    first = stream.getvalue().splitlines()[0]
    assert re.match(r"train: 3/10 step \(30%\) [\d.e+]+ step/s, ETA \d+s loss=3\.142 lr=0\.0003$", first), (
        first
    )
    bar.update(7)
    bar.close()
    last = stream.getvalue().splitlines()[-1]
    assert last.startswith("train: 10/10 step (100%)") and "ETA" not in last


def test_close_does_not_repeat_the_line_the_last_update_printed():
    """The ONNX export and the flows' benchmark printed their last line twice: the update reaching the total
    printed it, then close() printed the same state again."""
    stream = io.StringIO()
    bar = Progress(3, "export onnx", unit="stage", stream=stream, every_s=0)
    bar.stage("a")
    bar.stage("b")
    bar.advance_to(3)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [line for line in lines if line.startswith("export onnx: 3/3 stage (100%)")] == lines[-1:], lines


def test_fractional_amounts_print_as_people_read_them():
    """`data prepare` counts MB as float sums: its lines said 'tokenize: 2.4466710000000003/2.446671 MB'."""
    stream = io.StringIO()
    bar = Progress(2.446671, "prepare: tokenize", unit="MB", stream=stream, every_s=0)
    for _ in range(3):
        bar.update(0.815557)
    assert stream.getvalue().splitlines()[-1].startswith("prepare: tokenize: 2.447/2.447 MB (100%)")


def test_lines_are_throttled_and_a_blink_prints_nothing():
    stream = io.StringIO()
    with Progress(1000, "fast", stream=stream, every_s=60) as bar:
        for _ in range(1000):
            bar.update(1)
    assert stream.getvalue() == ""  # done in well under a second: no noise in logs


def test_terminal_gets_a_bar_that_moves_every_step():
    stream = Tty()
    sink = ConsoleSink(total_steps=6, mode="auto", stream=stream)
    assert sink.mode == "bar"
    for step in range(1, 4):
        sink.on_step(step)
    assert sink.progress.n == 3  # moved every step, before any logging step
    sink.log(3, {"loss": 2.5, "tokens_per_s": 1234.5, "lr": 1e-3})
    sink.close()
    out = stream.getvalue()
    assert "3/6" in out and "loss=2.5" in out and "tok/s=1234" in out


def test_off_a_terminal_the_first_step_prints_a_line_before_the_first_logging_step():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=100, mode="auto", stream=stream, log_every=10)
    assert sink.mode == "lines"
    for step in range(1, 10):
        sink.on_step(step)
    (line,) = stream.getvalue().splitlines()  # one line, at step 1: a log file shows the run is alive
    assert re.match(r"train: first step done, step 1/100 \(1%\) [\d.e+]+ step/s, ETA ", line), line
    sink.on_step(10)
    sink.log(10, {"loss": 2.5})
    assert stream.getvalue().splitlines()[-1].startswith("step 10/100 (10%)")

    resumed = io.StringIO()  # a resumed run whose first step is a logging step: that step's line only
    sink = ConsoleSink(total_steps=100, start_step=9, mode="lines", stream=resumed, log_every=10)
    sink.on_step(10)
    sink.log(10, {"loss": 2.5})
    assert len(resumed.getvalue().splitlines()) == 1


def test_modes_and_environment_override(monkeypatch):
    assert resolve_mode("auto", Tty()) == "bar" and resolve_mode("auto", io.StringIO()) == "lines"
    monkeypatch.setenv("MOE_LAB_PROGRESS", "off")
    assert resolve_mode("auto", Tty()) == "off" and resolve_mode("bar", Tty()) == "bar"
    with pytest.raises(ValueError, match="progress mode"):
        resolve_mode("loud")
    assert list(progress(range(4), "x", mode="off")) == [0, 1, 2, 3]
    assert format_seconds(5) == "5s" and format_seconds(125) == "2m05s" and format_seconds(7300) == "2h01m"


def test_training_bar_moves_every_step_between_logging_steps(tmp_path, monkeypatch):
    from moe_core.train import TrainConfig, train

    seen: list[int] = []
    original = ConsoleSink.on_step

    def spy(self, step):
        seen.append(step)
        original(self, step)

    monkeypatch.setattr(ConsoleSink, "on_step", spy)
    config = TrainConfig.build(
        {
            "model": {"preset": "switch-tiny"},
            "steps": 5,
            "batch_size": 2,
            "data": {"source": "synthetic", "seq_len": 16, "synthetic_blocks": 32},
            "log": {"every": 5, "progress": "lines"},
            "eval": {"batches": 1},
            "checkpoint": {"every": 5, "export": False},
        }
    )
    train(config, tmp_path / "run")
    assert seen == [1, 2, 3, 4, 5]


def test_finetune_progress_callback_follows_trainer_steps():
    from types import SimpleNamespace

    from moe_core.finetune.objectives import ProgressCallback

    stream = io.StringIO()
    cb = ProgressCallback("lines", stream=stream)
    state = SimpleNamespace(max_steps=4, global_step=0)
    cb.on_train_begin(None, state, None)
    cb.progress.every_s = 0
    for step in range(1, 5):
        state.global_step = step
        cb.on_step_end(None, state, None)
        cb.on_log(None, state, None, logs={"loss": 1.5, "learning_rate": 1e-4, "epoch": 0.5})
    cb.on_train_end(None, state, None)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("finetune: 1/4 step") and lines[-1].startswith("finetune: 4/4 step")
    assert "loss=1.5 lr=0.0001" in lines[-1]


def test_training_lines_one_per_logging_step_with_eta():
    stream = io.StringIO()
    sink = ConsoleSink(total_steps=4, mode="lines", stream=stream)
    for step in range(1, 5):
        sink.on_step(step)
        if step % 2 == 0:
            sink.log(step, {"loss": 3.0 / step, "lr": 1e-3, "tokens_per_s": 500.0})
    sink.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines  # on_step alone prints nothing off a terminal; close adds no duplicate
    assert re.match(r"step 2/4 \(50%\) [\d.e+]+ step/s, ETA \d+s loss=1\.5 lr=0\.001 tok/s=500$", lines[0]), (
        lines[0]
    )
    assert lines[1].startswith("step 4/4 (100%)") and "ETA" not in lines[1]


def test_off_a_terminal_a_command_turns_the_libraries_bars_off(tmp_path, monkeypatch):
    """transformers 5 draws "Loading weights" and "Writing model shards" tqdm bars at every load and save: in
    a flow's log (off a terminal) they were carriage-return noise between the lab's own lines. A command run
    off a terminal turns them off for itself and the processes it starts; a user's own setting wins."""
    import subprocess
    import sys

    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS", "MOE_LAB_PROGRESS"):
        monkeypatch.delenv(name, raising=False)
    code = (
        "import os, sys, moe_core.cli as c\n"
        "c.run_command(['convert', 'to-hf', sys.argv[1], '--out', sys.argv[2]], c.COMMANDS, c.build_parser)\n"
        "import transformers.utils.logging as l\n"
        "print(os.environ.get('HF_HUB_DISABLE_PROGRESS_BARS'), l.is_progress_bar_enabled())\n"
    )
    model = tmp_path / "model"
    from moe_core import MoEForCausalLM, get_config

    MoEForCausalLM(get_config("mixtral-tiny")).save_pretrained(model)

    def convert(out: str) -> subprocess.CompletedProcess:
        args = [sys.executable, "-c", code, str(model), str(tmp_path / out)]
        return subprocess.run(args, capture_output=True, text=True, timeout=300)

    run = convert("hf")
    assert run.stdout.strip().splitlines()[-1] == "1 False", run.stdout + run.stderr
    assert "Writing model shards" not in run.stderr and "Loading weights" not in run.stderr, run.stderr

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # the user's choice stands
    run = convert("hf2")
    assert run.stdout.strip().splitlines()[-1] == "0 True", run.stdout + run.stderr
