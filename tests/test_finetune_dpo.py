"""DPO through TRL: the reward margin rises, and the router losses are part of the DPO loss and logged."""

import math

import pytest
import torch

from moe_core.finetune import FinetuneConfig, finetune
from tests.finetune_helpers import preference_records, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def completion_logps(model, tokenizer, records, key: str) -> torch.Tensor:
    """Summed log-probability of each record's ``key`` answer after its prompt (chat template), in eval mode."""
    out = []
    model.eval()
    with torch.no_grad():
        for r in records:
            prompt = [{"role": "user", "content": r["prompt"]}]
            prompt_ids = tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            ids = tokenizer.apply_chat_template(
                prompt + [{"role": "assistant", "content": r[key]}], tokenize=True, return_dict=False
            )
            logp = model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
            targets = torch.tensor(ids[1:])
            out.append(logp.gather(-1, targets[:, None]).squeeze(-1)[len(prompt_ids) - 1 :].sum())
    return torch.stack(out)


def test_dpo_raises_the_reward_margin_and_keeps_the_router_losses(tmp_path):
    tokenizer = tiny_tokenizer()
    records = preference_records(8)
    model = tiny_model(router_aux_loss_coef=0.05, router_z_loss_coef=0.01)
    ref_chosen = completion_logps(model, tokenizer, records, "chosen")
    ref_rejected = completion_logps(model, tokenizer, records, "rejected")
    config = FinetuneConfig.build(
        {
            "objective": "dpo",
            "method": "full",
            "steps": 10,
            "batch_size": 4,
            "optim": {"lr": 1e-2},
            "dpo": {"beta": 0.1},
            "export": {"merged": False},
        }
    )
    result = finetune(config, tmp_path, model=model, tokenizer=tokenizer, records=records)

    beta = 0.1
    margin = beta * (
        (completion_logps(result.model, tokenizer, records, "chosen") - ref_chosen)
        - (completion_logps(result.model, tokenizer, records, "rejected") - ref_rejected)
    )
    assert margin.mean() > 0.1 and (margin > 0).float().mean() >= 0.75

    rows = [r for r in result.metrics if "aux_loss" in r]
    assert len(rows) == 10 and all(r["aux_loss"] > 0.5 for r in rows)
    first = rows[0]  # step 1: policy == reference, so the DPO term is log 2 and the rest is the router losses
    assert first["rewards/margins"] == 0.0
    assert first["loss"] == pytest.approx(
        math.log(2) + 0.05 * first["aux_loss"] + 0.01 * first["z_loss"], abs=2e-4
    )
    assert rows[-1]["rewards/margins"] > 0


def test_a_checkpointed_lora_dpo_run_warns_nothing_about_checkpointing_names(tmp_path):
    """transformers 5.24 renamed gradient checkpointing to activation checkpointing: the lab passed the old
    TrainingArguments name, and TRL 1.16 reads the old model property (`trl_seam.trl_reads_deprecated_names`),
    so every fine-tune printed two FutureWarnings about names the user never typed."""
    import warnings

    config = FinetuneConfig.build(
        {
            "objective": "dpo",
            "method": "lora",
            "steps": 2,
            "batch_size": 2,
            "gradient_checkpointing": True,
            "export": {"merged": False},
        }
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = finetune(
            config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(), records=preference_records(4)
        )
    assert result.report is not None
    said = [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    assert not said, said


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_lora_against_its_reference_trains_on_a_mapped_or_4_bit_base(tmp_path, objective):
    """TRL 1.16 makes the LoRA reference a frozen copy of the policy's adapter ("ref", added in its trainer's
    ``__init__``). On a memory-mapped or 4-bit base the expert wrappers are nested by hand (`expert_lora.inject`),
    PEFT's ``add_adapter`` did not reach them, and DPO and KTO stopped at the experts' factors ("ModuleDict has no
    attribute `ref`"): at full size, where the base is mapped by default, they did not run at all. Now every
    expert factor has its frozen copy, which stays at the initial adapter while the policy moves, and the mapped
    run is the copied run, step for step."""
    from tests.test_finetune_orpo_kto import kto_records
    from tests.test_mmap_base import hf_source

    source = hf_source(tmp_path, torch.bfloat16)
    records = preference_records(8) if objective == "dpo" else kto_records(4)
    forms = {
        "mapped": {},
        "copied": {"model": {"path": str(source), "dtype": "bfloat16", "mmap": False}},
        "qlora": {"method": "qlora", "quantize": {"group_size": 16}},
    }
    metrics = {}
    for form, fields in forms.items():
        config = FinetuneConfig.build(
            {
                "model": {"path": str(source), "dtype": "bfloat16"},
                "objective": objective,
                "steps": 2,
                "batch_size": 4,
                "lora": {"r": 4, "experts": "all"},
                "optim": {"lr": 5e-3},
                "data": {"max_length": 64, "chat_template": "chatml"},
                "log": {"progress": "off"},
                "export": {"merged": False, "hf": False},  # the result holds the trained PEFT model
                **fields,
            }
        )
        result = finetune(config, tmp_path / form, records=records)
        factors = dict(result.model.named_parameters())
        expert_B = [n for n in factors if ".experts." in n and ".lora_B.default." in n]
        assert len(expert_B) == 2 * 3  # two MoE layers, gate, up and down
        for name in expert_B:
            ref = factors[name.replace(".default.", ".ref.")]
            assert not ref.requires_grad and not ref.any()  # frozen at the initial adapter (B = 0)
            assert factors[name].any()  # the policy trained
        metrics[form] = [r for r in result.metrics if "loss" in r]
        first = metrics[form][0]  # the policy is its reference, up to bf16 paths (autograd's and no_grad's)
        assert abs(first["rewards/chosen"]) < 1e-2 and abs(first["rewards/rejected"]) < 1e-2
    for mapped, copied in zip(metrics["mapped"], metrics["copied"], strict=True):
        assert mapped["loss"] == pytest.approx(copied["loss"], abs=1e-3)
        assert mapped["grad_norm"] == pytest.approx(copied["grad_norm"], rel=2e-2)
