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
