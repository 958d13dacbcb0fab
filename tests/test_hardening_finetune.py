"""Fine-tuning under bad settings and reused folders: non-finite steps are skipped and counted, a diverged model is
never written, a failed run leaves nothing, an earlier run's outputs are not overwritten unless asked, one writer
per output directory."""

import json
import math

import pytest
import torch

from moe_core.fileio import OutputLock, OutputLockedError
from moe_core.finetune import FinetuneConfig, FinetuneDivergedError, FinetuneError, finetune
from moe_core.finetune.objectives import MoESFTTrainer
from moe_core.train import read_jsonl
from tests.finetune_helpers import instruction_records, preference_records, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def small(**fields):
    base = {
        "method": "full",
        "steps": 4,
        "batch_size": 2,
        "export": {"merged": True},
        "log": {"routing": False},
    }
    base.update(fields)
    return FinetuneConfig.build(base)


@pytest.mark.parametrize(
    "objective,steps", [("sft", 4), ("sft", 9), ("dpo", 4)]
)  # 9: stops at the streak limit
def test_a_diverging_fine_tune_writes_nothing_and_says_why(tmp_path, tokenizer, objective, steps):
    (tmp_path / "mlflow_run.json").write_text("{}")  # what a caller (the Prefect task) put there first
    config = small(steps=steps, objective=objective, optim={"lr": 1e30, "grad_clip": None})
    records = instruction_records(8) if objective == "sft" else preference_records(8)
    with pytest.raises(FinetuneDivergedError, match="non-finite loss or gradient.*nothing written"):
        finetune(config, tmp_path, model=tiny_model(), tokenizer=tokenizer, records=records)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow_run.json"]  # no config, metrics or weights


def test_a_non_finite_step_is_skipped_and_counted_and_the_loss_is_true(tmp_path, tokenizer, monkeypatch):
    original = MoESFTTrainer.compute_loss
    calls = []

    def poisoned(self, model, inputs, *args, **kwargs):
        loss = original(self, model, inputs, *args, **kwargs)
        calls.append(1)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setattr(MoESFTTrainer, "compute_loss", poisoned)
    model = tiny_model()
    result = finetune(small(), tmp_path, model=model, tokenizer=tokenizer, records=instruction_records(8))
    assert result.skipped_steps == 1 and result.summary["skipped_steps"] == 1
    rows = [row for row in read_jsonl(tmp_path / "metrics.jsonl") if "train_runtime" not in row]
    assert [row.get("skipped_steps") for row in rows] == [0.0, 1.0, 1.0, 1.0]
    assert (
        "loss" not in rows[1]
    )  # the skipped step has no stand-in loss (Trainer logged 0.0 or a mean before)
    assert all(isinstance(row["loss"], float) and math.isfinite(row["loss"]) for row in rows if "loss" in row)
    assert math.isfinite(result.last_step_loss) and result.final_loss == pytest.approx(rows[-1]["loss"])
    merged = result.merged_dir / "model.safetensors"
    assert merged.is_file() and all(torch.isfinite(p).all() for p in result.model.parameters())


def test_fine_tune_output_folders_follow_the_training_rules(tmp_path, tokenizer):
    config = small(steps=1)
    first = finetune(
        config, tmp_path, model=tiny_model(), tokenizer=tokenizer, records=instruction_records(4)
    )
    assert first.merged_dir == tmp_path / "merged" and (tmp_path / "summary.json").is_file()
    assert not list(tmp_path.glob(".staging*"))
    with pytest.raises(FinetuneError, match="already holds outputs of an earlier run .*--overwrite"):
        finetune(config, tmp_path, model=tiny_model(), tokenizer=tokenizer, records=instruction_records(4))
    lora = small(steps=1, method="lora")
    finetune(
        lora,
        tmp_path,
        model=tiny_model(),
        tokenizer=tokenizer,
        records=instruction_records(4),
        overwrite=True,
    )
    assert json.loads((tmp_path / "finetune_config.json").read_text())["method"] == "lora"
    assert (tmp_path / "adapter").is_dir()

    with OutputLock(tmp_path / "busy", "fine-tuning run"):  # another writer holds the folder
        with pytest.raises(OutputLockedError, match="in use by another fine-tuning run"):
            finetune(
                config,
                tmp_path / "busy",
                model=tiny_model(),
                tokenizer=tokenizer,
                records=instruction_records(4),
            )
    assert not (tmp_path / "busy").exists()


def test_the_finite_check_after_training_reads_what_trained_and_the_merge_check_reads_all():
    """After training only the trainable parameters and the buffers can have changed: the check reads those (a
    frozen memory-mapped base would otherwise be paged in whole); a merged model's every weight changed."""
    import torch

    from moe_core.finetune.run import check_finite_weights

    model = torch.nn.Linear(4, 4)
    model.register_buffer("expert_bias", torch.zeros(4))
    model.weight.requires_grad_(False)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")  # frozen: training cannot have made it
    check_finite_weights(model, "fine-tuned model", trained_only=True)
    with pytest.raises(
        FinetuneDivergedError, match=r"merged model: 1 tensors hold non-finite values \(first: weight\)"
    ):
        check_finite_weights(model, "merged model")
    for tensor, name in ((model.bias, "bias"), (model.expert_bias, "expert_bias")):
        with torch.no_grad():
            tensor[1] = float("inf")
        with pytest.raises(FinetuneDivergedError, match=rf"first: {name}"):
            check_finite_weights(model, "fine-tuned model", trained_only=True)
        with torch.no_grad():
            tensor[1] = 0.0
