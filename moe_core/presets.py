"""Named model presets ``<family>-<size>``: plain data, importable without torch or transformers (the CLI
lists them in its help). `moe_core.config.get_config` builds an `MoEConfig` from them."""

from __future__ import annotations

from typing import Any

SIZES: dict[str, dict[str, int]] = {
    # hidden, layers, heads, kv heads, vocab, context
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512, max_position_embeddings=256),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=8000, max_position_embeddings=1024),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 vocab_size=32000, max_position_embeddings=4096),
}


def family_settings(name: str, hidden: int) -> dict[str, Any]:
    """Architecture choices of each family; widths scale with the hidden size."""
    if name == "switch":  # Fedus et al. 2021: top-1, capacity factor 1.25, ReLU/GELU FFN experts of width 4d
        return dict(num_experts=8, num_experts_per_tok=1, ffn_activation="gelu", expert_intermediate_size=4 * hidden,
                    intermediate_size=4 * hidden, router="switch", capacity_factor=1.25, eval_capacity_factor=2.0,
                    norm_topk_prob=False, router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    if name == "mixtral":  # Jiang et al. 2024: top-2 of 8 SwiGLU experts, top-k weights renormalized
        return dict(num_experts=8, num_experts_per_tok=2, ffn_activation="swiglu",
                    expert_intermediate_size=2 * hidden, intermediate_size=4 * hidden, router="topk",
                    norm_topk_prob=True, router_aux_loss_coef=0.02, router_z_loss_coef=0.0)
    if name == "olmoe":  # Muennighoff et al. 2024: 64 fine-grained experts, top-8, qk-norm, no renormalization
        return dict(num_experts=64, num_experts_per_tok=8, ffn_activation="swiglu",
                    expert_intermediate_size=hidden // 2, intermediate_size=4 * hidden, router="topk",
                    norm_topk_prob=False, qk_norm=True, router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    if name == "shared":  # Qwen2-MoE: fine-grained routed experts plus one always-on gated shared expert
        return dict(num_experts=16, num_experts_per_tok=4, ffn_activation="swiglu",
                    expert_intermediate_size=hidden // 2, intermediate_size=4 * hidden, router="topk",
                    norm_topk_prob=False, num_shared_experts=1, shared_expert_intermediate_size=2 * hidden,
                    shared_expert_gate=True, attention_bias=True, router_aux_loss_coef=0.001)
    if name == "dense":
        return dict(num_experts=0, ffn_activation="swiglu", intermediate_size=4 * hidden)
    raise KeyError(name)


FAMILIES = ("switch", "mixtral", "olmoe", "shared", "dense")
PRESETS = tuple(f"{family}-{size}" for family in FAMILIES for size in SIZES)
