"""FLOPs per token from the model config: the one FLOPs model of the lab (training MFU, evaluation tables,
cost reports), by component.

A matmul of an [n, m] weight costs ``2 * n * m`` FLOPs per token in the forward pass (Kaplan et al. 2020);
training costs 3x the forward (backward = 2x forward). Per token:

- attention projections: ``2 * D * Hd * (2H + 2G)`` per layer (q, o: H heads; k, v: G kv heads);
- attention scores: ``2 * 2 * S_l * H * Hd`` per layer (QK^T and AV over the S_l keys a query sees, not
  halved for causality, as PaLM appendix B counts it): S_l = S in a full-attention layer, min(S, window) in a
  sliding-window one (gpt-oss's ``attention_window`` layers; `attended_keys`);
- dense FFN layers: ``2 * ffn_params``; MoE layers: router ``2 * D * E``, routed experts
  ``2 * K * expert_params`` active (``2 * E * expert_params`` if every expert ran on every token: the
  ``total`` column, what the dense-equal-total model pays), shared experts and their gate;
- LM head ``2 * D * V`` (the input embedding is a lookup).

Norm weights, biases, softmax, RoPE and the expert-dispatch bookkeeping are elementwise work and left out. So
``training_active = 6 * N + 12 * H * Hd * sum_l S_l`` (``12 * L * H * Hd * S`` without windows) with N the weights
a token is multiplied through (PaLM, Chowdhery et al. 2022, appendix B; N is `moe_core.config.parameter_counts`'
active count without the input embedding, norms and biases).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moe_core.config import MoEConfig, ffn_params, mla_attention_params

# dense bf16 peak FLOP/s per device (vendor datasheets, without sparsity)
PEAK_FLOPS_BF16 = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
}


@dataclass(frozen=True)
class FlopsBreakdown:
    """Forward FLOPs per token by component (see the module docstring)."""

    attention_proj: float
    attention_scores: float
    dense_ffn: float
    router: float
    experts_active: float
    experts_total: float  # every routed expert on every token
    shared_experts: float
    lm_head: float
    seq_len: int

    @property
    def attention(self) -> float:
        return self.attention_proj + self.attention_scores

    @property
    def experts(self) -> float:
        """Active routed + shared expert FLOPs (the MoE FFN part of the forward)."""
        return self.experts_active + self.shared_experts

    @property
    def forward_active(self) -> float:
        return (
            self.attention
            + self.dense_ffn
            + self.router
            + self.experts_active
            + self.shared_experts
            + self.lm_head
        )

    @property
    def forward_total(self) -> float:
        return (
            self.attention
            + self.dense_ffn
            + self.router
            + self.experts_total
            + self.shared_experts
            + self.lm_head
        )

    @property
    def training_active(self) -> float:
        """Training FLOPs per token (forward + backward): what the trainer's throughput and MFU count."""
        return 3.0 * self.forward_active

    def to_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "attention": self.attention,
            "experts": self.experts,
            "forward_active": self.forward_active,
            "forward_total": self.forward_total,
            "training_active": self.training_active,
        }


def flops_per_token(config: MoEConfig, seq_len: int) -> FlopsBreakdown:
    """Forward FLOPs per token of ``config`` at context length ``seq_len``, by component."""
    if seq_len < 1:
        raise ValueError(f"flops_per_token: seq_len={seq_len} must be >= 1")
    D, H, G, Hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    L = config.num_hidden_layers
    moe_layers = len(config.moe_layer_ids)
    dense_layers = L - moe_layers
    expert = ffn_params(config, config.expert_intermediate_size) if moe_layers else 0
    shared = 0
    if moe_layers and config.num_shared_experts:
        shared = config.num_shared_experts * ffn_params(config, config.shared_expert_intermediate_size)
        shared += D if config.shared_expert_gate else 0
    attention_proj = 2.0 * D * Hd * (2 * H + 2 * G) * L
    attention_scores = 2.0 * 2 * H * Hd * attended_keys(config, seq_len)
    if getattr(config, "attention_type", "mha") == "mla":
        attention_proj, attention_scores = mla_flops(config, seq_len)
    return FlopsBreakdown(
        attention_proj=attention_proj,
        attention_scores=attention_scores,
        dense_ffn=2.0 * ffn_params(config, config.intermediate_size) * dense_layers,
        router=2.0 * D * config.num_experts * moe_layers,
        experts_active=2.0 * config.num_experts_per_tok * expert * moe_layers,
        experts_total=2.0 * config.num_experts * expert * moe_layers,
        shared_experts=2.0 * shared * moe_layers,
        lm_head=2.0 * D * config.vocab_size,
        seq_len=seq_len,
    )


def attended_keys(config: MoEConfig, seq_len: int) -> int:
    """Keys one query attends to at context length ``seq_len``, summed over the layers: ``seq_len`` in a
    full-attention layer, at most ``attention_window`` in a sliding-window one (`MoEConfig.is_window_layer`;
    the model's `window_mask_for`). Multi-head latent attention has no window (`MultiHeadLatentAttention`)."""
    if getattr(config, "attention_type", "mha") == "mla":
        return seq_len * config.num_hidden_layers
    window = getattr(config, "attention_window", None)
    return sum(
        min(seq_len, window) if config.is_window_layer(i) else seq_len
        for i in range(config.num_hidden_layers)
    )


def mla_flops(config: MoEConfig, seq_len: int) -> tuple[float, float]:
    """Multi-head latent attention's projection and score FLOPs per token (`moe_core.model.
    MultiHeadLatentAttention`): every projection's weights once per token (kv_b_proj expands each token's latent
    once in a forward; its two RMSNorms are elementwise), and q.k over the nope + RoPE widths plus the weighted
    sum over the value width."""
    L, H = config.num_hidden_layers, config.num_attention_heads
    norms = config.kv_lora_rank + (config.q_lora_rank or 0)
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    scores = 2.0 * attended_keys(config, seq_len) * H * (qk + config.v_head_dim)
    return 2.0 * (mla_attention_params(config) - norms) * L, scores


def peak_flops(device_name: str | None) -> float | None:
    """A known accelerator's bf16 peak by name (e.g. ``torch.cuda.get_device_name()``), else None."""
    if not device_name:
        return None
    for key, value in PEAK_FLOPS_BF16.items():
        if key in device_name.upper():
            return value
    return None
