"""TrainConfig: typed, checks itself, --set overrides, round-trips through JSON; LR schedules."""

import re

import pytest

from moe_core.config import get_config
from moe_core.train.config import TrainConfig, TrainConfigError
from moe_core.train.optim import lr_lambda


def test_defaults_train_a_tiny_switch_model_on_the_builtin_corpus():
    config = TrainConfig()
    assert config.model.preset == "switch-tiny" and config.data.source == "builtin"
    assert config.model.build_config().router == "switch"


def test_overrides_are_typed_and_nested():
    config = TrainConfig().with_overrides(
        [
            "optim.lr=1e-3",
            "steps=7",
            "parallel.ep_size=2",
            "model.overrides.num_experts=4",
            "log.progress=off",
            "optim.grad_clip=null",
            "model.baseline=active",
        ]
    )
    assert config.optim.lr == pytest.approx(1e-3) and isinstance(config.optim.lr, float)
    assert config.steps == 7 and config.parallel.ep_size == 2 and config.log.progress == "off"
    assert config.optim.grad_clip is None
    model = config.model.build_config()
    assert model.num_experts == 0  # the dense baseline of a 4-expert switch-tiny
    assert model.intermediate_size == get_config("switch-tiny").expert_intermediate_size


@pytest.mark.parametrize(
    "item, fragment",
    [
        ("optim.lrr=1", "unknown field 'optim.lrr'"),
        ("steps=-1", "steps"),
        ("precision=fp8", "precision"),
        ("nokey", "expected key=value"),
        (
            "optim.betas=[0.9,",
            "'optim.betas=[0.9,': the value is not valid YAML",
        ),  # malformed YAML: no traceback
        ("model.overrides.num_experts={a: ", "the value is not valid YAML"),
    ],
)
def test_bad_overrides_name_the_field(item, fragment):
    with pytest.raises(TrainConfigError, match=re.escape(fragment)):
        TrainConfig().with_overrides([item])


def test_batch_must_split_over_accumulation_and_processes():
    with pytest.raises(TrainConfigError, match="grad_accum"):
        TrainConfig.build({"batch_size": 6, "grad_accum": 4})
    config = TrainConfig(batch_size=8, grad_accum=2)
    assert config.micro_batch_size(2) == 2
    with pytest.raises(TrainConfigError, match="do not split over 3 processes"):
        config.micro_batch_size(3)


def test_bad_model_preset_is_a_config_error():
    with pytest.raises(TrainConfigError, match="model.preset"):
        TrainConfig(model={"preset": "switch-huge"}).model.build_config()


def test_json_and_yaml_round_trip(tmp_path):
    config = TrainConfig.from_preset("mixtral-tiny", steps=3, optim={"schedule": "wsd"})
    config.save(tmp_path / "c.json")
    assert TrainConfig.load(tmp_path / "c.json") == config
    (tmp_path / "c.yaml").write_text("model: {preset: olmoe-tiny}\nlog: {progress: off}\nsteps: 4\n")
    loaded = TrainConfig.load(tmp_path / "c.yaml")
    assert loaded.model.preset == "olmoe-tiny" and loaded.log.progress == "off" and loaded.steps == 4
    with pytest.raises(TrainConfigError, match="not found"):
        TrainConfig.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("optim: {lr: -1}\n")
    with pytest.raises(TrainConfigError, match=r"bad.yaml: optim.lr"):
        TrainConfig.load(tmp_path / "bad.yaml")


def test_schedules():
    cosine = lr_lambda(TrainConfig(steps=100, optim={"warmup_steps": 10, "min_lr_ratio": 0.1}))
    assert cosine(0) == pytest.approx(0.1) and cosine(9) == pytest.approx(1.0)
    assert cosine(10) == pytest.approx(1.0) and cosine(100) == pytest.approx(0.1)
    assert cosine(55) == pytest.approx(0.55)  # halfway through the cosine
    wsd = lr_lambda(
        TrainConfig(
            steps=100,
            optim={"schedule": "wsd", "warmup_steps": 10, "decay_fraction": 0.2, "min_lr_ratio": 0.0},
        )
    )
    assert (
        wsd(50) == 1.0 and wsd(79) == 1.0 and wsd(89) == pytest.approx(0.5) and wsd(99) == pytest.approx(0.0)
    )
    third = lr_lambda(TrainConfig(steps=150))  # unset: a third of the run (issue 28 §2)
    assert third(48) < 1.0 and third(49) == pytest.approx(1.0) and third(50) == pytest.approx(1.0)
    assert third(150) == pytest.approx(TrainConfig().optim.min_lr_ratio)


def test_nproc_launches_torchrun_with_single_or_multi_node_rendezvous():
    import argparse

    from moe_core.errors import MoELabError
    from moe_core.train.cli import add_cli, torchrun_command, worker_argv

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(
        [
            "train",
            "--out",
            "runs/x",
            "--preset",
            "mixtral-tiny",
            "--set",
            "steps=3",
            "--nproc",
            "2",
            "--resume",
        ]
    )
    cmd = torchrun_command(args, worker_argv(args))
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    # the workers train with the same settings; they do not launch again
    assert cmd[5:] == [
        "-m",
        "moe_core.cli",
        "train",
        "--out",
        "runs/x",
        "--preset",
        "mixtral-tiny",
        "--set",
        "steps=3",
        "--resume",
    ]
    args = parser.parse_args(
        ["train", "--out", "o", "--nproc", "8", "--nnodes", "2", "--rdzv-endpoint", "h0:29400"]
    )
    cmd = torchrun_command(args, worker_argv(args))
    assert "--nnodes=2" in cmd and "--rdzv-endpoint=h0:29400" in cmd and "--rdzv-backend=c10d" in cmd
    args = parser.parse_args(["train", "--out", "o", "--nproc", "8", "--nnodes", "2"])
    with pytest.raises(MoELabError, match="--rdzv-endpoint"):
        torchrun_command(args, worker_argv(args))
