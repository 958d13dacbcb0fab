"""The fine-tuning config, the trainable-parameter report and the CLI wiring: fast, no training."""

import pytest

from moe_core.finetune import FinetuneConfig, FinetuneError
from moe_core.finetune.methods import apply_method
from moe_core.finetune.report import trainable_parameter_report
from tests.finetune_helpers import instruction_records, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_config_checks_itself_and_names_the_field():
    with pytest.raises(FinetuneError, match="expert_ids"):
        FinetuneConfig.build({"lora": {"experts": "list"}})
    with pytest.raises(FinetuneError, match="task_column"):
        FinetuneConfig.build({"method": "router_bias"})
    with pytest.raises(FinetuneError, match="lora.r"):
        FinetuneConfig.build({"lora": {"r": 0}})
    with pytest.raises(FinetuneError, match="unknown field"):
        FinetuneConfig().with_overrides(["lora.rank=4"])
    with pytest.raises(FinetuneError, match="compile=true is not supported with parallel.ep_size=2"):
        FinetuneConfig.build({"compile": True, "parallel": {"ep_size": 2}})


def test_overrides_yaml_and_per_layer_expert_ids(tmp_path):
    path = tmp_path / "ft.yaml"
    path.write_text("method: lora\nlora:\n  experts: list\n  expert_ids: {'1': [0, 2]}\nsteps: 3\n")
    config = FinetuneConfig.load(path).with_overrides(["optim.lr=1e-3", "freeze.router=false"])
    assert config.lora.expert_ids == {1: [0, 2]} and config.optim.lr == 1e-3 and config.train_router
    assert FinetuneConfig.build(config.model_dump()) == config  # what is saved loads back the same
    assert not FinetuneConfig().train_router  # LoRA keeps the router frozen unless asked
    assert FinetuneConfig(method="full").train_router


def test_report_lists_every_expert_adapter_and_the_parameter_it_adapts():
    model = tiny_model()
    peft_model, plan = apply_method(model, FinetuneConfig.build({"lora": {"r": 2}}))
    report = trainable_parameter_report(peft_model, plan)
    report.require_expert_adapters()
    targets = {row.target for row in report.rows if row.kind == "lora_expert"}
    assert targets == {
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert report.expert_adapters == {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    assert report.trainable_params == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert not any(
        row.kind in ("router", "experts", "attention") for row in report.rows
    )  # the base is frozen


def test_report_fails_when_expert_lora_reached_no_expert():
    model = tiny_model()
    # every expert frozen: LoRA can only reach attention, so asking for expert LoRA must not pass silently
    config = FinetuneConfig.build({"lora": {"experts": "all"}, "freeze": {"experts": [0, 1, 2, 3]}})
    peft_model, plan = apply_method(model, config)
    report = trainable_parameter_report(peft_model, plan)
    assert report.by_kind.get("lora_attention", 0) > 0
    with pytest.raises(FinetuneError, match="no expert weight got an adapter"):
        report.require_expert_adapters()


def test_finetune_refuses_to_start_when_expert_lora_misses_the_experts(tmp_path):
    from moe_core.finetune import finetune
    from tests.finetune_helpers import tiny_tokenizer

    config = FinetuneConfig.build({"steps": 1, "freeze": {"experts": [0, 1, 2, 3]}})
    with pytest.raises(FinetuneError, match="no expert weight got an adapter"):
        finetune(
            config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(), records=instruction_records(4)
        )
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained


def test_cli_registers_finetune_and_reads_config_and_overrides(tmp_path):
    from moe_core.cli import build_parser
    from moe_core.finetune.cli import resolve_config

    path = tmp_path / "ft.yaml"
    path.write_text("objective: dpo\n")
    args = build_parser().parse_args(
        [
            "finetune",
            "--config",
            str(path),
            "--model",
            "m",
            "--data",
            "d.jsonl",
            "--set",
            "steps=7",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    config = resolve_config(args)
    assert (config.objective, config.model.path, config.data.source, config.steps) == (
        "dpo",
        "m",
        "d.jsonl",
        7,
    )
