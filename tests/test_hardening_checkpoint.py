"""Checkpoints and run outputs under attack or bad luck: planted pickles, old formats, damaged or half-deleted
checkpoints, diverging runs, full disks, torn metrics lines, two runs on one directory, abandoned temporaries.

Tiny models on the synthetic source (no tokenizer); the lock test starts a second Python process."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_core.cli import main
from moe_core.fileio import (
    DiskFullError,
    OutputLock,
    OutputLockedError,
    atomic_directory,
    clean_abandoned_temporaries,
)
from moe_core.train import checkpoint as ckpt_io
from moe_core.train import read_jsonl
from moe_core.train.checkpoint import CheckpointError, list_checkpoints
from moe_core.train.loop import Trainer, TrainingDivergedError
from moe_core.train.telemetry import JsonlSink
from tests.test_train_loop import assert_bitwise_equal, tiny

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def run(config, out, resume=False):
    trainer = Trainer(config, out, resume=resume)
    try:
        return trainer.run()
    finally:
        trainer.close()


class Payload:
    """What an attacker plants: unpickling it creates ``marker`` (a stand-in for any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def rewrite_manifest(ckpt: Path) -> None:
    """An attacker who edits a checkpoint can also fix its manifest: sizes and checksums match again."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = {
            "bytes": (ckpt / name).stat().st_size,
            "sha256": ckpt_io._sha256(ckpt / name),
        }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory):
    """An 8-step run checkpointed at 4 and 8 (log every step), and its final weights."""
    out = tmp_path_factory.mktemp("reference") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every test here (one_thread): the same float sums as the resumed runs
    try:
        result = run(tiny(log={"every": 1}), out)
    finally:
        torch.set_num_threads(threads)
    return out, load_file(result.export_dir / "model.safetensors")


def copy_run(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


# ------------------------------------------------------------------------------------------------ pickles
def test_a_planted_payload_is_refused_and_never_runs(tmp_path, eight_steps):
    out = copy_run(eight_steps[0], tmp_path / "run")
    marker = tmp_path / "payload-ran"
    latest = list_checkpoints(out / "checkpoints")[-1]
    state = torch.load(latest / "rank0-state.pt", weights_only=True)
    state["scheduler"] = Payload(marker)  # hidden deep inside an otherwise valid state
    torch.save(state, latest / "rank0-state.pt")
    rewrite_manifest(latest)
    with pytest.raises(CheckpointError, match="rank0-state.pt: refused to load: it holds objects other than"):
        run(tiny(steps=10), out, resume=True)
    assert not marker.exists()

    # the same file without a fixed manifest is a damaged checkpoint: passed over, and still never unpickled
    torch.save(state, latest / "rank0-state.pt")
    (latest / "manifest.json").write_text((latest / "manifest.json").read_text())
    state_file = latest / "rank0-state.pt"
    state_file.write_bytes(state_file.read_bytes() + b"\0")  # size no longer matches
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_00000004"]
    assert not marker.exists()


def test_old_pickle_checkpoints_are_refused_with_a_way_forward(tmp_path, eight_steps, capsys):
    out = copy_run(eight_steps[0], tmp_path / "run")
    marker = tmp_path / "payload-ran"
    latest = list_checkpoints(out / "checkpoints")[-1]
    for name in ("rank0-state.pt", "manifest.json"):
        (latest / name).unlink()
    torch.save({"optimizer": {}, "rng": Payload(marker)}, latest / "rank0.pt")  # the format-1 layout
    torch.save({"scheduler": Payload(marker)}, latest / "rank0-trainer.pt")
    with pytest.raises(CheckpointError, match="earlier moe-lab .* refuses to load them.*model.safetensors"):
        run(tiny(steps=10), out, resume=True)
    assert not marker.exists()
    assert main(["train", "--out", str(out), "--resume"]) == 2  # the CLI: one clear line, exit 2
    err = capsys.readouterr().err
    assert "refuses to load them" in err and "Traceback" not in err and not marker.exists()


# ------------------------------------------------------------------------------------------------ damage
@pytest.mark.parametrize("damage", ["truncated_weights", "flipped_trainer_state", "weights_deleted"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_last_complete_one_exactly(
    tmp_path, eight_steps, damage, capfd
):
    reference, final = eight_steps
    out = copy_run(reference, tmp_path / "run")
    latest = out / "checkpoints" / "step_00000008"
    weights = latest / "model.safetensors"
    if damage == "truncated_weights":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "flipped_trainer_state":  # same size, other bytes: only the checksum sees it
        text = (latest / "trainer_state.json").read_text()
        (latest / "trainer_state.json").write_text(text.replace('"step": 8', '"step": 9'))
    else:  # a kill while pruning removed the weights but left the rest
        weights.unlink()
    (out / "final").rename(tmp_path / "first-final")
    result = run(tiny(log={"every": 1}), out, resume=True)
    assert "falling back to step_00000004" in capfd.readouterr().err
    assert_bitwise_equal(final, load_file(result.export_dir / "model.safetensors"))  # exact from step 4
    steps = [row["step"] for row in read_jsonl(out / "metrics.jsonl")]
    assert steps == list(range(1, 9))  # rows 5..8 of the first attempt were dropped, then written again


def test_resume_cuts_a_torn_metrics_line_and_readers_tolerate_one(tmp_path, eight_steps):
    out = copy_run(eight_steps[0], tmp_path / "run")
    metrics = out / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 9, "time": 17')  # a full disk or a kill mid-append
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(1, 9))  # torn last line left out
    run(tiny(steps=10, log={"every": 1}), out, resume=True)
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 11))  # every line parses


def test_pruning_and_killed_writes_leave_no_step_directory_that_counts(tmp_path):
    result = run(tiny(steps=8, checkpoint={"every": 2, "keep_last": 2}), tmp_path)
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_00000006", "step_00000008"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000006", "step_00000008"]
    manifest = json.loads((result.checkpoint / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in result.checkpoint.iterdir()} - {"manifest.json"}
    ckpt_io.verify_checkpoint(result.checkpoint)


# ------------------------------------------------------------------------------------------------ divergence
def test_a_diverging_run_checkpoints_only_after_good_steps_and_names_a_good_one(tmp_path):
    config = tiny(
        steps=12,
        optim={"lr": 1e30, "grad_clip": None, "warmup_steps": 0},
        log={"every": 1},
        checkpoint={"every": 1, "keep_last": 20},
        faults={"max_bad_steps_in_a_row": 2},
    )
    with pytest.raises(TrainingDivergedError, match="3 steps in a row") as err:
        run(config, tmp_path)
    finite_steps = {row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in row}
    bad_steps = {row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl") if "loss" not in row}
    written = [ckpt_io.step_of(p) for p in list_checkpoints(tmp_path / "checkpoints")]
    assert bad_steps and set(written) <= finite_steps  # no checkpoint right after a skipped step
    first_bad = min(bad_steps)
    if written and max(written) < first_bad - 1:
        assert "resume from" in str(err.value)
    else:  # the checkpoint just before the streak holds the weights that diverged: not offered
        assert "no checkpoint before the divergence gave a finite step" in str(err.value)
        assert not any(
            str(tmp_path / "checkpoints" / ckpt_io.step_dir_name(s)) in str(err.value) for s in written
        )


# ------------------------------------------------------------------------------------------------ full disk
def test_a_full_disk_while_logging_leaves_no_partial_line_and_says_so(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"loss": 3.0})
    real_write = os.write

    def half_then_full(fd, data):  # the kernel writes what fits, then the next write fails
        if len(data) > 8:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(DiskFullError, match=rf"writing {path}: it needs about \d+ B, .* free"):
        sink.log(2, {"loss": 2.5})
    monkeypatch.setattr(os, "write", real_write)
    sink.log(3, {"loss": 2.0})
    sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3]


def test_a_full_disk_while_checkpointing_is_one_clear_line_and_frees_the_space(tmp_path, monkeypatch, capsys):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_io, "save_file", no_space)
    args = [
        "train",
        "--out",
        str(tmp_path / "run"),
        "--set",
        "steps=2",
        "--set",
        "data.source=synthetic",
        "--set",
        "data.seq_len=32",
        "--set",
        "data.synthetic_blocks=64",
        "--set",
        "batch_size=4",
        "--set",
        "log.progress=off",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left on the device writing" in err[0] and "needs about" in err[0]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))  # the partial checkpoint is gone

    monkeypatch.undo()
    with pytest.raises(DiskFullError, match="free some space"):
        with atomic_directory(tmp_path / "other") as tmp:
            (tmp / "a").write_text("x")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".other.tmp-*"))


# ------------------------------------------------------------------------------------------------ locks
LOCK_HOLDER = """
import sys, time
from moe_core.fileio import OutputLock
lock = OutputLock(sys.argv[1], "test run").acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_writer_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            OutputLockedError, match=rf"in use by another training run \(pid {holder.pid} on host"
        ):
            Trainer(tiny(steps=2), out)
        assert not (out / "checkpoints").exists()  # refused before writing anything
        assert main(["train", "--out", str(out), "--set", "steps=2", "--set", "data.source=synthetic"]) == 2
        err = capsys.readouterr().err
        assert f"in use by another training run (pid {holder.pid}" in err and "Traceback" not in err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with OutputLock(
        out, "training run"
    ):  # the kernel dropped the dead holder's lock: taken over, with a message
        pass
    assert f"left by a training run that is gone (pid {holder.pid}" in capsys.readouterr().err
    assert not (tmp_path / ".run.lock").exists()  # released


# ------------------------------------------------------------------------------------------------ temporaries
KILLED_WRITER = """
import os, signal, sys
from moe_core.fileio import atomic_directory
with atomic_directory(sys.argv[1]) as tmp, atomic_directory(sys.argv[2]) as other:
    (tmp / "half").write_text("x")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_abandoned_temporaries_are_removed_and_live_ones_kept(tmp_path):
    from moe_core.data.prepare import PrepareConfig, prepare

    out = tmp_path / "prep"
    subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(out), str(tmp_path / "data")],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    (abandoned,) = tmp_path.glob(".prep.tmp-*")
    assert list(tmp_path.glob(".data.tmp-*"))
    with atomic_directory(tmp_path / "prep") as live:  # the next writer removed the abandoned temporary
        assert not abandoned.exists()
        assert clean_abandoned_temporaries(out) == [] and live.is_dir()  # and a third leaves a live one alone
        (live / "data").write_text("x")
    prepare(
        PrepareConfig(
            max_documents=24, vocab_size=300, seq_len=32, num_proc=1, val_fraction=0.1, test_fraction=0.1
        ),
        tmp_path / "data",
    )
    assert not list(tmp_path.glob(".data.tmp-*"))  # the killed preparation's leftovers went
