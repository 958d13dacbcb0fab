"""objective=orpo (TRL's trl.experimental.orpo) and objective=kto (TRL's KTOTrainer) with DPO's guarantees: the
router losses in the loss and logged, routing telemetry, non-finite steps skipped and counted, nothing written by
a run that diverged; KTO data (prompt/completion/label) refused with the file and row named before the model
loads."""

import json
import math
import re
import shlex
import shutil
from pathlib import Path

import pytest

from moe_core import load
from moe_core.data.errors import DataError
from moe_core.finetune import FinetuneConfig, FinetuneDivergedError, finetune
from moe_core.finetune.objectives import MoEKTOTrainer, MoEORPOTrainer
from moe_core.train.telemetry import read_jsonl
from tests.finetune_helpers import preference_records, tiny_model, tiny_tokenizer
from tests.test_finetune_dpo import completion_logps

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

REPO = Path(__file__).resolve().parents[1]
AUX, Z = 0.05, 0.01  # the tiny models' router-loss coefficients here


def kto_records(n: int = 8) -> list[dict]:
    """Unpaired feedback from the preference rows: each chosen answer desirable, each rejected one not."""
    rows = []
    for r in preference_records(n):
        rows.append({"prompt": r["prompt"], "completion": r["chosen"], "label": True})
        rows.append({"prompt": r["prompt"], "completion": r["rejected"], "label": False})
    return rows


def records_for(objective: str):
    return kto_records(8) if objective == "kto" else preference_records(8)


def config_for(objective: str, **fields) -> FinetuneConfig:
    base = {
        "objective": objective,
        "method": "full",
        "steps": 8,
        "batch_size": 4,
        "optim": {"lr": 1e-2},
        "export": {"merged": False},
        "log": {"progress": "off"},
    }
    base.update(fields)
    return FinetuneConfig.build(base)


@pytest.mark.parametrize("objective,method", [("orpo", "full"), ("kto", "full"), ("kto", "lora")])
def test_the_router_losses_are_in_the_objective_and_the_preference_is_learned(tmp_path, objective, method):
    tokenizer = tiny_tokenizer()
    records = preference_records(8)
    model = tiny_model(router_aux_loss_coef=AUX, router_z_loss_coef=Z)
    before = completion_logps(model, tokenizer, records, "chosen") - completion_logps(
        model, tokenizer, records, "rejected"
    )
    config = config_for(objective, method=method, **({"optim": {"lr": 3e-2}} if method == "lora" else {}))
    result = finetune(config, tmp_path, model=model, tokenizer=tokenizer, records=records_for(objective))

    rows = [r for r in result.metrics if "train_runtime" not in r]
    assert len(rows) == 8 and all(r["aux_loss"] > 0.5 and r["z_loss"] > 0 for r in rows)
    assert all("moe/layer_0/entropy" in r for r in rows)  # routing telemetry
    first = rows[0]
    router = AUX * first["aux_loss"] + Z * first["z_loss"]
    if objective == "orpo":  # ORPO: NLL of the chosen answer - beta * log sigmoid(log odds ratio)
        assert first["loss"] == pytest.approx(
            first["nll_loss"] - 0.1 * first["log_odds_ratio"] + router, abs=2e-4
        )
    else:  # KTO at step 1: policy == reference, so every example's loss is 1 - sigmoid(0) = 0.5 (and KL = 0)
        assert first["kl"] == 0.0 and first["loss"] == pytest.approx(0.5 + router, abs=2e-4)

    trained = result.model
    after = completion_logps(trained, tokenizer, records, "chosen") - completion_logps(
        trained, tokenizer, records, "rejected"
    )
    assert (after - before).mean() > 0.5  # the chosen answers gained on the rejected ones
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["skipped_steps"] == 0 and summary["steps_done"] == 8


@pytest.mark.parametrize("trainer_cls,objective", [(MoEORPOTrainer, "orpo"), (MoEKTOTrainer, "kto")])
def test_a_non_finite_step_is_skipped_and_counted(tmp_path, monkeypatch, trainer_cls, objective):
    original = trainer_cls.compute_loss
    calls = []

    def poisoned(self, model, inputs, *args, **kwargs):
        loss = original(self, model, inputs, *args, **kwargs)
        calls.append(1)
        return loss * float("nan") if len(calls) == 2 else loss

    monkeypatch.setattr(trainer_cls, "compute_loss", poisoned)
    config = config_for(objective, steps=4)
    result = finetune(
        config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(), records=records_for(objective)
    )
    assert result.skipped_steps == 1 and result.summary["skipped_steps"] == 1
    rows = [row for row in read_jsonl(tmp_path / "metrics.jsonl") if "train_runtime" not in row]
    assert [row.get("skipped_steps") for row in rows] == [0.0, 1.0, 1.0, 1.0]
    assert "loss" not in rows[1]  # no stand-in loss for the skipped step
    assert all(math.isfinite(row["loss"]) for row in rows if "loss" in row)


@pytest.mark.parametrize("objective", ["orpo", "kto"])
def test_a_diverging_run_writes_nothing(tmp_path, objective):
    (tmp_path / "mlflow_run.json").write_text("{}")  # what a caller put there first
    config = config_for(objective, steps=4, optim={"lr": 1e30, "grad_clip": None})
    with pytest.raises(FinetuneDivergedError, match="non-finite loss or gradient.*nothing written"):
        finetune(
            config, tmp_path, model=tiny_model(), tokenizer=tiny_tokenizer(), records=records_for(objective)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow_run.json"]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"prompt": "p", "completion": "c"}] * 3, r"kto.jsonl: missing column\(s\) \['label'\]"),
        (
            [{"prompt": "p", "completion": "c", "label": True}] * 2 + [{"prompt": "p", "completion": "c"}],
            r"kto.jsonl: row 3: label is missing \(null\); KTO data needs label true",
        ),
        (
            [{"prompt": "p", "completion": "c", "label": "yes"}] * 2,
            r"kto.jsonl: row 1: label is 'yes'",
        ),
    ],
)
def test_kto_data_without_labels_is_refused_before_the_model_loads(tmp_path, rows, message):
    data = write_jsonl(tmp_path / "kto.jsonl", rows)
    config = config_for("kto", model={"path": str(tmp_path / "not-loaded")}, data={"source": data})
    with pytest.raises(DataError, match=message):
        finetune(config, tmp_path / "out", tokenizer=tiny_tokenizer())
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"prompt": "p", "chosen": "c"}] * 2, r"pairs.jsonl: missing column\(s\) \['rejected'\]"),
        (
            [
                {"prompt": "p", "chosen": "c", "rejected": "r"},
                {"prompt": "p", "chosen": "c", "rejected": None},
            ],
            r"pairs.jsonl: row 2: rejected is empty",
        ),
    ],
)
def test_orpo_data_without_rejected_is_refused_before_the_model_loads(tmp_path, rows, message):
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    config = config_for("orpo", model={"path": str(tmp_path / "not-loaded")}, data={"source": data})
    with pytest.raises(DataError, match=message):
        finetune(config, tmp_path / "out", tokenizer=tiny_tokenizer())
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def alignment_commands() -> list[str]:
    """The README's `moe-lab` lines of its "Alignment objectives" block."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Alignment objectives") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.startswith("moe-lab ")]


def test_the_readme_alignment_commands_run_on_the_bundled_data(tmp_path, monkeypatch, capsys):
    """Each objective from the command line (`--set objective=...`) on examples/, with a tiny base in place of the
    pretraining's runs/a/final, and the reward model's held-out accuracy from `moe-lab eval`."""
    from moe_core.cli import main

    shutil.copytree(REPO / "examples", tmp_path / "examples")
    base = tmp_path / "runs" / "a" / "final"
    tiny_model().save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    monkeypatch.chdir(tmp_path)
    commands = alignment_commands()
    objectives = [c.split("objective=")[1].split()[0] for c in commands if "objective=" in c]
    assert objectives == ["dpo", "orpo", "kto", "reward"]
    for command in commands:
        argv = shlex.split(command)[1:]
        if argv[0] == "finetune":
            argv += ["--set", "steps=2", "--set", "log.progress=off"]
        assert main(argv) == 0, command
    assert all(
        (tmp_path / "runs" / name / "summary.json").is_file() for name in ("ft-dpo", "ft-orpo", "ft-kto")
    )
    assert load(tmp_path / "runs" / "rm").kind == "finetuned"
    report = json.loads((tmp_path / "runs" / "rm-eval" / "eval.json").read_text())["preferences"]
    assert report["pairs"] == 16 and 0.0 <= report["pairwise_accuracy"] <= 1.0
    capsys.readouterr()


@pytest.mark.parametrize("objective", ["sft", "dpo", "orpo", "kto", "reward"])
def test_the_finetune_flow_takes_every_objective(objective):
    from flows.finetune import FinetuneFlowParams

    params = FinetuneFlowParams.model_validate(
        {"config": {"objective": objective}, "base_model_dir": "runs/a/final"}
    )
    assert params.config.objective == objective
