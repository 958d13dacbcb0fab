"""Shared pieces of the multi-process tests (multi-node, elastic, launchers): a short mixtral-tiny run on
synthetic data, the `moe-lab train` command line, free ports, and comparisons of two runs' trajectories.

Tolerances as in test_train_parallel.py: several processes sum floats in another order than one, so losses
agree to ~1e-6 relative and weights to ~1e-5 of their norm over a few steps; runs of the same layout are
compared bitwise."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moe_core.train import read_jsonl
from moe_core.train.checkpoint import gather_state_dict

REPO = Path(__file__).resolve().parents[1]
STEPS = 8


def train_args(steps: int = STEPS, every: int = 4) -> list[str]:
    sets = [
        f"steps={steps}",
        "batch_size=8",
        "log.every=1",
        "log.progress=lines",
        "data.source=synthetic",
        "data.seq_len=32",
        "data.synthetic_blocks=128",
        f"checkpoint.every={every}",
        "optim.lr=1e-2",
        "optim.warmup_steps=2",
        "checkpoint.export=false",
        "eval.batches=1",
    ]
    return ["--preset", "mixtral-tiny", *[a for s in sets for a in ("--set", s)]]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def cli(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moe_core.cli", "train", "--out", str(out), *extra]


def run_cli(out: Path, *extra: str, timeout: float = 400) -> subprocess.CompletedProcess:
    result = subprocess.run(cli(out, *extra), env=env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def run_reshard_worker(nproc: int, *args: str) -> None:
    """``tests/reshard_worker.py`` on ``nproc`` local processes under torchrun (its options: that file)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(REPO / "tests" / "reshard_worker.py"),
        *args,
    ]
    result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_run(
    one: Path, many: Path, steps: int = STEPS, rel: float = 2e-5, weights_rel: float = 1e-4
) -> None:
    a, b = read_jsonl(one / "metrics.jsonl"), read_jsonl(many / "metrics.jsonl")
    a, b = [r for r in a if "loss" in r], [r for r in b if "loss" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    for key in ("loss", "lm_loss", "aux_loss", "grad_norm"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=rel), key
    assert a[-1]["lm_loss"] < a[0]["lm_loss"] - 0.1  # it trained: not a comparison of two idle runs
    wa = gather_state_dict(one / "checkpoints" / f"step_{steps:08d}")
    wb = gather_state_dict(many / "checkpoints" / f"step_{steps:08d}")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert ((wb[name] - wa[name]).norm() / wa[name].norm()).item() < weights_rel, name


def assert_comm_metrics(run: Path, world: int, ep_size: int, tokens_per_step: int = 8 * 32) -> None:
    """The expert-parallel communication telemetry of a finished run is there and adds up: every slot routed
    in an EP group is received by exactly one EP rank (dropless routing), and what one rank sends another
    receives."""
    from moe_core.config import get_config

    config = get_config("mixtral-tiny")
    moe_layers, k = len(config.moe_layer_ids), config.num_experts_per_tok
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    for row in rows:
        slots = sum(row[f"comm/ep_rank_{j}/tokens_recv"] for j in range(ep_size))
        assert slots == pytest.approx(tokens_per_step / (world // ep_size) * k * moe_layers)
        sent = sum(row[f"comm/rank_{r}/a2a_bytes_sent"] for r in range(world))
        assert (
            sent == pytest.approx(sum(row[f"comm/rank_{r}/a2a_bytes_recv"] for r in range(world)))
            and sent > 0
        )
        assert 0 < row["comm/frac_step"] < 1 and row["comm/tokens_recv_imbalance"] >= 1
        assert row["comm/a2a_ms"] == pytest.approx(
            sum(row[f"comm/layer_{i}/a2a_ms"] for i in config.moe_layer_ids)
        )
