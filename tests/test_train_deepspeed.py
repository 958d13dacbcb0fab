"""The DeepSpeed backend (`moe_core.train.deepspeed_engine`, ``parallel.backend=deepspeed``) on CPU: DeepSpeed's CPU
accelerator, its collectives over gloo.

- One process: ZeRO over a world of one is the same arithmetic as the native loop (flat partitions, the same AdamW
  kernel, the same clipping), so the two runs agree bitwise; a non-finite step is skipped and counted as natively.
- Two processes, ZeRO-2: follows the one-process native run of the same global batch. Tolerance as for DDP in
  test_train_parallel.py: the gradient average is summed in two halves, so losses agree to ~1e-6 relative and
  weights to ~1e-5 of their norm over a few steps (measured: losses to 2e-7, grad norms to 5e-8).
- Stop at step 2 and resume equals the uninterrupted run bitwise: the same layout sums in the same order, and the
  optimizer partitions come back from our weights-only rank files exactly (tested on the four-process run, whose
  ZeRO-2 partitions hold both the dense and the MoE parameter groups).
- Four processes, ep 2 x dp 2 (`deepspeed_experts.py`): the expert shards in DeepSpeed's MoE parameter groups,
  partitioned and reduced over the expert-data-parallel groups; follows the one-process native run as the native
  ep2 x dp2 run does (measured over 4 steps: losses to 1.4e-7, grad norms to 1.6e-6, weights to 4.2e-5 of their
  norm; against the native ep2 x dp2 run, weights to 4.8e-6), with the same communication telemetry, and resumes
  exactly.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from moe_core.quiet import quiet_deepspeed_cpu_notice
from moe_core.train import TrainConfig, read_jsonl, train
from moe_core.train.checkpoint import gather_state_dict, load_rank_files
from moe_core.train.config import ParallelSection, TrainConfigError
from moe_core.train.deepspeed_engine import ds_config
from moe_core.train.loop import Trainer
from tests.dist_helpers import assert_comm_metrics, env, run_cli, train_args
from tests.test_train_loop import PoisonedLoss, assert_bitwise_equal, tiny

DEFAULT_ZERO_STAGE = ParallelSection().zero_stage


def test_deepspeed_is_installed_by_the_test_extra():
    """DeepSpeed is in the `test` extra, so CI has it: a missing install fails here rather than skipping the
    backend's tests (checked without importing it: importing DeepSpeed takes seconds)."""
    assert importlib.util.find_spec("deepspeed") is not None, (
        "pip install -e '.[test]' (it pulls .[deepspeed])"
    )


def deepspeed_config(**fields) -> TrainConfig:
    return TrainConfig.build(
        {"model": {"preset": "mixtral-tiny"}, "parallel": {"backend": "deepspeed"}, **fields}
    )


def test_settings_the_backend_does_not_cover_are_refused_by_name():
    for fields, named in (
        ({"parallel": {"backend": "deepspeed", "dp_mode": "fsdp2"}}, "parallel.dp_mode=fsdp2"),
        ({"precision": "fp16"}, "precision=fp16"),
        ({"compile": True}, "compile=true"),
    ):
        with pytest.raises(TrainConfigError, match=named):
            deepspeed_config(**fields)
    with pytest.raises(TrainConfigError, match="offload_optimizer=true needs parallel.backend=deepspeed"):
        TrainConfig.build({"parallel": {"offload_optimizer": True}})
    # expert parallelism is covered (`test_expert_parallel_...` below)
    assert deepspeed_config(parallel={"backend": "deepspeed", "ep_size": 2}).parallel.ep_size == 2


def test_deepspeed_config_carries_our_batch_split_clipping_and_zero_settings():
    config = deepspeed_config(
        batch_size=16,
        grad_accum=2,
        optim={"grad_clip": 0.5},
        parallel={"backend": "deepspeed", "zero_stage": 1, "offload_optimizer": True},
    )
    ds = ds_config(config, micro_batch=config.micro_batch_size(2), world_size=2, n_params=1000)
    assert (
        ds["train_batch_size"],
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
    ) == (
        16,
        4,
        2,
    )
    assert ds["gradient_clipping"] == 0.5
    assert (
        ds["zero_optimization"]["stage"] == 1
        and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    )
    assert ds_config(deepspeed_config(optim={"grad_clip": None}), 8, 1, 10**9)["gradient_clipping"] == 0.0
    # buckets no larger than the model (DeepSpeed's default 5e8 elements are allocated every step)
    assert (
        ds["zero_optimization"]["reduce_bucket_size"]
        == ds["zero_optimization"]["allgather_bucket_size"]
        == 1000
    )


@pytest.mark.slow
def test_one_process_deepspeed_equals_the_native_loop_and_skips_a_non_finite_step(tmp_path):
    # ZeRO-1 with the optimizer offloaded to the CPU and two micro-batches: DeepSpeed's accumulation, its
    # offload path and our LR schedule against the native loop
    fields = dict(steps=3, grad_accum=2, optim={"warmup_steps": 2, "lr": 1e-2}, checkpoint={"export": False})
    torchrun_keys = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    environment = {k: os.environ.get(k) for k in torchrun_keys}
    native = train(tiny(**fields), tmp_path / "native")
    ds = train(
        tiny(**fields, parallel={"backend": "deepspeed", "zero_stage": 1, "offload_optimizer": True}),
        tmp_path / "ds",
    )
    assert [r["loss"] for r in ds.history] == [r["loss"] for r in native.history]
    assert_bitwise_equal(gather_state_dict(native.checkpoint), gather_state_dict(ds.checkpoint))
    # the run leaves the process as it found it: a LOCAL_RANK left behind made a later fine-tune in the same
    # process (accelerate) and a later `--nproc` launch take the process for a torchrun worker
    assert {k: os.environ.get(k) for k in torchrun_keys} == environment

    trainer = Trainer(tiny(steps=4, parallel={"backend": "deepspeed"}), tmp_path / "skip")
    try:
        trainer.forward_model = PoisonedLoss(trainer.backend.engine, bad_calls={2})
        trainer.train_step()
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        stats = trainer.train_step()  # the poisoned one: DeepSpeed finds the NaN gradient and does not step
        assert stats["finite"] == 0.0 and trainer.skipped_steps == 1 and trainer.bad_in_row == 1
        assert_bitwise_equal(before, trainer.model.state_dict())
        assert trainer.train_step()["finite"] == 1.0 and trainer.bad_in_row == 0
        assert not torch.equal(before["lm_head.weight"], trainer.model.state_dict()["lm_head.weight"])
    finally:
        trainer.close()


ARGS = train_args(steps=4, every=2)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The one-process native run both multi-process DeepSpeed runs follow."""
    out = tmp_path_factory.mktemp("native")
    run_cli(out, *ARGS)
    return out


def follows_the_native_run(tmp_path, native, deepspeed) -> list[dict]:
    """Train through DeepSpeed with ``deepspeed``'s flags; the logged rows agree with the native run's, and
    the run trained. Returns the DeepSpeed run's rows."""
    run_cli(tmp_path / "ds", *ARGS, *deepspeed)
    a = [r for r in read_jsonl(native / "metrics.jsonl") if "loss" in r]
    b = [r for r in read_jsonl(tmp_path / "ds" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("loss", "lm_loss", "aux_loss", "grad_norm", "lr"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=2e-5), key
    assert b[-1]["lm_loss"] < b[0]["lm_loss"] - 0.05  # it trained
    return b


def final_weights(tmp_path, native, last: str) -> tuple[dict, dict]:
    """Both runs' weights at checkpoint ``last``, equal within float tolerance."""
    wa, wb = gather_state_dict(native / last), gather_state_dict(tmp_path / "ds" / last)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert ((wb[name] - wa[name]).norm() / wa[name].norm()).item() < 1e-4, name
    return wa, wb


def optimizer_states(ckpt, rank: int) -> dict:
    return load_rank_files(ckpt, rank)["optimizer"]["state"]


def resumes_exactly(tmp_path, deepspeed, last: str, rows: list[dict], ranks: int) -> None:
    """Stop at step 2 (its checkpoint is the newest), resume, train to ``last``: the same weights, every
    rank's optimizer state and the same logged rows, bitwise."""
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ds", resumed)
    shutil.rmtree(resumed / last)
    run_cli(resumed, *ARGS, *deepspeed, "--resume")
    assert_bitwise_equal(gather_state_dict(resumed / last), gather_state_dict(tmp_path / "ds" / last))
    for rank in range(ranks):
        got, want = optimizer_states(resumed / last, rank), optimizer_states(tmp_path / "ds" / last, rank)
        assert got.keys() == want.keys()
        for index in want:
            assert_bitwise_equal(got[index], want[index])
    c = [r for r in read_jsonl(resumed / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in c] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in rows
    ]


@pytest.mark.slow
def test_two_process_zero2_follows_the_native_run_and_partitions_the_optimizer(tmp_path, native):
    deepspeed = ("--nproc", "2", "--set", "parallel.backend=deepspeed", "--set", "parallel.zero_stage=2")
    follows_the_native_run(tmp_path, native, deepspeed)
    last = "checkpoints/step_00000004"
    wa, _ = final_weights(tmp_path, native, last)
    # each rank's optimizer file holds its ZeRO partition (half of the flat state), loaded weights-only
    sizes = [
        sum(
            v.numel()
            for s in load_rank_files(tmp_path / "ds" / last, r)["optimizer"]["state"].values()
            for k, v in s.items()
            if k == "exp_avg"
        )
        for r in (0, 1)
    ]
    total = sum(t.numel() for t in wa.values())
    assert abs(sizes[0] - sizes[1]) <= 2 * len(wa) and sum(sizes) >= total - 16  # (tied weights, alignment)
    # resuming ZeRO-2 partitions exactly: the ep 2 x dp 2 test below (ZeRO-2 is the default stage)


@pytest.mark.slow
def test_expert_parallel_ep2_by_dp2_follows_the_native_run_and_resumes_exactly(tmp_path, native):
    deepspeed = ("--nproc", "4", "--set", "parallel.backend=deepspeed", "--set", "parallel.ep_size=2")
    assert DEFAULT_ZERO_STAGE == 2  # this run's resume is also the ZeRO-2 resume test
    b = follows_the_native_run(tmp_path, native, deepspeed)
    assert_comm_metrics(tmp_path / "ds", world=4, ep_size=2)  # our all-to-all, timed as natively
    last = "checkpoints/step_00000004"
    wa, _ = final_weights(tmp_path, native, last)
    assert {p.name for p in (tmp_path / "ds" / last).glob("experts-*")} == {
        "experts-ep0-of-2.safetensors",
        "experts-ep1-of-2.safetensors",
    }
    # the experts' optimizer state is DeepSpeed's MoE group, partitioned over the expert-data-parallel group
    # (2 ranks hold one EP rank's experts, half each); the rest over all 4 ranks
    groups = load_rank_files(tmp_path / "ds" / last, 0)["optimizer"]["param_groups"]
    assert [(g.get("moe", False), g.get("name")) for g in groups][-1] == (True, "ep_size_2")
    assert not any(g.get("moe") for g in groups[:-1])
    (expert_index,) = groups[-1]["params"]
    expert_numel = sum(t.numel() for n, t in wa.items() if ".experts." in n)
    held = [optimizer_states(tmp_path / "ds" / last, r)[expert_index]["exp_avg"].numel() for r in range(4)]
    assert held == [expert_numel // 4] * 4

    resumes_exactly(tmp_path, deepspeed, last, b, ranks=4)


def test_only_deepspeeds_cpu_notice_is_silenced():
    logger, seen = logging.getLogger("DeepSpeed"), []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        with quiet_deepspeed_cpu_notice():
            logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, ...")
            logger.warning("OVERFLOW! Skipping step.")
        logger.warning("Setting accelerator to CPU.")  # outside the block: shown
    finally:
        logger.removeHandler(handler)
    assert seen == ["OVERFLOW! Skipping step.", "Setting accelerator to CPU."]


@pytest.mark.slow
def test_saving_our_model_imports_deepspeed_without_its_cpu_notice(tmp_path):
    # transformers' save_pretrained unwraps through accelerate, which imports DeepSpeed where it is installed
    code = (
        "import sys\n"
        "from moe_core.config import get_config\n"
        "from moe_core.model import MoEForCausalLM\n"
        f"MoEForCausalLM(get_config('switch-tiny')).save_pretrained({str(tmp_path)!r})\n"
        "print('deepspeed imported:', 'deepspeed' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "deepspeed imported: True" in result.stdout  # else this test checks nothing
    assert "Setting accelerator to CPU" not in result.stdout + result.stderr
