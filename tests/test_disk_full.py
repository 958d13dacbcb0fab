"""A full disk is one line, from every writer: on a real, tiny filesystem (a tmpfs mounted for the test), the
errors the libraries raise themselves (safetensors' "os error 28", torch.save's "unexpected pos"), not
stand-ins for them. Needs root to mount; skipped elsewhere."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_core.fileio import DiskFullError, atomic_directory, disk_full_guard
from moe_lab.cli import main

BIG = {"w": torch.zeros(1024, 1024)}  # 4 MiB


@pytest.mark.parametrize(
    "write",
    [
        lambda path: save_file(BIG, str(path)),  # SafetensorError: "... os error 28"
        lambda path: torch.save(
            BIG, path
        ),  # RuntimeError: "[enforce fail at inline_container.cc] unexpected pos"
        lambda path: Path(path).write_bytes(b"x" * 4 * 2**20),  # OSError ENOSPC
    ],
    ids=["safetensors", "torch.save", "plain write"],
)
def test_the_libraries_out_of_space_errors_become_one_line(small_disk, write):
    target = small_disk / "weights.bin"
    with pytest.raises(
        DiskFullError, match=rf"no space left on the device writing .*{small_disk.name}.* free"
    ):
        with disk_full_guard(target):
            write(target)


def test_other_errors_pass_through(small_disk):
    with pytest.raises(ValueError, match="not about space"):
        with disk_full_guard(small_disk / "x"):
            raise ValueError("not about space")


def test_the_space_needed_is_checked_before_anything_is_written(small_disk):
    ran = []
    with pytest.raises(DiskFullError, match="needs about 8.0 MiB"):
        with disk_full_guard(small_disk / "ckpt", needed=8 * 2**20):
            ran.append(True)
    assert not ran


def test_a_staged_output_on_a_full_disk_leaves_nothing(small_disk):
    with pytest.raises(DiskFullError):
        with atomic_directory(small_disk / "out") as tmp:
            torch.save(BIG, tmp / "model.pt")
    assert list(small_disk.iterdir()) == []


def test_training_onto_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(small_disk, capsys):
    args = ["train", "--out", str(small_disk / "run"), "--preset", "mixtral-tiny"]
    args += ["--set", "steps=2", "--set", "data.source=synthetic", "--set", "data.seq_len=32"]
    args += ["--set", "data.synthetic_blocks=64", "--set", "batch_size=4", "--set", "log.progress=off"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left on the device writing" in err[0], err
    checkpoints = small_disk / "run" / "checkpoints"
    assert not checkpoints.exists() or not list(checkpoints.iterdir())
