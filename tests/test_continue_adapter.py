"""Going on training an earlier fine-tune's adapter (`moe_core.finetune.as_trained.continued`): SFT, then DPO on
the SFT'd adapter, the way TRL's DPO trains an adapter against a frozen copy of itself. ``model.path`` naming a
fine-tune output that holds its adapter alone (every output above 1 B parameters, every QLoRA output) used to load
the base with that adapter inside and wrap it again: PEFT re-initialized the adapter's factors, so the run started
from the base, silently, and wrote an adapter that recorded the base alone."""

from __future__ import annotations

import json

import pytest
import torch

from moe_core import load
from moe_core.finetune import FinetuneConfig, FinetuneError, finetune
from moe_core.finetune import run as run_module
from moe_core.finetune.as_trained import continued
from moe_core.finetune.methods import unwrap
from moe_core.finetune.run import load_inputs, select_parameters
from tests.finetune_helpers import preference_records
from tests.test_load_as_trained import adapter_only_finetune

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


X = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))


def logits(model, adapter: str | None = "default") -> torch.Tensor:
    """``model``'s logits on `X` in eval mode; for a PEFT model under ``adapter`` (None: adapters disabled)."""
    from trl.trainer.utils import use_adapter

    was_training = model.training
    model.eval()
    with torch.no_grad():
        if hasattr(model, "peft_config") and adapter != "default":
            with use_adapter(model, adapter):
                out = model(input_ids=X).logits
        else:
            out = model(input_ids=X).logits
    model.train(was_training)
    return out


def assert_computes_the_same(model, expected, adapter: str | None = "default") -> None:
    torch.testing.assert_close(logits(model, adapter), logits(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lora", ["all", "esft"])
def test_model_path_naming_an_adapter_only_output_trains_on_its_adapter(tmp_path, lora):
    fields = {"lora": {"r": 4, "experts": "esft", "esft_share": 0.5}} if lora == "esft" else {}
    source, first = adapter_only_finetune(tmp_path, **fields)
    sft = tmp_path / "out"
    config = FinetuneConfig.build({"model": {"path": str(sft)}, "steps": 2, "batch_size": 4})
    resolved, note = continued(config)
    assert note is not None and str(sft) in note
    assert resolved.model.path == str(source)  # the base it trained on, not the output
    assert resolved.lora.init_from == str(sft)
    recorded = FinetuneConfig.load(sft / "finetune_config.json")
    assert resolved.lora.model_dump() == {**recorded.lora.model_dump(), "init_from": str(sft)}
    assert resolved.data.chat_template == "chatml"  # the framing it trained with

    # the run starts from the adapter (the model computes what the SFT output does), and trains it
    inputs = load_inputs(resolved, records=first_records())
    selected = select_parameters(resolved, inputs, tmp_path)
    assert_computes_the_same(selected.train_model, load(sft).model)
    assert all(p.requires_grad for n, p in selected.train_model.named_parameters() if ".default." in n)


def first_records():
    from tests.finetune_helpers import instruction_records

    return instruction_records(16)


def test_dpo_on_an_sft_adapter_has_that_adapter_as_its_reference(tmp_path):
    source, first = adapter_only_finetune(tmp_path)
    sft = tmp_path / "out"
    config = FinetuneConfig.build(
        {
            "model": {"path": str(sft)},
            "objective": "dpo",
            "steps": 2,
            "batch_size": 4,
            "optim": {"lr": 5e-3},
            "log": {"progress": "off"},
            "export": {"merged": False, "hf": False},  # the result holds the trained PEFT model
        }
    )
    result = finetune(config, tmp_path / "dpo", records=preference_records(8))
    model = result.model
    sft_model = load(sft).model
    assert_computes_the_same(model, sft_model, adapter="ref")  # TRL's frozen reference: the SFT adapter
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".ref." in n)
    assert not torch.allclose(logits(model), logits(sft_model), atol=1e-4)  # the policy trained on from there
    first_row = next(r for r in result.metrics if "loss" in r)
    assert abs(first_row["rewards/chosen"]) < 1e-4  # at step 1 the policy is its reference

    # the output records the base and where it started; it loads as it trained, the SFT adapter included
    written = json.loads((tmp_path / "dpo" / "finetune_config.json").read_text())
    assert written["model"]["path"] == str(source) and written["lora"]["init_from"] == str(sft)
    assert json.loads((tmp_path / "dpo" / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(source)
    assert_computes_the_same(load(tmp_path / "dpo").model, unwrap(model))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lora": {"r": 16}}, r"lora.r=16: the adapter of .* was trained with lora.r=4"),
        ({"quantize": {"base": "nf4"}}, r"quantize.base='nf4': .* was trained with quantize.base=None"),
        ({"method": "full"}, r"method=full with the adapter of"),
    ],
)
def test_a_shape_other_than_the_adapter_s_is_refused_before_the_model_loads(
    tmp_path, monkeypatch, fields, message
):
    adapter_only_finetune(tmp_path)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the checks")

    monkeypatch.setattr(run_module, "load", no_weights)
    config = FinetuneConfig.build({"model": {"path": str(tmp_path / "out")}, **fields})
    with pytest.raises(FinetuneError, match=message):
        finetune(config, tmp_path / "again", records=first_records())


def test_lora_init_from_names_a_lora_output_or_is_refused(tmp_path):
    config = FinetuneConfig.build({"model": {"path": str(tmp_path)}, "lora": {"init_from": str(tmp_path)}})
    with pytest.raises(FinetuneError, match="not a LoRA fine-tune's output"):
        continued(config)


def test_a_model_in_memory_without_a_tokenizer_is_refused_by_name(tmp_path):
    """Finding the tokenizer where `load` finds it must not read a path that was never given."""
    from tests.finetune_helpers import tiny_model

    with pytest.raises(FinetuneError, match="no tokenizer: set model.tokenizer"):
        finetune(
            FinetuneConfig.build({"steps": 1}), tmp_path / "out", model=tiny_model(), records=first_records()
        )
