"""One FLOPs model (`moe_core.flops`): its weights are the ones `parameter_counts` counts, and the trainer's
throughput and MFU count its training total. (Component numbers by hand: tests/test_analytics_cost.py.)"""

from __future__ import annotations

import pytest

from moe_core.config import get_config, parameter_counts
from moe_core.flops import flops_per_token, peak_flops
from moe_core.presets import PRESETS
from moe_core.train import TrainConfig
from moe_core.train.loop import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

S = 64
VARIANTS = [(name, {}) for name in sorted(PRESETS) if name.endswith("-tiny")] + [
    ("mixtral-tiny", {"tie_word_embeddings": True}),
    ("mixtral-tiny", {"attention_bias": True, "qk_norm": True}),
    ("shared-tiny", {"shared_expert_gate": True}),
    ("switch-tiny", {"ffn_activation": "gelu"}),
]


def elementwise_params(config, column: str = "total") -> int:
    """Norm weights and biases: parameters a token is not multiplied through (no matmul FLOPs); ``column``
    "active" counts the expert biases of the K experts a token passes through (gpt-oss), "total" of all E."""
    layers = config.num_hidden_layers
    count = 2 * config.hidden_size * layers + config.hidden_size  # two RMSNorms per layer, the final one
    H, G, Hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if config.attention_bias:
        count += Hd * (H + 2 * G) * layers
    if config.qk_norm and config.qk_norm_per_head:  # Qwen3: one head_dim weight each for q and k
        count += 2 * Hd * layers
    elif config.qk_norm:
        count += Hd * (H + G) * layers
    if config.attention_type == "mla":  # its latent's RMSNorm and the q bottleneck's
        count += (config.kv_lora_rank + (config.q_lora_rank or 0)) * layers
    if config.o_proj_bias:  # gpt-oss
        count += config.hidden_size * layers
    if config.attention_sinks:  # gpt-oss: one logit per head
        count += H * layers
    moe_layers = len(config.moe_layer_ids)
    if config.router_bias:
        count += config.num_experts * moe_layers
    if config.expert_bias:
        experts = config.num_experts_per_tok if column == "active" else config.num_experts
        count += experts * (2 * config.expert_intermediate_size + config.hidden_size) * moe_layers
    return count


@pytest.mark.parametrize("name, overrides", VARIANTS)
def test_flops_are_two_per_weight_of_parameter_counts(name, overrides):
    """Forward FLOPs = 2 x the weights a token passes through (+ attention scores): the same weights
    `parameter_counts` counts, less the input embedding (a lookup; with tied embeddings it is the LM head)."""
    config = get_config(name, **overrides)
    counts, flops = parameter_counts(config), flops_per_token(config, S)
    lookup = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    for column, forward in (("active", flops.forward_active), ("total", flops.forward_total)):
        weights = counts[column] - elementwise_params(config, column) - lookup
        assert forward - flops.attention_scores == 2 * weights, column
    # q.k over the query/key width, then the weighted sum over the value width (the same width, but in MLA)
    qk, v = config.head_dim, config.head_dim
    if config.attention_type == "mla":
        qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    assert flops.attention_scores == 2 * S * config.num_attention_heads * (qk + v) * config.num_hidden_layers
    assert flops.training_active == 3 * flops.forward_active


def test_the_trainer_counts_the_breakdowns_training_total(tmp_path):
    config = TrainConfig.build(
        {
            "model": {"preset": "mixtral-tiny"},
            "steps": 1,
            "batch_size": 4,
            "data": {"source": "synthetic", "seq_len": 32, "synthetic_blocks": 16},
            "log": {"progress": "off"},
        }
    )
    trainer = Trainer(config, tmp_path)
    assert trainer.flops_per_token == flops_per_token(trainer.model_config, 32).training_active


def test_peak_flops_by_device_name():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("cpu") is None and peak_flops(None) is None
