"""Expert parallelism on CPU (gloo): a 2-process run with the experts sharded over both processes follows
the 1-process run of the same global batch, step for step.

What is equal in principle, and what only up to float rounding: every process gets half of each global batch;
the LM and z losses are per-token means (equal token counts, so the average over processes is the global
mean); the load-balancing loss is computed from all-reduced f_e and P_e (`parallel.global_aux_loss`), i.e.
over the global batch as on one process. Routing is dropless (mixtral-tiny): with a capacity factor each
process would bound capacity over its own tokens and drop differently, a real difference and not tested
here. What differs is the order of float sums (all-to-all, gradient all-reduce, FSDP reduce-scatter), so the
losses agree to ~1e-6 relative, not bitwise. Top-k selection is discontinuous: once in a while rounding flips
a near-tie and one token goes to another expert, a jump of ~1e-4 in the loss (seen at step 19 of 20 once).
So: 2e-5 relative over the first 10 steps, 1e-3 over all 20; weights 1e-4 (relative norm) at step 10, 1e-2
at step 20.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from moe_core.train import read_jsonl
from moe_core.train.checkpoint import gather_state_dict

REPO = Path(__file__).resolve().parents[1]
ARGS = [
    "--preset",
    "mixtral-tiny",
    "--set",
    "steps=20",
    "--set",
    "batch_size=8",
    "--set",
    "log.every=1",
    "--set",
    "log.progress=lines",
    "--set",
    "data.source=synthetic",
    "--set",
    "data.seq_len=32",
    "--set",
    "data.synthetic_blocks=256",
    "--set",
    "checkpoint.every=10",
    "--set",
    "optim.lr=3e-3",  # at 1e-2 Adam amplifies the first steps' 1e-7 rounding differences 10x a step on some
    # CPUs (AVX-512: 7e-5 apart by step 9, weights 3e-2 apart by step 20); at 3e-3, 4e-6 and 4e-5, and it trains
    "--set",
    "optim.warmup_steps=2",
]


def run_cli(out: Path, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "moe_core.cli", "train", "--out", str(out), *ARGS, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run_cli(out)
    return out


def assert_same_trajectory(one: Path, many: Path) -> None:
    a, b = read_jsonl(one / "metrics.jsonl"), read_jsonl(many / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 21))
    for key in ("loss", "lm_loss", "aux_loss", "grad_norm"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=2e-5), key
    assert a[-1]["lm_loss"] < a[0]["lm_loss"] - 0.3  # it trained: the comparison is not of two idle runs
    for key in ("moe/layer_0/expert_3_frac", "moe/layer_1/entropy"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-3, abs=1e-3), key
    # weights (expert shards gathered) relative to each tensor's norm: elementwise, Adam magnifies rounding
    # in near-zero entries
    for step, tolerance in ((10, 1e-4), (20, 2e-4)):
        wa = gather_state_dict(one / "checkpoints" / f"step_{step:08d}")
        wb = gather_state_dict(many / "checkpoints" / f"step_{step:08d}")
        assert wa.keys() == wb.keys()
        for name in wa:
            assert ((wb[name] - wa[name]).norm() / wa[name].norm()).item() < tolerance, (step, name)
    assert load_file(many / "final" / "model.safetensors").keys() == wa.keys()  # the export is whole


@pytest.mark.slow
def test_two_process_expert_parallel_run_matches_one_process(one_process, ep2_run):
    assert_same_trajectory(one_process, ep2_run)  # ep2_run (conftest): --nproc 2 --set parallel.ep_size=2
    # each process wrote its expert shard; the export gathered them into one Hugging Face checkpoint
    ckpt = ep2_run / "checkpoints" / "step_00000020"
    assert {p.name for p in ckpt.glob("experts-*")} == {
        "experts-ep0-of-2.safetensors",
        "experts-ep1-of-2.safetensors",
    }


@pytest.mark.slow
def test_two_process_fsdp2_data_parallel_run_matches_one_process(tmp_path, one_process):
    # ep_size=1: every rank holds all experts; everything else is sharded by FSDP2 (the ZeRO-3 path)
    run_cli(tmp_path / "fsdp2", "--nproc", "2", "--set", "parallel.dp_mode=fsdp2")
    assert_same_trajectory(one_process, tmp_path / "fsdp2")


# ep 2 x dp 2 (four processes) is tests/test_multinode.py's two-node run: the same groups, one more launcher.
