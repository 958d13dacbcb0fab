"""Loss and perplexity: token-weighted over the split, checked by hand with a model of fixed predictions."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moe_core import MoEForCausalLM, get_config
from moe_core.eval.perplexity import EvaluationError, comparison_table, evaluate_loss, model_row, to_markdown


class FixedDistributionLM(nn.Module):
    """Predicts the same next-token distribution at every position."""

    def __init__(self, probs: list[float]) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=len(probs))
        self.anchor = nn.Parameter(torch.zeros(1))
        self.register_buffer("logp_V", torch.tensor(probs).log())

    def forward(self, input_ids, use_cache=False, **kwargs):
        return SimpleNamespace(logits=self.logp_V.expand(*input_ids.shape, -1))


def test_perplexity_weighs_every_token_the_same():
    model = FixedDistributionLM([0.5, 0.25, 0.25])
    batches = [torch.tensor([[0, 0, 0]]), torch.tensor([[0, 1, 1, 1, 1]])]  # 2 tokens at ln 2, 4 at ln 4
    result = evaluate_loss(model, batches, split="hand")
    assert result.tokens == 6 and result.sequences == 2
    assert result.loss == pytest.approx((2 * math.log(2) + 4 * math.log(4)) / 6)
    assert result.perplexity == pytest.approx(2 ** (10 / 6))  # a mean of batch means would give 2 ** 1.5
    assert result.bits_per_token == pytest.approx(10 / 6)
    assert evaluate_loss(model, batches, max_batches=1).loss == pytest.approx(math.log(2))


def test_matches_the_models_own_loss_and_keeps_mode():
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("mixtral-tiny"))
    model.train()
    ids_BS = torch.randint(0, 512, (2, 12))
    result = evaluate_loss(model, [ids_BS])
    assert model.training
    model.eval()
    with torch.no_grad():
        assert result.loss == pytest.approx(float(model(ids_BS, labels=ids_BS).lm_loss), rel=1e-5)


def test_errors_name_the_problem():
    model = FixedDistributionLM([0.5, 0.5])
    with pytest.raises(EvaluationError, match="vocab_size 2"):
        evaluate_loss(model, [torch.tensor([[0, 5]])])
    with pytest.raises(EvaluationError, match="no token to predict"):
        evaluate_loss(model, [], split="empty")


def test_comparison_table_against_dense_baselines():
    from moe_core.config import dense_baseline
    from moe_core.eval.perplexity import LossResult

    moe = get_config("mixtral-tiny")
    rows = [
        model_row("moe", moe, {"validation": LossResult("validation", math.log(20.0), 100, 2)}),
        model_row(
            "dense-total",
            dense_baseline(moe, "total"),
            {"validation": LossResult("validation", math.log(25.0), 100, 2)},
        ),
    ]
    table = comparison_table(rows, reference="dense-total")
    assert list(table["validation_ppl"]) == pytest.approx([20.0, 25.0])
    assert list(table["validation_ppl_ratio"]) == pytest.approx([0.8, 1.0])
    assert table.loc[0, "params_active"] < table.loc[1, "params_active"]
    assert table.loc[0, "experts"] == "2/8" and table.loc[1, "experts"] == "dense"
    markdown = to_markdown(table)
    assert markdown.splitlines()[0].startswith("| model | experts |") and "| moe | 2/8 |" in markdown
    with pytest.raises(EvaluationError, match="reference"):
        comparison_table(rows, reference="nope")


def test_one_perplexity_for_training_and_evaluation(tmp_path):
    """Training's validation perplexity clamped at exp(50) while evaluation gave exp(loss) up to inf: one
    function now serves both."""
    import math

    from moe_core.eval.perplexity import LossResult, perplexity
    from moe_core.train import loop

    assert perplexity(60.0) == math.exp(60.0)  # the trainer's clamp gave exp(50)
    assert perplexity(800.0) == float("inf")
    assert LossResult("eval", 60.0, 1, 1).perplexity == perplexity(60.0)
    assert loop.perplexity is perplexity


def test_a_comparison_says_how_many_tokens_each_model_trained_on(tmp_path):
    """The README once compared an MoE trained 300 steps with a dense model trained 50: the table now shows
    the tokens behind each model and a comparison of unequal budgets warns."""
    from moe_core.eval.perplexity import unequal_training
    from moe_core.train import TrainConfig, train
    from moe_core.train.checkpoint import tokens_trained

    def run(steps, out):
        config = TrainConfig.build(
            {
                "model": {"preset": "switch-tiny"},
                "steps": steps,
                "batch_size": 2,
                "data": {"source": "synthetic", "seq_len": 16, "synthetic_blocks": 32},
                "log": {"every": 1, "progress": "off"},
                "checkpoint": {"every": steps},
                "eval": {"batches": 1},
            }
        )
        return train(config, out)

    short, long = run(1, tmp_path / "short"), run(3, tmp_path / "long")
    assert tokens_trained(tmp_path / "long") == long.tokens == 3 * 2 * 16
    assert tokens_trained(long.export_dir) == long.tokens  # a run's final/ model: its run's tokens
    assert tokens_trained(long.checkpoint) == long.tokens
    assert tokens_trained(tmp_path) is None
    rows = [
        {"model": "moe", "tokens_trained": long.tokens},
        {"model": "dense", "tokens_trained": short.tokens},
    ]
    assert "moe 96, dense 32" in unequal_training(rows)
    assert unequal_training([rows[0], {**rows[1], "tokens_trained": long.tokens}]) is None
    assert unequal_training([rows[0], {"model": "hub", "tokens_trained": None}]) is None  # unknown: no claim
