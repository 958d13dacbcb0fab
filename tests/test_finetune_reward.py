"""objective=reward: a reward head on the MoE backbone trained through TRL's RewardTrainer with the router losses
in its objective; it learns a rule that holds on held-out pairs, saves, loads as kind "reward" (merged and
adapter), and `moe-lab eval --preferences` reports its pairwise accuracy."""

import json
import math
import random

import pytest
import torch
from safetensors import safe_open

from moe_core import load
from moe_core.data.errors import DataError
from moe_core.finetune import FinetuneConfig, FinetuneError, finetune
from moe_core.finetune.objectives import reward_pair_ids
from moe_core.reward_model import MoEForSequenceClassification, pairwise_accuracy, reward_model_from
from tests.finetune_helpers import ANIMALS, COLORS, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def rule_pairs() -> tuple[list[dict], list[dict]]:
    """The rule: asked for the color, the answer naming the color is preferred to the one naming the animal.
    64 (color, animal) prompts, shuffled: 40 to train on, 24 held out (combinations never seen in training)."""
    pairs = [
        {
            "prompt": f"Name the color in: the {c} {a}.",
            "chosen": f"The color is {c}.",
            "rejected": f"The animal is {a}.",
        }
        for c in COLORS
        for a in ANIMALS
    ]
    random.Random(0).shuffle(pairs)
    return pairs[:40], pairs[40:]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_reward_of_a_padded_sequence_is_that_of_the_sequence_alone():
    """The score is read at the last real token: padding (right or left) changes nothing (reference: each
    sequence on its own, no mask)."""
    model = reward_model_from(tiny_model()).eval()
    seqs = [[5, 9, 14, 3, 7], [11, 4]]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=torch.tensor([s])).logits for s in seqs])
        for side in ("right", "left"):
            ids = torch.zeros(2, 5, dtype=torch.long)
            mask = torch.zeros(2, 5, dtype=torch.long)
            for b, s in enumerate(seqs):
                where = slice(0, len(s)) if side == "right" else slice(5 - len(s), 5)
                ids[b, where], mask[b, where] = torch.tensor(s), 1
            # left padding shifts positions; RoPE is relative, so only padding on the right is exact
            batched = model(input_ids=ids, attention_mask=mask).logits
            torch.testing.assert_close(batched, alone, atol=1e-5 if side == "right" else 1e-4, rtol=0)


def test_reward_model_learns_a_rule_that_holds_on_held_out_pairs(tmp_path, capsys):
    train, held_out = rule_pairs()
    tokenizer = tiny_tokenizer()
    model = tiny_model(router_aux_loss_coef=0.05, router_z_loss_coef=0.01)
    config = FinetuneConfig.build(
        {
            "objective": "reward",
            "method": "full",
            "steps": 20,
            "batch_size": 8,
            "optim": {"lr": 3e-3},
            "log": {"progress": "off"},
        }
    )
    pairs = reward_pair_ids(tokenizer, held_out)
    before = pairwise_accuracy(reward_model_from(tiny_model()), pairs)["pairwise_accuracy"]
    result = finetune(config, tmp_path / "rm", model=model, tokenizer=tokenizer, records=train)

    assert isinstance(result.model, MoEForSequenceClassification)
    held = pairwise_accuracy(result.model, pairs)
    assert before < 0.6 and held["pairwise_accuracy"] > 0.9 and held["mean_margin"] > 0

    rows = [r for r in result.metrics if "aux_loss" in r]
    assert len(rows) == 20 and all(r["aux_loss"] > 0.5 and r["z_loss"] > 0 for r in rows)
    first = rows[
        0
    ]  # small rewards at step 1: -log sigmoid(m) = log 2 - m/2 + O(m^2); the rest is the router's
    pairwise = math.log(2) - first["margin"] / 2
    assert first["loss"] == pytest.approx(
        pairwise + 0.05 * first["aux_loss"] + 0.01 * first["z_loss"], abs=2e-3
    )
    assert rows[-1]["accuracy"] == 1.0 and "moe/layer_0/entropy" in rows[-1]  # routing telemetry

    loaded = load(tmp_path / "rm")  # the fine-tuning directory: its merged/ reward model
    assert loaded.kind == "finetuned" and isinstance(loaded.model, MoEForSequenceClassification)
    assert load(tmp_path / "rm" / "merged").kind == "reward"
    assert pairwise_accuracy(loaded.model, pairs) == pytest.approx(held)

    from moe_core.cli import main

    held_file = write_jsonl(tmp_path / "held_out.jsonl", held_out)
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(tmp_path / "rm"), "--preferences", held_file, "--out", str(out)]) == 0
    report = json.loads((out / "eval.json").read_text())["preferences"]
    assert report["pairs"] == 24 and report["pairwise_accuracy"] == pytest.approx(held["pairwise_accuracy"])
    capsys.readouterr()


def test_reward_lora_trains_the_head_and_the_adapter_loads_as_a_reward_model(tmp_path):
    train, held_out = rule_pairs()
    tokenizer = tiny_tokenizer()
    base_dir = tmp_path / "base"
    tiny_model().save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    config = FinetuneConfig.build(
        {
            "model": {"path": str(base_dir)},
            "objective": "reward",
            "method": "lora",
            "steps": 4,
            "batch_size": 8,
            "optim": {"lr": 1e-2},
            "log": {"progress": "off"},
        }
    )
    result = finetune(config, tmp_path / "rm", records=train)
    pairs = reward_pair_ids(tokenizer, held_out)
    from_adapter = load(result.adapter_dir)  # base + adapter + its score head
    assert from_adapter.kind == "adapter" and isinstance(from_adapter.model, MoEForSequenceClassification)
    expected = pairwise_accuracy(result.model, pairs)
    assert pairwise_accuracy(from_adapter.model, pairs) == pytest.approx(expected)
    with safe_open(result.adapter_dir / "adapter_model.safetensors", "pt") as f:
        assert [k for k in f.keys() if "score" in k] == ["base_model.model.score.weight"]  # the head, in full


def test_preference_data_without_rejected_is_refused_before_the_model_loads(tmp_path):
    rows = [{"prompt": "Name the color in: the red cat.", "chosen": "The color is red."}] * 4
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    config = FinetuneConfig.build(
        {"objective": "reward", "model": {"path": str(tmp_path / "not-loaded")}, "data": {"source": data}}
    )
    with pytest.raises(DataError, match=r"pairs.jsonl: missing column\(s\) \['rejected'\]"):
        finetune(config, tmp_path / "out", tokenizer=tiny_tokenizer())
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_reward_refuses_an_hf_export():
    with pytest.raises(FinetuneError, match="objective=reward writes a reward model"):
        FinetuneConfig.build({"objective": "reward", "export": {"hf": True}})
    with pytest.raises(FinetuneError, match="batch_size to 2 or more"):
        FinetuneConfig.build({"objective": "kto", "batch_size": 1})
