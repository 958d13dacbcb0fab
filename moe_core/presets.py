"""Named model presets ``<family>-<size>``: plain data, importable without torch or transformers (the CLI
lists them in its help). `moe_core.config.get_config` builds an `MoEConfig` from them."""

from __future__ import annotations

from typing import Any

SIZES: dict[str, dict[str, int]] = {
    # hidden, layers, heads, kv heads, vocab, context
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
        max_position_embeddings=1024,
    ),
    "base": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
}


def family_settings(name: str, hidden: int, layers: int = 2, balance: str = "lab") -> dict[str, Any]:
    """Architecture choices of each family; widths scale with the hidden size (``layers``: the depth, for
    per-layer patterns such as gpt-oss's alternating attention). ``balance`` picks the load-balancing
    coefficient: the lab's (``"lab"``, healthy at any run length) or the family's paper's (``"paper"``);
    see `AUX_LOSS_COEF`."""
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r}: choose one of {BALANCES}")
    settings = _architecture(name, hidden, layers)
    if name in AUX_LOSS_COEF:
        settings["router_aux_loss_coef"] = AUX_LOSS_COEF[name][balance]
    return settings


def _architecture(name: str, hidden: int, layers: int) -> dict[str, Any]:
    if name == "switch":  # Fedus et al. 2021: top-1, capacity factor 1.25, ReLU/GELU FFN experts of width 4d
        # Embeddings N(0, 1) as in T5, which Switch builds on (mesh-tf; transformers' SwitchTransformers
        # `_init_weights`), not 0.02: with 0.02, the few Adam steps of warm-up write one direction shared by
        # all tokens that outgrows the token embeddings, the router input becomes 85-99% that common part
        # (measured at step 10 of the lifecycle run), its logits a per-expert offset for the whole batch, and
        # top-1 sends most of a batch to one expert: 20-60% of slots dropped at capacity 1.25 (issue 17).
        # Re-measured with the recipe's warm-up and aux 0.1 (switch-small, 150 steps, seed 0): std 1.0 val
        # loss 5.740, drops <= 3% per layer at step 150; 0.1: 5.882, 2-4%; 0.02: 6.276, 6-12% (33-67% at step
        # 20-50). The price is in long runs with Adam, whose absolute steps barely move a unit-scale table (T5
        # used Adafactor, whose steps are relative): switch-tiny, one pass over the built-in corpus (2,500
        # steps, three seeds), val ppl 59.44 at 0.02 against 67.65 at 1.0 (dense-active: 62.27 / 69.44), though
        # layer 0 then drops 5.8% of its slots (1.0: 0.5%); `embedding_init_std=None` (0.02) is the override
        # for such runs (benchmarks/README.md, "Session 7").
        # Multiplicative router jitter 1e-2: Switch's (and transformers') default. The router losses are summed
        # over MoE layers, each with its coefficient (mesh-tf's Switch/GShard layers each add coef * loss to
        # the total), not averaged: an average divides the pull toward balance by the number of MoE layers.
        # The aux coefficient: `AUX_LOSS_COEF` below (the paper's 0.01 is `balance="paper"`).
        return dict(
            num_experts=8,
            num_experts_per_tok=1,
            ffn_activation="gelu",
            expert_intermediate_size=4 * hidden,
            intermediate_size=4 * hidden,
            router="switch",
            capacity_factor=1.25,
            eval_capacity_factor=2.0,
            norm_topk_prob=False,
            router_z_loss_coef=0.001,
            router_jitter=0.01,
            embedding_init_std=1.0,
            router_loss_reduction="sum",
        )
    if name == "mixtral":  # Jiang et al. 2024: top-2 of 8 SwiGLU experts, top-k weights renormalized
        return dict(
            num_experts=8,
            num_experts_per_tok=2,
            ffn_activation="swiglu",
            expert_intermediate_size=2 * hidden,
            intermediate_size=4 * hidden,
            router="topk",
            norm_topk_prob=True,
            router_z_loss_coef=0.0,
        )
    if (
        name == "olmoe"
    ):  # Muennighoff et al. 2024: 64 fine-grained experts, top-8, qk-norm, no renormalization
        # Router losses as OLMoE trained them (OLMo + megablocks: moe_loss_weight 0.01, moe_zloss_weight 0.001,
        # megablocks' E * sum_e f_e P_e with f over the T*K slots, averaged over layers: our normalization and
        # "mean" reduction). At OLMoE's lr 4e-4 with ~2k warm-up steps that balances; in a short, hot run
        # (the lifecycle's 150 steps at lr 3e-3) it does not: with 64 experts the router probabilities stay
        # near uniform, so the LB loss reads ~1.1-1.3 while the busiest expert takes 3-5x the mean load and
        # experts die (issue 17). The lab's 0.1 (`AUX_LOSS_COEF`) roughly halves the skew and keeps experts
        # alive. With `router_loss_reduction="sum"` as well (4x the pull) a 300-step run reaches max/mean < 1.5
        # in every layer at a slightly better perplexity; the coarse families lose 5-11% to that
        # (benchmarks/README.md).
        return dict(
            num_experts=64,
            num_experts_per_tok=8,
            ffn_activation="swiglu",
            expert_intermediate_size=hidden // 2,
            intermediate_size=4 * hidden,
            router="topk",
            norm_topk_prob=False,
            qk_norm=True,
            router_z_loss_coef=0.001,
        )
    if name == "shared":  # Qwen2-MoE: fine-grained routed experts plus one always-on gated shared expert
        # Qwen2-MoE's aux coefficient (`AUX_LOSS_COEF`, `balance="paper"`) is, like OLMoE's, too weak to balance
        # a 150-step run at lr 3e-3, where the lab's 0.1 balances it (max/mean 1.2-1.5 per layer at step 150)
        return dict(
            num_experts=16,
            num_experts_per_tok=4,
            ffn_activation="swiglu",
            expert_intermediate_size=hidden // 2,
            intermediate_size=4 * hidden,
            router="topk",
            norm_topk_prob=False,
            num_shared_experts=1,
            shared_expert_intermediate_size=2 * hidden,
            shared_expert_gate=True,
            attention_bias=True,
        )
    if (
        name == "deepseek"
    ):  # DeepSeek-V3 (DeepSeek-AI 2024): MLA, sigmoid group-limited routing, shared expert
        # The V3 recipe at lab scale: the first layer dense (first_k_dense_replace=1, Moonlight's), 16
        # fine-grained experts in 4 groups, top-4 within the best 2 groups, one shared expert, weights
        # renormalized and scaled by 2.5 (V3's routed_scaling_factor); balanced by the aux-loss-free bias at
        # V3's update speed 0.001 (report §2.1.2), the load-balancing loss only reported. MLA widths follow V3's
        # proportions: per-head nope 2x the RoPE part, value as wide as nope, latent and q rank a fraction of D.
        nope = max(16, hidden // 8)
        return dict(
            attention_type="mla",
            q_lora_rank=hidden // 2,
            kv_lora_rank=hidden // 4,
            qk_nope_head_dim=nope,
            qk_rope_head_dim=nope // 2,
            v_head_dim=nope,
            num_experts=16,
            num_experts_per_tok=4,
            ffn_activation="swiglu",
            expert_intermediate_size=hidden // 2,
            intermediate_size=3 * hidden,
            dense_layers=[0],
            num_shared_experts=1,
            shared_expert_intermediate_size=hidden // 2,
            router="deepseek",
            router_score="sigmoid",
            norm_topk_prob=True,
            router_groups=4,
            router_topk_groups=2,
            router_group_score="top2_sum",
            routed_scaling_factor=2.5,
            router_bias_update_rate=0.001,
            router_z_loss_coef=0.0,
        )
    if name == "qwen3":  # Qwen3-MoE (Yang et al. 2025; transformers models/qwen3_moe): 128 fine-grained
        # experts, top-8 renormalized, no shared expert, per-head q/k RMSNorm, head_dim 2x hidden/heads and
        # expert width 3/8 hidden as Qwen3-30B-A3B (2048 hidden, 32 heads of 128, experts of 768).
        return dict(
            num_experts=128,
            num_experts_per_tok=8,
            ffn_activation="swiglu",
            expert_intermediate_size=3 * hidden // 8,
            intermediate_size=3 * hidden,
            router="topk",
            norm_topk_prob=True,
            qk_norm=True,
            qk_norm_per_head=True,
            router_z_loss_coef=0.0,
        )
    if name == "gptoss":
        # gpt-oss (OpenAI 2025; transformers models/gpt_oss): 32 experts top-4 (gpt-oss-20b),
        # expert width = hidden, softmax over the top-4 biased logits, biased experts with the clamped SwiGLU
        # (limit 7), biased q/k/v/o, attention sinks, sliding window of 128 on every other layer from the first,
        # YaRN RoPE (theta 150000, factor 32 over 4096 positions).
        return dict(
            num_experts=32,
            num_experts_per_tok=4,
            ffn_activation="swiglu",
            expert_intermediate_size=hidden,
            intermediate_size=hidden,
            router="topk",
            router_topk_order="topk_then_softmax",
            router_bias=True,
            expert_bias=True,
            swiglu_limit=7.0,
            attention_bias=True,
            o_proj_bias=True,
            attention_sinks=True,
            attention_window=128,
            attention_window_layers=list(range(0, layers, 2)),
            rope_theta=150000.0,
            rope_yarn=dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096),
            router_z_loss_coef=0.0,
        )
    if name == "glm4moe":
        # GLM-4.5-Air (GLM-4.5 Team 2025; transformers models/glm4_moe): DeepSeek-V3's routing on grouped-query
        # attention: the first layer dense, then fine-grained experts top-k on sigmoid scores with the
        # aux-loss-free selection bias (one group, renormalized, scaling 1.0 as Air) plus one ungated shared
        # expert as wide as a routed one; biased q/k/v, head_dim 2x hidden / heads (Air: 128 with 96 heads over
        # a 4096 hidden size), RoPE on the first half of each head (partial_rotary_factor 0.5), theta 1e6.
        # Balancing as GLM-4.5's report (§2.1: loss-free balance routing plus a 0.0001 sequence-level auxiliary
        # loss): the bias at DeepSeek-V3's update speed 0.001, the load-balancing loss at 0.0001
        heads = next((s["num_attention_heads"] for s in SIZES.values() if s["hidden_size"] == hidden), 4)
        return dict(
            head_dim=2 * hidden // heads,
            attention_bias=True,
            rope_partial_factor=0.5,
            rope_theta=1000000.0,
            num_experts=16,
            num_experts_per_tok=4,
            ffn_activation="swiglu",
            expert_intermediate_size=hidden // 2,
            intermediate_size=3 * hidden,
            dense_layers=[0],
            num_shared_experts=1,
            shared_expert_intermediate_size=hidden // 2,
            router="deepseek",
            router_score="sigmoid",
            norm_topk_prob=True,
            router_groups=1,
            router_topk_groups=1,
            router_group_score="top2_sum",
            routed_scaling_factor=1.0,
            router_bias_update_rate=0.001,
            router_z_loss_coef=0.0,
        )
    if name == "dense":
        return dict(num_experts=0, ffn_activation="swiglu", intermediate_size=4 * hidden)
    raise KeyError(name)


# The load-balancing loss coefficient of each family: the lab's default ("lab") and its paper's ("paper",
# `balance="paper"`, `--set model.balance=paper`). The papers' values are for runs of 10^4-10^6 steps at a low
# learning rate after thousands of warm-up steps; in the runs this lab is used for (150 to 2,500 steps at lr
# 3e-3) they balance too slowly: Switch layers drop 5-16% of their slots and fine-grained experts die (issue 17,
# issue 28 §2). 0.1 (with the warm-up a third of the run, `OptimSection.warmup_fraction`) is what the quality
# benchmark measured healthy and best for every loss-balanced family: switch-small at 150 steps, val loss
# 5.740 against 5.842 (0.01), 5.791 (0.03) and 5.854 (0.3), drops <= 3% per layer; at 2,500 steps (tiny, three
# seeds) max/mean 1.04-1.20 and no dead expert where 0.01 leaves 1.5-2.2 (benchmarks/README.md, "Training
# quality"). The coefficient is ours: E * sum_e f_e P_e per layer (1.0 balanced), transformers' `router_aux_
# loss_coef` is K times smaller (`moe_core.convert`). The bias-balanced families (deepseek, glm4moe) keep their
# paper's small sequence-level loss in both: the bias does the balancing.
AUX_LOSS_COEF: dict[str, dict[str, float]] = {
    "switch": {"lab": 0.1, "paper": 0.01},  # Fedus et al. 2022, §2.2: alpha = 10^-2
    "mixtral": {"lab": 0.1, "paper": 0.02},  # Mixtral-8x7B's published config.json (the paper names none)
    "olmoe": {
        "lab": 0.1,
        "paper": 0.01,
    },  # Muennighoff et al. 2024, §2 / Table 10: load-balancing weight 0.01
    "shared": {"lab": 0.1, "paper": 0.004},  # Qwen2-MoE's config 0.001 on transformers' scale, x K = 4
    "qwen3": {"lab": 0.1, "paper": 0.008},  # Qwen3-30B-A3B's config 0.001, x K = 8
    "gptoss": {"lab": 0.1, "paper": 0.004},  # gpt-oss-20b's config 0.001 (OpenAI 2025), x K = 4
    "deepseek": {"lab": 0.0001, "paper": 0.0001},  # DeepSeek-V3 report §2.1.2: sequence-wise alpha = 0.0001
    "glm4moe": {"lab": 0.0001, "paper": 0.0001},  # GLM-4.5 report §2.1: sequence-level loss weight 0.0001
}
BALANCES = ("lab", "paper")

FAMILIES = ("switch", "mixtral", "olmoe", "shared", "qwen3", "gptoss", "deepseek", "glm4moe", "dense")
PRESETS = tuple(f"{family}-{size}" for family in FAMILIES for size in SIZES)
