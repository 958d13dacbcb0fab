"""Stand-ins for published Hugging Face MoE checkpoints: the published ``config.json`` with random weights.

    from moe_core.published import PUBLISHED, build_published
    directory = build_published("olmoe-1b-7b", layers=4)   # ~/.cache/moe-lab/published/olmoe-1b-7b-4l
    AutoModelForCausalLM.from_pretrained(directory)          # or moe_core.load(directory), moe-lab finetune ...
    build_published("mixtral-8x7b", layers=1, overrides=PUBLISHED["mixtral-8x7b"].tiny_overrides)  # for tests

From the command line: ``python benchmarks/finetune_scale.py --model NAME [--layers N] --build-only`` (prints
the directory). This is not a ``moe-lab`` command: a stand-in that cannot say anything true about text is a
tool for measuring the lab, not part of a user's workflow.

What fine-tuning and inference cost at real size depends on the architecture's shapes, not on what the weights
learned, and no model hub is reachable where the lab is tested. So this writes a checkpoint directory that
loads exactly like the published one (same ``model_type``, tensor names, shapes, dtype and sharded layout),
with random weights: N(0, ``std``) for every matrix, ones for the RMSNorm scales, zeros for the biases,
seeded per tensor (the same seed gives the same bytes). The tokenizer is the lab's byte-level BPE
(`moe_core.data.tokenizer.train_tokenizer`, trained on a few documents of the built-in corpus) with its chat
template, far smaller than the model's vocabulary (the lab accepts ``len(tokenizer) <= vocab_size``); the
config's BOS/EOS/PAD ids are that tokenizer's, everything else is as published.

Memory: the model is never built. The tensor layout is the hub's (`tensor_layout`: per-expert tensors, as the
published files have them; the shapes from a model instantiated on the meta device), and each safetensors shard is written tensor by tensor, each tensor in row chunks of at most
``CHUNK_ELEMENTS`` (the header first: shapes are known up front), so the peak memory is a few hundred MiB
whatever the model's size (26.7 GiB for Qwen1.5-MoE-A2.7B, 87 GiB for Mixtral-8x7B: mind the disk).

Where it goes: ``$MOE_LAB_PUBLISHED_CACHE``, else ``~/.cache/moe-lab/published``, one directory per name,
layer cut and size override; never in git. The directory is built in a temporary sibling and renamed into
place (`moe_core.fileio.atomic_directory`), under a lock so two builders do not race. A complete directory
holds ``published.json`` (what was asked for, and every file's size); a second call with the same request
checks that record and the files' sizes and returns at once.

Published configs (``PUBLISHED``): each value is the hub's ``config.json`` of the named repository, as recalled
and cross-checked against transformers 4.57's config defaults (``models/*/configuration_*.py``, which were
written to reproduce these models) and against copies of the hub files in public code (cited per model below).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from moe_core.convert import ARCHITECTURES, config_from_hf, weight_plan
from moe_core.data.sources import builtin_corpus
from moe_core.data.tokenizer import SPECIAL_TOKEN_FIELDS, special_token_ids, train_tokenizer
from moe_core.errors import MoELabError
from moe_core.fileio import OutputLock, atomic_directory, require_free_space
from moe_core.model import MoEForCausalLM

CACHE_ENV = "MOE_LAB_PUBLISHED_CACHE"
RECORD = "published.json"  # written last into a complete directory: the request and every file's size
FORMAT_VERSION = 2  # bump when the bytes written for a request change, so cached directories are rebuilt
CHUNK_ELEMENTS = 1 << 24  # a tensor is drawn in row chunks of at most this many values (64 MiB in float32)
DEFAULT_SHARD_BYTES = 2 * 2**30  # the hub's files are 2-10 GB; small enough to copy, few enough to list
DEFAULT_TOKENIZER_VOCAB = 4096
TOKENIZER_DOCUMENTS = (
    40  # of the built-in corpus (parsing them is the cost), to train the stand-in tokenizer on
)


class PublishedError(MoELabError):
    """A request for a published stand-in that cannot be met (unknown name, bad layer count or override)."""


@dataclass(frozen=True)
class PublishedModel:
    """A published MoE checkpoint: its hub id and its ``config.json`` fields (the architecture's, not the file's
    bookkeeping: no ``transformers_version``, ``_name_or_path``)."""

    name: str
    hub_id: str
    config: dict[str, Any] = field(repr=False)
    # the same architecture shrunk to a few KiB per layer (``overrides=`` for tests and quick looks)
    tiny_overrides: dict[str, Any] = field(default_factory=dict, repr=False)


PUBLISHED: dict[str, PublishedModel] = {
    # allenai/OLMoE-1B-7B-0924 config.json: 16 layers, 64 experts top-8, hidden 2048, expert width 1024,
    # vocab 50304 (6.92 B parameters). Cross-checked: transformers 4.57 OlmoeConfig defaults equal every field
    # but intermediate_size (2048 there; 1024 published, also in the OLMoE paper, Table 1); the hub file as
    # copied in public code (a parameter-count script's `base_config` of "OlmoeForCausalLM", and a Rust port's
    # test "the real OLMoE-1B-7B config.json shape").
    "olmoe-1b-7b": PublishedModel(
        "olmoe-1b-7b",
        "allenai/OLMoE-1B-7B-0924",
        {
            "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "clip_qkv": None,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 1024,
            "max_position_embeddings": 4096,
            "norm_topk_prob": False,
            "num_attention_heads": 16,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 16,
            "num_key_value_heads": 16,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.01,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 50304,
        },
        tiny_overrides=dict(
            hidden_size=64,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=512,
        ),
    ),
    # Qwen/Qwen1.5-MoE-A2.7B config.json: 24 layers, 60 experts top-4 of width 1408 plus one gated shared expert
    # of width 5632, hidden 2048, q/k/v biases, vocab 151936 (14.3 B parameters). Cross-checked: transformers 4.57
    # Qwen2MoeConfig defaults equal the architecture fields (its max_position_embeddings 32768 and rope_theta 1e4
    # are the generic Qwen2 ones; the published 8192 and 1e6 are in the hub file as copied in a Rust inference
    # port's `qwen2_moe_a27b_config`, and in the Chat model's card).
    "qwen1.5-moe-a2.7b": PublishedModel(
        "qwen1.5-moe-a2.7b",
        "Qwen/Qwen1.5-MoE-A2.7B",
        {
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "attention_dropout": 0.0,
            "decoder_sparse_step": 1,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 5632,
            "max_position_embeddings": 8192,
            "max_window_layers": 21,
            "moe_intermediate_size": 1408,
            "norm_topk_prob": False,
            "num_attention_heads": 16,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 24,
            "num_key_value_heads": 16,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 5632,
            "sliding_window": 32768,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        tiny_overrides=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=512,
        ),
    ),
    # Qwen/Qwen3-30B-A3B config.json: 48 layers, 128 experts top-8 of width 768 (renormalized), no shared expert,
    # hidden 2048, 32 query heads of head_dim 128 (not hidden / heads = 64) and 4 KV heads, per-head q/k RMSNorm,
    # vocab 151936 (30.5 B parameters, 3.3 B active). Cross-checked: transformers 5.24 Qwen3MoeConfig defaults
    # equal the architecture fields but the depth, head_dim and renormalization (its generic 24 layers, no
    # head_dim, norm_topk_prob False); the published 48 / 128 / true / 40960 positions / rope_theta 1e6 as in
    # the model card (Qwen3 technical report, Table 2: 48 layers, 32/4 heads, 128 experts, 8 activated).
    "qwen3-30b-a3b": PublishedModel(
        "qwen3-30b-a3b",
        "Qwen/Qwen3-30B-A3B",
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "decoder_sparse_step": 1,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 6144,
            "max_position_embeddings": 40960,
            "max_window_layers": 48,
            "mlp_only_layers": [],
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "num_attention_heads": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 48,
            "num_key_value_heads": 4,
            "output_router_logits": False,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        tiny_overrides=dict(
            hidden_size=64,
            head_dim=32,  # still != hidden / heads, as published
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=16,
            num_experts_per_tok=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        ),
    ),
    # openai/gpt-oss-20b config.json: 24 layers alternating sliding-window (128) and full attention, 32 experts
    # top-4 of width 2880 with biases and the clamped SwiGLU (limit 7), biased q/k/v/o, attention sinks, 64 query
    # heads of 64 and 8 KV heads, YaRN RoPE (theta 150000, factor 32 over 4096), vocab 201088 (20.9 B
    # parameters). Cross-checked: transformers 5.24 GptOssConfig defaults are gpt-oss-120b's (36 layers, 128
    # experts) and equal the rest; 24 / 32 / pad 199999 / eos 200002 / aux 0.9 as in the model card. The hub
    # file's quantization_config (quant_method mxfp4: the experts as MXFP4 blocks and scales) is left out: the
    # stand-in is what transformers and the lab hold after dequantizing, bf16 (`moe_core.convert` reads
    # MXFP4 files too, `dequantize_mxfp4`)
    "gpt-oss-20b": PublishedModel(
        "gpt-oss-20b",
        "openai/gpt-oss-20b",
        {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "attention_bias": True,
            "attention_dropout": 0.0,
            "experts_per_token": 4,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 2880,
            "initial_context_length": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 2880,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "max_position_embeddings": 131072,
            "num_attention_heads": 64,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 24,
            "num_key_value_heads": 8,
            "num_local_experts": 32,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            # the hub file's rope_scaling + rope_theta (transformers 4's spelling), as transformers 5 writes them
            "rope_parameters": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "rope_theta": 150000.0,
                "rope_type": "yarn",
                "truncate": False,
            },
            "router_aux_loss_coef": 0.9,
            "sliding_window": 128,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 201088,
        },
        tiny_overrides=dict(
            hidden_size=64,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            sliding_window=4,
        ),
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 32 layers, 8 experts top-2 of width 14336, hidden 4096, GQA with 8
    # KV heads, vocab 32000 (46.7 B parameters, 87 GiB in bf16). Cross-checked: transformers 4.57 MixtralConfig
    # defaults equal the architecture fields (its max_position_embeddings 131072 and router_aux_loss_coef 0.001
    # differ: the hub file has 32768 and 0.02, as copied in public training configs "mixtral-8x7b").
    "mixtral-8x7b": PublishedModel(
        "mixtral-8x7b",
        "mistralai/Mixtral-8x7B-v0.1",
        {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "num_attention_heads": 32,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.02,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 32000,
        },
        tiny_overrides=dict(
            hidden_size=64,
            intermediate_size=32,
            num_local_experts=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        ),
    ),
    # moonshotai/Moonlight-16B-A3B config.json (model_type deepseek_v3): 27 layers, the first dense (width 11264),
    # then 64 experts top-6 of width 1408 plus 2 shared, sigmoid scores with the selection bias, one group,
    # renormalized weights times 2.446; MLA with a full-rank q (q_lora_rank null), latent 512, RoPE 64, no rope
    # scaling; vocab 163840 (16.0 B parameters). Cross-checked: the hub file as copied in a Rust MLA inference
    # port's test ("MOONLIGHT_CONFIG"; its eos 163586 is the Instruct model's) and transformers 5.24's
    # DeepseekV3Config fields. Left out: ``auto_map`` (remote code the lab never runs).
    "moonlight-16b-a3b": PublishedModel(
        "moonlight-16b-a3b",
        "moonshotai/Moonlight-16B-A3B",
        {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "aux_loss_alpha": 0.001,
            "bos_token_id": 163584,
            "eos_token_id": 163585,
            "ep_size": 1,
            "first_k_dense_replace": 1,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 11264,
            "kv_lora_rank": 512,
            "max_position_embeddings": 8192,
            "moe_intermediate_size": 1408,
            "moe_layer_freq": 1,
            "n_group": 1,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "norm_topk_prob": True,
            "num_attention_heads": 16,
            "num_experts_per_tok": 6,
            "num_hidden_layers": 27,
            "num_key_value_heads": 16,
            "num_nextn_predict_layers": 0,
            "pretraining_tp": 1,
            "q_lora_rank": None,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "rms_norm_eps": 1e-05,
            "rope_theta": 50000.0,
            "routed_scaling_factor": 2.446,
            "scoring_func": "sigmoid",
            "seq_aux": True,
            "tie_word_embeddings": False,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "v_head_dim": 128,
            "vocab_size": 163840,
        },
        tiny_overrides=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            vocab_size=512,
        ),
    ),
    # deepseek-ai/DeepSeek-V2-Lite config.json (model_type deepseek_v2): 27 layers, the first dense (width
    # 10944), then 64 experts top-6 of width 1408 plus 2 shared, softmax greedy top-k, no renormalization; MLA
    # with a full-rank q, latent 512, RoPE 64; YaRN RoPE (factor 40 over 4096 positions, mscale 0.707); vocab
    # 102400 (15.7 B parameters). Cross-checked: transformers 5.24's DeepseekV2Config (written for this
    # checkpoint: "deepseek-ai/DeepSeek-V2-Lite") and the DeepSeek-Coder-V2-Lite hub file as copied in a
    # hardware-sizing test (the same architecture). Its YaRN (frequencies, attention factor, MLA's softmax
    # scale times mscale^2) converts exactly (`moe_core.convert`), the tiny stand-in's too.
    "deepseek-v2-lite": PublishedModel(
        "deepseek-v2-lite",
        "deepseek-ai/DeepSeek-V2-Lite",
        {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "aux_loss_alpha": 0.001,
            "bos_token_id": 100000,
            "eos_token_id": 100001,
            "first_k_dense_replace": 1,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 10944,
            "kv_lora_rank": 512,
            "max_position_embeddings": 163840,
            "moe_intermediate_size": 1408,
            "moe_layer_freq": 1,
            "n_group": 1,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "num_attention_heads": 16,
            "num_experts_per_tok": 6,
            "num_hidden_layers": 27,
            "num_key_value_heads": 16,
            "pretraining_tp": 1,
            "q_lora_rank": None,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 40,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
            "rope_theta": 10000,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "seq_aux": True,
            "tie_word_embeddings": False,
            "topk_group": 1,
            "topk_method": "greedy",
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "v_head_dim": 128,
            "vocab_size": 102400,
        },
        tiny_overrides=dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            vocab_size=512,
        ),
    ),
    # zai-org/GLM-4.5-Air config.json (model_type glm4_moe): 46 layers, the first dense (width 10944), then 128
    # experts top-8 of width 1408 plus 1 shared, sigmoid scores with the selection bias, one group, renormalized,
    # scaling 1.0; grouped-query attention with 96 query heads of head_dim 128 (12288 wide over a 4096 hidden
    # size) and 8 KV heads, q/k/v biases, no q/k norm, RoPE on the first half of each head (partial_rotary_factor
    # 0.5, theta 1e6); vocab 151552 (106.9 B parameters without the MTP layer; the model card's "106B total,
    # 12B active"). Cross-checked: transformers 5.24's Glm4MoeConfig defaults are Air's shape (46 layers, hidden
    # 4096, 96/8 heads, 128 experts top-8 of 1408 plus 1 shared, dense width 10944, vocab 151552, scaling 1.0,
    # partial_rotary_factor 0.5; head_dim is no field there: the hub file's 128) and the GLM-4.5 report's Table 1
    # for Air (1 dense + 45 MoE layers + 1 MTP layer, head dim 128, no qk-norm). The hub file's
    # multi-token-prediction layer (num_nextn_predict_layers 1: ``model.layers.46.*``) is not written: transformers
    # never builds it in Glm4MoeForCausalLM, and the lab skips it on load (`moe_core.convert.mtp_weight_names`)
    "glm-4.5-air": PublishedModel(
        "glm-4.5-air",
        "zai-org/GLM-4.5-Air",
        {
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "attention_bias": True,
            "attention_dropout": 0.0,
            "eos_token_id": [151329, 151336, 151338],
            "first_k_dense_replace": 1,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 10944,
            "max_position_embeddings": 131072,
            "moe_intermediate_size": 1408,
            "n_group": 1,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "num_attention_heads": 96,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 46,
            "num_key_value_heads": 8,
            "num_nextn_predict_layers": 1,
            "pad_token_id": 151329,
            "partial_rotary_factor": 0.5,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "routed_scaling_factor": 1.0,
            "tie_word_embeddings": False,
            "topk_group": 1,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_qk_norm": False,
            "vocab_size": 151552,
        },
        tiny_overrides=dict(
            hidden_size=64,
            head_dim=32,  # still != hidden / heads, as published
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        ),
    ),
}


# ------------------------------------------------------------------------------------------------ the request
def published_model(name: str) -> PublishedModel:
    if name not in PUBLISHED:
        raise PublishedError(f"unknown published model {name!r}; choose one of {', '.join(PUBLISHED)}")
    return PUBLISHED[name]


def published_config(
    name: str, layers: int | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The published ``config.json`` fields of ``name``, cut to its first ``layers`` decoder layers, with
    ``overrides`` (any existing field: tests shrink ``hidden_size``, ``num_experts`` ...) applied."""
    spec = published_model(name)
    config = json.loads(json.dumps(spec.config))  # a deep copy
    published_layers = config["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= published_layers:
            raise PublishedError(
                f"{name}: layers={layers}; choose 1..{published_layers} (the published count)"
            )
        config["num_hidden_layers"] = layers
        if "max_window_layers" in config:  # Qwen2: layers below it use full attention; keep the same meaning
            config["max_window_layers"] = min(config["max_window_layers"], layers)
        if "layer_types" in config:  # gpt-oss: one attention kind per layer; the first `layers` of them
            config["layer_types"] = config["layer_types"][:layers]
    unknown = sorted(set(overrides or {}) - set(config))
    if unknown:
        raise PublishedError(
            f"{name}: overrides name fields the published config does not have: {unknown}; "
            f"its fields are {sorted(config)}"
        )
    config.update(overrides or {})
    experts = config.get("num_experts", config.get("num_local_experts", config.get("n_routed_experts")))
    problems = [
        f"{key}={config[key]!r} must be a positive integer"
        for key in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "num_experts_per_tok",
        )
        if not (isinstance(config[key], int) and config[key] > 0)
    ]
    if not problems:
        if config["num_experts_per_tok"] > experts:
            problems.append(
                f"num_experts_per_tok={config['num_experts_per_tok']} is above the {experts} experts"
            )
        # (a config with its own head_dim, as GLM-4.5-Air's 96 heads of 128 over 4096, needs no such multiple)
        if config.get("head_dim") is None and config["hidden_size"] % config["num_attention_heads"]:
            problems.append("hidden_size must be a multiple of num_attention_heads")
        if config["num_attention_heads"] % config["num_key_value_heads"]:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
    if problems:
        raise PublishedError(f"{name}: the config is not valid: {'; '.join(problems)}")
    return config


def directory_name(name: str, layers: int | None = None, overrides: dict[str, Any] | None = None) -> str:
    """``olmoe-1b-7b``, ``olmoe-1b-7b-4l``, ``olmoe-1b-7b-1l-<hash of the overrides>``."""
    parts = [name]
    if layers is not None and layers != published_model(name).config["num_hidden_layers"]:
        parts.append(f"{layers}l")
    if overrides:
        parts.append(hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:10])
    return "-".join(parts)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$MOE_LAB_PUBLISHED_CACHE``, else ``~/.cache/moe-lab/published``."""
    root = cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "moe-lab" / "published"
    return Path(root).expanduser()


# ------------------------------------------------------------------------------------------------ the layout
def hf_config_object(config: dict[str, Any]):
    """The transformers config object for a ``config.json`` dict (validates the fields)."""
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    try:
        return CONFIG_MAPPING[config["model_type"]](**fields)
    except (TypeError, ValueError) as err:
        raise PublishedError(f"config for {config['model_type']} is not valid: {err}") from None


def tensor_layout(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor the architecture's published checkpoint holds, ``(name, shape)``, under the names and in
    the layout hub checkpoints carry, layer by layer. transformers 5's modeling classes hold the experts fused
    (``mlp.experts.gate_up_proj`` [E, 2F, D]) and convert at load, but hub checkpoints (and transformers 5's
    ``save_pretrained`` by default) store one ``[O, I]`` tensor per expert under the family's own names
    (Mixtral's ``block_sparse_moe.experts.{j}.w1``, OLMoE's ``mlp.experts.{j}.gate_proj``, ...: the conversion
    plan's, `moe_core.convert.weight_plan`); a stand-in in the fused layout would let both the baseline and
    the lab memory-map what a user's download makes them copy. gpt-oss's checkpoints are fused: its layout is
    transformers' model class's. Nothing is allocated (meta device)."""
    # (pad_token_id names a row of the embedding, no tensor of its own: a published id past a shrunk vocabulary,
    # as GLM-4.5-Air's 151329 in a test's 512, would only trip nn.Embedding's check)
    hf = hf_config_object({**config, "pad_token_id": None})
    arch = ARCHITECTURES[config["model_type"]]
    if arch.model_type == "gpt_oss":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
        tensors = model.state_dict()
        if hf.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        return [(name, tuple(t.shape)) for name, t in tensors.items()]
    ours = config_from_hf(arch, hf)
    with torch.device("meta"):
        model = MoEForCausalLM(ours)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    layout = []
    for our_name, hf_names in weight_plan(ours, arch):
        shape = shapes[our_name] if len(hf_names) == 1 else shapes[our_name][1:]  # per-expert slices of dim 0
        layout += [(name, shape) for name in hf_names]
    return sorted(layout, key=_checkpoint_order)


def _checkpoint_order(entry: tuple[str, tuple[int, ...]]) -> tuple[int, str]:
    """Embeddings first, then layer by layer, then the final norm and head (so shards hold whole layers)."""
    name = entry[0]
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer:
        return int(layer.group(1)), name
    return (-1, name) if "embed" in name else (1 << 30, name)


# ------------------------------------------------------------------------------------------------ the values
def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_chunks(
    name: str, shape: tuple[int, ...], seed: int, std: float, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """The values of one tensor, in row chunks (concatenated along dim 0 they are the tensor): ones for an
    RMSNorm scale (``*norm.weight``), zeros for a bias, else N(0, std) from a generator seeded by
    (seed, name), so a tensor's values do not depend on what else is written or in which order."""
    rows = shape[0] if shape else 1
    row_shape = shape[1:]
    per_row = max(1, int(torch.Size(row_shape).numel()))
    step = max(1, CHUNK_ELEMENTS // per_row)
    generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        chunk_shape = (n, *row_shape) if shape else ()
        if name.endswith("norm.weight"):
            yield torch.ones(chunk_shape, dtype=dtype)
        elif name.endswith(".bias"):
            yield torch.zeros(chunk_shape, dtype=dtype)
        else:
            yield torch.empty(chunk_shape, dtype=dtype).normal_(0.0, std, generator=generator)


# ------------------------------------------------------------------------------------------------ the files
# safetensors' file format (https://huggingface.co/docs/safetensors, "Format"): an 8-byte little-endian header
# length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}} padded
# with spaces, then the tensors' bytes back to back, little-endian, C order. Written here by hand because
# `safetensors.torch.save_file` needs the whole shard in memory; `safe_open` reads the result (the test does).
_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def write_safetensors_streamed(
    path: Path,
    tensors: list[tuple[str, tuple[int, ...]]],
    chunks_of,
    dtype: torch.dtype,
) -> int:
    """Write ``tensors`` (name, shape) to one safetensors file, each tensor's values from
    ``chunks_of(name, shape)`` (row chunks), one chunk in memory at a time. Returns the bytes written."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = int(torch.Size(shape).numel()) * itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name, shape in tensors:
            written = 0
            for chunk in chunks_of(name, shape):
                raw = chunk.contiguous().view(torch.uint8 if itemsize == 1 else _INT_VIEW[itemsize])
                f.write(memoryview(raw.numpy()).cast("B"))
                written += chunk.numel() * itemsize
            expected = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if written != expected:  # a bug in the chunking, never the user's input
                raise RuntimeError(f"internal: {name} wrote {written} bytes, expected {expected}")
    return 8 + len(head) + offset


_INT_VIEW = {2: torch.int16, 4: torch.int32}  # numpy has no bfloat16: the bytes go out through an int view


def shard_plan(
    tensors: list[tuple[str, tuple[int, ...]]], itemsize: int, max_shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = int(torch.Size(shape).numel()) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _tokenizer_texts() -> list[str]:
    return [doc.text for doc in builtin_corpus(TOKENIZER_DOCUMENTS)]


def write_tokenizer(directory: Path, vocab_size: int) -> dict[str, int]:
    """The lab's byte-level BPE with its chat template, trained on the built-in corpus; returns its
    BOS/EOS/PAD ids by config field."""
    tokenizer = train_tokenizer(_tokenizer_texts(), vocab_size=vocab_size)
    tokenizer.save_pretrained(str(directory))
    return special_token_ids(tokenizer)


def _file_sizes(directory: Path) -> dict[str, int]:
    # not the record itself, nor atomic_directory's ``.in-use`` lock file (removed once renamed into place)
    return {
        p.name: p.stat().st_size
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != RECORD and not p.name.startswith(".")
    }


def _request(name, layers, overrides, seed, std, tokenizer_vocab, max_shard_bytes) -> dict[str, Any]:
    return {
        "name": name,
        "hub_id": published_model(name).hub_id,
        "layers": layers,
        "overrides": overrides or {},
        "seed": seed,
        "std": std,
        "dtype": "bfloat16",
        "tokenizer_vocab": tokenizer_vocab,
        "tokenizer_documents": TOKENIZER_DOCUMENTS,
        "max_shard_bytes": max_shard_bytes,
        "format_version": FORMAT_VERSION,
    }


def is_complete(directory: Path, request: dict[str, Any]) -> bool:
    """Whether ``directory`` was completely written for ``request``: its record names the same request and
    every file it lists is there with its recorded size (the weights are not re-hashed: that would read GiBs)."""
    record_path = directory / RECORD
    if not record_path.is_file():
        return False
    try:
        record = json.loads(record_path.read_text())
    except ValueError:
        return False
    if record.get("request") != request:
        return False
    sizes = record.get("files", {})
    return bool(sizes) and all(
        (directory / f).is_file() and (directory / f).stat().st_size == n for f, n in sizes.items()
    )


# ------------------------------------------------------------------------------------------------ the build
def build_published(
    name: str,
    *,
    layers: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    std: float = 0.02,
    tokenizer_vocab: int = DEFAULT_TOKENIZER_VOCAB,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress=None,
) -> Path:
    """The directory of the random-weight stand-in for published model ``name`` (see the module docstring),
    built if it is not complete in the cache yet. ``progress(line)`` gets a line per shard written."""
    config = published_config(name, layers, overrides)
    request = _request(name, layers, overrides, seed, std, tokenizer_vocab, max_shard_bytes)
    directory = cache_root(cache_dir) / directory_name(name, layers, overrides)
    if is_complete(directory, request):
        return directory
    tokenizer_vocab = min(tokenizer_vocab, config["vocab_size"])
    dtype = torch.bfloat16
    itemsize = 2
    layout = tensor_layout(config)
    total = sum(int(torch.Size(shape).numel()) for _, shape in layout) * itemsize
    directory.parent.mkdir(parents=True, exist_ok=True)
    require_free_space(directory.parent, total + 64 * 2**20)
    with OutputLock(directory, "published-model build"):
        if is_complete(directory, request):  # another builder finished while we waited for nothing
            return directory
        with atomic_directory(directory, overwrite=True, error_cls=PublishedError) as tmp:
            ids = write_tokenizer(tmp, tokenizer_vocab)
            # the tokenizer's ids; a published id it has no token for (GLM-4.5-Air's pad_token_id) is unset
            config.update(
                {field: ids.get(field) for field in SPECIAL_TOKEN_FIELDS if field in config or field in ids}
            )
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            generation = {
                k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
            }
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            shards = shard_plan(layout, itemsize, max_shard_bytes)
            weight_map: dict[str, str] = {}
            for k, shard in enumerate(shards):
                file = (
                    "model.safetensors"
                    if len(shards) == 1
                    else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                )
                write_safetensors_streamed(
                    tmp / file,
                    shard,
                    lambda n, s: random_chunks(n, s, seed, std, dtype),
                    dtype,
                )
                weight_map.update(dict.fromkeys((n for n, _ in shard), file))
                if progress is not None:
                    progress(f"{name}: wrote {file} ({k + 1}/{len(shards)})")
            if len(shards) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            record = {
                "request": request,
                "parameters": total // itemsize,
                "bytes": total,
                "files": _file_sizes(tmp),
            }
            (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return directory
