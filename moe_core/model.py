"""The MoE decoder: one model for Switch, Mixtral, OLMoE, Qwen2-MoE-style shared experts and dense baselines.

Architecture choices (each a field of `MoEConfig`):
- Pre-norm decoder with RMSNorm (Zhang & Sennrich 2019) and rotary position embeddings (Su et al. 2021), over
  the whole head or its first part only (``rope_partial_factor``; GLM-4.5, GLM-4.5 Team 2025).
- Grouped-query attention (Ainslie et al. 2023) through `F.scaled_dot_product_attention`; optional qk-norm
  over the whole q and k projections (OLMoE, Muennighoff et al. 2024) or per head (Qwen3, Yang et al. 2025),
  q/k/v bias (Qwen2-MoE), q/k/v clip.
  Or multi-head latent attention (``attention_type="mla"``; DeepSeek-V2, DeepSeek-AI 2024, §2.1): keys and
  values from a low-rank latent plus one decoupled RoPE key shared by the heads; the cache holds the latent.
- FFN: SwiGLU (Shazeer 2020) or GELU; every `moe_every_n`-th layer a Mixture of Experts (Shazeer et al. 2017;
  GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021; Mixtral, Jiang et al. 2024; OLMoE)
  with a pluggable router (`moe_core.routing`, incl. Expert Choice, Zhou et al. 2022, and DeepSeek-V3's
  auxiliary-loss-free bias) and optional shared experts (Qwen2-MoE; DeepSeekMoE, Dai et al. 2024).
- Loss: next-token cross-entropy plus the router losses (`moe_core.router_losses`: load balancing and z-loss
  over the non-padding tokens, weighed by `router_loss`, the one place every trainer takes them from), added
  whenever labels are given and a coefficient is above zero (so they can never be silently off during
  fine-tuning). ``lm_loss`` is reported separately for perplexity, ``aux_loss`` and ``z_loss`` as layer means
  (1.0 = uniform). The router losses are training signals: in eval mode under ``torch.no_grad()``
  (generation, evaluation, analytics) they are not computed.

Legend: B = batch, S = sequence (query) length, L = key length, D = model dim, H = heads, G = kv heads,
Hd = head dim, T = B*S tokens, V = vocab.

A `transformers` `PreTrainedModel` with `GenerationMixin`: ``save_pretrained`` (safetensors),
``from_pretrained``, ``generate`` with a KV cache, PEFT and TRL work on it; importing this module registers
``model_type="moe_lab"`` with the Auto classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.utils import ModelOutput

from moe_core.config import MoEConfig
from moe_core.experts import GroupedExperts, ffn_act
from moe_core.quiet import quiet_deepspeed_cpu_notice
from moe_core.router_losses import LoadBalance, RouterLosses, layer_losses, router_loss
from moe_core.routing import RoutingRecord, build_router


# ------------------------------------------------------------------------------------------------ pieces
class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back (as Llama/Mixtral/OLMoE do in transformers)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def yarn_frequencies(
    inv_freq_h: torch.Tensor, head_dim: int, theta: float, yarn: dict
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of LLMs", §3.2-3.4): the inverse
    frequencies blended between extrapolation (high frequencies, kept) and interpolation (low frequencies,
    divided by ``factor``) by a linear ramp over the dimensions whose wavelength completes between ``beta_fast``
    and ``beta_slow`` rotations in ``original_max_position_embeddings``; and the attention factor that scales
    cos and sin (sqrt(1/t) = 0.1 ln(s) + 1, or DeepSeek-V2's mscale / mscale_all_dim ratio). As transformers
    5.24 ``modeling_rope_utils._compute_yarn_parameters`` (gpt-oss, DeepSeek-V2/V3)."""
    factor = float(yarn["factor"])
    original = yarn["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        if yarn.get("mscale") and yarn.get("mscale_all_dim"):
            attention_factor = mscale(factor, yarn["mscale"]) / mscale(factor, yarn["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (as upstream: no zero-width ramp)
    ramp_h = (torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq_h.device) - low) / (high - low)
    extrapolate_h = 1 - ramp_h.clamp(0, 1)  # 1: keep the frequency, 0: interpolate it
    inv_freq_h = (inv_freq_h / factor) * (1 - extrapolate_h) + inv_freq_h * extrapolate_h
    return inv_freq_h, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """RoPE; with ``yarn`` (`MoEConfig.rope_yarn`) YaRN's frequencies and attention factor (`yarn_frequencies`)."""

    def __init__(self, head_dim: int, theta: float, yarn: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.yarn = head_dim, theta, yarn
        self.attention_factor = 1.0  # multiplies cos and sin (YaRN's sqrt(1/t))
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self, device: torch.device | None = None) -> torch.Tensor:
        exponents = (
            torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        )
        inv_freq_h = 1.0 / (self.theta**exponents)
        if self.yarn is not None:
            inv_freq_h, self.attention_factor = yarn_frequencies(
                inv_freq_h, self.head_dim, self.theta, self.yarn
            )
        return inv_freq_h

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute what no checkpoint holds (see `materialize`)."""
        self.inv_freq.copy_(self.frequencies(self.inv_freq.device))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs_BSh = position_ids_BS[..., None].float() * self.inv_freq.float()
            emb_BSHd = torch.cat((freqs_BSh, freqs_BSh), dim=-1)
            if self.attention_factor != 1.0:
                cos, sin = emb_BSHd.cos() * self.attention_factor, emb_BSHd.sin() * self.attention_factor
                return cos.to(x.dtype), sin.to(x.dtype)
            return emb_BSHd.cos().to(x.dtype), emb_BSHd.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q_BHSHd, k_BGSHd, cos_BSHd, sin_BSHd):
    cos, sin = cos_BSHd[:, None], sin_BSHd[:, None]
    return q_BHSHd * cos + rotate_half(q_BHSHd) * sin, k_BGSHd * cos + rotate_half(k_BGSHd) * sin


def apply_partial_rope(q_BHSHd, k_BGSHd, cos_BSR, sin_BSR):
    """RoPE on the first R dims of each head (R = cos's width, `MoEConfig.rotary_dim`), the other Hd - R passed
    through: GLM-4.5's partial rotary embeddings (transformers 5.24 ``models/glm4_moe/modeling_glm4_moe.py``
    ``apply_rotary_pos_emb``: rotate-half within those R dims, not interleaved pairs)."""
    R = cos_BSR.shape[-1]
    q_rot, k_rot = apply_rope(q_BHSHd[..., :R], k_BGSHd[..., :R], cos_BSR, sin_BSR)
    return torch.cat([q_rot, q_BHSHd[..., R:]], dim=-1), torch.cat([k_rot, k_BGSHd[..., R:]], dim=-1)


class FeedForward(nn.Module):
    """Dense FFN (also the shared expert): SwiGLU ``down(silu(gate x) * up x)`` or GELU ``down(gelu(up x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.activation = activation
        self.gate_proj = (
            nn.Linear(hidden_size, intermediate_size, bias=False) if activation == "swiglu" else None
        )
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h_gate = self.gate_proj(x) if self.gate_proj is not None else None
        return self.down_proj(ffn_act(self.activation, h_gate, self.up_proj(x)))


# ------------------------------------------------------------------------------------------------ attention
class Attention(nn.Module):
    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.clip_qkv = config.clip_qkv
        self.dropout = config.attention_dropout
        # GLM-4.5: RoPE on the first rotary_dim dims of each head only (`apply_partial_rope`)
        self.partial_rope = config.rotary_dim < config.head_dim
        D, Hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(D, self.num_heads * Hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * Hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * Hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * Hd, D, bias=getattr(config, "o_proj_bias", False))
        # gpt-oss (modeling_gpt_oss.py, eager_attention_forward): one learned logit per head joins each row's
        # softmax, so a query may put weight on "nothing"; initialized like the other weights (_init_weights)
        self.sinks = (
            nn.Parameter(torch.empty(self.num_heads)) if getattr(config, "attention_sinks", False) else None
        )
        self.window = config.attention_window if config.is_window_layer(layer_idx) else None
        self.qk_norm_per_head = config.qk_norm and getattr(config, "qk_norm_per_head", False)
        # Qwen3-MoE (modeling_qwen3_moe.py): RMSNorm over each head's Hd, before RoPE
        if self.qk_norm_per_head:
            self.q_norm = RMSNorm(Hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(Hd, config.rms_norm_eps)
        elif config.qk_norm:  # OLMoE: one RMSNorm over all heads' q (and k), before RoPE
            self.q_norm = RMSNorm(self.num_heads * Hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * Hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x_BSD, cos_sin, mask_BqL, cache: Cache | None):
        B, S, _ = x_BSD.shape
        q, k, v = self.q_proj(x_BSD), self.k_proj(x_BSD), self.v_proj(x_BSD)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q_BSHHd = q.view(B, S, self.num_heads, self.head_dim)
        k_BSGHd = k.view(B, S, self.num_kv_heads, self.head_dim)
        if self.qk_norm_per_head:
            q_BSHHd, k_BSGHd = self.q_norm(q_BSHHd), self.k_norm(k_BSGHd)
        q_BHSHd = q_BSHHd.transpose(1, 2)
        k_BGSHd = k_BSGHd.transpose(1, 2)
        v_BGSHd = v.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        rope = apply_partial_rope if self.partial_rope else apply_rope
        q_BHSHd, k_BGSHd = rope(q_BHSHd, k_BGSHd, *cos_sin)
        if cache is not None:  # (each cache layer keeps its own write position, transformers 5)
            k_BGSHd, v_BGSHd = cache.update(k_BGSHd, v_BGSHd, self.layer_idx)
        if self.num_kv_heads != self.num_heads:  # GQA: each kv head serves H/G query heads
            repeat = self.num_heads // self.num_kv_heads
            k_BGSHd = k_BGSHd.repeat_interleave(repeat, dim=1)
            v_BGSHd = v_BGSHd.repeat_interleave(repeat, dim=1)
        if self.sinks is not None:
            out_BHSHd = attention_with_sinks(
                q_BHSHd, k_BGSHd, v_BGSHd, mask_BqL, self.sinks, self.dropout, self.training
            )
            return self.o_proj(out_BHSHd.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))
        out_BHSHd = F.scaled_dot_product_attention(
            q_BHSHd,
            k_BGSHd,
            v_BGSHd,
            attn_mask=mask_BqL,
            # a Python bool: with a symbolic S (torch.compile / torch.export dynamic shapes) ``S > 1`` is a
            # SymBool, which SDPA rejects; branching on it makes the tracer guard on it instead
            is_causal=True if mask_BqL is None and S > 1 else False,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.o_proj(out_BHSHd.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))


def apply_rope_interleaved(q_BHSR, k_B1SR, cos_BSR, sin_BSR):
    """RoPE on interleaved pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout; transformers'
    ``apply_rotary_pos_emb_interleave`` in ``models/deepseek_v3/modeling_deepseek_v3.py``, and V2's complex
    product): the rotated pair i comes out at positions i and R/2 + i, as HF writes it, so q and k agree."""
    cos, sin = (
        cos_BSR[..., : cos_BSR.shape[-1] // 2][:, None],
        sin_BSR[..., : sin_BSR.shape[-1] // 2][:, None],
    )

    def rotate(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    return rotate(q_BHSR), rotate(k_B1SR)


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 §2.1, DeepSeek-V3 §2.1.1; transformers 5.24
    ``models/deepseek_v3/modeling_deepseek_v3.py`` ``DeepseekV3Attention``, same names and weights).

    Legend (besides the file's): R = kv_lora_rank (the latent), Rq = q_lora_rank, N = qk_nope_head_dim,
    P = qk_rope_head_dim (the decoupled RoPE part, one key shared by all heads), Dv = v_head_dim.

    q = q_b(RMSNorm(q_a(x))) (or q_proj(x) when q_lora_rank is None), split per head into [N | P];
    [c | k_pe] = kv_a_proj_with_mqa(x), c normalized (kv_a_layernorm): the cache stores c and the rotated k_pe
    only, R + P numbers per token and layer instead of H * (N + P + Dv), and every step expands them through
    kv_b_proj into per-head k_nope [N] and v [Dv]. Softmax scale (N + P) ** -0.5 (YaRN's mscale is not here:
    YaRN is refused on conversion until the shared RotaryEmbedding has it).
    """

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.interleave = config.rope_interleave
        self.window = None  # every MLA layer attends to the whole past (no sliding window)
        self.dropout = config.attention_dropout
        self.scale = (self.nope + self.rope) ** -0.5
        yarn = config.rope_yarn or {}
        if yarn.get(
            "mscale_all_dim"
        ):  # YaRN's 0.1 ln(s) + 1 on the softmax too, squared (DeepSeek-V2 §2.1.3 and
            # transformers' DeepseekV3Attention; the RoPE's attention factor is mscale / mscale_all_dim of it)
            m = 0.1 * yarn["mscale_all_dim"] * math.log(yarn["factor"]) + 1.0 if yarn["factor"] > 1 else 1.0
            self.scale = self.scale * m * m
        D, H, Rq = config.hidden_size, self.num_heads, config.q_lora_rank
        if Rq is None:
            self.q_proj = nn.Linear(D, H * (self.nope + self.rope), bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(D, Rq, bias=False)
            self.q_a_layernorm = RMSNorm(Rq)  # eps 1e-6 as HF's (not rms_norm_eps)
            self.q_b_proj = nn.Linear(Rq, H * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)

    def forward(self, x_BSD, cos_sin, mask_BqL, cache: Cache | None):
        B, S, _ = x_BSD.shape
        H = self.num_heads
        q = (
            self.q_proj(x_BSD)
            if self.q_proj is not None
            else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD)))
        )
        q_BHSQ = q.view(B, S, H, self.nope + self.rope).transpose(1, 2)
        q_nope_BHSN, q_pe_BHSP = q_BHSQ.split([self.nope, self.rope], dim=-1)
        latent_BSR, k_pe_BSP = self.kv_a_proj_with_mqa(x_BSD).split([self.kv_rank, self.rope], dim=-1)
        # both viewed as one-head 4D tensors, so a transformers cache layer stores them as its "keys"/"values"
        latent_B1SR = self.kv_a_layernorm(latent_BSR).view(B, 1, S, self.kv_rank)
        k_pe_B1SP = k_pe_BSP.reshape(B, 1, S, self.rope)
        if self.interleave:
            q_pe_BHSP, k_pe_B1SP = apply_rope_interleaved(q_pe_BHSP, k_pe_B1SP, *cos_sin)
        else:
            q_pe_BHSP, k_pe_B1SP = apply_rope(q_pe_BHSP, k_pe_B1SP, *cos_sin)
        if cache is not None:  # MLA's point: the compressed latent and the shared RoPE key are what is cached
            latent_B1SR, k_pe_B1SP = cache.update(latent_B1SR, k_pe_B1SP, self.layer_idx)
        L = latent_B1SR.shape[2]
        kv_BHLK = self.kv_b_proj(latent_B1SR[:, 0]).view(B, L, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope_BHLN, v_BHLV = kv_BHLK.split([self.nope, self.v_dim], dim=-1)
        k_BHLQ = torch.cat([k_nope_BHLN, k_pe_B1SP.expand(B, H, L, self.rope)], dim=-1)
        q_BHSQ = torch.cat([q_nope_BHSN, q_pe_BHSP], dim=-1)
        out_BHSV = F.scaled_dot_product_attention(
            q_BHSQ,
            k_BHLQ,
            v_BHLV,
            attn_mask=mask_BqL,
            is_causal=True if mask_BqL is None and S > 1 else False,  # (a Python bool: see `Attention`)
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
        )
        return self.o_proj(out_BHSV.transpose(1, 2).reshape(B, S, H * self.v_dim))


def attention_with_sinks(q_BHSHd, k_BHLHd, v_BHLHd, mask_BqL, sinks_H, dropout: float, training: bool):
    """Softmax attention whose every row also holds the head's sink logit (gpt-oss; transformers 5.24
    ``models/gpt_oss/modeling_gpt_oss.py`` eager_attention_forward): ``softmax([q k^T / sqrt(Hd), sink_h])``
    with the sink's column dropped, so the row's weights sum to less than one. Computed eagerly ([B, H, S, L]
    scores): SDPA has no place for the extra logit. ``mask_BqL``: True = attend, None = causal."""
    S, L = q_BHSHd.shape[-2], k_BHLHd.shape[-2]
    scores_BHSL = torch.matmul(q_BHSHd, k_BHLHd.transpose(2, 3)) * q_BHSHd.shape[-1] ** -0.5
    if mask_BqL is None:  # plain causal: query s (the last S of L positions) sees keys up to L - S + s
        mask_BqL = torch.ones(S, L, dtype=torch.bool, device=q_BHSHd.device).tril(L - S)[None, None]
    scores_BHSL = scores_BHSL.masked_fill(~mask_BqL, torch.finfo(scores_BHSL.dtype).min)
    sinks_BHS1 = sinks_H.to(scores_BHSL.dtype).reshape(1, -1, 1, 1).expand(*scores_BHSL.shape[:-1], 1)
    combined = torch.cat([scores_BHSL, sinks_BHS1], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values  # (as upstream, for bf16's range)
    probs_BHSL = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    probs_BHSL = F.dropout(probs_BHSL, p=dropout, training=training).to(v_BHLHd.dtype)
    return torch.matmul(probs_BHSL, v_BHLHd)


# ------------------------------------------------------------------------------------------------ MoE block
class MoEBlock(nn.Module):
    """Router -> experts (-> plus shared experts). Returns the output and the layer's `RoutingRecord`."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.router = build_router(config)
        self.router.gate.is_router_gate = True  # its initialization is the Switch one (_init_weights)
        self.experts = GroupedExperts(
            config.num_experts,
            config.hidden_size,
            config.expert_intermediate_size,
            config.ffn_activation,
            config.expert_impl,
            bias=config.expert_bias,
            swiglu_limit=config.swiglu_limit,
            swiglu_alpha=config.swiglu_alpha,
        )
        self.shared_expert = None
        self.shared_expert_gate = None
        if config.num_shared_experts > 0:  # shared experts fused into one wide FFN (DeepSeekMoE)
            width = config.num_shared_experts * config.shared_expert_intermediate_size
            self.shared_expert = FeedForward(config.hidden_size, width, config.ffn_activation)
            if config.shared_expert_gate:  # Qwen2-MoE: sigmoid(w . x) scales the shared expert
                self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(
        self, x_BSD: torch.Tensor, expert_impl: str | None = None
    ) -> tuple[torch.Tensor, RoutingRecord]:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        record = self.router(x_TD)
        y_TD = self.experts(x_TD, record, impl=expert_impl)
        if self.shared_expert is not None:
            shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            y_TD = y_TD + shared_TD
        return y_TD.view(B, S, D), record


# ------------------------------------------------------------------------------------------------ decoder
class DecoderLayer(nn.Module):
    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_moe = config.is_moe_layer(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        attention_cls = MultiHeadLatentAttention if config.attention_type == "mla" else Attention
        self.self_attn = attention_cls(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_moe:
            self.mlp = MoEBlock(config)
        else:
            self.mlp = FeedForward(config.hidden_size, config.intermediate_size, config.ffn_activation)

    def forward(self, h_BSD, cos_sin, mask_BqL, cache, expert_impl=None):
        h_BSD = h_BSD + self.self_attn(self.input_layernorm(h_BSD), cos_sin, mask_BqL, cache)
        x_BSD = self.post_attention_layernorm(h_BSD)
        if self.is_moe:
            y_BSD, record = self.mlp(x_BSD, expert_impl)
        else:
            y_BSD, record = self.mlp(x_BSD), None
        return h_BSD + y_BSD, record


def attention_mask_for(attention_mask_BL, cache_position_S, key_len: int, query_len: int):
    """Boolean [B, 1, S, L] mask (True = attend) for SDPA, or None when plain causal attention is exact.

    Rows whose every key is masked (left padding) attend everywhere instead: their outputs are never used,
    and an all-masked row would turn into NaN that 0-weights cannot cancel.
    """
    if attention_mask_BL is None and query_len == key_len:
        return None
    if (
        attention_mask_BL is not None
        and query_len == key_len
        and not torch.compiler.is_compiling()
        and bool(attention_mask_BL.all())
    ):  # (a compiled graph cannot branch on data: it keeps the mask)
        return None
    key_pos_L = torch.arange(key_len, device=cache_position_S.device)
    allowed_BqL = (key_pos_L[None, :] <= cache_position_S[:, None])[None, None]
    if attention_mask_BL is not None:
        allowed_BqL = allowed_BqL & padding_mask_for(attention_mask_BL, 0, key_len)[:, None, None, :]
    return allowed_BqL | ~allowed_BqL.any(dim=-1, keepdim=True)


def padding_mask_for(attention_mask_BL, key_offset: int, key_len: int):
    """Boolean [B, L] (True = a real token) for the L keys from cache position ``key_offset`` on. A mask shorter
    than the keys (transformers' ``generate`` on a StaticCache passes the tokens so far, the cache holds
    max_cache_len slots) counts the slots past it as real: they lie in the future, which the causal part masks."""
    padding_BL = attention_mask_BL[:, key_offset : key_offset + key_len].bool()
    missing = key_len - padding_BL.shape[-1]
    return F.pad(padding_BL, (0, missing), value=True) if missing > 0 else padding_BL


def window_mask_for(attention_mask_BL, cache_position_S, key_len: int, window: int, key_offset: int = 0):
    """Boolean [B, 1, S, L] mask (True = attend) of causal attention over the last ``window`` keys, the query's own
    included (gpt-oss's sliding layers; transformers' masking_utils.sliding_window_overlay: k > q - window). Rows
    with no key left attend everywhere instead, as in `attention_mask_for`.

    The L keys are those the layer's cache hands back, from cache position ``key_offset`` on: a sliding cache
    layer (transformers' DynamicSlidingWindowLayer) keeps only the last window - 1, so its keys start later than
    a full layer's (``Cache.get_mask_sizes(S, layer) -> (key_len, key_offset)``, as masking_utils reads it)."""
    key_pos_L = torch.arange(key_len, device=cache_position_S.device) + key_offset
    query_pos_S1 = cache_position_S[:, None]
    allowed_BqL = ((key_pos_L[None, :] <= query_pos_S1) & (key_pos_L[None, :] > query_pos_S1 - window))[
        None, None
    ]
    if attention_mask_BL is not None:
        allowed_BqL = allowed_BqL & padding_mask_for(attention_mask_BL, key_offset, key_len)[:, None, None, :]
    return allowed_BqL | ~allowed_BqL.any(dim=-1, keepdim=True)


# ------------------------------------------------------------------------------------------------ model
@dataclass
class MoECausalLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None  # transformers 5's name (4.x: past_key_values)
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None  # layer mean of the load-balancing loss (reported)
    z_loss: torch.Tensor | None = None  # layer mean of the z-loss (reported)
    router_loss: torch.Tensor | None = None  # what the router losses add to the objective (`router_loss`)
    router_losses: RouterLosses | None = None  # per layer
    routing: tuple[RoutingRecord, ...] | None = None


class MoEPreTrainedModel(PreTrainedModel):
    config_class = MoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True
    _supports_cache_class = True
    # the aux-loss-free selection bias is fp32 whatever the dtype (`moe_core.routing.AuxLossFreeRouter` keeps it so
    # through every cast); declared to transformers' loader too, as DeepSeek-V3 declares e_score_correction_bias
    _keep_in_fp32_modules_strict = ["expert_bias"]

    def save_pretrained(self, *args, **kwargs):
        # transformers unwraps the model through accelerate, which imports DeepSpeed where it is installed: its
        # CPU-accelerator notice is noise for a model that never saw DeepSpeed (`moe_core.quiet`)
        with quiet_deepspeed_cpu_notice():
            return super().save_pretrained(*args, **kwargs)

    def _apply(self, fn, recurse: bool = True):
        """`nn.Module._apply` (``.to(device)``, ``.cuda()``, ...); then a memory-mapped base (`moe_core.mapped`)
        moved wholly off the CPU drops its checkpoint reader (``mapped_from``): no tensor is a view of the files
        any more, and keeping their mappings left every page the copy read in the process's resident set (the
        H100's OLMoE-1B-7B LoRA child: 13.4 of its 15.2 GiB peak were file pages, all of it on the GPU)."""
        out = super()._apply(fn, recurse)
        if getattr(self, "mapped_from", None) is not None and all(
            t.device.type != "cpu" for t in (*self.parameters(), *self.buffers())
        ):
            self.mapped_from = None
        return out

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if hasattr(module, "reset_buffers"):
            # what no checkpoint holds (non-persistent buffers: RoPE frequencies, a router's pending load):
            # transformers 5 builds the model on the meta device and fills these through _init_weights
            module.reset_buffers()
        if getattr(module, "is_router_gate", False):  # (marked by MoEBlock: transformers 5 never calls
            # _init_weights on a module without parameters of its own, such as the Router around this Linear)
            # Switch Transformer §2.4: truncated normal, std sqrt(s / fan_in) with s = 0.1, "for stability"
            fan_in = module.weight.shape[1]
            router_std = math.sqrt(0.1 / fan_in)
            nn.init.trunc_normal_(module.weight, 0.0, router_std, -2 * router_std, 2 * router_std)
            if module.bias is not None:  # (gpt-oss's router bias)
                module.bias.data.zero_()
        elif isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            embedding_std = getattr(
                self.config, "embedding_init_std", None
            )  # (configs saved before it existed)
            module.weight.data.normal_(0.0, embedding_std or std)
        elif isinstance(module, GroupedExperts):
            for name, p in module.named_parameters(recurse=False):  # biases (gpt-oss) start at zero, as HF's
                p.data.zero_() if name.endswith("_bias") else p.data.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)
        if isinstance(module, Attention) and module.sinks is not None:  # (gpt-oss: normal(0, std) as Linear)
            module.sinks.data.normal_(0.0, std)


class MoEModel(MoEPreTrainedModel):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(  # (rotary_dim: head_dim unless RoPE is partial, GLM-4.5)
            config.rotary_dim, config.rope_theta, getattr(config, "rope_yarn", None)
        )
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        expert_impl=None,
    ):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("MoEModel.forward: give exactly one of input_ids or inputs_embeds")
        h_BSD = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, S, _ = h_BSD.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        checkpointing = self.gradient_checkpointing and self.training
        if use_cache and cache is None and not checkpointing:
            # (the config's layer_types / sliding_window: a window layer keeps only its last window - 1 keys)
            cache = DynamicCache(config=self.config)
        if not use_cache:
            cache = None
        # where this step's tokens land in the cache: after what it holds (transformers 5 passes no
        # cache_position; a StaticCache's length is a tensor, so a compiled graph does not guard on it)
        past_len = cache.get_seq_length() if cache is not None else 0
        cache_position_S = torch.arange(S, device=h_BSD.device) + past_len
        if position_ids is None:
            position_ids = cache_position_S[None].expand(B, S)
        # keys the attention sees, per kind of layer (full, or a sliding window): past + S for a DynamicCache's
        # full layers, at most window - 1 + S for its sliding ones (from a later offset), the preallocated length
        # for a StaticCache; one mask per kind, built for the first layer of that kind
        masks_BqL: dict[int | None, torch.Tensor | None] = {}
        for i, layer in enumerate(self.layers):
            window = layer.self_attn.window
            if window in masks_BqL:
                continue
            key_len, key_offset = cache.get_mask_sizes(S, i) if cache is not None else (S, 0)
            masks_BqL[window] = (
                attention_mask_for(attention_mask, cache_position_S, key_len, S)
                if window is None
                else window_mask_for(attention_mask, cache_position_S, key_len, window, key_offset)
            )
        cos_sin = self.rotary_emb(h_BSD, position_ids)

        records: list[RoutingRecord] = []
        for layer in self.layers:
            mask = masks_BqL[layer.self_attn.window]
            if checkpointing:  # non-reentrant, so the records keep their gradient for the router losses
                h_BSD, record = checkpoint(
                    layer, h_BSD, cos_sin, mask, None, expert_impl, use_reentrant=False
                )
            else:
                h_BSD, record = layer(h_BSD, cos_sin, mask, cache, expert_impl)
            if record is not None:
                records.append(record)
                if self.training:
                    layer.mlp.router.observe(record)
        return self.norm(h_BSD), cache, records


def compile_layers(model: nn.Module, **compile_kwargs) -> int:
    """``torch.compile`` each decoder layer of ``model`` (a causal LM, a reward model, a PEFT model around one)
    in place, as torchtitan compiles its blocks: the layers share one compiled code, so compiling costs about one
    layer's time, and the embedding, the layer loop (activation checkpointing, the routers' statistics) and the
    head stay eager. The experts keep their routed path under it (`moe_core.experts.impl_under_capture`).
    Returns the number of layers compiled."""
    decoders = [m for m in model.modules() if isinstance(m, MoEModel)]
    if len(decoders) != 1:
        raise ValueError(
            f"compile_layers: expected one MoEModel in {type(model).__name__}, found {len(decoders)}"
        )
    for layer in decoders[0].layers:
        layer.compile(**compile_kwargs)
    return len(decoders[0].layers)


class RouterAccess:
    """The routers of a model whose decoder is ``self.model`` (`MoEModel`): the causal LM and the reward model."""

    def routers(self):
        return [layer.mlp.router for layer in self.model.layers if layer.is_moe]

    def update_router_biases(self, loads_LE: list[torch.Tensor] | None = None) -> None:
        """After an optimizer step: let stateful routers (aux-loss-free bias) act on the load they saw."""
        for i, router in enumerate(self.routers()):
            router.update_bias(None if loads_LE is None else loads_LE[i])


class MoEForCausalLM(RouterAccess, MoEPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # tied -> source (transformers 5)

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        self.model = MoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # the scope of the load-balancing statistics in training (`moe_core.router_losses.LoadBalance`, set by
        # the trainer, from outside); None: each forward balances its own tokens
        self.load_balance: LoadBalance | None = None
        self.post_init()

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """What ``generate`` passes as the attention mask on a compileable (static) cache: the [B, L] padding mask
        as it is. transformers' hook (generation/utils.py, prepare_inputs_for_generation) would otherwise build its
        own 4D masks, per ``config.layer_types``, for attention functions this model does not use: the model
        builds its masks itself from the padding mask and each layer's cache (`MoEModel.forward`)."""
        return attention_mask

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        output_routing: bool = False,
        expert_impl: str | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MoECausalLMOutput:
        h_BSD, cache, records = self.model(
            input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, expert_impl
        )
        h_keep = h_BSD[:, -logits_to_keep:] if logits_to_keep else h_BSD
        logits_BSV = self.lm_head(h_keep)

        losses = extra = None
        if records and (self.training or torch.is_grad_enabled()):  # not under no_grad in eval (generation)
            S = h_BSD.shape[1]
            token_mask = (
                attention_mask[:, -S:] if attention_mask is not None else None
            )  # padding does not count
            balancing = [router.balancing for router in self.routers()]
            losses = layer_losses(
                records, balancing, token_mask, self.load_balance if self.training else None
            )
            extra = router_loss(self.config, losses)
        loss = lm_loss = None
        if labels is not None:
            # labels are the inputs: position s predicts token s+1 (transformers' convention)
            lm_loss = F.cross_entropy(
                logits_BSV[:, :-1].float().reshape(-1, logits_BSV.shape[-1]),
                labels[:, 1:].reshape(-1).to(logits_BSV.device),
                ignore_index=-100,
            )
            loss = lm_loss if extra is None else lm_loss + extra
        return MoECausalLMOutput(
            loss=loss,
            logits=logits_BSV,
            cache=cache,
            lm_loss=lm_loss,
            aux_loss=None if losses is None else losses.aux,
            z_loss=None if losses is None else losses.z,
            router_loss=extra,
            router_losses=losses,
            routing=tuple(records) if output_routing else None,
        )


def materialize(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Storage on ``device`` for a model built on the meta device (torchtitan's pattern: build on meta, then give
    each rank only what it holds): every parameter and persistent buffer uninitialized, for a loader to fill;
    what no checkpoint holds (non-persistent buffers) computed by the modules' ``reset_buffers``."""
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model


def materialize_unsaved(model: nn.Module) -> nn.Module:
    """For a model built on the meta device whose checkpoint tensors were assigned to it
    (``load_state_dict(..., assign=True)``: each in the dtype and storage it was read in, nothing allocated
    twice): what no checkpoint holds (non-persistent buffers), given storage on the CPU and computed by the
    modules' ``reset_buffers``, as `materialize` does. A parameter or buffer still on the meta device after that
    was in no checkpoint: refused."""
    for module in model.modules():
        placed = False
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                setattr(module, name, torch.empty_like(buffer, device="cpu"))
                placed = True
        if placed and hasattr(module, "reset_buffers"):
            module.reset_buffers()
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{left[:3]} were neither loaded nor computed (a checkpoint without them?)")
    return model


AutoConfig.register(MoEConfig.model_type, MoEConfig, exist_ok=True)
AutoModel.register(MoEConfig, MoEModel, exist_ok=True)
AutoModelForCausalLM.register(MoEConfig, MoEForCausalLM, exist_ok=True)
