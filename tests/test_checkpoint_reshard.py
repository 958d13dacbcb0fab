"""A start that costs what a rank owns, and checkpoints that reshard, on CPU (gloo), with few launches:

- `written`: one run at ep 2 x dp 2 (DDP, 4 processes, 2 steps of mixtral-tiny) writes a checkpoint;
- `fsdp2_ep2`: 2 processes, ep 2 with FSDP2 (`tests/reshard_worker.py`): build a mid-size Mixtral-shaped trainer
  and measure what each rank allocated, build the tiny one and checkpoint its initial weights, resume `written`
  and checkpoint what it loaded;
- `ep4`: 4 processes, ep 4 (DDP): the same without the measurement;
- one process: the same, in this process.

What this layout loaded is written back at that layout; the test compares it, gathered, with what was written:
a reshard moves tensors without arithmetic, so weights and AdamW state are equal bitwise. The initial weights
are equal bitwise at 1, 2 and 4 processes (`moe_core.train.build`: a stream per module and per global expert).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moe_core.train.build import build_meta_model, rank_parameter_bytes
from moe_core.train.checkpoint import (
    OPTIMIZER_FILE,
    CheckpointError,
    TensorIndex,
    gather_state_dict,
    load_rank_files,
)
from moe_core.train.config import TrainConfig
from moe_core.train.loop import Trainer
from tests.dist_helpers import run_cli, run_reshard_worker
from tests.reshard_worker import MEASURE_SETS, TINY_SETS
from tests.test_hardening_checkpoint import rewrite_manifest

pytestmark = pytest.mark.slow

STEP = "step_00000002"
STEP0 = "step_00000000"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("written") / "run"
    sets = [a for s in TINY_SETS for a in ("--set", s)]
    run_cli(out, "--preset", "mixtral-tiny", *sets, "--nproc", "4", "--set", "parallel.ep_size=2")
    assert (out / "checkpoints" / STEP / "experts-ep1-of-2.safetensors").is_file()
    return out


def rerun_reshard_worker(
    tmp: Path, written: Path, nproc: int, sets: list[str], measure: bool = False
) -> Path:
    """A copy of ``written`` resumed (and re-checkpointed), and a fresh tiny run's step-0 checkpoint, in ``tmp``."""
    shutil.copytree(written, tmp / "resumed")
    args = ["--fresh", str(tmp / "fresh"), "--resume", str(tmp / "resumed")]
    if measure:
        args += ["--measure", str(tmp / "measure"), str(tmp / "report")]
    run_reshard_worker(nproc, *args, *[a for s in sets for a in ("--set", s)])
    return tmp


@pytest.fixture(scope="module")
def fsdp2_ep2(tmp_path_factory, written) -> Path:
    sets = ["parallel.ep_size=2", "parallel.dp_mode=fsdp2"]
    return rerun_reshard_worker(tmp_path_factory.mktemp("fsdp2-ep2"), written, 2, sets, measure=True)


@pytest.fixture(scope="module")
def ep4(tmp_path_factory, written) -> Path:
    return rerun_reshard_worker(tmp_path_factory.mktemp("ep4"), written, 4, ["parallel.ep_size=4"])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, written) -> Path:
    tmp = tmp_path_factory.mktemp("one")
    shutil.copytree(written, tmp / "resumed")
    fresh = Trainer(TrainConfig.from_preset("mixtral-tiny").with_overrides(TINY_SETS), tmp / "fresh")
    try:
        fresh.save_checkpoint()
    finally:
        fresh.close()
    config = TrainConfig.load(tmp / "resumed" / "checkpoints" / STEP / "train_config.json")
    resumed = Trainer(config.with_overrides(["parallel.ep_size=1"]), tmp / "resumed", resume=True)
    try:
        assert resumed.step == 2
        resumed.save_checkpoint()
    finally:
        resumed.close()
    return tmp


def optimizer_state(ckpt: Path) -> dict[str, torch.Tensor]:
    index = TensorIndex(ckpt, OPTIMIZER_FILE, "optimizer-experts-")
    return {name: index.read(name) for name in index.names()}


def assert_equal_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, different[:5]


@pytest.mark.parametrize("layout", ["one_process", "ep4", "fsdp2_ep2"])
def test_a_checkpoint_written_at_ep2_dp2_resumes_at_another_layout_with_the_same_state(
    request, written, layout
):
    before = written / "checkpoints" / STEP
    after = request.getfixturevalue(layout) / "resumed" / "checkpoints" / STEP
    weights = gather_state_dict(before)
    assert_equal_tensors(weights, gather_state_dict(after))
    moments = optimizer_state(before)
    assert {name.rsplit(":", 1)[1] for name in moments} == {"exp_avg", "exp_avg_sq", "step"}
    parameters = {
        name
        for name, _ in build_meta_model(
            TrainConfig.load(before / "train_config.json").model.build_config()
        ).named_parameters()
    }
    assert {name.rsplit(":", 1)[0] for name in moments} == parameters  # every parameter's, and only those
    assert_equal_tensors(moments, optimizer_state(after))
    old, new = load_rank_files(before, 0), load_rank_files(after, 0)
    assert new["data"] == old["data"]
    assert new["scheduler"]["last_epoch"] == old["scheduler"]["last_epoch"] == 2
    assert new["scheduler"]["_last_lr"][0] == old["scheduler"]["_last_lr"][0]


def test_initial_weights_are_the_same_at_1_2_and_4_processes(one_process, fsdp2_ep2, ep4):
    one = gather_state_dict(one_process / "fresh" / "checkpoints" / STEP0)
    assert_equal_tensors(one, gather_state_dict(fsdp2_ep2 / "fresh" / "checkpoints" / STEP0))
    assert_equal_tensors(one, gather_state_dict(ep4 / "fresh" / "checkpoints" / STEP0))
    # and they differ where they should: every expert its own draw, routers their own rule
    up = one["model.layers.0.mlp.experts.up_proj"]
    assert not torch.equal(up[0], up[1]) and up.std().item() == pytest.approx(0.02, rel=0.1)


def test_a_rank_allocates_only_the_shards_it_owns(fsdp2_ep2):
    """The mid-size Mixtral-shaped trainer at ep 2 with FSDP2 on 2 ranks: each rank's materialized parameters are
    what the dry run predicts (half the experts, half of every dense tensor), and its peak RSS grew by less than
    the whole model's weights: a full build (the model before this change) alone needs all of them."""
    config = TrainConfig.from_preset("mixtral-tiny").with_overrides(MEASURE_SETS)
    predicted = rank_parameter_bytes(config.model.build_config(), 2, 2, "fsdp2")
    whole = predicted[0]["whole_model"]
    for rank in range(2):
        row = json.loads((fsdp2_ep2 / "report" / f"rank{rank}.json").read_text())
        assert row["materialized"] == predicted[rank]["params"] < 0.55 * whole
        assert row["materialized"] <= row["rss_growth"] < whole, row


def test_a_per_rank_optimizer_checkpoint_of_another_layout_is_refused_by_name(tmp_path):
    """DeepSpeed's checkpoints (and format 2's) keep the optimizer state per rank: they resume at their own layout
    only, and a resume at another is refused before anything is loaded, naming what to do."""
    out = tmp_path / "run"
    trainer = Trainer(TrainConfig.from_preset("mixtral-tiny").with_overrides(TINY_SETS), out)
    try:
        ckpt = trainer.save_checkpoint()
    finally:
        trainer.close()
    state = torch.load(ckpt / "rank0-state.pt", weights_only=True)
    state["optimizer"] = {"state": {}, "param_groups": state["optimizer_groups"]}  # as DeepSpeed's rank files
    torch.save(state, ckpt / "rank0-state.pt")
    trainer_state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**trainer_state, "world_size": 2, "ep_size": 2}))
    rewrite_manifest(ckpt)
    with pytest.raises(
        CheckpointError, match="written by 2 processes with ep_size=2.*resume with the same --nproc"
    ):
        Trainer(TrainConfig.load(ckpt / "train_config.json"), out, resume=True)
