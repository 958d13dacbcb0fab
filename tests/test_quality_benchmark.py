"""benchmarks/quality.py's arms and arithmetic, without training: every arm builds the model it names at
every preset size (an arm whose overrides no longer build would fail only an hour into the full run), the
pairs compare a MoE with a dense model of equal active parameters, and the margins table is right."""

from argparse import Namespace

import pytest

from moe_core.config import parameter_counts
from tests.bench_helpers import load_benchmark


@pytest.fixture(scope="module")
def quality():
    return load_benchmark("quality")


def _args(size="tiny"):
    return Namespace(
        size=size, seq=128, max_documents=2000, vocab=2000, steps=2500, batch=8, eval_batches=16, cache=None
    )


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_every_arm_builds_its_model(quality, size):
    for arm in quality.ARMS:
        config = quality.train_config(arm, _args(size), seed=0, source="builtin")
        model = config.model.build_config()
        assert model.hidden_size == quality.SIZES[size]["hidden_size"], arm
        assert (model.num_experts == 0) == (quality.ARMS[arm][2] is not None), arm
        assert config.steps == 2500 and config.optim.warmup(config.steps) == 2500 // 3


def test_switch_comparison_uses_the_long_run_embedding_init(quality):
    for arm in ("switch-0.02", "dense-active-0.02", "dense-total-0.02"):
        model = quality.train_config(arm, _args(), seed=0, source="builtin").model.build_config()
        assert model.embedding_init_std is None, arm  # the 0.02 init
    for arm in ("switch", "dense-active"):  # the preset as it is: its N(0, 1) table, for routing health
        model = quality.train_config(arm, _args(), seed=0, source="builtin").model.build_config()
        assert model.embedding_init_std == 1.0, arm
    assert {"switch-0.02", "dense-active-0.02"} <= set(quality.SEEDED)


def test_margin_pairs_have_equal_active_parameters(quality):
    for moe, dense in quality.MARGINS:
        configs = [
            quality.train_config(arm, _args(), 0, "builtin").model.build_config() for arm in (moe, dense)
        ]
        routers = configs[0].num_experts * configs[0].hidden_size * configs[0].num_hidden_layers
        active = [parameter_counts(c)["active"] for c in configs]
        assert quality.ARMS[dense][2] == "active"
        assert active[0] - routers == active[1], (moe, dense, active)  # equal but for the routers' E x d


def test_pair_margins_per_seed_and_on_the_means(quality):
    rows = [
        {"arm": "olmoe", "seed": 0, "val_ppl": 47.5},
        {"arm": "dense-olmoe", "seed": 0, "val_ppl": 50.0},
        {"arm": "olmoe", "seed": 1, "val_ppl": 52.0},
        {"arm": "dense-olmoe", "seed": 1, "val_ppl": 50.0},
        {"arm": "switch", "seed": 0, "val_ppl": 60.0},  # its dense model did not run: no pair
    ]
    table = quality.summarize([dict(r, params_active=1, params_total=1) for r in rows])
    margins = quality.pair_margins(rows, table)
    assert list(margins) == ["olmoe vs dense-olmoe"]
    assert margins["olmoe vs dense-olmoe"]["per_seed"] == [0.05, -0.04]
    assert margins["olmoe vs dense-olmoe"]["mean"] == pytest.approx(1 - 49.75 / 50.0, abs=1e-4)
