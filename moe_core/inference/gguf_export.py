"""GGUF export of a Hugging Face MoE checkpoint, for llama.cpp (and the engines built on it).

The path from a lab checkpoint: ``moe-lab convert to-hf CKPT --arch ARCH --out HF`` (exact, see
`moe_core.convert`), then ``moe-lab export gguf HF --out model.gguf``. The file is what llama.cpp's own
converter (``convert_hf_to_gguf.py``, in newer versions split into ``conversion/*.py``) writes for the same directory,
one `GGUFLayout` per Hugging Face ``model_type`` (`LAYOUTS`):

==============  ==============  =====================================================================
model_type      llama.cpp arch  converter class, and what differs from a plain stack of tensors
==============  ==============  =====================================================================
mixtral         ``llama``       ``LlamaModel``: q/k rows permuted from rotate-half to interleaved RoPE
olmoe           ``olmoe``       ``OlmoeModel``: q/k norms over the whole projection; NEOX RoPE, no permute
qwen2_moe       ``qwen2moe``    ``Qwen2MoeModel``: gated shared expert (``ffn_*_shexp``, ``ffn_gate_inp_shexp``)
qwen3_moe       ``qwen3moe``    ``Qwen3MoeModel``: per-head q/k norms, ``key_length`` = head_dim
deepseek_v3     ``deepseek2``   ``DeepseekV2Model``: MLA (below), ``exp_probs_b`` (the selection bias),
deepseek_v2                     shared experts, leading dense layers, sigmoid (V3) / softmax (V2) gating
gpt_oss         ``gpt-oss``     ``GptOssModel``: fused gate_up split (gate = even columns), biases,
                                ``attn_sinks``, sliding window on even layers, YaRN keys
glm4_moe        ``glm4moe``     ``Glm4MoeModel``: partial RoPE (``rope.dimension_count``), biased q/k/v,
                                DeepSeek-V3's routing and shared expert, ``post_attention_norm``
==============  ==============  =====================================================================

Common to all: experts stacked [E, ...] per projection (``blk.N.ffn_{gate,up,down}_exps``, as the converter
stacks them; transformers 5's fused ``gate_up_proj`` [E, 2F, D] is split gate-first as ``Qwen2MoeModel`` does),
tensor names from the ``gguf`` package's `TensorNameMap` for the architecture, hyperparameters under the
converter's keys; float32 weights (``general.file_type = ALL_F32``): quantize with llama.cpp's ``llama-quantize``
afterwards.

Tokenizer: the byte-level BPE of ``tokenizer.json`` as ``tokenizer.ggml.model = gpt2``, padded with unused
tokens up to the vocabulary size, and ``tokenizer.ggml.pre``, the name of the llama.cpp pre-tokenizer (the
regexes that split text before BPE) that splits as the tokenizer.json's ``pre_tokenizer`` does, from one table
(`PRE_TOKENIZERS`): ``gpt-2`` (the lab's own tokenizer, GPT-2; ``olmo`` for OLMoE's GPT-NeoX one, the same
splits), ``qwen2``, ``deepseek-v3``, ``deepseek-llm`` (DeepSeek-V2), ``gpt-4o`` (gpt-oss), ``glm4``,
``llama-bpe``. llama.cpp's converter names it by hashing a published tokenizer's ids of a check text; here it is
read from the declared regexes. One that matches none, a normalizer llama.cpp does not run (Qwen's NFC is
let through: llama.cpp's converter ignores it too, so text not in NFC tokenizes differently there), and
SentencePiece-style tokenizers (byte fallback / Metaspace: Mixtral's and Llama-2's published ones, which
llama.cpp runs as its ``llama`` vocabulary with per-token scores) are refused before any weight is read: llama.cpp
would otherwise split text differently and run the model on other ids.

RoPE: llama.cpp runs ``llama`` with interleaved (NORM) RoPE, hence the Mixtral permute; ``olmoe``, ``qwen*moe``,
``gpt-oss`` and ``glm4moe`` use NEOX (rotate-half) RoPE like transformers, and ``deepseek2`` uses NORM RoPE on
the decoupled rope dims, which DeepSeek's HF weights already assume (``rope_interleave``), so none of those is
permuted (as the converter).

DeepSeek MLA is written in llama.cpp's current layout by default (``mla="split"``): ``kv_b_proj`` split per
head into ``attn_k_b`` (transposed, [H, kv_lora_rank, nope]) and ``attn_v_b`` ([H, v_head_dim, kv_lora_rank]),
with ``head_count_kv = 1``, ``key_length = kv_lora_rank + rope``, ``value_length = kv_lora_rank`` and the
``*_mla`` lengths: the absorbed-MLA form whose KV cache holds the latent. ``mla="unsplit"`` writes the older
layout (one ``attn_kv_b``, MHA head counts and lengths, no ``*_mla`` keys), which current llama.cpp still loads
(as plain multi-head attention) and builds from before mid-2025 require. A q projection without LoRA
(DeepSeek-V2-Lite's ``q_proj`` -> ``attn_q``) gets ``attention.q_lora_rank = 0``: llama.cpp reads that key
for every layer count except V2-Lite's own.

gpt-oss: the experts are written as F32 (the dequantized values, not MXFP4); llama.cpp's converter accepts
non-MXFP4 experts (it warns that performance may be degraded) and llama.cpp runs F32/F16 experts;
``llama-quantize`` can make them MXFP4 again. llama.cpp hard-codes the clamped SwiGLU (alpha 1.702, limit 7)
and the sliding-window pattern (even layers), so other values are refused. It always truncates YaRN's correction
range (floor / ceil, transformers' ``truncate=True``, the lab's default); the published gpt-oss config says
``truncate: false``, which llama.cpp (and every gpt-oss GGUF its converter writes) runs with slightly different
frequencies in the correction range: logged, not refused.

What llama.cpp cannot run as written is refused before any weight is read, with the reason (`refusals`):
other RoPE scalings, dense (non-MoE) layers in the Qwen families, OLMoE with grouped-query attention (llama.cpp's
olmoe normalizes k over the whole hidden size), DeepSeek-V2's group-limited routing with more than one group
(llama.cpp scores a group by the sum of its two best experts, V2 by its best one), quantized checkpoints.

Checked in tests/test_gguf_families.py (every family read back against llama.cpp's loader shapes and keys, values
equal to the HF tensors after these transforms) and, in llama.cpp itself (the prebuilt 0.4.17 build of
tests/llama_cpp_engine.py), greedy tokens equal to ours from olmoe, qwen2moe and deepseek2 (unsplit) files.
That build has no qwen3moe, gpt-oss or glm4moe, no split MLA and no expert groups. The tokenizer: in
tests/test_gguf_tokenizer.py (each family's published pre-tokenizer rebuilt; llama.cpp's ids of tricky text equal
Hugging Face's for every name that build has, all but ``gpt-4o`` and ``glm4``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from moe_core.errors import MoELabError
from moe_core.fileio import atomic_file, check_output_file

logger = logging.getLogger(__name__)


class GGUFExportError(MoELabError):
    """A checkpoint that cannot be written as GGUF; the message says why and what to do."""


def permute_rope_rows(w_OI: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: per head, rows (first half, second half) -> interleaved pairs."""
    O = w_OI.shape[0]
    return w_OI.reshape(n_head, 2, O // n_head // 2, *w_OI.shape[1:]).swapaxes(1, 2).reshape(w_OI.shape)


def unpermute_rope_rows(w_OI: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `permute_rope_rows`."""
    O = w_OI.shape[0]
    return w_OI.reshape(n_head, O // n_head // 2, 2, *w_OI.shape[1:]).swapaxes(1, 2).reshape(w_OI.shape)


# ================================================================================================ config.json
def _n_experts(cfg: dict) -> int:
    """Routed experts, under the name each family's config.json uses."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(key):
            return int(cfg[key])
    raise GGUFExportError(
        "config.json names no expert count (num_local_experts / num_experts / n_routed_experts)"
    )


def _rope(cfg: dict) -> dict:
    """RoPE parameters as transformers 5 writes them (``rope_parameters``), or transformers 4's two fields."""
    if isinstance(cfg.get("rope_parameters"), dict):
        return dict(cfg["rope_parameters"])
    return {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {})}


def _rope_type(cfg: dict) -> str:
    rope = _rope(cfg)
    return rope.get("rope_type", rope.get("type")) or "default"


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


# ================================================================================================ refusals
def _rope_refusals(cfg: dict, yarn: bool) -> list[str]:
    allowed = ("default", "yarn") if yarn else ("default",)
    if _rope_type(cfg) not in allowed:
        return [
            f"rope_parameters.rope_type={_rope_type(cfg)!r}: written are {', '.join(allowed)} "
            "(llama.cpp's converter keys for other scalings are not carried here)"
        ]
    return []


def _all_moe_refusals(cfg: dict) -> list[str]:
    """Qwen-MoE: llama.cpp's qwen2moe / qwen3moe have a MoE block in every layer."""
    reasons = []
    if cfg.get("mlp_only_layers"):
        reasons.append(
            f"mlp_only_layers={cfg['mlp_only_layers']}: llama.cpp's layout has experts in every layer"
        )
    if cfg.get("decoder_sparse_step", 1) != 1:
        reasons.append(f"decoder_sparse_step={cfg['decoder_sparse_step']}: llama.cpp's layout needs 1")
    return reasons


def _none(cfg: dict) -> list[str]:
    return []


def _olmoe_refusals(cfg: dict) -> list[str]:
    # llama.cpp's olmoe: attn_k_norm of {n_embd}, i.e. as many KV heads as query heads (OLMoE-1B-7B's)
    n_kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if n_kv != cfg["num_attention_heads"]:
        return [
            f"num_key_value_heads={n_kv} < num_attention_heads={cfg['num_attention_heads']}: llama.cpp's olmoe "
            "normalizes k over the whole hidden size (no grouped-query attention)"
        ]
    return []


def _deepseek_scoring(cfg: dict) -> str:
    """The router's score function: config.json's ``scoring_func`` where the hub config has one, else the
    family's (transformers' DeepseekV3 scores with sigmoid, DeepseekV2 with softmax)."""
    return cfg.get("scoring_func") or ("softmax" if cfg.get("model_type") == "deepseek_v2" else "sigmoid")


def _deepseek_refusals(cfg: dict) -> list[str]:
    reasons = []
    if _deepseek_scoring(cfg) not in ("softmax", "sigmoid"):
        reasons.append(f"scoring_func={_deepseek_scoring(cfg)!r}: written are 'softmax' and 'sigmoid'")
    if (
        cfg.get("model_type") == "deepseek_v2"
        and _groups_used(cfg)
        and cfg.get("topk_group", 1) < cfg["n_group"]
    ):
        reasons.append(
            f"topk_method='group_limited_greedy' with n_group={cfg['n_group']}: DeepSeek-V2 scores a group by its "
            "best expert, llama.cpp by the sum of its two best (DeepSeek-V3's); use n_group=1 or deepseek_v3"
        )
    return reasons


def _gptoss_refusals(cfg: dict) -> list[str]:
    reasons = []
    # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE (src/llama-graph.cpp): constexpr alpha = 1.702f, limit = 7.0f
    if float(cfg.get("swiglu_limit", 7.0)) != 7.0 or float(cfg.get("swiglu_alpha", 1.702)) != 1.702:
        reasons.append(
            f"swiglu_limit={cfg.get('swiglu_limit')}, swiglu_alpha={cfg.get('swiglu_alpha')}: llama.cpp's gpt-oss "
            "hard-codes limit 7.0 and alpha 1.702"
        )
    # llama.cpp's gpt-oss: set_swa_pattern(2), i.e. layers 0, 2, 4, ... slide; the window from sliding_window
    n = cfg["num_hidden_layers"]
    expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if cfg.get("layer_types") is not None and list(cfg["layer_types"]) != expected:
        reasons.append(
            f"layer_types={cfg['layer_types']}: llama.cpp's gpt-oss slides on the even layers only ({expected})"
        )
    return reasons


def _gptoss_warnings(cfg: dict) -> list[str]:
    if _rope_type(cfg) == "yarn" and _rope(cfg).get("truncate", True) is False:
        # ggml_rope_yarn_corr_dims floors / ceils the correction range: transformers' truncate=True
        return [
            "rope_parameters.truncate=false (the published gpt-oss config): llama.cpp always truncates YaRN's "
            "correction range, so the RoPE frequencies of the dims inside it differ slightly from transformers' "
            "(as in every gpt-oss GGUF llama.cpp's own converter writes)"
        ]
    return []


# ================================================================================================ tensors
# Shapes in names: E = experts, F = expert width, D = model dim, H = heads, R = kv_lora_rank,
# X = nope + v_head_dim (kv_b_proj's rows per head)
# transformers 5's fused expert layout (moe_core.convert `_FUSED_EXPERTS`): gate_up_proj [E, 2F, D] (gate rows
# first), down_proj [E, D, F]
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$")


def _stack_experts(
    names: list[str], get: Callable[[str], torch.Tensor], n_experts: int, where: Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, read with ``get`` one at a time, with the per-expert projections of a layer stacked
    [E, ...] under ``<layer>.experts.<proj>.weight`` (llama.cpp's converters' merged names): at most one layer's
    projection stack is held at once."""
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for name in names:
        match = _PER_EXPERT.match(name)
        if match is None:
            yield name, get(name)
        else:
            prefix, expert, proj = match.groups()
            groups.setdefault((prefix, proj), {})[int(expert)] = name
    for (prefix, proj), experts in groups.items():
        if sorted(experts) != list(range(n_experts)):
            missing = sorted(set(range(n_experts)) - set(experts))
            raise GGUFExportError(
                f"{where}: {prefix}.*.{proj}.weight has experts {len(experts)} of {n_experts} "
                f"(missing {missing[:5]}); not a complete checkpoint"
            )
        yield f"{prefix}.{proj}.weight", torch.stack([get(experts[e]) for e in range(n_experts)])


def _plain(name: str, t: torch.Tensor, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face names the `TensorNameMap` knows as they are; transformers 5's fused experts split gate-first
    (``Qwen2MoeModel.modify_tensors``)."""
    match = _FUSED_EXPERTS.match(name)
    if match is None:
        yield name, t
    elif match.group(2) == "down_proj":
        yield f"{match.group(1)}.down_proj.weight", t
    else:
        F = t.shape[-2] // 2
        yield f"{match.group(1)}.gate_proj.weight", t[..., :F, :]
        yield f"{match.group(1)}.up_proj.weight", t[..., F:, :]


def _llama_tensor(name: str, t: torch.Tensor, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Mixtral: q/k rows to llama.cpp's interleaved RoPE (``LlamaModel.permute``)."""
    n_head = cfg["num_attention_heads"]
    if name.endswith("self_attn.q_proj.weight"):
        t = permute_rope_rows(t, n_head)
    elif name.endswith("self_attn.k_proj.weight"):
        t = permute_rope_rows(t, cfg.get("num_key_value_heads") or n_head)
    yield from _plain(name, t, cfg)


def _selection_bias_name(name: str) -> str:
    """DeepSeek-V3 / GLM-4.5's ``mlp.gate.e_score_correction_bias`` under the name the `TensorNameMap` maps to
    ``blk.N.exp_probs_b.bias`` (the converters' ``e_score_correction.bias``)."""
    return name.replace("e_score_correction_bias", "e_score_correction.bias")


def _glm4moe_tensor(name: str, t: torch.Tensor, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    yield from _plain(_selection_bias_name(name), t, cfg)


def _deepseek_tensor(mla: str) -> Callable:
    def tensor(name: str, t: torch.Tensor, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
        name = _selection_bias_name(name)
        if mla == "split" and name.endswith("self_attn.kv_b_proj.weight"):
            # DeepseekV2Model.modify_tensors: kv_b [H * (nope + v), r] -> k_b [H, r, nope] (transposed), v_b [H, v, r]
            H, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b_HXR = t.reshape(H, nope + v, t.shape[-1])
            k_b, v_b = kv_b_HXR[:, :nope], kv_b_HXR[:, nope:]
            yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)
            yield name.replace("kv_b_proj", "v_b_proj"), v_b
        else:
            yield from _plain(name, t, cfg)

    return tensor


def _gptoss_tensor(name: str, t: torch.Tensor, cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """``GptOssModel.modify_tensors`` on unquantized experts: gate_up_proj [E, D, 2F] (x @ W, gate at even
    columns) -> gate and up [E, F, D]; down_proj [E, F, D] -> [E, D, F]; biases split the same way; the sinks
    get a ``.weight`` suffix (``attn_sinks.weight``)."""
    prefix, _, leaf = name.rpartition(".")
    if leaf == "sinks":
        yield f"{name}.weight", t
    elif leaf == "gate_up_proj":
        w = t.transpose(-1, -2)
        yield f"{prefix}.gate_proj.weight", w[:, 0::2, :]
        yield f"{prefix}.up_proj.weight", w[:, 1::2, :]
    elif leaf == "gate_up_proj_bias":
        yield f"{prefix}.gate_proj.bias", t[..., 0::2]
        yield f"{prefix}.up_proj.bias", t[..., 1::2]
    elif leaf == "down_proj":
        yield f"{prefix}.down_proj.weight", t.transpose(-1, -2)
    elif leaf == "down_proj_bias":
        yield f"{prefix}.down_proj.bias", t
    else:
        yield name, t


# ================================================================================================ metadata
def _common_metadata(writer: gguf.GGUFWriter, cfg: dict, head_count_kv: int | None = None) -> None:
    """``TextModel.set_gguf_parameters``: the keys every architecture reads."""
    n_head = cfg["num_attention_heads"]
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(head_count_kv or cfg.get("num_key_value_heads") or n_head)
    writer.add_rope_freq_base(float(_rope(cfg).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_expert_count(_n_experts(cfg))
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _head_lengths(writer: gguf.GGUFWriter, cfg: dict) -> None:
    if cfg.get("head_dim") is not None:  # the converter writes config.json's head_dim as it is
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])


def _llama_metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
    _common_metadata(writer, cfg)
    head_dim = _head_dim(cfg)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _olmoe_metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
    _common_metadata(writer, cfg)  # llama.cpp's olmoe sizes its experts by feed_forward_length
    _head_lengths(writer, cfg)


def _qwen_moe_metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
    """``Qwen2MoeModel.set_gguf_parameters`` (``Qwen3MoeModel`` inherits it)."""
    _common_metadata(writer, cfg)
    _head_lengths(writer, cfg)
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _groups_used(cfg: dict) -> bool:
    """Whether the router picks groups first (DeepSeek-V3's noaux_tc, V2's group_limited_greedy, GLM-4.5)."""
    limited = cfg.get("model_type") != "deepseek_v2" or cfg.get("topk_method") == "group_limited_greedy"
    return limited and (cfg.get("n_group") or 1) > 1


def _routing_metadata(writer: gguf.GGUFWriter, cfg: dict, gating: gguf.ExpertGatingFuncType) -> None:
    """DeepSeek-V3-style routing keys shared by deepseek2 and glm4moe."""
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    writer.add_leading_dense_block_count(cfg.get("first_k_dense_replace") or 0)
    writer.add_expert_gating_func(gating)
    if cfg.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    if cfg.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if _groups_used(cfg):
        writer.add_expert_group_count(cfg["n_group"])
        writer.add_expert_group_used_count(cfg["topk_group"])


def _deepseek_metadata(mla: str) -> Callable:
    def metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
        """``DeepseekV2Model.set_gguf_parameters``; ``mla="unsplit"``: the pre-absorption head counts."""
        r, rope, nope, v = (
            cfg["kv_lora_rank"],
            cfg["qk_rope_head_dim"],
            cfg["qk_nope_head_dim"],
            cfg["v_head_dim"],
        )
        _common_metadata(writer, cfg, head_count_kv=1 if mla == "split" else cfg["num_attention_heads"])
        writer.add_q_lora_rank(cfg.get("q_lora_rank") or 0)
        writer.add_kv_lora_rank(r)
        if mla == "split":  # MLA as MQA over the latent: one KV head of the latent (+ rope part)
            writer.add_key_length(r + rope)
            writer.add_value_length(r)
            writer.add_key_length_mla(nope + rope)
            writer.add_value_length_mla(v)
        else:
            writer.add_key_length(nope + rope)
            writer.add_value_length(v)
            # builds before mid-2025 read this key unconditionally; with no RoPE scaling it changes nothing
            # (llama.cpp multiplies it by log(1 / freq_scale) = 0)
            writer.add_rope_scaling_yarn_log_mul(0.0)
        writer.add_rope_dimension_count(rope)
        _routing_metadata(writer, cfg, _GATING[_deepseek_scoring(cfg)])

    return metadata


_GATING = {"softmax": gguf.ExpertGatingFuncType.SOFTMAX, "sigmoid": gguf.ExpertGatingFuncType.SIGMOID}


def _glm4moe_metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
    """``Glm4MoeModel.set_gguf_parameters``: RoPE on the first partial_rotary_factor of each head."""
    _common_metadata(writer, cfg)
    _head_lengths(writer, cfg)
    # transformers 5 keeps the factor in rope_parameters, transformers 4 beside it; GLM-4.5's default 0.5
    factor = _rope(cfg).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    writer.add_rope_dimension_count(int(_head_dim(cfg) * factor))
    _routing_metadata(writer, cfg, gguf.ExpertGatingFuncType.SIGMOID)


def _gptoss_metadata(writer: gguf.GGUFWriter, cfg: dict) -> None:
    """``GptOssModel.set_gguf_parameters`` and the converter's YaRN keys."""
    _common_metadata(writer, cfg)
    _head_lengths(writer, cfg)
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_expert_feed_forward_length(cfg["intermediate_size"])
    rope = _rope(cfg)
    if _rope_type(cfg) == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(float(rope["attention_factor"]))


# ================================================================================================ layouts
@dataclass(frozen=True)
class GGUFLayout:
    """How one Hugging Face ``model_type`` is written as one llama.cpp architecture."""

    arch: gguf.MODEL_ARCH
    metadata: Callable[[gguf.GGUFWriter, dict], None]  # hyperparameter keys
    tensor: Callable[[str, torch.Tensor, dict], Iterator[tuple[str, torch.Tensor]]]  # HF -> mappable names
    refusals: Callable[[dict], list[str]] = _none  # what llama.cpp cannot run, from config.json
    yarn: bool = False  # YaRN RoPE written (gpt-oss)
    required: tuple[str, ...] = ()  # config.json fields the metadata needs beyond `_COMMON_FIELDS`
    # what llama.cpp runs slightly differently from transformers: said (logged), not refused
    warnings: Callable[[dict], list[str]] = _none

    @property
    def arch_name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


_COMMON_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "rms_norm_eps",
    "num_experts_per_tok",
    "vocab_size",
)
_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size")


def _deepseek_layout(mla: str) -> GGUFLayout:
    return GGUFLayout(
        gguf.MODEL_ARCH.DEEPSEEK2,
        _deepseek_metadata(mla),
        _deepseek_tensor(mla),
        _deepseek_refusals,
        required=_MLA_FIELDS,
    )


A = gguf.MODEL_ARCH
LAYOUTS: dict[str, GGUFLayout] = {
    "mixtral": GGUFLayout(A.LLAMA, _llama_metadata, _llama_tensor),
    "olmoe": GGUFLayout(A.OLMOE, _olmoe_metadata, _plain, _olmoe_refusals),
    "qwen2_moe": GGUFLayout(
        A.QWEN2MOE, _qwen_moe_metadata, _plain, _all_moe_refusals, required=("moe_intermediate_size",)
    ),
    "qwen3_moe": GGUFLayout(
        A.QWEN3MOE, _qwen_moe_metadata, _plain, _all_moe_refusals, required=("moe_intermediate_size",)
    ),
    "deepseek_v3": _deepseek_layout("split"),
    "deepseek_v2": _deepseek_layout("split"),
    "gpt_oss": GGUFLayout(
        A.GPT_OSS,
        _gptoss_metadata,
        _gptoss_tensor,
        _gptoss_refusals,
        yarn=True,
        required=("sliding_window",),
        warnings=_gptoss_warnings,
    ),
    "glm4_moe": GGUFLayout(
        A.GLM4_MOE, _glm4moe_metadata, _glm4moe_tensor, required=("moe_intermediate_size",)
    ),
}
del A
MLA_LAYOUTS = ("split", "unsplit")


def layout_for(model_type: str | None, mla: str = "split") -> GGUFLayout:
    """The `GGUFLayout` of a config.json's ``model_type``; ``mla`` picks DeepSeek's attention layout."""
    if mla not in MLA_LAYOUTS:
        raise GGUFExportError(f"mla={mla!r}: choose one of {', '.join(MLA_LAYOUTS)}")
    if model_type not in LAYOUTS:
        raise GGUFExportError(
            f"model_type {model_type!r} has no GGUF layout here; written are {', '.join(LAYOUTS)} "
            "(convert with `moe-lab convert to-hf CKPT --arch ARCH`)"
        )
    if model_type in ("deepseek_v3", "deepseek_v2"):
        return _deepseek_layout(mla)
    return LAYOUTS[model_type]


# ================================================================================================ tokenizer
# llama.cpp picks its pre-tokenizer (the regexes that split text into words before BPE) from the name in
# ``tokenizer.ggml.pre``. Its converter (``convert_hf_to_gguf.py``, ``get_vocab_base_pre``) finds the name by
# hashing a published tokenizer's ids of a check text; here it is read from what tokenizer.json declares: its
# ``pre_tokenizer``, reduced to the list of regexes it splits with (`_split_regexes`), looked up in this table.
# Each entry: the regexes in the form tokenizer.json writes them (``Split`` patterns, Isolated; ``ByteLevel`` with
# ``use_regex`` is GPT-2's regex; ``Digits`` is \p{N} or \p{N}+), and the name llama.cpp runs them under, from
# llama.cpp ``src/llama-vocab.cpp`` (the name -> LLAMA_VOCAB_PRE_TYPE switch in ``llama_vocab::impl::load``, and
# each type's regex list in the ``llm_tokenizer_bpe`` constructor, whose comments keep tokenizer.json's original
# form), ggml-org/llama.cpp at commit 00ad355e (read 2026-11). The prebuilt llama.cpp of the tests (llama-cpp-cffi
# 0.4.17, early 2025) has every name here but ``gpt-4o`` and ``glm4``, and tokenizes as Hugging Face with each
# (tests/test_gguf_tokenizer.py). Names llama.cpp has for the same behaviour (``olmo`` for ``gpt-2``) are not
# separate entries: `_CONVERTER_NAME` picks the one its converter writes for a model_type.
GPT2_REGEX = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"  # ByteLevel use_regex
)
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
QWEN2_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_REGEX = QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")  # Llama-3's and GLM-4's: digit runs of 1-3
GPT4O_REGEX = (  # tiktoken's o200k (gpt-oss's o200k_harmony)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK3_REGEXES = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",  # CJK ideographs, hiragana, katakana
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^""" + "\r\n" + r"""\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[""" + "\r\n" + r"""]*|\s*[""" + "\r\n" + r"""]+|\s+(?!\S)|\s+""",
)
# DeepSeek-LLM / V2's letters: three range ends are U+1F7D, U+1FD3, U+1FDB as tokenizer.json has them (llama.cpp's
# source shows them NFC-normalized to U+03CE, U+0390, U+038A, which makes those ranges descending: invalid there)
DEEPSEEK_LLM_REGEXES = (
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",  # noqa: E501, RUF001
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",  # noqa: RUF001
    r"\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",  # Digits(individual_digits=false)
)


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer: its ``tokenizer.ggml.pre`` name and the tokenizer.json regexes it splits by."""

    name: str
    regexes: tuple[str, ...]
    # llama.cpp's name also sets ``ignore_merges``: tells apart names that share regexes (Llama-3's and GLM-4's)
    ignore_merges: bool = False
    families: str = ""  # the published tokenizers written under it


PRE_TOKENIZERS = (
    # llama.cpp's GPT2 type; also its "olmo" (same regexes and flags), the name its converter gives OLMoE's
    PreTokenizer("gpt-2", (GPT2_REGEX,), families="GPT-2, GPT-NeoX / OLMoE, the lab's own tokenizer"),
    PreTokenizer("qwen2", (QWEN2_REGEX,), families="Qwen1.5 / Qwen2 / Qwen3 (MoE)"),
    PreTokenizer("llama-bpe", (LLAMA3_REGEX,), ignore_merges=True, families="Llama-3"),
    PreTokenizer("glm4", (LLAMA3_REGEX,), families="GLM-4 / GLM-4.5"),
    PreTokenizer("deepseek-v3", DEEPSEEK3_REGEXES, families="DeepSeek-V3 / R1, Kimi K2's base"),
    PreTokenizer("deepseek-llm", DEEPSEEK_LLM_REGEXES, families="DeepSeek-LLM / DeepSeek-V2"),
    PreTokenizer("gpt-4o", (GPT4O_REGEX,), families="gpt-oss (o200k)"),
)
# where llama.cpp has several names for one behaviour, the one its converter writes for that model_type (GLM-4.5's
# tokenizer is "glm4" whatever its ignore_merges, as the converter's hash names it)
_CONVERTER_NAME = {("gpt-2", "olmoe"): "olmo", ("llama-bpe", "glm4_moe"): "glm4"}
# normalizers llama.cpp does not run but that change nothing for text already in that form (Qwen2's NFC)
_HARMLESS_NORMALIZERS = (None, "NFC")


def _split_regexes(pre: dict | None, where: Path) -> tuple[str, ...]:
    """The regexes a byte-level tokenizer.json ``pre_tokenizer`` splits by, in order (what llama.cpp's regex lists
    are), ending in the ByteLevel byte mapping; raises for anything llama.cpp's BPE pre-tokenizers cannot do."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    regexes: list[str] = []
    for i, step in enumerate(steps):
        kind = step.get("type")
        if kind == "ByteLevel":
            if i != len(steps) - 1 or step.get("add_prefix_space", False):
                raise GGUFExportError(
                    f"{where}: pre_tokenizer ByteLevel {'adds a prefix space' if i == len(steps) - 1 else 'is not last'}"
                    ", which no llama.cpp pre-tokenizer does"
                )
            if step.get("use_regex", True):
                regexes.append(GPT2_REGEX)
            return tuple(regexes)
        if (
            kind == "Split"
            and step.get("behavior", "Isolated") == "Isolated"
            and not step.get("invert", False)
        ):
            pattern = step.get("pattern", {})
            regexes.append(pattern["Regex"] if "Regex" in pattern else re.escape(pattern.get("String", "")))
        elif kind == "Digits":
            regexes.append(r"\p{N}" if step.get("individual_digits", False) else r"\p{N}+")
        else:
            raise GGUFExportError(
                f"{where}: pre_tokenizer step {json.dumps(step)[:200]} has no llama.cpp equivalent"
            )
    raise GGUFExportError(
        f"{where}: pre_tokenizer {json.dumps(pre)[:200]} does not end in ByteLevel: not a byte-level BPE tokenizer"
    )


def _is_sentencepiece(data: dict) -> bool:
    """A SentencePiece-style BPE (Llama-2 / Mistral / Mixtral): byte fallback, spaces as U+2581 (Metaspace)."""
    text = json.dumps([data.get("normalizer"), data.get("pre_tokenizer")], ensure_ascii=False)
    return bool(data.get("model", {}).get("byte_fallback")) or "Metaspace" in text or "\u2581" in text


def pre_tokenizer_name(data: dict, where: Path, model_type: str | None = None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` name for a byte-level BPE tokenizer.json (parsed ``data``): the
    `PRE_TOKENIZERS` entry whose regexes are exactly those its pre_tokenizer splits by. Raises `GGUFExportError`
    naming what was found when none is: llama.cpp would split text differently from Hugging Face (its "default"
    splits contractions, digit runs and punctuation otherwise) and the model would run on other ids."""
    normalizer = (data.get("normalizer") or {}).get("type")
    if normalizer == "Sequence" and not data["normalizer"].get("normalizers"):
        normalizer = None  # DeepSeek-V3's empty Sequence
    if normalizer not in _HARMLESS_NORMALIZERS:
        raise GGUFExportError(
            f"{where}: normalizer {json.dumps(data['normalizer'])[:200]}: llama.cpp's BPE tokenizers do not "
            "normalize, so the GGUF file would tokenize text differently; not written"
        )
    regexes = _split_regexes(data.get("pre_tokenizer"), where)
    ignore_merges = bool(data.get("model", {}).get("ignore_merges", False))
    # several names for one regex list (Llama-3's and GLM-4's) differ in ignore_merges, which tells them apart;
    # elsewhere the flag changes nothing for a vocabulary whose every token its merges build
    candidates = [pre for pre in PRE_TOKENIZERS if pre.regexes == regexes]
    if len(candidates) > 1:
        candidates = [pre for pre in candidates if pre.ignore_merges == ignore_merges]
    if candidates:
        return _CONVERTER_NAME.get((candidates[0].name, model_type), candidates[0].name)
    known = "; ".join(f"{p.name} ({p.families})" for p in PRE_TOKENIZERS)
    raise GGUFExportError(
        f"{where}: its pre_tokenizer splits by {json.dumps(regexes, ensure_ascii=False)[:400]} "
        f"(model.ignore_merges={ignore_merges}), which matches none of llama.cpp's pre-tokenizers known here: "
        f"{known}. llama.cpp would split text differently from Hugging Face, so the file is not written. If "
        "llama.cpp has this pre-tokenizer (src/llama-vocab.cpp), add it to PRE_TOKENIZERS in "
        "moe_core/inference/gguf_export.py; otherwise convert with llama.cpp's convert_hf_to_gguf.py"
    )


@dataclass(frozen=True)
class BPEVocab:
    """A byte-level BPE vocabulary as llama.cpp's ``gpt2`` tokenizer model reads it."""

    tokens: list[str]  # padded with unused tokens up to config.json's vocab_size
    types: list[gguf.TokenType]
    merges: list[str]
    pre: str  # tokenizer.ggml.pre


def read_vocab(hf_dir: Path, vocab_size: int, model_type: str | None = None) -> BPEVocab:
    """The vocabulary of ``hf_dir/tokenizer.json`` and its llama.cpp pre-tokenizer name; refused (with the reason)
    when llama.cpp would not tokenize as Hugging Face does."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise GGUFExportError(
            f"{hf_dir}: no tokenizer.json; llama.cpp needs the vocabulary in the file "
            "(`moe-lab convert to-hf` copies the checkpoint's tokenizer files along)"
        )
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise GGUFExportError(
            f"{path}: tokenizer model {model.get('type')!r}; only byte-level BPE is written"
        )
    if _is_sentencepiece(data):
        # llama.cpp runs these as tokenizer.ggml.model = "llama" with per-token scores and types
        # (convert_hf_to_gguf.py `_set_vocab_sentencepiece` from tokenizer.model): not written here
        raise GGUFExportError(
            f"{path}: a SentencePiece-style tokenizer (byte_fallback / Metaspace, e.g. Mixtral's or Llama-2's), "
            "which llama.cpp runs as its 'llama' vocabulary with per-token scores from tokenizer.model; this export "
            "writes byte-level BPE only: convert this checkpoint with llama.cpp's convert_hf_to_gguf.py"
        )
    pre = pre_tokenizer_name(data, path, model_type)
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    vocab.update(special)
    if max(vocab.values()) >= vocab_size:
        raise GGUFExportError(f"{path}: token id {max(vocab.values())} does not fit vocab_size={vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in vocab.items():
        tokens[i] = token
        types[i] = gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return BPEVocab(tokens, types, merges, pre)


# ================================================================================================ export
class SafetensorsCheckpoint:
    """The tensors of a Hugging Face safetensors checkpoint (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists), memory-mapped and read one at a time by name.

    `moe_core.convert.CheckpointReader` does this and more (``.bin`` files, fused-expert aliases, MXFP4), but
    importing `moe_core.convert` brings in the model and transformers (about 3x this command's start-up);
    this export reads only what `moe-lab convert to-hf` writes."""

    def __init__(self, directory: Path) -> None:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: directory / file for name, file in weight_map.items()}
        elif (directory / "model.safetensors").is_file():
            with safe_open(str(directory / "model.safetensors"), "pt") as f:
                self.file_of = dict.fromkeys(f.keys(), directory / "model.safetensors")
        else:
            raise GGUFExportError(
                f"{directory}: no model.safetensors or model.safetensors.index.json; write the checkpoint with "
                "`moe-lab convert to-hf`"
            )
        self._open: dict[Path, object] = {}

    def _file(self, name: str):
        path = self.file_of[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), "pt")
        return self._open[path]

    def names(self) -> list[str]:
        return sorted(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)


def read_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise GGUFExportError(
            f"{hf_dir}: no config.json; give a directory written by `moe-lab convert to-hf`"
        )
    return json.loads(path.read_text())


def refusals(cfg: dict, layout: GGUFLayout) -> list[str]:
    """Why llama.cpp's architecture cannot run this config as written (empty: it can)."""
    missing = [f for f in _COMMON_FIELDS + layout.required if cfg.get(f) is None]
    if missing:
        return [f"config.json lacks {', '.join(missing)}, which the {layout.arch_name!r} metadata needs"]
    reasons = _rope_refusals(cfg, layout.yarn) + layout.refusals(cfg)
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method")
        reasons.append(
            f"quantization_config (quant_method={method!r}): this export writes float weights; load the checkpoint "
            "(`moe-lab convert from-hf`, which dequantizes MXFP4) and write it back with `moe-lab convert to-hf`, "
            "then quantize the GGUF with llama.cpp's llama-quantize"
        )
    return reasons


def gguf_tensors(
    reader: SafetensorsCheckpoint, cfg: dict, layout: GGUFLayout, where: Path, *, meta: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(GGUF name, tensor)`` for every weight in llama.cpp's layout, read one at a time; with ``meta``, the
    same sequence on the meta device (names and shapes, nothing read): the plan the file's header is written
    from before the weights stream into it."""
    name_map = gguf.get_tensor_name_map(layout.arch, cfg["num_hidden_layers"])

    def get(name: str) -> torch.Tensor:
        if meta:
            return torch.empty(reader.shape(name), device="meta")  # written as float32 either way
        return reader.get(name)

    names = [n for n in reader.names() if not n.endswith("rotary_emb.inv_freq")]
    for hf_name, t in _stack_experts(names, get, _n_experts(cfg), where):
        for name, piece in layout.tensor(hf_name, t, cfg):
            gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise GGUFExportError(
                    f"{where}: tensor {hf_name!r} has no name in llama.cpp's {layout.arch_name!r} layout"
                )
            yield gguf_name, piece


def export_gguf(
    hf_dir: str | os.PathLike, out_file: str | os.PathLike, *, overwrite: bool = False, mla: str = "split"
) -> Path:
    """Write the Hugging Face MoE checkpoint in ``hf_dir`` (a `LAYOUTS` model_type) as one float32 GGUF file in
    llama.cpp's layout for its architecture, staged (`atomic_file`: ``out_file`` is the old file or the complete
    new one); an existing ``out_file`` is replaced only with ``overwrite``. ``mla``: DeepSeek's attention layout
    (module docstring). What llama.cpp cannot run is refused, with every reason, before any weight is read.

    Streams: the header is written from a plan made on the meta device, then each tensor is read, transformed,
    written and dropped, so memory holds one layer's stack of one expert projection at most, never the model."""
    hf_dir, out_file = Path(hf_dir), Path(out_file)
    check_output_file(out_file, overwrite, GGUFExportError)  # before anything expensive
    cfg = read_config(hf_dir)
    layout = layout_for(cfg.get("model_type"), mla)
    reasons = refusals(cfg, layout)
    if reasons:
        raise GGUFExportError(
            f"{hf_dir}: cannot write this {cfg['model_type']!r} checkpoint as llama.cpp's "
            f"{layout.arch_name!r} GGUF:\n  - " + "\n  - ".join(reasons)
        )
    for warning in layout.warnings(cfg):
        logger.warning("%s: %s", hf_dir, warning)
    vocab = read_vocab(hf_dir, cfg["vocab_size"], cfg.get("model_type"))
    reader = SafetensorsCheckpoint(hf_dir)  # stored names: the layouts handle fused and per-expert experts
    packed = sorted(n for n in reader.names() if n.endswith(("_blocks", "_scales")))
    if packed:
        raise GGUFExportError(
            f"{hf_dir}: {packed[0]} and {len(packed) - 1} more are MXFP4-packed; this export writes float weights: "
            "load the checkpoint (`moe-lab convert from-hf`, which dequantizes them) and write it back with "
            "`moe-lab convert to-hf` first"
        )
    plan = [(name, tuple(t.shape)) for name, t in gguf_tensors(reader, cfg, layout, hf_dir, meta=True)]

    with atomic_file(out_file, overwrite, GGUFExportError) as tmp:
        writer = gguf.GGUFWriter(str(tmp), layout.arch_name)
        try:
            writer.add_name(hf_dir.name)
            layout.metadata(writer, cfg)
            _write_vocab(writer, hf_dir, cfg, vocab)
            for name, shape in plan:
                writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for (name, _), (written, t) in zip(plan, gguf_tensors(reader, cfg, layout, hf_dir), strict=True):
                assert name == written  # the same sequence as the plan
                writer.write_tensor_data(np.ascontiguousarray(t.float().numpy()))
        finally:
            writer.close()
    return out_file


def _write_vocab(writer: gguf.GGUFWriter, hf_dir: Path, cfg: dict, vocab: BPEVocab) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    # BOS/EOS/PAD (and the chat template) the way llama.cpp's converter finds them: the tokenizer files first,
    # then config.json (`gguf.SpecialVocab`), so a checkpoint whose config lacks them still stops at EOS
    special = gguf.SpecialVocab(hf_dir, load_merges=False, n_vocab=cfg["vocab_size"])
    special.add_to_gguf(writer, quiet=True)
