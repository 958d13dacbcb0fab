"""Cost accounting: FLOPs per token and money, checked against numbers computed by hand on a tiny config."""

from __future__ import annotations

import json

import pytest
import torch

from moe_core import MoEConfig, MoEForCausalLM
from moe_core.analytics.cost import (
    CostError,
    PriceTable,
    TrainingUsage,
    cost_per_million_tokens,
    cost_report,
    measure_throughput,
    training_cost,
    usage_from_events,
)
from moe_core.flops import flops_per_token

S = 16


def tiny(**overrides) -> MoEConfig:
    # layer 0 dense (width 5), layer 1 MoE: 4 experts of width 3, top-2; D=8, H=2, G=1, Hd=4, V=10
    return MoEConfig(
        vocab_size=10,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=5,
        num_experts=4,
        num_experts_per_tok=2,
        expert_intermediate_size=3,
        moe_every_n=2,
        ffn_activation="swiglu",
        max_position_embeddings=S,
        **overrides,
    )


def test_flops_by_component():
    f = flops_per_token(tiny(), S)
    assert f.attention_proj == 2 * 8 * 4 * (2 * 2 + 2 * 1) * 2 == 768
    assert f.attention_scores == 2 * 2 * S * 2 * 4 * 2 == 1024
    assert f.dense_ffn == 2 * (3 * 8 * 5) * 1 == 240
    assert f.router == 2 * 8 * 4 == 64
    assert f.experts_active == 2 * 2 * (3 * 8 * 3) == 288
    assert f.experts_total == 2 * 4 * (3 * 8 * 3) == 576
    assert f.lm_head == 2 * 8 * 10 == 160
    assert f.forward_active == 768 + 1024 + 240 + 64 + 288 + 160 == 2544
    assert f.forward_total == 2544 - 288 + 576
    assert f.training_active == 3 * 2544


def test_money_by_hand():
    prices = PriceTable({"testgpu": 3.6})
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)  # 3.6 $/h over 3.6M tokens/h
    report = cost_report(tiny(), tokens_per_s=1000.0, device="testgpu", seq_len=S, prices=prices)
    assert report.usd_per_million_tokens == pytest.approx(1.0)
    assert report.expert_activations_per_token == 2  # K=2 on one MoE layer
    assert report.usd_per_million_expert_activations == pytest.approx(1.0 * 288 / 2544 / 2)
    dense_total = 768 + 1024 + 2 * (2 * 3 * 8 * 12) + 160  # both layers dense, width 4 experts * 3
    assert report.dense_total_flops_per_token == dense_total == 3104
    assert report.flop_saving == pytest.approx(1 - 2544 / 3104)
    assert report.dense_total_usd_per_million_tokens == pytest.approx(3104 / 2544)
    with_drops = cost_report(tiny(), 1000.0, "testgpu", S, prices, drop_rate=0.5)
    assert with_drops.expert_activations_per_token == 1.0
    assert "saving vs dense-equal-total" in report.to_markdown()
    json.dumps(report.to_dict())


def test_training_cost_to_date(tmp_path):
    usage = TrainingUsage(tokens=1_000_000, wall_seconds=7200, device="testgpu", num_devices=2)
    cost = training_cost(usage, tiny(), S, PriceTable({"testgpu": 3.6}))
    assert cost.device_hours == pytest.approx(4.0)
    assert cost.usd == pytest.approx(14.4)
    assert cost.usd_per_million_tokens == pytest.approx(14.4)
    assert cost.flops == pytest.approx(1e6 * 3 * 2544)
    events = tmp_path / "metrics.jsonl"
    events.write_text(
        '{"step": 1, "time": 100.0, "tokens": 1000.0, "loss": 5.0}\n'
        '{"step": 2, "time": 160.0, "tokens": 3000.0}\n{"step": 2, "time": 161.0}\n'
    )
    from_events = usage_from_events(events, "cpu")
    assert (from_events.tokens, from_events.wall_seconds) == (3000, pytest.approx(61.0))
    events.write_text('{"step": 1}\n')
    with pytest.raises(CostError, match="no rows"):
        usage_from_events(events, "cpu")


def test_price_table(tmp_path):
    prices = PriceTable()
    assert prices.price("NVIDIA H100 80GB HBM3") == prices.price("h100") == 4.0  # documented default
    with pytest.raises(CostError, match="no price for device 'tpu-v9'"):
        prices.price("tpu-v9")
    path = tmp_path / "prices.json"
    path.write_text('{"H100": 2.0, "tpu-v9": 9.0}')
    custom = PriceTable.from_file(path)
    assert (custom.price("h100"), custom.price("tpu-v9"), custom.price("cpu")) == (2.0, 9.0, 0.4)
    with pytest.raises(ValueError, match="usd_per_hour"):
        PriceTable({"x": -1.0})
    with pytest.raises(CostError, match="positive"):
        cost_per_million_tokens(1.0, 0.0)


def test_measured_throughput_counts_tokens_and_keeps_mode():
    torch.manual_seed(0)
    # "sorted": torch._grouped_mm on CPU rejects this config's 3-wide experts (rows not 16-byte aligned)
    model = MoEForCausalLM(tiny(expert_impl="sorted"))
    model.train()
    result = measure_throughput(model, batch_size=2, seq_len=8, steps=2, warmup=0)
    assert result.tokens == 2 * 8 * 2 and result.tokens_per_s > 0 and result.device == "cpu"
    assert model.training
