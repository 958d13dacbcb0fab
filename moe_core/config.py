"""Model configuration and named presets.

`MoEConfig` is a transformers `PreTrainedConfig` (``model_type="moe_lab"``), so it is saved as ``config.json``
beside every checkpoint and old checkpoints keep loading (unknown keys are kept, missing ones take defaults).
It checks itself when built: a bad value raises `ValueError` naming the field and what to do, and so does an
unknown field (``MoEConfig(num_expert=2)``, ``get_config(..., **overrides)``: a typo is never kept silently).
Loading a saved ``config.json`` (``from_pretrained`` / ``from_dict``) accepts Hugging Face's standard keys and
keeps unknown ones with a warning, so files written by other versions keep loading.

Presets are ``<family>-<size>``: families ``switch``, ``mixtral``, ``olmoe``, ``shared``, ``deepseek``, ``dense``; sizes
``tiny`` (tests, seconds), ``small`` (minutes on a CPU) and ``base`` (a GPU).
"""

from __future__ import annotations

import inspect
import logging
import math
from functools import cache
from typing import Any

from transformers import PreTrainedConfig

from moe_core.errors import did_you_mean
from moe_core.presets import FAMILIES, PRESETS, SIZES, family_settings
from moe_core.routing import pruned_mass_matters, resolve_router
from moe_core.transformers_seam import generation_default_keys

logger = logging.getLogger(__name__)

FFN_ACTIVATIONS = ("swiglu", "gelu")
ROUTER_SCORES = ("softmax", "sigmoid")
TOPK_ORDERS = ("softmax_then_topk", "topk_then_softmax")
ROUTER_LOSS_REDUCTIONS = ("mean", "sum")
PRUNED_CHOICES = ("refill", "drop")
# YaRN's parameters, named as in transformers' rope_parameters (modeling_rope_utils._compute_yarn_parameters)
YARN_REQUIRED = ("factor", "original_max_position_embeddings")
YARN_KEYS = (
    *YARN_REQUIRED,
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "truncate",
)
EXPERT_IMPLS = ("auto", "reference", "sorted", "grouped_mm", "static", "gather")
ATTENTION_TYPES = ("mha", "mla")  # grouped-query attention; DeepSeek-V2/V3 multi-head latent attention
ROUTER_GROUP_SCORES = ("top2_sum", "max")  # DeepSeek-V3's group score; DeepSeek-V2's


class MoEConfig(PreTrainedConfig):
    """Decoder-only transformer whose FFN is a Mixture of Experts every `moe_every_n` layers.

    Attention: RoPE, grouped-query attention (`num_key_value_heads`), optional qk-norm (OLMoE: RMSNorm over
    the whole q and k projections; Qwen3-MoE with `qk_norm_per_head`: over each head's head_dim), optional q/k/v bias (Qwen2-MoE), optional clip of q/k/v (OLMoE).

    MoE block: `num_experts` experts of width `expert_intermediate_size`, `num_experts_per_tok` per token,
    chosen by the router named in `router` (a name from `moe_core.routing.ROUTERS` or a dotted path to a
    `Router` subclass in an imported or allowed module; see `moe_core.routing.resolve_router`). `capacity_factor=None` is dropless; a number bounds each expert's tokens
    to ceil(capacity_factor * T * K / E) and drops the overflow, which passes through the residual.
    Optional shared experts run on every token (Qwen2-MoE, DeepSeek), with an optional sigmoid gate.
    The router losses enter the training loss as ``coef * mean`` over MoE layers (``router_loss_reduction=
    "mean"``: OLMoE/megablocks, transformers) or ``coef * sum`` (``"sum"``: Switch, GShard, Megatron-LM).
    A pruned model (`moe_core.inference.prune`) may keep `router_pruned_experts` removed experts' gate rows in
    its router's softmax denominator, so kept experts keep their trained weights, and with
    ``router_pruned_choices="drop"`` leave empty the slots that went to them (`moe_core.routing`).

    Layer `i` is an MoE layer when ``num_experts > 0``, ``i not in dense_layers`` and
    ``(i + 1) % moe_every_n == 0`` (the rule of Qwen2-MoE's `decoder_sparse_step`); other layers use a
    dense FFN of width `intermediate_size`. A model with ``num_experts=0`` is a dense baseline that runs
    through the very same code.
    """

    model_type = "moe_lab"
    keys_to_ignore_at_inference = ["cache"]  # the output field (transformers 5; 4.x: past_key_values)

    def __init__(
        self,
        vocab_size: int = 8000,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 8,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        rope_yarn: dict[str, Any] | None = None,
        rope_partial_factor: float = 1.0,
        rms_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        o_proj_bias: bool = False,
        attention_sinks: bool = False,
        attention_window: int | None = None,
        attention_window_layers: list[int] | None = None,
        qk_norm: bool = False,
        qk_norm_per_head: bool = False,
        clip_qkv: float | None = None,
        attention_dropout: float = 0.0,
        # --- multi-head latent attention (DeepSeek-V2/V3; attention_type="mla") ---
        attention_type: str = "mha",
        q_lora_rank: int | None = None,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        rope_interleave: bool = True,
        ffn_activation: str = "swiglu",
        intermediate_size: int = 1024,
        # --- mixture of experts ---
        num_experts: int = 8,
        num_experts_per_tok: int = 2,
        expert_intermediate_size: int = 512,
        expert_bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
        moe_every_n: int = 1,
        dense_layers: list[int] | None = None,
        num_shared_experts: int = 0,
        shared_expert_intermediate_size: int | None = None,
        shared_expert_gate: bool = False,
        # --- routing ---
        router: str = "topk",
        router_score: str = "softmax",
        router_bias: bool = False,
        router_topk_order: str = "softmax_then_topk",
        norm_topk_prob: bool = True,
        capacity_factor: float | None = None,
        eval_capacity_factor: float | None = None,
        router_jitter: float = 0.0,
        router_aux_loss_coef: float = 0.01,
        router_z_loss_coef: float = 0.001,
        router_bias_update_rate: float = 0.0,
        router_loss_reduction: str = "mean",
        router_pruned_experts: int = 0,
        router_pruned_choices: str = "refill",
        # --- DeepSeek routing (router="deepseek") ---
        router_groups: int = 1,
        router_topk_groups: int = 1,
        router_group_score: str = "top2_sum",
        routed_scaling_factor: float = 1.0,
        expert_impl: str = "auto",
        # --- misc ---
        initializer_range: float = 0.02,
        embedding_init_std: float | None = None,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        hf_origin: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        check_model_fields(kwargs)  # our fields are named parameters; the rest must be transformers' own
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = (
            num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        )
        self.head_dim = head_dim if head_dim is not None else hidden_size // max(num_attention_heads, 1)
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        # YaRN RoPE (gpt-oss, DeepSeek): transformers' rope_parameters keys for rope_type "yarn" (`YARN_KEYS`)
        self.rope_yarn = dict(rope_yarn) if rope_yarn is not None else None
        # GLM-4.5 (transformers' partial_rotary_factor): RoPE rotates the first int(head_dim * factor) dims of each
        # q/k head and passes the rest through unrotated (`rotary_dim`, `moe_core.model.apply_partial_rope`)
        self.rope_partial_factor = rope_partial_factor
        self.rms_norm_eps = rms_norm_eps
        self.attention_bias = attention_bias
        self.o_proj_bias = o_proj_bias  # gpt-oss: attention_bias there biases o_proj as well
        # gpt-oss: a learned logit per head in the softmax's denominator (self_attn.sinks), Xiao et al. 2024
        self.attention_sinks = attention_sinks
        # gpt-oss: causal attention over the last `attention_window` keys (the query's own included) in the layers
        # `attention_window_layers` (None: every layer); full attention elsewhere. transformers' names for the
        # same thing, `layer_types` and `sliding_window`, are read-only views of these two (below), so its caches
        # keep only the window's keys in those layers
        self.attention_window = attention_window
        self.attention_window_layers = (
            list(attention_window_layers) if attention_window_layers is not None else None
        )
        self.qk_norm = qk_norm
        # Qwen3-MoE: the q/k RMSNorm is over each head's head_dim (one weight of size head_dim shared by the
        # heads), not over the whole projection as OLMoE's; only meaningful with qk_norm=True
        self.qk_norm_per_head = qk_norm_per_head
        self.clip_qkv = clip_qkv
        self.attention_dropout = attention_dropout
        # MLA (model.MultiHeadLatentAttention): q through an optional rank-q_lora_rank bottleneck with its RMSNorm,
        # k/v compressed to kv_lora_rank plus one RoPE key of qk_rope_head_dim shared by the heads; head_dim is
        # then the RoPE part's width (what the rotary embedding rotates), as transformers' DeepseekV3Config sets it
        self.attention_type = attention_type
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope_interleave = rope_interleave
        if attention_type == "mla" and head_dim is None:
            self.head_dim = qk_rope_head_dim
        self.ffn_activation = ffn_activation
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.expert_intermediate_size = expert_intermediate_size
        # gpt-oss experts (modeling_gpt_oss.py GptOssExperts): biases on gate/up/down and the clamped SwiGLU
        # (`moe_core.experts.clamped_swiglu`; swiglu_limit None: the plain SwiGLU)
        self.expert_bias = expert_bias
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha = swiglu_alpha
        self.moe_every_n = moe_every_n
        self.dense_layers = list(dense_layers or [])
        self.num_shared_experts = num_shared_experts
        self.shared_expert_intermediate_size = (
            shared_expert_intermediate_size
            if shared_expert_intermediate_size is not None
            else expert_intermediate_size
        )
        self.shared_expert_gate = shared_expert_gate
        self.router = router
        self.router_score = router_score
        self.router_bias = router_bias  # gpt-oss: the gate's logits have a bias per expert
        self.router_topk_order = router_topk_order
        self.norm_topk_prob = norm_topk_prob
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.router_jitter = router_jitter
        self.router_aux_loss_coef = router_aux_loss_coef
        self.router_z_loss_coef = router_z_loss_coef
        self.router_bias_update_rate = router_bias_update_rate
        self.router_loss_reduction = router_loss_reduction
        # gate rows of experts removed by `moe-lab prune`, kept in the softmax denominator (moe_core.routing)
        self.router_pruned_experts = router_pruned_experts
        # a token's top-k choice that was pruned: "refill" (next-best kept expert) or "drop" (slot left empty)
        self.router_pruned_choices = router_pruned_choices
        # DeepSeek group-limited routing (routing.DeepSeekRouter): experts in router_groups equal groups, a token
        # picks its router_topk_groups best groups (scored by router_group_score) and its top-k inside them;
        # the combine weights are multiplied by routed_scaling_factor
        self.router_groups = router_groups
        self.router_topk_groups = router_topk_groups
        self.router_group_score = router_group_score
        self.routed_scaling_factor = routed_scaling_factor
        self.expert_impl = expert_impl
        self.initializer_range = initializer_range
        # None: initializer_range. Why a separate value: see `moe_core.presets.family_settings("switch")` and
        # `MoEPreTrainedModel`
        self.embedding_init_std = embedding_init_std
        self.use_cache = use_cache
        # Where a converted model came from (architecture, model_type, extra HF fields); used by `to_hf`.
        self.hf_origin = hf_origin
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate()

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
        """A saved config (``config.json``): unknown keys are kept as attributes with a warning, not refused, so
        a file written by another version (or with a typo in it) still loads and can be inspected."""
        fields = model_fields()
        unknown = {k: v for k, v in config_dict.items() if k not in fields}
        if unknown:
            hints = "".join(did_you_mean(k, fields) for k in unknown)
            logger.warning(
                "MoEConfig: unknown field(s) %s in a saved config are kept but unused%s",
                sorted(unknown),
                hints,
            )
        result = super().from_dict({k: v for k, v in config_dict.items() if k in fields}, **kwargs)
        config = result[0] if isinstance(result, tuple) else result
        for key, value in unknown.items():
            setattr(config, key, value)
        return result

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def bad(field: str, msg: str) -> ValueError:
            return ValueError(f"MoEConfig.{field}={getattr(self, field)!r}: {msg}")

        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) <= 0:
                raise bad(field, "must be a positive integer")
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.ffn_activation not in FFN_ACTIVATIONS:
            raise bad("ffn_activation", f"choose one of {FFN_ACTIVATIONS}")
        if self.num_experts < 0:
            raise bad("num_experts", "must be >= 0 (0 means a dense model)")
        if self.moe_every_n < 1:
            raise bad("moe_every_n", "must be >= 1")
        if self.embedding_init_std is not None and not self.embedding_init_std > 0:
            raise bad("embedding_init_std", "must be positive, or None for initializer_range")
        if self.attention_window is not None and (
            not isinstance(self.attention_window, int) or self.attention_window < 1
        ):
            raise bad(
                "attention_window", "must be a positive integer (keys per query), or None for full attention"
            )
        if self.attention_window_layers is not None:
            if self.attention_window is None:
                raise bad("attention_window_layers", "needs attention_window; set it or leave this None")
            outside = [i for i in self.attention_window_layers if not 0 <= i < self.num_hidden_layers]
            if outside:
                raise bad(
                    "attention_window_layers", f"{outside} are not layers 0..{self.num_hidden_layers - 1}"
                )
        if self.rope_yarn is not None:
            missing = [k for k in YARN_REQUIRED if self.rope_yarn.get(k) is None]
            unknown = sorted(set(self.rope_yarn) - set(YARN_KEYS))
            if missing or unknown:
                raise bad(
                    "rope_yarn",
                    f"needs {list(YARN_REQUIRED)} and takes only {list(YARN_KEYS)} (missing {missing}, "
                    f"unknown {unknown}); None for plain RoPE",
                )
            if not float(self.rope_yarn["factor"]) >= 1:
                raise bad("rope_yarn", "factor must be >= 1 (the context extension ratio)")
        if self.qk_norm_per_head and not self.qk_norm:
            raise bad("qk_norm_per_head", "normalizes per head only with qk_norm=True; set qk_norm=True too")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise bad("clip_qkv", "must be positive or None")
        if self.expert_impl not in EXPERT_IMPLS:
            raise bad("expert_impl", f"choose one of {EXPERT_IMPLS}")
        if self.num_shared_experts < 0:
            raise bad("num_shared_experts", "must be >= 0")
        self.validate_mla(bad)
        self.validate_partial_rope(bad)
        if self.num_experts == 0:
            return
        if self.swiglu_limit is not None and (self.ffn_activation != "swiglu" or not self.swiglu_limit > 0):
            raise bad("swiglu_limit", "the clamped SwiGLU needs ffn_activation='swiglu' and a positive limit")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise bad("num_experts_per_tok", f"must be between 1 and num_experts={self.num_experts}")
        if self.expert_intermediate_size <= 0:
            raise bad("expert_intermediate_size", "must be a positive integer")
        if self.router_score not in ROUTER_SCORES:
            raise bad("router_score", f"choose one of {ROUTER_SCORES}")
        if self.router_loss_reduction not in ROUTER_LOSS_REDUCTIONS:
            raise bad("router_loss_reduction", f"choose one of {ROUTER_LOSS_REDUCTIONS}")
        if self.router_topk_order not in TOPK_ORDERS:
            raise bad("router_topk_order", f"choose one of {TOPK_ORDERS}")
        for field in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, field)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise bad(field, "must be a positive number, or None for dropless routing")
        for field in (
            "router_jitter",
            "router_aux_loss_coef",
            "router_z_loss_coef",
            "router_bias_update_rate",
        ):
            if getattr(self, field) < 0:
                raise bad(field, "must be >= 0")
        if self.router_pruned_experts < 0:
            raise bad("router_pruned_experts", "must be >= 0")
        if self.router_pruned_experts and not pruned_mass_matters(self):
            raise bad(
                "router_pruned_experts",
                "pruned experts' gate rows only enter a softmax whose top-k weights are not renormalized "
                "(router 'topk'/'switch'/'aux_free', router_score='softmax', softmax_then_topk, "
                "norm_topk_prob=False); set it to 0",
            )
        if self.router_pruned_choices not in PRUNED_CHOICES:
            raise bad("router_pruned_choices", f"choose one of {PRUNED_CHOICES}")
        if self.router_pruned_choices == "drop" and (
            self.router not in ("topk", "switch")
            or self.capacity_factor is not None
            or self.eval_capacity_factor is not None
        ):
            raise bad(
                "router_pruned_choices",
                "'drop' ranks kept experts against the pruned rows by logit: a dropless 'topk' or 'switch' "
                "router only (a selection bias or capacity would rank them differently); use 'refill'",
            )
        try:
            router_cls = resolve_router(self.router)
        except (KeyError, ImportError, TypeError) as err:
            raise bad("router", str(err)) from None
        try:
            router_cls.check_config(self)
        except ValueError as err:
            raise bad("router", str(err)) from None

    def validate_mla(self, bad) -> None:
        """Multi-head latent attention's fields (`attention_type="mla"`)."""
        if self.attention_type not in ATTENTION_TYPES:
            raise bad("attention_type", f"choose one of {ATTENTION_TYPES}")
        if self.attention_type != "mla":
            return
        for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) <= 0:
                raise bad(field, "must be a positive integer (attention_type='mla')")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise bad("q_lora_rank", "must be a positive integer, or None for a full-rank q projection")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", "RoPE rotates pairs: must be even")
        if self.head_dim != self.qk_rope_head_dim:
            raise bad(
                "head_dim",
                f"with attention_type='mla' it is the RoPE width: set it to "
                f"qk_rope_head_dim={self.qk_rope_head_dim} (or leave it None)",
            )
        if self.attention_bias or self.qk_norm or self.clip_qkv is not None:
            raise bad("attention_type", "MLA has no q/k/v bias, qk_norm or clip_qkv here; turn those off")

    def validate_partial_rope(self, bad) -> None:
        """Partial rotary embeddings (`rope_partial_factor`, GLM-4.5)."""
        factor = self.rope_partial_factor
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise bad(
                "rope_partial_factor", "must be in (0, 1]: the share of each head's dims that RoPE rotates"
            )
        if factor == 1:
            return
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise bad(
                "rope_partial_factor",
                f"rotates int(head_dim={self.head_dim} * factor) = {self.rotary_dim} dims; RoPE rotates pairs, so "
                "that must be even and at least 2",
            )
        if self.attention_type == "mla":
            raise bad(
                "rope_partial_factor",
                "multi-head latent attention has its own RoPE part (qk_rope_head_dim): set 1.0",
            )

    # ------------------------------------------------------------------ derived
    @property
    def rotary_dim(self) -> int:
        """The dims of each q/k head that RoPE rotates: the first ``int(head_dim * rope_partial_factor)`` (as
        transformers computes it), all of them by default."""
        return int(self.head_dim * getattr(self, "rope_partial_factor", 1.0))

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.dense_layers
            and (layer_idx + 1) % self.moe_every_n == 0
        )

    def is_window_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` attends over the last `attention_window` keys only (gpt-oss's sliding layers)."""
        window = getattr(self, "attention_window", None)
        layers = getattr(self, "attention_window_layers", None)
        return window is not None and (layers is None or layer_idx in layers)

    # transformers' vocabulary for the windows, derived from ours (read-only, never saved): DynamicCache(config=)
    # and StaticCache(config=) read them (cache_utils.get_layer_types_and_kwargs) and give each window layer a
    # DynamicSlidingWindowLayer / StaticSlidingWindowLayer that keeps only its last `attention_window` - 1 keys;
    # `generate` builds its cache that way, and so does `MoEModel.forward` (the mask follows each layer's kept
    # keys: `moe_core.model.window_mask_for`)
    @property
    def layer_types(self) -> list[str] | None:
        layers = getattr(self, "num_hidden_layers", None)
        if layers is None:  # (PreTrainedConfig.__init__ reads it before ours has set the fields)
            return None
        return ["sliding_attention" if self.is_window_layer(i) else "full_attention" for i in range(layers)]

    @property
    def sliding_window(self) -> int | None:
        return getattr(self, "attention_window", None)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]


@cache
def model_fields() -> frozenset[str]:
    """Every key a user may give `MoEConfig`: its own parameters and those `PreTrainedConfig` understands
    (its parameters, generation defaults it still reads, and the bookkeeping keys of a saved config.json)."""
    own = set(inspect.signature(MoEConfig.__init__).parameters) - {"self", "kwargs"}
    hf = set(inspect.signature(PreTrainedConfig.__init__).parameters) - {"self", "kwargs"}
    hf |= set(PreTrainedConfig().to_dict()) | generation_default_keys()
    # popped by PreTrainedConfig.__init__ / from_dict (configuration_utils.py)
    hf |= {
        "torch_dtype",
        "name_or_path",
        "_commit_hash",
        "attn_implementation",
        "gradient_checkpointing",
        "num_labels",
        "tf_legacy_loss",
        "use_bfloat16",
        "transformers_version",
        "model_type",
    }
    return frozenset(own | hf)


def check_model_fields(keys, where: str = "MoEConfig") -> None:
    """Refuse keys that are not model fields (a typo like ``num_expert``), naming the closest field."""
    fields = model_fields()
    for key in keys:
        if key not in fields:
            raise ValueError(
                f"{where}: unknown field {key!r}{did_you_mean(key, fields)} (model fields are the "
                "parameters of moe_core.config.MoEConfig)"
            )


# ---------------------------------------------------------------------------------------------- presets
# the preset tables live in moe_core.presets (plain data, so the CLI lists them without importing transformers)


def get_config(preset: str, *, balance: str = "lab", **overrides: Any) -> MoEConfig:
    """Build the config of a named preset, e.g. ``get_config("mixtral-tiny", num_experts=16)``. ``balance=
    "paper"`` takes the family's published load-balancing coefficient instead of the lab's (see
    `moe_core.presets.AUX_LOSS_COEF`); an explicit ``router_aux_loss_coef`` wins over both."""
    family, _, size = preset.partition("-")
    if family not in FAMILIES or size not in SIZES:
        raise ValueError(
            f"unknown preset {preset!r}{did_you_mean(preset, PRESETS)}; choose one of: {', '.join(PRESETS)}"
        )
    layers = overrides.get("num_hidden_layers", SIZES[size]["num_hidden_layers"])
    kwargs = {
        **SIZES[size],
        **family_settings(family, SIZES[size]["hidden_size"], layers, balance),
        **overrides,
    }
    return MoEConfig(**kwargs)


def ffn_params(config: MoEConfig, width: int) -> int:
    """Weights of one FFN (a dense layer's, an expert's) of hidden width ``width``: gate, up and down
    matrices for SwiGLU, up and down otherwise. The one count `parameter_counts` and `moe_core.flops` use."""
    matrices = 3 if config.ffn_activation == "swiglu" else 2
    return matrices * config.hidden_size * width


def dense_baseline(config: MoEConfig, match: str = "active") -> MoEConfig:
    """A dense model with the same attention and as many FFN parameters as the MoE model's active
    (``match="active"``: K routed experts plus shared experts) or total (``match="total"``) ones."""
    if config.num_experts == 0:
        raise ValueError("dense_baseline: the config is already dense (num_experts=0)")
    if match not in ("active", "total"):
        raise ValueError(f"dense_baseline: match={match!r}; choose 'active' or 'total'")
    routed = config.num_experts_per_tok if match == "active" else config.num_experts
    width = (
        routed * config.expert_intermediate_size
        + config.num_shared_experts * config.shared_expert_intermediate_size
    )
    data = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "hf_origin"):
        data.pop(key, None)
    data.update(num_experts=0, intermediate_size=width, num_shared_experts=0, dense_layers=[])
    return MoEConfig.from_dict(data)  # a copy: keys a loaded config carried stay as they were


def parameter_counts(config: MoEConfig) -> dict[str, int]:
    """Total and active (per token) parameter counts, computed from the config alone."""
    d, hd = config.hidden_size, config.head_dim
    attn = d * hd * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    if config.attention_bias:
        attn += hd * (config.num_attention_heads + 2 * config.num_key_value_heads)
    if config.qk_norm and config.qk_norm_per_head:  # one head_dim weight each for q and k
        attn += 2 * hd
    elif config.qk_norm:
        attn += hd * (config.num_attention_heads + config.num_key_value_heads)
    if getattr(config, "attention_type", "mha") == "mla":
        attn = mla_attention_params(config)
    if config.o_proj_bias:
        attn += d
    if config.attention_sinks:
        attn += config.num_attention_heads
    norms = 2 * d
    total = active = 0
    for i in range(config.num_hidden_layers):
        total += attn + norms
        active += attn + norms
        if config.is_moe_layer(i):
            expert = ffn_params(config, config.expert_intermediate_size)
            shared = config.num_shared_experts * ffn_params(config, config.shared_expert_intermediate_size)
            shared += d if config.shared_expert_gate and config.num_shared_experts else 0
            if config.expert_bias:  # gpt-oss: gate and up [F], down [D] per expert
                gated = 2 if config.ffn_activation == "swiglu" else 1
                expert += gated * config.expert_intermediate_size + d
            router = (d + 1) * config.num_experts if config.router_bias else d * config.num_experts
            total += config.num_experts * expert + shared + router
            active += config.num_experts_per_tok * expert + shared + router
        else:
            total += ffn_params(config, config.intermediate_size)
            active += ffn_params(config, config.intermediate_size)
    embed = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    return {"total": total + embed + d, "active": active + embed + d, "embedding": embed}


def mla_attention_params(config: MoEConfig) -> int:
    """Weights of one multi-head latent attention (`moe_core.model.MultiHeadLatentAttention`)."""
    d, H = config.hidden_size, config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    R, Rq = config.kv_lora_rank, config.q_lora_rank
    q = d * H * qk if Rq is None else d * Rq + Rq + Rq * H * qk  # (+ the q_a_layernorm scale)
    kv = d * (R + config.qk_rope_head_dim) + R + R * H * (config.qk_nope_head_dim + config.v_head_dim)
    return q + kv + H * config.v_head_dim * d
