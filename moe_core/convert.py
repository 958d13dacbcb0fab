"""Exact conversion between our `MoEForCausalLM` and Hugging Face Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, gpt-oss,
DeepSeek-V3, DeepSeek-V2 and GLM-4.5 (glm4_moe) checkpoints.

    from moe_core.convert import from_hf, to_hf
    model = from_hf("path/or/hub-id")                 # MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM
    to_hf(model, "out_dir")                           # written back as the architecture it came from
    to_hf(MoEForCausalLM(get_config("olmoe-tiny")), "out_dir", architecture="olmoe")  # a native model

or ``moe-lab convert from-hf SRC --out DIR`` and ``moe-lab convert to-hf SRC --out DIR --arch olmoe``.

Nothing is approximated: a config the other side cannot express exactly is refused with every reason at once
(`ConversionError`), and the tests hold logits equal within 1e-5 in float32 in both directions. The truth for
the Hugging Face side is transformers 5's ``models/{mixtral,olmoe,qwen2_moe}/modeling_*.py`` (checked at 5.24).

Weights, in the per-expert names hub checkpoints carry and transformers 5 still writes by default (its modeling
classes hold the experts fused and convert at load; a checkpoint written fused, ``save_pretrained(
save_original_format=False)``, is read too: `CheckpointReader`). HF name -> ours; every other name is identical on
both sides, layer ``i``, expert ``j``::

    Mixtral    model.layers.i.block_sparse_moe.gate                 -> model.layers.i.mlp.router.gate
               model.layers.i.block_sparse_moe.experts.j.w1/w3/w2   -> mlp.experts.gate_proj/up_proj/down_proj[j]
    OLMoE      model.layers.i.mlp.gate                              -> mlp.router.gate
               model.layers.i.mlp.experts.j.{gate,up,down}_proj     -> mlp.experts.{gate,up,down}_proj[j]
               self_attn.q_norm / k_norm (RMSNorm over all heads)   -> self_attn.q_norm / k_norm
    Qwen2-MoE  as OLMoE for gate and experts, plus q/k/v biases, mlp.shared_expert.{gate,up,down}_proj,
               mlp.shared_expert_gate, and dense ``mlp.{gate,up,down}_proj`` in non-sparse layers
    DeepSeek   (V3 and V2) as OLMoE for gate and experts; MLA's self_attn.{q_proj | q_a_proj, q_a_layernorm,
               q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (same names on both sides);
               mlp.shared_experts.*_proj -> mlp.shared_expert.*_proj; V3's mlp.gate.e_score_correction_bias
               -> mlp.router.expert_bias (V2 has none: read as zeros, refused on the way back unless zero)

    Qwen3-MoE  as OLMoE for gate and experts, q_norm / k_norm per head ([head_dim]), dense ``mlp.*_proj`` in
               non-sparse layers; no shared expert
    gpt-oss    fused experts only (`GPTOSS_EXPERTS`: gate/up interleaved, transposed), with biases; router
               ``mlp.router.{weight,bias}`` -> mlp.router.gate; ``self_attn.sinks``; q/k/v/o biases. MXFP4
               experts (``*_blocks`` / ``*_scales``, as published) are dequantized on load to bf16
               (`dequantize_mxfp4`, equal to transformers' ``convert_moe_packed_tensors``); `to_hf` never
               writes MXFP4: it writes the model's dtype (bf16 for a published checkpoint loaded as is)
    GLM-4.5    as DeepSeek-V3 for router, experts, shared experts and dense layers; grouped-query attention with
               q/k/v biases and q_norm / k_norm per head (``use_qk_norm``), same names on both sides. The
               multi-token-prediction layers (``num_nextn_predict_layers``, stored as ``model.layers.{L}.*`` after
               the L decoder layers) are skipped on load, as transformers' Glm4MoeForCausalLM skips them
               (``_keys_to_ignore_on_load_unexpected``; only its ``generate(use_mtp=True)`` reads them), and never
               written: `to_hf` writes ``num_nextn_predict_layers: 0`` (`mtp_weight_names`)

Config (HF -> ours)::

    all        hidden_act "silu" -> ffn_activation "swiglu"; softmax top-k token choice, dropless -> router
               "topk"; rope_parameters' rope_theta (4.x config.json: rope_theta), rms_norm_eps, max_position_embeddings, tie_word_embeddings, pad/bos/eos
               ids, attention_dropout, initializer_range carry over; router_z_loss_coef = 0 (HF has none)
    Mixtral    num_local_experts -> num_experts; intermediate_size -> expert_intermediate_size; head_dim;
               norm_topk_prob = True (Mixtral always renormalizes); router_jitter_noise -> router_jitter
    OLMoE      num_experts; intermediate_size -> expert_intermediate_size; qk_norm = True; clip_qkv;
               norm_topk_prob
    Qwen2-MoE  moe_intermediate_size -> expert_intermediate_size; intermediate_size (dense layers);
               shared_expert_intermediate_size with num_shared_experts = 1 and shared_expert_gate = True;
               decoder_sparse_step -> moe_every_n; mlp_only_layers -> dense_layers; qkv_bias ->
               attention_bias; norm_topk_prob
    DeepSeek   attention_type "mla" with q_lora_rank, kv_lora_rank, qk_{nope,rope}_head_dim, v_head_dim (head_dim =
               qk_rope_head_dim), rope_interleave (V2: always); n_routed_experts, moe_intermediate_size, n_shared_experts
               (ungated, as wide as a routed expert), first_k_dense_replace -> dense_layers; router "deepseek":
               V3 sigmoid + bias, n_group/topk_group, group score top-2 sum; V2 softmax, topk_method greedy |
               group_limited_greedy (group score max); norm_topk_prob, routed_scaling_factor; rope_parameters
               (yarn) -> rope_yarn (MLA's softmax scale times mscale(factor, mscale_all_dim)^2, as transformers).
               Refused by name: other RoPE scalings, other topk_method/scoring_func, moe_layer_freq != 1, V2 norm_topk_prob=True,
               quantization_config, num_key_value_heads != num_attention_heads, attention/mlp biases. Balancing: V2's
               aux_loss_alpha is exactly router_aux_loss_coef; V3 gets 0 and router_bias_update_rate 0 (the
               published bias stays put unless the rate is set: `_deepseek_config_from_hf`)

    Qwen3-MoE  moe_intermediate_size -> expert_intermediate_size; decoder_sparse_step, mlp_only_layers,
               head_dim, norm_topk_prob; qk_norm = qk_norm_per_head = True; refused: use_sliding_window,
               attention_bias (it biases o_proj too)
    gpt-oss    num_local_experts; intermediate_size -> expert_intermediate_size; attention_bias -> attention_bias
               and o_proj_bias; sliding_window + layer_types -> attention_window + attention_window_layers;
               rope_parameters (yarn) -> rope_yarn; swiglu_limit/alpha; router_topk_order "topk_then_softmax",
               router_bias, expert_bias, attention_sinks = True; refused: other rope types, other layer types,
               a quantization_config other than mxfp4
    GLM-4.5    DeepSeek-V3's routing fields as above (router "deepseek", sigmoid + bias, top-2-sum group score,
               n_group/topk_group, norm_topk_prob, routed_scaling_factor; V3's balancing: coefficient 0, bias
               rate 0); num_key_value_heads, head_dim, attention_bias (q/k/v only), use_qk_norm -> qk_norm =
               qk_norm_per_head; rope_parameters' partial_rotary_factor -> rope_partial_factor (RoPE on the first
               int(head_dim * factor) dims, rotate-half); yarn -> rope_yarn. Refused: other RoPE types, odd rotary
               widths, n_shared_experts 0, quantization_config (`_glm4_moe_refusals`)

Load-balancing coefficient: our loss is ``E * sum_e f_e P_e`` with f_e the fraction of the T*K routed slots
(1.0 under uniform routing, `moe_core.routing`); transformers' ``load_balancing_loss_func`` averages its one-hot
over tokens but sums over the K slots, so for one layer it is exactly K times ours. Hence
``ours.router_aux_loss_coef = K * hf.router_aux_loss_coef`` (and back). Two differences remain and are
documented rather than converted: HF pools the router logits of all layers before taking the product while we
average per-layer losses (equal for one layer, both minimized by uniform routing), and HF adds the loss only
when ``output_router_logits=True`` (off by default; kept in ``hf_origin`` for the way back) while ours adds it
whenever the coefficient is above zero.

``config.hf_origin`` records the source architecture and every HF config field our config cannot regenerate
(e.g. ``output_router_logits``, ``max_window_layers``, ``head_dim: null``), so HF -> ours -> HF gives the same
HF config and the same tensors. Writes are atomic (a temporary directory next to the output, renamed into
place); tokenizer and generation files next to the source are copied along.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import CONFIG_MAPPING, GenerationConfig

from moe_core.config import YARN_KEYS, MoEConfig
from moe_core.data.framing import FRAMING_FILE
from moe_core.data.tokenizer import SPECIAL_TOKEN_FIELDS, set_model_input_names
from moe_core.errors import MoELabError
from moe_core.fileio import atomic_directory, check_output_dir
from moe_core.model import MoEForCausalLM
from moe_core.transformers_seam import no_init_weights

logger = logging.getLogger(__name__)


class ConversionError(MoELabError):
    """A checkpoint or config that cannot be converted exactly; the message says why and what to do."""


@dataclass(frozen=True)
class HFArchitecture:
    """Where a Hugging Face MoE architecture keeps its experts, and what it calls them."""

    model_type: str
    class_name: str
    moe_module: str  # attribute of the decoder layer holding router + experts
    expert_weights: tuple[str, str, str]  # HF names of our (gate_proj, up_proj, down_proj)
    shared_experts: str = (
        "shared_expert"  # HF name of the MoE block's shared-expert FFN (ours: shared_expert)
    )
    # the router's selection bias (ours: mlp.router.expert_bias): "none" (the architecture has none), "stored"
    # (DeepSeek-V3's mlp.gate.e_score_correction_bias), "zeros" (DeepSeek-V2 has none: read as zeros, and
    # written only while it is zero)
    router_bias: str = "none"


ARCHITECTURES: dict[str, HFArchitecture] = {
    "mixtral": HFArchitecture("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
    "olmoe": HFArchitecture("olmoe", "OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": HFArchitecture(
        "qwen2_moe", "Qwen2MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")
    ),
    # DeepSeek-V3 (Moonlight, Kimi K2) and DeepSeek-V2(-Lite): multi-head latent attention, shared experts, the
    # first layers dense, group-limited routing (`_deepseek_config_from_hf`)
    "deepseek_v3": HFArchitecture(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        shared_experts="shared_experts",
        router_bias="stored",
    ),
    "deepseek_v2": HFArchitecture(
        "deepseek_v2",
        "DeepseekV2ForCausalLM",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        shared_experts="shared_experts",
        router_bias="zeros",
    ),
    "qwen3_moe": HFArchitecture(
        "qwen3_moe", "Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")
    ),
    # experts always fused (`GPTOSS_EXPERTS`); the per-expert names below are the reader's aliases for them
    "gpt_oss": HFArchitecture("gpt_oss", "GptOssForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    # GLM-4.5 / GLM-4.5-Air: DeepSeek-V3's MoE (router with the selection bias, shared experts, dense first layers)
    # on grouped-query attention with partial RoPE (`_glm4_moe_config_from_hf`)
    "glm4_moe": HFArchitecture(
        "glm4_moe",
        "Glm4MoeForCausalLM",
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        shared_experts="shared_experts",
        router_bias="stored",
    ),
}
DEEPSEEK = ("deepseek_v3", "deepseek_v2")
SUPPORTED = ", ".join(f"{a.model_type} ({a.class_name})" for a in ARCHITECTURES.values())

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files that make a converted directory usable beyond the weights: tokenizers, chat templates, generation defaults,
# and a fine-tune's prompt framing (moe_core.data.framing), so quantized, pruned and converted copies keep it.
COMPANION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    FRAMING_FILE,
)
HUB_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", *COMPANION_FILES]
# Config keys that describe a file, not the architecture; never carried in hf_origin.
_VOLATILE_KEYS = (
    "transformers_version",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "model_type",
    "architectures",
)
_SILU = ("silu", "swish")  # the same function in transformers' ACT2FN


def get_architecture(name: str) -> HFArchitecture:
    """An architecture by model_type (``mixtral``) or class name (``MixtralForCausalLM``)."""
    for arch in ARCHITECTURES.values():
        if name in (arch.model_type, arch.class_name):
            return arch
    raise ConversionError(f"unsupported architecture {name!r}; supported: {SUPPORTED}")


# ================================================================================================ reading
def resolve_source(path_or_hub_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint directory, downloading config, safetensors and tokenizer files for a hub id."""
    path = Path(path_or_hub_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConversionError(f"{path} is a file; give the checkpoint directory that holds config.json")
    repo_id = str(path_or_hub_id)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ConversionError(f"{repo_id}: no such directory, and not a Hugging Face hub id either") from None
    # read at call time (huggingface_hub reads it once, at import)
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=offline
            )
        )
    except Exception as err:  # offline, not found, gated, no network: all end here
        hint = " (HF_HUB_OFFLINE is set: only the local cache is searched)" if offline else ""
        raise ConversionError(
            f"{repo_id}: no such local directory, and the hub snapshot could not be fetched{hint}: "
            f"{type(err).__name__}: {err}. Download it where the hub is reachable and pass the directory."
        ) from None


# transformers 5's fused expert layout (``save_pretrained(save_original_format=False)``; its modeling classes
# hold experts this way): layer i's ``model.layers.i.mlp.experts.gate_up_proj`` [E, 2F, D] (gate rows first, then
# up, as ``OlmoeExperts.forward`` chunks them), ``...mlp.experts.down_proj`` [E, D, F], router ``...mlp.gate``
_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


# gpt-oss's experts (always fused; transformers 5.24 models/gpt_oss/modeling_gpt_oss.py GptOssExperts): layer i's
# ``mlp.experts.gate_up_proj`` [E, D, 2F] (x @ W: transposed against nn.Linear, gate and up interleaved on the
# last axis), ``gate_up_proj_bias`` [E, 2F], ``down_proj`` [E, F, D], ``down_proj_bias`` [E, D]; router
# ``mlp.router.weight`` [E, D] and ``mlp.router.bias`` [E]
GPTOSS_EXPERTS = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$"
)


@dataclass(frozen=True)
class _GptOssSlice:
    """Expert ``expert``'s part of a gpt-oss fused tensor: ``half`` 0 (gate) / 1 (up) of the interleaved last axis
    or None (all of it), transposed to nn.Linear's [out, in] when ``transpose``."""

    expert: int
    half: int | None
    transpose: bool

    def __call__(self, fused: torch.Tensor) -> torch.Tensor:
        part = fused[self.expert]
        if self.half is not None:
            part = part[..., self.half :: 2]
        return part.transpose(0, 1) if self.transpose else part


# MXFP4 (OCP Microscaling, 4-bit E2M1 values in blocks of 32 sharing an E8M0 power-of-two scale), as the published
# gpt-oss checkpoints store their experts: ``<name>_blocks`` [E, R, G, 16] uint8 (two values per byte, low nibble
# first) and ``<name>_scales`` [E, R, G] uint8 (exponent + 127). The E2M1 code points, as transformers 5.24
# integrations/mxfp4.py FP4_VALUES
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(
    blocks_ERGB: torch.Tensor, scales_ERG: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP4 blocks and scales to a dense [E, G * 32, R] tensor in ``dtype`` (bf16: exact, every FP4 value times
    a power of two is a bf16 number), the layout transformers' ``convert_moe_packed_tensors`` returns, i.e. the
    fused weight of a bf16 gpt-oss checkpoint. One expert at a time, so the scratch is one expert's values."""
    E, R, G, B = blocks_ERGB.shape
    if scales_ERG.shape != (E, R, G):
        raise ConversionError(
            f"MXFP4 scales of shape {tuple(scales_ERG.shape)} do not match blocks {(E, R, G, B)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out_EIR = torch.empty(E, G * B * 2, R, dtype=dtype)
    for e in range(E):
        codes = blocks_ERGB[e].to(torch.uint8)
        values_RGB2 = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1)
        exponent_RG1 = scales_ERG[e].to(torch.int32)[..., None, None] - 127
        values_RGB2 = torch.ldexp(values_RGB2.float(), exponent_RG1.float()).to(dtype)
        out_EIR[e] = values_RGB2.reshape(R, G * B * 2).transpose(0, 1)
    return out_EIR


class CheckpointReader:
    """Tensors of a Hugging Face checkpoint, read one at a time by name.

    safetensors (``model.safetensors`` or shards listed in ``model.safetensors.index.json``) are memory-mapped;
    PyTorch ``.bin`` files are read with ``torch.load(weights_only=True)``, never with a general unpickler.

    With ``arch`` given, a checkpoint in transformers 5's fused expert layout (`_FUSED_EXPERTS`) is read under the
    per-expert names hub checkpoints use (and transformers writes by default), so one name table
    (`weight_plan`) serves both: expert j's gate_proj is ``gate_up_proj[j, :F]``, its up_proj
    ``gate_up_proj[j, F:]``, its down_proj ``down_proj[j]`` (views of the fused tensor, read once per layer).
    """

    def __init__(self, directory: Path, arch: HFArchitecture | None = None) -> None:
        self.directory = directory
        self._open: dict[Path, Any] = {}
        self.file_of: dict[str, Path] = {}
        self._alias: dict[str, tuple[str, tuple]] = {}  # per-expert name -> (fused name, index into it)
        self._held: tuple[str, torch.Tensor] | None = None  # the fused tensor last read (one layer's stack)
        self._fused_file: dict[str, Path] = {}  # fused name -> its file (file_of lists the per-expert names)
        for index_name, single_name in (
            ("model.safetensors.index.json", "model.safetensors"),
            ("pytorch_model.bin.index.json", "pytorch_model.bin"),
        ):
            if (directory / index_name).is_file():
                weight_map = json.loads((directory / index_name).read_text())["weight_map"]
                self.file_of = {name: directory / file for name, file in weight_map.items()}
                break
            if (directory / single_name).is_file():
                self.file_of = {
                    name: directory / single_name for name in self._shard(directory / single_name).keys()
                }
                break
        else:
            raise ConversionError(
                f"{directory}: no weights found; expected model.safetensors, model.safetensors.index.json, "
                f"pytorch_model.bin or pytorch_model.bin.index.json (hub ids fetch safetensors only, never "
                f"pickled files)"
            )
        self._zeros: dict[str, tuple[int, ...]] = {}  # names served as zeros (`_zero_router_biases`)
        self._mxfp4: dict[str, tuple[str, str]] = {}  # gpt-oss: fused name -> its MXFP4 (blocks, scales)
        if arch is not None and arch.model_type == "gpt_oss":
            self._alias_gptoss()
        elif arch is not None:
            self._alias_fused(arch)
            if arch.router_bias == "zeros":
                self._zero_router_biases()

    def _zero_router_biases(self) -> None:
        """DeepSeek-V2 has no selection bias; our router (`moe_core.routing.DeepSeekRouter`) has one, which such
        a checkpoint gives as zeros, under DeepSeek-V3's name (so one name table serves both)."""
        for name in list(self.file_of):
            match = re.match(r"^model\.layers\.(\d+)\.mlp\.gate\.weight$", name)
            if match:
                self._zeros[f"model.layers.{match.group(1)}.mlp.gate.e_score_correction_bias"] = (
                    self.shape(name)[0],
                )

    def _alias_gptoss(self) -> None:
        """gpt-oss's fused experts (`GPTOSS_EXPERTS`) read under per-expert names: expert j's gate_proj is
        ``gate_up_proj[j, :, 0::2].T`` (gate and up interleaved along the last axis, modeling_gpt_oss.py
        ``_apply_gate``), its up_proj ``gate_up_proj[j, :, 1::2].T``, its down_proj ``down_proj[j].T``; the biases
        likewise. MXFP4 weights (``*_blocks`` / ``*_scales``, the published checkpoints) are dequantized on read."""
        experts_of: dict[str, int] = {}
        for name in list(self.file_of):
            if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in self.file_of:
                fused = name.removesuffix("_blocks")
                self._mxfp4[fused] = (name, fused + "_scales")
                self.file_of[fused] = self.file_of[name]
                experts_of[fused] = self.shape(name)[0]
        for blocks, scales in self._mxfp4.values():
            self._fused_file[blocks] = self.file_of.pop(blocks)
            self._fused_file[scales] = self.file_of.pop(scales)
        for name in [n for n in self.file_of if GPTOSS_EXPERTS.match(n)]:
            i, kind = GPTOSS_EXPERTS.match(name).groups()
            E = experts_of[name] if name in experts_of else self.shape(name)[0]
            experts = f"model.layers.{i}.mlp.experts"
            for j in range(E):
                if kind == "gate_up_proj":
                    self._alias[f"{experts}.{j}.gate_proj.weight"] = (name, _GptOssSlice(j, 0, True))
                    self._alias[f"{experts}.{j}.up_proj.weight"] = (name, _GptOssSlice(j, 1, True))
                elif kind == "gate_up_proj_bias":
                    self._alias[f"{experts}.{j}.gate_proj.bias"] = (name, _GptOssSlice(j, 0, False))
                    self._alias[f"{experts}.{j}.up_proj.bias"] = (name, _GptOssSlice(j, 1, False))
                elif kind == "down_proj":
                    self._alias[f"{experts}.{j}.down_proj.weight"] = (name, _GptOssSlice(j, None, True))
                else:
                    self._alias[f"{experts}.{j}.down_proj.bias"] = (name, _GptOssSlice(j, None, False))
        for alias, (name, _) in self._alias.items():
            self.file_of[alias] = self.file_of[name]
        for name in {name for name, _ in self._alias.values()}:
            self._fused_file[name] = self.file_of.pop(name)

    def _alias_fused(self, arch: HFArchitecture) -> None:
        for name in [n for n in self.file_of if _FUSED_EXPERTS.match(n)]:
            i, kind = _FUSED_EXPERTS.match(name).groups()
            E, rows = self.shape(name)[:2]
            moe = f"model.layers.{i}.{arch.moe_module}"
            gate, up, down = arch.expert_weights
            parts = (
                ((gate, slice(0, rows // 2)), (up, slice(rows // 2, rows)))
                if kind == "gate_up_proj"
                else ((down, slice(None)),)
            )
            for j in range(E):
                for leaf, rows_slice in parts:
                    self._alias[f"{moe}.experts.{j}.{leaf}.weight"] = (name, (j, rows_slice))
            router = f"model.layers.{i}.mlp.gate.weight"
            if arch.moe_module != "mlp" and router in self.file_of:  # Mixtral: block_sparse_moe in 4.x names
                self._alias[f"{moe}.gate.weight"] = (router, ())
        for alias, (name, _) in self._alias.items():
            self.file_of[alias] = self.file_of[name]
        for name in {name for name, _ in self._alias.values()}:
            self._fused_file[name] = self.file_of.pop(name)

    def _shard(self, file: Path):
        if file not in self._open:
            if not file.is_file():
                raise ConversionError(f"{file}: listed in the checkpoint index but missing")
            if file.suffix == ".safetensors":
                self._open[file] = safe_open(str(file), framework="pt", device="cpu")
            else:
                try:
                    self._open[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # legacy (non-zip) serialization cannot be memory-mapped
                    self._open[file] = torch.load(file, map_location="cpu", weights_only=True)
        return self._open[file]

    def release(self, file: Path) -> None:
        """Close ``file``'s handle (its mapping goes once no tensor read from it is alive); read again, it
        reopens."""
        self._open.pop(file, None)
        if self._held is not None and self._fused_file.get(self._held[0]) == file:
            self._held = None

    def __deepcopy__(self, memo) -> CheckpointReader:
        return self  # read-only file handles: a copied model (a DPO reference) shares them, as it shares the files

    def names(self) -> set[str]:
        return set(self.file_of) | set(self._zeros)

    def dequantized_on_read(self) -> list[str]:
        """The stored tensors this reader dequantizes as it reads them (gpt-oss's MXFP4 experts): what it gives
        for those is a new tensor each time, never a view of the file (`moe_core.mapped` refuses them)."""
        return sorted(self._mxfp4)

    def source_of(self, name: str) -> str:
        """The stored tensor ``name`` is read from: itself, or the fused tensor it is a slice of."""
        return self._alias[name][0] if name in self._alias else name

    def get(self, name: str) -> torch.Tensor:
        if name in self._zeros:
            return torch.zeros(self._zeros[name])
        if name in self._alias:
            fused, index = self._alias[name]
            if self._held is None or self._held[0] != fused:
                self._held = (fused, self._read(fused))
            if isinstance(index, _GptOssSlice):
                return index(self._held[1])
            return self._held[1][index] if index else self._held[1]
        return self._read(name)

    def _read(self, name: str) -> torch.Tensor:
        if name in self._mxfp4:
            blocks, scales = self._mxfp4[name]
            return dequantize_mxfp4(self._read(blocks), self._read(scales))
        shard = self._shard(self._fused_file.get(name) or self.file_of[name])
        return shard.get_tensor(name) if hasattr(shard, "get_tensor") else shard[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._zeros:
            return self._zeros[name]
        shard = self._shard(self.file_of[name])
        return tuple(shard.get_slice(name).get_shape() if hasattr(shard, "get_slice") else shard[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        if name in self._zeros:
            return torch.float32
        name = self._alias[name][0] if name in self._alias else name
        if name in self._mxfp4:
            return torch.bfloat16  # what `dequantize_mxfp4` gives (as transformers without an MXFP4 kernel)
        shard = self._shard(self._fused_file.get(name) or self.file_of[name])
        if hasattr(shard, "get_slice"):
            stored = shard.get_slice(name).get_dtype()
            return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}[
                stored
            ]
        return shard[name].dtype


def read_hf_config(directory: Path) -> tuple[HFArchitecture, Any, dict[str, Any]]:
    """The architecture, the transformers config object and the raw config.json of a HF checkpoint."""
    file = directory / "config.json"
    if not file.is_file():
        raise ConversionError(f"{directory}: no config.json; is this a Hugging Face checkpoint directory?")
    raw = json.loads(file.read_text())
    model_type = raw.get("model_type")
    if model_type == MoEConfig.model_type:
        raise ConversionError(f"{directory} is already a moe_lab checkpoint; load it with moe_core.load")
    if model_type not in ARCHITECTURES:
        raise ConversionError(
            f"{directory}: model_type {model_type!r} is not supported; supported: {SUPPORTED}"
        )
    arch = ARCHITECTURES[model_type]
    return arch, CONFIG_MAPPING[model_type](**{k: v for k, v in raw.items() if k != "model_type"}), raw


# ================================================================================================ configs
def ffn_and_rope_refusals(hf, yarn: bool = False) -> list[str]:
    """What a transformers config's activation and RoPE say that our model cannot express (SwiGLU experts,
    RoPE over the whole head, unscaled unless ``yarn``: YaRN for the families that read it into
    `MoEConfig.rope_yarn`): shared by conversion and upcycling."""
    reasons = []
    if hf.hidden_act not in _SILU:
        reasons.append(
            f"hidden_act={hf.hidden_act!r}: our experts are SwiGLU (silu), so only 'silu' converts"
        )
    if yarn:
        rope = {k: v for k, v in rope_extras(hf).items() if k != "type"}  # (4.x rope_scaling's alias)
        reasons += _rope_refusals(rope.pop("rope_type", "default"), rope)
    elif rope_extras(hf):
        reasons.append(
            f"rope_parameters={hf.rope_parameters!r} (config.json's rope_scaling or rope_parameters): our RoPE "
            "is unscaled; only rope_type 'default' (with rope_theta) converts"
        )
    if getattr(hf, "partial_rotary_factor", 1.0) != 1.0:
        reasons.append(f"partial_rotary_factor={hf.partial_rotary_factor}: our RoPE rotates the whole head")
    return reasons


def _refusals_from_hf(arch: HFArchitecture, hf) -> list[str]:
    if arch.model_type == "gpt_oss":
        return _gptoss_refusals(hf)
    if arch.model_type == "glm4_moe":
        return _glm4_moe_refusals(hf)
    reasons = ffn_and_rope_refusals(hf, yarn=arch.model_type in DEEPSEEK)
    if arch.model_type == "mixtral" and hf.sliding_window is not None:
        reasons.append(f"sliding_window={hf.sliding_window}: our attention is full causal attention")
    if arch.model_type == "qwen2_moe" and hf.use_sliding_window:
        reasons.append("use_sliding_window=True: our attention is full causal attention")
    if arch.model_type == "qwen3_moe":
        reasons += _qwen3_moe_refusals(hf)
    if arch.model_type == "olmoe" and hf.attention_bias:
        reasons.append(
            "attention_bias=True: OLMoE then also biases o_proj, which our attention has no bias for"
        )
    if arch.model_type in DEEPSEEK:
        reasons += _deepseek_refusals_from_hf(arch, hf)
    return reasons


# What each DeepSeek router variant transformers 5.24 implements (``DeepseekV3TopkRouter``: sigmoid scores,
# the noaux_tc selection whatever config.json says; ``DeepseekV2TopkRouter``: softmax, topk_method below)
_DEEPSEEK_SCORING = {"deepseek_v3": "sigmoid", "deepseek_v2": "softmax", "glm4_moe": "sigmoid"}
_DEEPSEEK_TOPK_METHODS = {"deepseek_v3": ("noaux_tc",), "deepseek_v2": ("greedy", "group_limited_greedy")}


def _deepseek_refusals_from_hf(arch: HFArchitecture, hf) -> list[str]:
    """What a DeepSeek-V2/V3 config says that the lab cannot express exactly (`_refusals_from_hf`)."""
    reasons = []
    quantization = getattr(hf, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        reasons.append(
            f"quantization_config (quant_method={method!r}): the lab reads float32/bfloat16/float16 weights "
            "only; dequantize the checkpoint first (e.g. DeepSeek's fp8_cast_bf16.py) and drop the field"
        )
    if hf.num_key_value_heads != hf.num_attention_heads:
        reasons.append(
            f"num_key_value_heads={hf.num_key_value_heads}: multi-head latent attention expands the latent into "
            f"every head; only num_key_value_heads == num_attention_heads ({hf.num_attention_heads}) converts"
        )
    if hf.attention_bias:
        reasons.append(
            "attention_bias=True: our multi-head latent attention has no biases; only False converts"
        )
    if getattr(hf, "mlp_bias", False):
        reasons.append("mlp_bias=True: our FFNs and experts have no biases; only False converts")
    freq = getattr(hf, "moe_layer_freq", 1)
    if freq not in (None, 1):
        reasons.append(
            f"moe_layer_freq={freq}: transformers 5.24 ignores it (every layer from first_k_dense_replace on "
            "is an MoE layer) while DeepSeek's code does not, so the meaning is ambiguous; only 1 converts"
        )
    scoring = getattr(hf, "scoring_func", None)
    if scoring not in (None, _DEEPSEEK_SCORING[arch.model_type]):
        reasons.append(
            f"scoring_func={scoring!r}: transformers' {arch.class_name} scores experts with "
            f"{_DEEPSEEK_SCORING[arch.model_type]!r} only"
        )
    method = getattr(hf, "topk_method", None)
    methods = _DEEPSEEK_TOPK_METHODS[arch.model_type]
    if method is not None and method not in methods:
        reasons.append(
            f"topk_method={method!r}: transformers 5.24's {arch.class_name} implements {', '.join(methods)} only"
        )
    grouped = arch.model_type == "deepseek_v3" or method == "group_limited_greedy"
    E = hf.n_routed_experts
    if grouped and not (
        isinstance(hf.n_group, int)
        and isinstance(hf.topk_group, int)
        and hf.n_group >= 1
        and E % hf.n_group == 0
        and 1 <= hf.topk_group <= hf.n_group
    ):
        reasons.append(
            f"n_group={hf.n_group}, topk_group={hf.topk_group}: group-limited routing needs n_group dividing "
            f"n_routed_experts={E} and 1 <= topk_group <= n_group"
        )
    if arch.model_type == "deepseek_v2" and hf.norm_topk_prob:
        reasons.append(
            "norm_topk_prob=True: transformers 5.24's DeepseekV2TopkRouter ignores it while DeepSeek's code "
            "renormalizes, so the meaning is ambiguous; only False converts"
        )
    return reasons


def _qwen3_moe_refusals(hf) -> list[str]:
    """What a Qwen3-MoE config says that our model cannot express (transformers models/qwen3_moe)."""
    reasons = []
    if hf.use_sliding_window:
        reasons.append(
            "use_sliding_window=True: Qwen3-MoE's sliding window is not supported; set it to false"
        )
    if hf.attention_bias:
        reasons.append(
            "attention_bias=True: Qwen3-MoE then also biases o_proj, which our attention has no bias for; "
            "supported: false"
        )
    return reasons


def _glm4_moe_rope(hf) -> tuple[str, dict[str, Any], float]:
    """A GLM-4.5 config's RoPE: ``(rope_type, its other parameters, partial_rotary_factor)``; transformers 5 moves
    ``partial_rotary_factor`` (config.json's top-level key, default 0.5 in Glm4MoeConfig) into ``rope_parameters``."""
    rope = {k: v for k, v in (hf.rope_parameters or {}).items() if k not in ("rope_theta", "type")}
    factor = rope.pop("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    return rope.pop("rope_type", "default"), rope, float(factor if factor is not None else 1.0)


def _glm4_moe_head_dim(hf) -> int:
    """As Glm4MoeAttention reads it: ``head_dim`` when the config has one (GLM-4.5: 128 with 96 heads over a
    hidden size of 4096), else hidden_size / num_attention_heads."""
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def _glm4_moe_refusals(hf) -> list[str]:
    """What a GLM-4.5 config says that the lab cannot express exactly (transformers 5.24
    ``models/glm4_moe/modeling_glm4_moe.py``): SwiGLU FFNs, plain or YaRN RoPE over an even number of each head's
    dims, DeepSeek-V3's group-limited routing with at least one shared expert, unquantized weights."""
    reasons = []
    if hf.hidden_act not in _SILU:
        reasons.append(
            f"hidden_act={hf.hidden_act!r}: our FFNs and experts are SwiGLU (silu); only 'silu' converts"
        )
    rope_type, rope, factor = _glm4_moe_rope(hf)
    reasons += _rope_refusals(rope_type, rope)
    rotary = int(_glm4_moe_head_dim(hf) * factor)
    if not 0 < factor <= 1 or rotary < 2 or rotary % 2:
        reasons.append(
            f"partial_rotary_factor={factor}: RoPE would rotate int(head_dim={_glm4_moe_head_dim(hf)} * factor) = "
            f"{rotary} dims of each head; only a factor in (0, 1] giving an even number >= 2 converts"
        )
    quantization = getattr(hf, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        reasons.append(
            f"quantization_config (quant_method={method!r}): the lab reads float32/bfloat16/float16 weights only; "
            "use the unquantized checkpoint (GLM-4.5-Air, not GLM-4.5-Air-FP8) or dequantize it and drop the field"
        )
    if not (isinstance(hf.n_shared_experts, int) and hf.n_shared_experts >= 1):
        reasons.append(
            f"n_shared_experts={hf.n_shared_experts}: Glm4MoeMoE always adds a shared expert of width "
            "moe_intermediate_size * n_shared_experts; only >= 1 converts"
        )
    E, G, Gk = hf.n_routed_experts, hf.n_group, hf.topk_group
    if not (isinstance(G, int) and isinstance(Gk, int) and G >= 1 and E % G == 0 and 1 <= Gk <= G):
        reasons.append(
            f"n_group={G}, topk_group={Gk}: group-limited routing needs n_group dividing n_routed_experts={E} and "
            "1 <= topk_group <= n_group"
        )
    elif E // G < 2:  # Glm4MoeTopkRouter scores each group by its two best experts
        reasons.append(
            f"n_group={G}: Glm4MoeTopkRouter needs at least 2 experts per group (n_routed_experts={E})"
        )
    elif hf.num_experts_per_tok > Gk * (E // G):
        reasons.append(
            f"num_experts_per_tok={hf.num_experts_per_tok}: more than the {Gk * (E // G)} experts in topk_group={Gk} "
            "groups"
        )
    return reasons


def _glm4_moe_config_from_hf(hf) -> dict[str, Any]:
    """Our config fields for a GLM-4.5 config (transformers 5.24 ``models/glm4_moe``): grouped-query attention with
    its head_dim, q/k/v biases (``attention_bias``; o_proj has none), RMSNorm per head on q and k when
    ``use_qk_norm``, RoPE on the first ``int(head_dim * partial_rotary_factor)`` dims; the MoE as DeepSeek-V3's
    (`_deepseek_config_from_hf`): layers from ``first_k_dense_replace`` on are MoE layers, ``n_shared_experts``
    ungated shared experts of width ``moe_intermediate_size``, sigmoid scores with the selection bias
    (``e_score_correction_bias`` -> the router's ``expert_bias``), top-2-sum group scores. Balancing: transformers
    has no router loss for GLM; the coefficient and the bias update rate are 0, so the published bias stays as it
    is unless ``router_bias_update_rate`` is set."""
    rope_type, rope, factor = _glm4_moe_rope(hf)
    return dict(
        **_decoder_fields(hf),
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=_glm4_moe_head_dim(hf),
        attention_bias=bool(hf.attention_bias),
        qk_norm=bool(hf.use_qk_norm),
        qk_norm_per_head=bool(hf.use_qk_norm),
        rope_partial_factor=factor,
        rope_yarn=rope if rope_type == "yarn" else None,
        **_deepseek_moe_fields(hf),
        router_score="sigmoid",
        norm_topk_prob=bool(hf.norm_topk_prob),
        router_groups=hf.n_group,
        router_topk_groups=hf.topk_group,
        router_group_score="top2_sum",
        router_aux_loss_coef=0.0,
    )


def _rope_refusals(rope_type: str, rope: dict[str, Any]) -> list[str]:
    """RoPE the lab computes (`moe_core.model.RotaryEmbedding`): plain, or YaRN with transformers' keys."""
    if rope_type not in ("default", "yarn"):
        return [f"rope_parameters rope_type={rope_type!r}: supported 'yarn' and 'default'"]
    if rope_type == "default":
        return [f"rope_parameters {sorted(rope)}: plain RoPE takes rope_theta only"] if rope else []
    reasons = []
    unknown = sorted(set(rope) - set(YARN_KEYS))
    if unknown:
        reasons.append(f"rope_parameters {unknown}: YaRN takes {list(YARN_KEYS)} only")
    if rope.get("factor") is None:  # transformers would derive it from max_position_embeddings
        reasons.append("rope_parameters: YaRN without 'factor' is not supported; give the factor")
    return reasons


def _yarn_of(hf) -> dict[str, Any] | None:
    """`MoEConfig.rope_yarn` of a config whose ``rope_parameters`` say YaRN (transformers' key names)."""
    rope = dict(hf.rope_parameters or {})
    if rope.get("rope_type") != "yarn":
        return None
    return {
        k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta", "type")
    }  # (type: 4.x alias)


def _gptoss_refusals(hf) -> list[str]:
    """What a gpt-oss config says that our model cannot express (transformers models/gpt_oss). Its RoPE is YaRN
    (or plain), its experts the clamped SwiGLU whatever ``hidden_act`` says (GptOssExperts never reads it)."""
    reasons = []
    rope = dict(hf.rope_parameters or {})
    rope_type = rope.pop("rope_type", "default")
    rope.pop("rope_theta", None)
    reasons += _rope_refusals(rope_type, rope)
    kinds = set(hf.layer_types or [])
    if kinds - {"sliding_attention", "full_attention"}:
        reasons.append(
            f"layer_types {sorted(kinds - {'sliding_attention', 'full_attention'})}: supported "
            "'sliding_attention' and 'full_attention'"
        )
    if getattr(hf, "partial_rotary_factor", 1.0) != 1.0:
        reasons.append(f"partial_rotary_factor={hf.partial_rotary_factor}: our RoPE rotates the whole head")
    quantization = getattr(hf, "quantization_config", None)
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        if method != "mxfp4":
            reasons.append(
                f"quantization_config quant_method={method!r}: supported 'mxfp4' (dequantized to bf16 on load)"
            )
    return reasons


def _gptoss_config(hf) -> dict[str, Any]:
    """Our fields for a gpt-oss config (every layer MoE, biased router and experts, sinks, windows, YaRN)."""
    yarn = _yarn_of(hf)
    window_layers = [i for i, kind in enumerate(hf.layer_types or []) if kind == "sliding_attention"]
    return dict(
        num_experts=hf.num_local_experts,
        expert_intermediate_size=hf.intermediate_size,
        intermediate_size=hf.intermediate_size,
        head_dim=hf.head_dim,
        attention_bias=hf.attention_bias,
        o_proj_bias=hf.attention_bias,
        attention_sinks=True,
        attention_window=hf.sliding_window if window_layers else None,
        attention_window_layers=window_layers if window_layers else None,
        rope_yarn=yarn,
        router_topk_order="topk_then_softmax",  # top-k of the biased logits, softmax over those K
        norm_topk_prob=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=hf.swiglu_limit,
        swiglu_alpha=hf.swiglu_alpha,
    )


_LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling")  # transformers 4's config.json fields for RoPE


def rope_theta(hf) -> float:
    """RoPE's base of a transformers 5 config (``rope_parameters``; a 4.x config.json's top-level ``rope_theta``
    is folded into it when the config is built)."""
    return float((hf.rope_parameters or {}).get("rope_theta", hf.default_theta))


def rope_extras(hf) -> dict[str, Any]:
    """What a config's ``rope_parameters`` says beyond plain RoPE with a base (scaling, partial rotation)."""
    params = dict(hf.rope_parameters or {})
    params.pop("rope_theta", None)
    if params.get("rope_type") == "default":
        params.pop("rope_type")
    return params


def config_from_hf(arch: HFArchitecture, hf, raw: dict[str, Any] | None = None) -> MoEConfig:
    """Our config for a transformers config of `arch`; refuses what our model cannot express exactly."""
    reasons = _refusals_from_hf(arch, hf)
    if reasons:
        raise ConversionError(
            f"cannot convert this {arch.class_name} exactly:\n  - " + "\n  - ".join(reasons)
        )
    if arch.model_type in DEEPSEEK:
        return _with_origin(arch, MoEConfig(**_deepseek_config_from_hf(arch, hf)), hf, raw)
    if arch.model_type == "glm4_moe":
        return _with_origin(arch, MoEConfig(**_glm4_moe_config_from_hf(hf)), hf, raw)
    K = hf.num_experts_per_tok
    common = dict(
        **_decoder_fields(hf),
        num_key_value_heads=hf.num_key_value_heads,
        ffn_activation="swiglu",
        num_experts_per_tok=K,
        router="topk",
        router_score="softmax",
        router_topk_order="softmax_then_topk",
        capacity_factor=None,
        router_aux_loss_coef=K * hf.router_aux_loss_coef,  # HF's loss is K times ours (module docstring)
        router_z_loss_coef=0.0,
    )
    if arch.model_type == "mixtral":
        if hf.router_jitter_noise:
            logger.warning(
                "router_jitter_noise=%s: HF Mixtral also multiplies the experts' input by the noise in "
                "training; ours jitters the router input only (no effect in eval)",
                hf.router_jitter_noise,
            )
        specific = dict(
            num_experts=hf.num_local_experts,
            expert_intermediate_size=hf.intermediate_size,
            intermediate_size=hf.intermediate_size,
            head_dim=hf.head_dim,
            norm_topk_prob=True,
            router_jitter=hf.router_jitter_noise,
        )
    elif arch.model_type == "olmoe":
        specific = dict(
            num_experts=hf.num_experts,
            expert_intermediate_size=hf.intermediate_size,
            intermediate_size=hf.intermediate_size,
            qk_norm=True,
            clip_qkv=hf.clip_qkv,
            norm_topk_prob=hf.norm_topk_prob,
        )
    elif arch.model_type == "gpt_oss":
        specific = _gptoss_config(hf)
    elif arch.model_type == "qwen3_moe":  # no shared expert, per-head q/k norm, explicit head_dim
        specific = dict(
            num_experts=hf.num_experts,
            expert_intermediate_size=hf.moe_intermediate_size,
            intermediate_size=hf.intermediate_size,
            moe_every_n=hf.decoder_sparse_step,
            dense_layers=list(hf.mlp_only_layers),
            qk_norm=True,
            qk_norm_per_head=True,
            norm_topk_prob=hf.norm_topk_prob,
            head_dim=getattr(hf, "head_dim", None),
        )
    else:
        specific = dict(
            num_experts=hf.num_experts,
            expert_intermediate_size=hf.moe_intermediate_size,
            intermediate_size=hf.intermediate_size,
            num_shared_experts=1,
            shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
            shared_expert_gate=True,
            moe_every_n=hf.decoder_sparse_step,
            dense_layers=list(hf.mlp_only_layers),
            attention_bias=hf.qkv_bias,
            norm_topk_prob=hf.norm_topk_prob,
            head_dim=getattr(hf, "head_dim", None),
        )
    # specific fields win (gpt-oss's top-k order)
    return _with_origin(arch, MoEConfig(**{**common, **specific}), hf, raw)


def _with_origin(arch: HFArchitecture, config: MoEConfig, hf, raw: dict[str, Any] | None) -> MoEConfig:
    """`config` with ``hf_origin``: the source architecture and the HF fields our config does not regenerate."""
    raw = hf.to_dict() if raw is None else raw
    # transformers 4's spelling of RoPE (what hub checkpoints carry): the theta is ours, and written back as
    # transformers 5's rope_parameters; rope_scaling was refused above unless null
    raw = {k: v for k, v in raw.items() if k not in _LEGACY_ROPE_KEYS}
    mapped = hf_config_fields(arch, config)
    extra = {k: v for k, v in raw.items() if k not in _VOLATILE_KEYS and not (k in mapped and mapped[k] == v)}
    config.hf_origin = {"architecture": arch.class_name, "model_type": arch.model_type, "config": extra}
    return config


def _decoder_fields(hf) -> dict[str, Any]:
    """The fields every family's config carries under the same names (sizes, RoPE's base, norms, special ids)."""
    return dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        max_position_embeddings=hf.max_position_embeddings,
        rope_theta=rope_theta(hf),
        rms_norm_eps=hf.rms_norm_eps,
        attention_dropout=hf.attention_dropout,
        initializer_range=hf.initializer_range,
        use_cache=hf.use_cache,
        tie_word_embeddings=hf.tie_word_embeddings,
        pad_token_id=hf.pad_token_id,
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
    )


def _deepseek_moe_fields(hf) -> dict[str, Any]:
    """The MoE fields DeepSeek-V3/V2 and GLM-4.5 configs share (their scoring, groups and balancing differ and are
    the callers'): the first ``first_k_dense_replace`` layers dense of width ``intermediate_size``, routed SwiGLU
    experts of width ``moe_intermediate_size`` with as many ungated shared experts of that width, the ``deepseek``
    router selecting from softmax/sigmoid scores and scaling by ``routed_scaling_factor``; no capacity, no z-loss,
    and a bias update rate of 0 (the published selection bias stays as it is unless set)."""
    return dict(
        ffn_activation="swiglu",
        intermediate_size=hf.intermediate_size,
        num_experts=hf.n_routed_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        expert_intermediate_size=hf.moe_intermediate_size,
        dense_layers=list(range(min(hf.first_k_dense_replace or 0, hf.num_hidden_layers))),
        num_shared_experts=hf.n_shared_experts,
        shared_expert_intermediate_size=hf.moe_intermediate_size,
        shared_expert_gate=False,
        router="deepseek",
        router_topk_order="softmax_then_topk",
        routed_scaling_factor=float(hf.routed_scaling_factor),
        capacity_factor=None,
        router_bias_update_rate=0.0,
        router_z_loss_coef=0.0,
    )


def _deepseek_moe_hf_fields(config: MoEConfig) -> dict[str, Any]:
    """`_deepseek_moe_fields` the other way: the MoE widths and layer split of a DeepSeek-V3/V2 or GLM-4.5
    config (the dense layers are the first ``first_k_dense_replace``; refusals check that)."""
    return dict(
        n_routed_experts=config.num_experts,
        moe_intermediate_size=config.expert_intermediate_size,
        intermediate_size=config.intermediate_size,
        n_shared_experts=config.num_shared_experts,
        first_k_dense_replace=len(config.dense_layers),
    )


def _deepseek_config_from_hf(arch: HFArchitecture, hf) -> dict[str, Any]:
    """Our config fields for a DeepSeek-V3 / V2 config (transformers 5.24 ``models/deepseek_v{3,2}``).

    MLA widths carry over (head_dim = qk_rope_head_dim, as HF sets it); V2 rotates interleaved pairs (its
    complex product), V3 as ``rope_interleave`` says. Layers from ``first_k_dense_replace`` on are MoE layers,
    the first ones dense of width ``intermediate_size``; ``n_shared_experts`` ungated shared experts of width
    ``moe_intermediate_size``. Routing (`moe_core.routing.DeepSeekRouter`): V3 sigmoid, group score top-2 sum,
    ``e_score_correction_bias`` -> the router's ``expert_bias``; V2 softmax, ``greedy`` = one group,
    ``group_limited_greedy`` scores a group by its best expert. Balancing: transformers has no router loss for
    either; V2's ``aux_loss_alpha`` (DeepSeek's expert-level balance loss, alpha * sum_i f_i P_i with f_i the
    load relative to uniform) is exactly our coefficient (its ``seq_aux`` per-sequence statistics excepted),
    V3 gets 0 and a bias update rate of 0: the published bias stays as it is unless ``router_bias_update_rate``
    is set (DeepSeek-V3 pretrained with 0.001).
    """
    v3 = arch.model_type == "deepseek_v3"
    grouped = v3 or getattr(hf, "topk_method", "greedy") == "group_limited_greedy"
    return dict(
        **_decoder_fields(hf),
        num_key_value_heads=hf.num_attention_heads,
        attention_type="mla",
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        head_dim=hf.qk_rope_head_dim,
        rope_interleave=bool(hf.rope_interleave) if v3 else True,
        rope_yarn=_yarn_of(hf),
        **_deepseek_moe_fields(hf),
        router_score=_DEEPSEEK_SCORING[arch.model_type],
        norm_topk_prob=bool(hf.norm_topk_prob) if v3 else False,
        router_groups=hf.n_group if grouped else 1,
        router_topk_groups=hf.topk_group if grouped else 1,
        router_group_score="top2_sum" if v3 else "max",
        router_aux_loss_coef=0.0 if v3 else float(getattr(hf, "aux_loss_alpha", 0.0) or 0.0),
    )


def refusals_to_hf(config: MoEConfig, arch: HFArchitecture) -> list[str]:
    """Every reason `config` cannot be written as `arch` exactly (empty when it can)."""
    if arch.model_type in DEEPSEEK:
        return _deepseek_refusals_to_hf(config, arch)
    if arch.model_type == "glm4_moe":
        return _glm4_moe_refusals_to_hf(config, arch)
    name, reasons = arch.class_name, _partial_rope_refusals(config, arch)
    if config.attention_type == "mla":
        reasons.append(
            f"attention_type='mla': {name} has grouped-query attention; use deepseek_v3 or deepseek_v2"
        )
    dense_layers_ok = arch.model_type in ("qwen2_moe", "qwen3_moe")  # decoder_sparse_step, mlp_only_layers
    if config.num_experts == 0 and not dense_layers_ok:
        reasons.append(f"num_experts=0 (a dense model): {name} has experts in every layer; use qwen2_moe")
    if config.num_experts > 0:
        if config.router not in ("topk", "switch"):
            reasons.append(f"router={config.router!r}: {name} routes by softmax top-k token choice only")
        if config.router_score != "softmax":
            reasons.append(f"router_score={config.router_score!r}: {name} scores experts with a softmax")
        if config.capacity_factor is not None or config.eval_capacity_factor is not None:
            reasons.append(
                f"capacity_factor={config.capacity_factor}, eval_capacity_factor="
                f"{config.eval_capacity_factor}: {name} is dropless; set both to None"
            )
        if arch.model_type == "mixtral" and not _renormalized(config):
            reasons.append(
                f"norm_topk_prob=False (router {config.router!r}): Mixtral always renormalizes top-k"
            )
        if config.router_pruned_experts:
            reasons.append(
                f"router_pruned_experts={config.router_pruned_experts}: this pruned router keeps the dropped "
                f"experts' softmax mass in its denominator, which {name} cannot express; prune with "
                "`moe-lab prune --renormalize` for a checkpoint to convert"
            )
        if not dense_layers_ok and config.moe_layer_ids != list(range(config.num_hidden_layers)):
            reasons.append(
                f"dense layers (moe_every_n={config.moe_every_n}, dense_layers={config.dense_layers}): "
                f"every {name} layer is an MoE layer; use qwen2_moe"
            )
        if arch.model_type != "qwen2_moe" and config.num_shared_experts:
            reasons.append(f"num_shared_experts={config.num_shared_experts}: {name} has no shared experts")
        if arch.model_type == "qwen2_moe" and not (config.num_shared_experts and config.shared_expert_gate):
            reasons.append(
                "Qwen2-MoE has one sigmoid-gated shared expert in every MoE layer: needs "
                "num_shared_experts >= 1 and shared_expert_gate=True (use mixtral or olmoe otherwise)"
            )
    if config.ffn_activation != "swiglu":
        reasons.append(f"ffn_activation={config.ffn_activation!r}: {name} FFNs are SwiGLU")
    reasons += _qk_norm_refusals(config, arch)
    reasons += _gptoss_feature_refusals(config, arch)
    if config.clip_qkv is not None and arch.model_type != "olmoe":
        reasons.append(f"clip_qkv={config.clip_qkv}: {name} does not clip q/k/v; use olmoe")
    if config.attention_bias and arch.model_type not in ("qwen2_moe", "gpt_oss"):
        reasons.append(f"attention_bias=True: {name} has no q/k/v bias; use qwen2_moe")
    if (
        arch.model_type not in ("mixtral", "qwen3_moe", "gpt_oss")  # (these carry head_dim)
        and config.head_dim * config.num_attention_heads != config.hidden_size
    ):
        reasons.append(
            f"head_dim={config.head_dim}: {name} needs head_dim * num_attention_heads == hidden_size"
        )
    return reasons


def _deepseek_refusals_to_hf(config: MoEConfig, arch: HFArchitecture) -> list[str]:
    """Every reason `config` cannot be written as DeepSeek-V3 / V2 exactly (`refusals_to_hf`)."""
    name, v3 = arch.class_name, arch.model_type == "deepseek_v3"
    reasons = []
    if config.attention_type != "mla":
        reasons.append(
            f"attention_type={config.attention_type!r}: {name} uses multi-head latent attention ('mla')"
        )
    if not v3 and not config.rope_interleave:
        reasons.append(f"rope_interleave=False: {name} rotates interleaved pairs (its complex RoPE)")
    return reasons + _deepseek_moe_refusals_to_hf(config, arch)


def _deepseek_moe_refusals_to_hf(config: MoEConfig, arch: HFArchitecture) -> list[str]:
    """The FFN and MoE half of `_deepseek_refusals_to_hf`, also GLM-4.5's (DeepSeek-V3's MoE, routed as V3):
    SwiGLU, the 'deepseek' router with the architecture's scores, the first layers dense and every later one MoE,
    ungated shared experts as wide as the routed ones."""
    name, v3 = arch.class_name, arch.model_type != "deepseek_v2"
    reasons = []
    if config.ffn_activation != "swiglu":
        reasons.append(f"ffn_activation={config.ffn_activation!r}: {name} FFNs are SwiGLU")
    if config.num_experts == 0:
        reasons.append(f"num_experts=0 (a dense model): {name} has MoE layers after its first dense ones")
        return reasons
    if config.router != "deepseek":
        reasons.append(
            f"router={config.router!r}: {name} routes with DeepSeek's group-limited top-k ('deepseek')"
        )
        return reasons
    score = _DEEPSEEK_SCORING[arch.model_type]
    if config.router_score != score:
        reasons.append(f"router_score={config.router_score!r}: {name} scores experts with {score!r}")
    grouped = config.router_topk_groups < config.router_groups
    group_score = "top2_sum" if v3 else "max"
    if grouped and config.router_group_score != group_score:
        reasons.append(
            f"router_group_score={config.router_group_score!r}: {name} scores a group by {group_score!r}"
        )
    if not v3 and config.norm_topk_prob:
        reasons.append(f"norm_topk_prob=True: transformers' {name} router never renormalizes top-k")
    if not v3 and config.router_bias_update_rate > 0:
        reasons.append(
            f"router_bias_update_rate={config.router_bias_update_rate}: {name} has no selection bias "
            "(e_score_correction_bias); use deepseek_v3"
        )
    k = len(config.dense_layers)
    if config.moe_layer_ids != list(range(k, config.num_hidden_layers)) or sorted(
        config.dense_layers
    ) != list(range(k)):
        reasons.append(
            f"dense layers (moe_every_n={config.moe_every_n}, dense_layers={config.dense_layers}): {name} has "
            "its first first_k_dense_replace layers dense and every later one MoE"
        )
    if not config.num_shared_experts or config.shared_expert_gate:
        reasons.append(
            f"num_shared_experts={config.num_shared_experts}, shared_expert_gate={config.shared_expert_gate}: "
            f"{name} has >= 1 ungated shared experts in every MoE layer"
        )
    if (
        config.num_shared_experts
        and config.shared_expert_intermediate_size != config.expert_intermediate_size
    ):
        reasons.append(
            f"shared_expert_intermediate_size={config.shared_expert_intermediate_size}: {name}'s shared experts "
            f"are as wide as the routed ones (expert_intermediate_size={config.expert_intermediate_size})"
        )
    return reasons


def _glm4_moe_refusals_to_hf(config: MoEConfig, arch: HFArchitecture) -> list[str]:
    """Every reason `config` cannot be written as GLM-4.5 exactly (`refusals_to_hf`): grouped-query attention with
    optional q/k/v biases and per-head q/k norm (no o_proj bias, clip or sinks), any partial RoPE factor, plain or
    YaRN RoPE; DeepSeek-V3's MoE (`_deepseek_moe_refusals_to_hf`)."""
    name, reasons = arch.class_name, []
    if config.attention_type != "mha":
        reasons.append(
            f"attention_type={config.attention_type!r}: {name} has grouped-query attention ('mha'); use "
            "deepseek_v3 or deepseek_v2"
        )
    reasons += _qk_norm_refusals(config, arch)
    if config.clip_qkv is not None:
        reasons.append(f"clip_qkv={config.clip_qkv}: {name} does not clip q/k/v; use olmoe")
    reasons += _gptoss_feature_refusals(config, arch)
    return reasons + _deepseek_moe_refusals_to_hf(config, arch)


def _partial_rope_refusals(config: MoEConfig, arch: HFArchitecture) -> list[str]:
    """Partial RoPE (`MoEConfig.rope_partial_factor`): only GLM-4.5's classes rotate part of each head."""
    factor = getattr(config, "rope_partial_factor", 1.0)
    if factor == 1 or arch.model_type == "glm4_moe":
        return []
    return [f"rope_partial_factor={factor}: {arch.class_name} rotates the whole head; use glm4_moe"]


def _qk_norm_refusals(config: MoEConfig, arch: HFArchitecture) -> list[str]:
    """The q/k norm each target has: OLMoE over the whole projection, Qwen3-MoE per head, the others none."""
    per_head = config.qk_norm and config.qk_norm_per_head
    whole = config.qk_norm and not config.qk_norm_per_head
    if arch.model_type == "olmoe" and not whole:
        return [
            f"qk_norm={config.qk_norm}, qk_norm_per_head={config.qk_norm_per_head}: OLMoE always normalizes "
            "the whole q and k projections (qk_norm=True, qk_norm_per_head=False)"
        ]
    if arch.model_type == "qwen3_moe" and not per_head:
        return [
            f"qk_norm={config.qk_norm}, qk_norm_per_head={config.qk_norm_per_head}: Qwen3-MoE always "
            "normalizes q and k per head (qk_norm=True, qk_norm_per_head=True)"
        ]
    if arch.model_type == "glm4_moe" and config.qk_norm and not per_head:  # (use_qk_norm: per head, or none)
        return [
            f"qk_norm=True, qk_norm_per_head=False: {arch.class_name} normalizes q and k per head "
            "(use_qk_norm; qk_norm_per_head=True) or not at all"
        ]
    if arch.model_type not in ("olmoe", "qwen3_moe", "glm4_moe") and config.qk_norm:
        return [f"qk_norm=True: {arch.class_name} has no q/k norm; use olmoe or qwen3_moe"]
    return []


def _gptoss_feature_refusals(config: MoEConfig, arch: HFArchitecture) -> list[str]:
    """gpt-oss's pieces: all of them for gpt_oss (its classes have no switch for any), none for the others."""
    pieces = {
        "attention_sinks": config.attention_sinks,
        "router_bias": config.router_bias,
        "expert_bias": config.expert_bias,
        "swiglu_limit": config.swiglu_limit is not None,
        "o_proj_bias": config.o_proj_bias,
        "attention_window": config.attention_window is not None,
        "rope_yarn": config.rope_yarn is not None
        and arch.model_type not in (*DEEPSEEK, "glm4_moe"),  # (theirs too)
    }
    if arch.model_type != "gpt_oss":
        return [
            f"{field}={getattr(config, field)!r}: {arch.class_name} has no such piece; use gpt_oss"
            for field, present in pieces.items()
            if present
        ]
    needed = ("attention_sinks", "router_bias", "expert_bias", "swiglu_limit")
    reasons = [
        f"{field}={getattr(config, field)!r}: every gpt-oss layer has it; gpt_oss needs it set"
        for field in needed
        if not pieces[field]
    ]
    if config.o_proj_bias != config.attention_bias:
        reasons.append(
            f"attention_bias={config.attention_bias}, o_proj_bias={config.o_proj_bias}: gpt-oss biases q/k/v "
            "and o together (one attention_bias); set both the same"
        )
    return reasons


def _renormalized(config: MoEConfig) -> bool:
    """Whether the top-k weights sum to one: renormalized softmax top-k, or softmax over the top-k logits
    (the same numbers: softmax is monotonic, and renormalizing its top-k is a softmax over those logits)."""
    if config.router == "switch":
        return False  # SwitchRouter keeps the raw probability
    return config.norm_topk_prob or config.router_topk_order == "topk_then_softmax"


def hf_config_fields(arch: HFArchitecture, config: MoEConfig) -> dict[str, Any]:
    """The HF config fields that our config determines (the rest come from `hf_origin` or HF defaults)."""
    K = config.num_experts_per_tok
    fields = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        rms_norm_eps=config.rms_norm_eps,
        attention_dropout=config.attention_dropout,
        initializer_range=config.initializer_range,
        use_cache=config.use_cache,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        hidden_act="silu",
        num_experts_per_tok=K,
        router_aux_loss_coef=config.router_aux_loss_coef / K,
    )
    if arch.model_type in DEEPSEEK:
        del fields["router_aux_loss_coef"]  # (DeepSeek configs have none; V2's aux_loss_alpha below)
        v3 = arch.model_type == "deepseek_v3"
        fields.update(
            **_deepseek_moe_hf_fields(config),
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            routed_scaling_factor=config.routed_scaling_factor,
            norm_topk_prob=config.norm_topk_prob,
            num_key_value_heads=config.num_attention_heads,
            attention_bias=False,
        )
        if config.rope_yarn is not None:
            fields["rope_parameters"] = {
                "rope_type": "yarn",
                "rope_theta": config.rope_theta,
                **config.rope_yarn,
            }
        grouped = config.router_topk_groups < config.router_groups
        if v3:
            fields.update(
                n_group=config.router_groups,
                topk_group=config.router_topk_groups,
                rope_interleave=config.rope_interleave,
            )
        else:
            fields.update(topk_method="group_limited_greedy" if grouped else "greedy", mlp_bias=False)
            if config.router_aux_loss_coef > 0:  # not a transformers field; exactly our coefficient
                fields["aux_loss_alpha"] = config.router_aux_loss_coef
            if grouped:  # (greedy: n_group/topk_group mean nothing and come from hf_origin as they were)
                fields.update(n_group=config.router_groups, topk_group=config.router_topk_groups)
    elif arch.model_type == "glm4_moe":
        del fields["router_aux_loss_coef"]  # (GLM configs have none)
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.rope_yarn is not None:
            rope = {"rope_type": "yarn", "rope_theta": config.rope_theta, **config.rope_yarn}
        fields.update(
            rope_parameters={**rope, "partial_rotary_factor": config.rope_partial_factor},
            partial_rotary_factor=config.rope_partial_factor,
            head_dim=config.head_dim,
            attention_bias=config.attention_bias,
            use_qk_norm=config.qk_norm,
            **_deepseek_moe_hf_fields(config),
            n_group=config.router_groups,
            topk_group=config.router_topk_groups,
            routed_scaling_factor=config.routed_scaling_factor,
            norm_topk_prob=config.norm_topk_prob,
            num_nextn_predict_layers=0,  # our model has no multi-token-prediction layer to write (`mtp_weight_names`)
        )
    elif arch.model_type == "mixtral":
        fields.update(
            num_local_experts=config.num_experts,
            intermediate_size=config.expert_intermediate_size,
            head_dim=config.head_dim,
            router_jitter_noise=config.router_jitter,
            sliding_window=None,
        )
    elif arch.model_type == "olmoe":
        fields.update(
            num_experts=config.num_experts,
            intermediate_size=config.expert_intermediate_size,
            clip_qkv=config.clip_qkv,
            norm_topk_prob=_renormalized(config),
            attention_bias=False,
        )
    elif arch.model_type == "gpt_oss":
        fields.update(
            num_local_experts=config.num_experts,
            intermediate_size=config.expert_intermediate_size,
            head_dim=config.head_dim,
            attention_bias=config.attention_bias,
            sliding_window=config.attention_window,
            layer_types=[
                "sliding_attention" if config.is_window_layer(i) else "full_attention"
                for i in range(config.num_hidden_layers)
            ],
            swiglu_limit=config.swiglu_limit,
            swiglu_alpha=config.swiglu_alpha,
        )
        if config.rope_yarn is not None:
            fields["rope_parameters"] = {
                "rope_type": "yarn",
                "rope_theta": config.rope_theta,
                **config.rope_yarn,
            }
    elif arch.model_type == "qwen3_moe":
        fields.update(
            num_experts=config.num_experts,
            moe_intermediate_size=config.expert_intermediate_size,
            intermediate_size=config.intermediate_size,
            decoder_sparse_step=config.moe_every_n,
            mlp_only_layers=list(config.dense_layers),
            norm_topk_prob=_renormalized(config),
            head_dim=config.head_dim,
            attention_bias=False,
            use_sliding_window=False,
        )
    else:
        fields.update(
            num_experts=config.num_experts,
            moe_intermediate_size=config.expert_intermediate_size,
            intermediate_size=config.intermediate_size,
            shared_expert_intermediate_size=config.num_shared_experts
            * config.shared_expert_intermediate_size,
            decoder_sparse_step=config.moe_every_n,
            mlp_only_layers=list(config.dense_layers),
            qkv_bias=config.attention_bias,
            norm_topk_prob=_renormalized(config),
            use_sliding_window=False,
        )
    return fields


def _same(key: str, origin_value: Any, value: Any, config: MoEConfig) -> bool:
    """Whether the source's spelling of a field means the value our config gives it now."""
    if origin_value == value:
        return True
    if isinstance(origin_value, float) and isinstance(value, float):
        return math.isclose(origin_value, value, rel_tol=1e-9)  # K * c / K need not round-trip exactly
    if key == "head_dim" and origin_value is None:
        return value == config.hidden_size // config.num_attention_heads
    return key == "hidden_act" and origin_value in _SILU and value in _SILU


def config_to_hf(config: MoEConfig, arch: HFArchitecture):
    """The transformers config of `arch` for our config, with the HF-only fields kept in `hf_origin`."""
    reasons = refusals_to_hf(config, arch)
    if reasons:
        raise ConversionError(
            f"cannot write this model as {arch.class_name} exactly:\n  - " + "\n  - ".join(reasons)
        )
    if config.router_z_loss_coef > 0:
        logger.warning(
            "router_z_loss_coef=%s is not carried: %s has no router z-loss (logits are unaffected)",
            config.router_z_loss_coef,
            arch.class_name,
        )
    if config.router_jitter > 0 and arch.model_type != "mixtral":
        logger.warning(
            "router_jitter=%s is not carried: %s has no router jitter (logits are unaffected)",
            config.router_jitter,
            arch.class_name,
        )
    elif config.router_jitter > 0:
        logger.warning(
            "router_jitter=%s becomes router_jitter_noise: in training HF Mixtral also multiplies the "
            "experts' input by the noise, ours the router input only",
            config.router_jitter,
        )
    fields = hf_config_fields(arch, config)
    origin = config.hf_origin or {}
    if origin.get("model_type") == arch.model_type:
        for key, origin_value in origin.get("config", {}).items():
            if key not in fields or _same(key, origin_value, fields[key], config):
                fields[key] = origin_value
    hf = CONFIG_MAPPING[arch.model_type](**fields)
    hf.architectures = [arch.class_name]
    return hf


# ================================================================================================ weights
def weight_plan(config: MoEConfig, arch: HFArchitecture) -> list[tuple[str, tuple[str, ...]]]:
    """``(our name, HF names)`` for every weight; several HF names are per-expert slices stacked on dim 0."""
    plan: list[tuple[str, tuple[str, ...]]] = []
    same: list[str] = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        same += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        if config.attention_type == "mla":  # the same names on both sides (DeepseekV3Attention's)
            same += [f"{p}.self_attn.{x}" for x in mla_weight_names(config)]
        else:
            same += [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"]
        if config.attention_bias:
            same += [f"{p}.self_attn.{x}_proj.bias" for x in "qkv"]
        if config.o_proj_bias:
            same.append(f"{p}.self_attn.o_proj.bias")
        if config.attention_sinks:
            same.append(f"{p}.self_attn.sinks")
        if config.qk_norm:
            same += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        if config.is_moe_layer(i):
            moe = f"{p}.{arch.moe_module}"
            router = f"{moe}.router" if arch.model_type == "gpt_oss" else f"{moe}.gate"
            plan.append((f"{p}.mlp.router.gate.weight", (f"{router}.weight",)))
            if config.router_bias:
                plan.append((f"{p}.mlp.router.gate.bias", (f"{router}.bias",)))
            if config.expert_bias:  # gpt-oss (`CheckpointReader._alias_gptoss` names)
                for ours in ("gate_proj", "up_proj", "down_proj"):
                    names = tuple(f"{moe}.experts.{j}.{ours}.bias" for j in range(config.num_experts))
                    plan.append((f"{p}.mlp.experts.{ours}_bias", names))
            for ours, theirs in zip(("gate_proj", "up_proj", "down_proj"), arch.expert_weights):
                plan.append(
                    (
                        f"{p}.mlp.experts.{ours}",
                        tuple(f"{moe}.experts.{j}.{theirs}.weight" for j in range(config.num_experts)),
                    )
                )
            if arch.router_bias != "none" and config.router == "deepseek":
                plan.append((f"{p}.mlp.router.expert_bias", (f"{moe}.gate.e_score_correction_bias",)))
            if config.num_shared_experts:
                plan += [
                    (
                        f"{p}.mlp.shared_expert.{x}_proj.weight",
                        (f"{moe}.{arch.shared_experts}.{x}_proj.weight",),
                    )
                    for x in ("gate", "up", "down")
                ]
                if config.shared_expert_gate:
                    same.append(f"{p}.mlp.shared_expert_gate.weight")
        else:
            same += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    same.append("model.norm.weight")
    if not config.tie_word_embeddings:
        same.append("lm_head.weight")
    return [(name, (name,)) for name in same] + plan


def mla_weight_names(config: MoEConfig) -> list[str]:
    """Multi-head latent attention's weights under ``self_attn`` (`moe_core.model.MultiHeadLatentAttention`)."""
    q = (
        ["q_proj.weight"]
        if config.q_lora_rank is None
        else ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"]
    )
    return q + ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]


def our_tensors(model: MoEForCausalLM, plan, tensors: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Our parameters by name (``tensors`` where given, else the model's state dict), checked to be exactly those
    the plan covers (catches model drift early)."""
    tensors = dict(tensors) if tensors is not None else model.state_dict(keep_vars=True)
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    planned = {ours for ours, _ in plan}
    if planned != set(tensors):
        raise ConversionError(
            f"internal: the conversion plan and MoEForCausalLM disagree (unplanned: "
            f"{sorted(set(tensors) - planned)[:5]}, missing: {sorted(planned - set(tensors))[:5]}); "
            f"moe_core/convert.py needs updating for this model"
        )
    return tensors


def load_dtype(dtype: torch.dtype | str | None, reader: CheckpointReader, error_cls=None) -> torch.dtype:
    """The dtype a load asked for (a torch dtype or one of `DTYPES`' names), else the checkpoint's own."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise (error_cls or ConversionError)(f"dtype={dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    return dtype or source_dtype(reader)


def source_dtype(reader: CheckpointReader) -> torch.dtype:
    name = (
        "model.embed_tokens.weight" if "model.embed_tokens.weight" in reader.file_of else min(reader.file_of)
    )
    return reader.dtype(name)


def check_coverage(directory: Path, reader: CheckpointReader, plan, config: MoEConfig) -> None:
    """Refuse a checkpoint that lacks a weight the plan needs or holds one the plan has no place for."""
    available = reader.names()
    missing = [n for _, names in plan for n in names if n not in available]
    if missing:
        raise ConversionError(
            f"{directory}: {len(missing)} weights the config implies are missing, e.g. "
            f"{missing[:3]}; is the checkpoint complete and its config right?"
        )
    used = {n for _, names in plan for n in names}
    ignorable = (
        {"lm_head.weight"} if config.tie_word_embeddings else set()
    )  # tied: the embedding is the truth
    mtp = mtp_weight_names(config, available - used)
    if mtp:
        logger.info(
            "%s: skipping the %d weights of its multi-token-prediction layer(s) (num_nextn_predict_layers), as "
            "transformers' causal LM does",
            directory,
            len(mtp),
        )
    ignorable |= mtp
    unused = sorted(n for n in available - used - ignorable if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ConversionError(
            f"{directory}: {len(unused)} weights have no place in the converted model, e.g. "
            f"{unused[:3]}; refusing to drop them silently"
        )


_LAYER_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_weight_names(config: MoEConfig, names) -> set[str]:
    """The names among ``names`` that belong to the multi-token-prediction (MTP) layers a GLM-4.5 or DeepSeek-V3
    checkpoint stores after its L decoder layers, as ``model.layers.{L .. L + n - 1}.*`` with n =
    ``num_nextn_predict_layers`` of the source config (`hf_origin`). transformers' causal LMs never build them
    (``Glm4MoeForCausalLM._keys_to_ignore_on_load_unexpected``; only ``generate(use_mtp=True)`` loads them into a
    separate draft model); ours neither, so they are skipped, not refused."""
    origin = (config.hf_origin or {}).get("config") or {}
    n = int(origin.get("num_nextn_predict_layers", origin.get("num_mtp_layers")) or 0)
    L = config.num_hidden_layers
    return {
        name
        for name in names
        if (match := _LAYER_WEIGHT.match(name)) is not None and L <= int(match.group(1)) < L + n
    }


def check_shape(directory: Path, name: str, source: torch.Tensor, ours: str, shape) -> None:
    if tuple(source.shape) != tuple(shape):
        raise ConversionError(
            f"{directory}: {name} has shape {tuple(source.shape)}, the config implies {tuple(shape)} for {ours}"
        )


# a loader that copies what it reads unmaps the file it reads after this many bytes (and reopens it for the next
# tensor): the pages read stay page cache, not the process's resident set (a hub shard is 2-10 GB)
RELEASE_EVERY_BYTES = 64 * 2**20


def stream_weights(reader: CheckpointReader, plan, *, release: bool = False):
    """``(our name, expert index or None, checkpoint name, tensor)`` for every weight of the plan, one tensor
    read at a time: a per-expert slice of a stacked weight comes with its expert's index. ``release``: a loader
    that keeps no view of the files (it copies or quantizes what it reads) unmaps each file once the plan moves
    on to another, or once `RELEASE_EVERY_BYTES` were read from it, so that the pages read stay page cache and
    do not add up in the process's resident set (a second copy of the whole checkpoint's size by the end of a
    load, beside the model's own memory); a file visited again is opened again. A stored tensor several plan
    entries are sliced from (a fused [E, ...] experts tensor) is never released between its slices."""
    current, source, read = None, None, 0
    for ours, names in plan:
        for e, name in enumerate(names):
            file = reader.file_of.get(name)
            next_source = reader.source_of(name)
            if release and current is not None and next_source != source:
                if file != current or read >= RELEASE_EVERY_BYTES:
                    reader.release(current)
                    read = 0
            if file != current:
                read = 0
            current = file if file is not None else current
            source = next_source
            tensor = reader.get(name)
            read += tensor.numel() * tensor.element_size()
            yield ours, (None if len(names) == 1 else e), name, tensor
    if release and current is not None:
        reader.release(current)


@dataclass
class StreamingLoad:
    """A model checkpoint directory (a Hugging Face one of `ARCHITECTURES`, or ours) opened for a loader
    that streams its tensors into a model built on the meta device: the QLoRA loader quantizing the experts as
    they come (`moe_core.quantized.load_quantizing_experts`) and the memory-mapping one (`moe_core.mapped`). The
    plan is checked to cover the model and the files exactly before any storage exists."""

    directory: Path
    arch: HFArchitecture | None  # None: our own checkpoint, whose file names are the model's
    reader: CheckpointReader
    model: MoEForCausalLM  # on the meta device, in ``dtype``
    plan: list[tuple[str, tuple[str, ...]]]  # `weight_plan`'s (our name, checkpoint names)
    dtype: torch.dtype

    def finish(self) -> MoEForCausalLM:
        """The model once every tensor is in: its dtype and where it came from recorded, in eval mode."""
        self.model.config.dtype = self.dtype
        self.model.config.name_or_path = self.model.name_or_path = str(self.directory.absolute())
        return self.model.eval()


def open_streaming(
    path: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    error_cls: type[MoELabError] = ConversionError,
    purpose: str = "loading",
) -> StreamingLoad:
    """Open the checkpoint at ``path`` for streaming (`StreamingLoad`); ``dtype`` default: the checkpoint's own.
    A directory that is neither ours nor a converted architecture is one ``error_cls`` naming ``purpose``."""
    directory = resolve_source(path)
    try:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as err:
        raise error_cls(f"{directory / 'config.json'}: unreadable ({err})") from None
    arch = next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)
    if arch is not None:
        config = config_from_hf(arch, *read_hf_config(directory)[1:])
    elif model_type == MoEConfig.model_type:
        config = MoEConfig.from_pretrained(directory)
    else:
        raise error_cls(
            f"{directory}: model_type {model_type!r} is neither ours ({MoEConfig.model_type}) nor a Hugging Face "
            f"MoE the lab converts ({', '.join(ARCHITECTURES)}); {purpose} reads those"
        )
    reader = CheckpointReader(directory, arch)
    dtype = load_dtype(dtype, reader, error_cls)
    with torch.device("meta"):
        model = MoEForCausalLM._from_config(config, dtype=dtype)
    if arch is not None:
        plan = weight_plan(config, arch)
    else:  # ours: the file's names are the model's
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        plan = [(name, (name,)) for name in model.state_dict() if name not in tied]
    our_tensors(model, plan)  # the plan covers the model exactly
    check_coverage(directory, reader, plan, config)
    return StreamingLoad(directory, arch, reader, model, plan, dtype)


def from_hf(
    path_or_hub_id: str | os.PathLike, dtype: torch.dtype | str | None = None, revision: str | None = None
) -> MoEForCausalLM:
    """Our model from a Hugging Face Mixtral, OLMoE or Qwen2-MoE checkpoint (a directory or a hub id).

    The weights are streamed tensor by tensor from the checkpoint into our model (the HF model is never built),
    in `dtype` (default: the checkpoint's own). The result is in eval mode.
    """
    directory = resolve_source(path_or_hub_id, revision)
    arch, hf, raw = read_hf_config(directory)
    config = config_from_hf(arch, hf, raw)
    reader = CheckpointReader(directory, arch)
    dtype = load_dtype(dtype, reader, ConversionError)
    with no_init_weights():  # every tensor is overwritten below
        model = MoEForCausalLM._from_config(config, dtype=dtype)
    model.tie_weights()  # post_init skips tying when initialization is off (from_pretrained ties afterwards too)
    plan = weight_plan(config, arch)
    tensors = our_tensors(model, plan)
    check_coverage(directory, reader, plan, config)
    with torch.no_grad():
        # release: every tensor is copied into the model, none stays a view of the files
        for ours, e, name, source in stream_weights(reader, plan, release=True):
            target = tensors[ours] if e is None else tensors[ours][e]
            check_shape(directory, name, source, ours, target.shape)
            target.copy_(source)
    model.config.dtype = dtype
    # where it came from, as from_pretrained records it: PEFT writes it as an adapter's base_model_name_or_path
    source = (
        str(path_or_hub_id) if directory != Path(path_or_hub_id).expanduser() else str(directory.absolute())
    )
    model.config.name_or_path = model.name_or_path = source
    return model.eval()


@dataclass(frozen=True)
class Deferred:
    """A tensor a writer makes as it writes it, one shard's at a time, rather than one held before: an expert slice
    with a fine-tune's delta added (`moe_core.mapped.stacked_tensors`). Its shape and dtype size the shards."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def made(t: torch.Tensor | Deferred) -> torch.Tensor:
    """``t``, made now if it is `Deferred`."""
    return t.make() if isinstance(t, Deferred) else t


def _write_safetensors(
    directory: Path, tensors: list[tuple[str, torch.Tensor | Deferred]], max_shard_bytes: int
) -> None:
    """Write named tensors as ``model.safetensors``, or as shards plus ``model.safetensors.index.json``; a
    `Deferred` one is made when its shard is written and let go of after."""
    shards: list[list[tuple[str, torch.Tensor | Deferred]]] = [[]]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        file = (
            "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        # the model's own memory, never a copy: a per-expert slice of a stacked [E, F, D] tensor is a contiguous
        # view, which safetensors writes from its pointer (slices that share a storage without overlapping are
        # accepted); contiguous() copies only a tensor that is not contiguous, one at a time
        save_file(
            {name: made(t).detach().contiguous() for name, t in shard},
            str(directory / file),
            metadata={"format": "pt"},
        )
        weight_map.update(dict.fromkeys((name for name, _ in shard), file))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def to_hf(
    model: MoEForCausalLM,
    out_dir: str | os.PathLike,
    architecture: str | None = None,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    max_shard_size: int = 5 * 2**30,
    tensors: Mapping[str, Any] | None = None,
) -> Path:
    """Write `model` as a Hugging Face checkpoint loadable with ``AutoModelForCausalLM.from_pretrained``.

    `architecture` (``mixtral``, ``olmoe``, ``qwen2_moe``) defaults to the one the model was converted from; a
    native model must name one. Refuses, with every reason, what the target cannot express exactly. Tokenizer
    and generation files in `tokenizer_dir` are copied along. Returns the output directory. ``tensors``: the
    weights by our names, in place of the model's state dict: a stacked expert projection as its ``[E, O, I]``
    tensor or a sequence of E per-expert ones, any of them `Deferred` (a memory-mapped model's experts, a
    fine-tune's adapter merged into each as it is written: `moe_core.mapped.stacked_tensors`).
    """
    config = model.config
    origin = config.hf_origin or {}
    name = architecture or origin.get("model_type")
    if name is None:
        raise ConversionError(
            f"this model was not converted from Hugging Face, so name the target "
            f"architecture; supported: {SUPPORTED}"
        )
    arch = get_architecture(name)
    hf_config = config_to_hf(config, arch)
    plan = weight_plan(config, arch)
    ours = our_tensors(model, plan, tensors)
    tensors = [
        (hf_name, ours[our_name] if len(names) == 1 else ours[our_name][j])
        for our_name, names in plan
        for j, hf_name in enumerate(names)
    ]
    if arch.router_bias == "zeros":  # DeepSeek-V2: no selection bias to write; refuse one that would be lost
        biased = [n for n, t in tensors if n.endswith(".e_score_correction_bias") and bool(t.detach().any())]
        if biased:
            raise ConversionError(
                f"cannot write this model as {arch.class_name} exactly: its router has a nonzero selection bias "
                f"({biased[0]} and {len(biased) - 1} more), which {arch.class_name} has no place for; use deepseek_v3"
            )
        tensors = [(n, t) for n, t in tensors if not n.endswith(".e_score_correction_bias")]
    if arch.model_type == "gpt_oss":
        tensors = gptoss_fused_tensors(tensors)
    hf_config.dtype = str(ours["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    with atomic_directory(out_dir, overwrite, ConversionError) as tmp:
        _write_safetensors(tmp, tensors, max_shard_size)
        hf_config.save_pretrained(tmp)
        copied = copy_companion_files(tokenizer_dir, tmp) if tokenizer_dir else []
        if "generation_config.json" not in copied:
            GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
    return Path(out_dir)


def gptoss_fused_tensors(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The per-expert tensors of a plan written in gpt-oss's fused layout (`GPTOSS_EXPERTS`): gate and up
    interleaved on the last axis and transposed to [E, D, 2F], down to [E, F, D]. Each layer's fused tensors are
    new storage (at most one layer's experts twice over while it is written)."""
    per_expert = re.compile(
        r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$"
    )
    out: list[tuple[str, torch.Tensor]] = []
    groups: dict[tuple[str, str, str], list[torch.Tensor]] = {}
    for name, tensor in tensors:
        match = per_expert.match(name)
        if match is None:
            out.append((name, tensor))
            continue
        prefix, _, proj, kind = match.groups()
        if not groups.get((prefix, proj, kind)):
            out.append(((prefix, proj, kind), None))  # placeholder: where this group goes
        groups.setdefault((prefix, proj, kind), []).append(made(tensor).detach())
    result = []
    for name, tensor in out:
        if tensor is not None:
            result.append((name, tensor))
            continue
        prefix, proj, kind = name
        if proj == "up_proj":
            continue  # written with gate_proj
        if proj == "down_proj":
            stack = torch.stack(groups[name])
            result.append(
                (
                    f"{prefix}.down_proj" + ("_bias" if kind == "bias" else ""),
                    stack.transpose(1, 2) if kind == "weight" else stack,
                )
            )
            continue
        gate, up = torch.stack(groups[name]), torch.stack(groups[(prefix, "up_proj", kind)])
        if kind == "weight":  # [E, F, D] each -> [E, D, 2F], gate at even columns
            fused = torch.stack((gate, up), dim=2).reshape(gate.shape[0], -1, gate.shape[2]).transpose(1, 2)
            result.append((f"{prefix}.gate_up_proj", fused.contiguous()))
        else:  # [E, F] each -> [E, 2F]
            result.append(
                (f"{prefix}.gate_up_proj_bias", torch.stack((gate, up), dim=2).reshape(gate.shape[0], -1))
            )
    return [(n, t.contiguous()) for n, t in result]


# ================================================================================================ files
def copy_companion_files(source: str | os.PathLike, destination: Path) -> list[str]:
    """Copy tokenizer, chat-template and generation files from `source`; returns the names copied. Copies of
    files written before these were fixed are brought up to date: a tokenizer of ours names only the model's
    inputs (`set_model_input_names`, no token_type_ids), and a generation_config.json gets the BOS/EOS/PAD ids
    it lacks from the destination's config.json (write that first)."""
    copied = []
    for name in COMPANION_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, destination / name)
            copied.append(name)
    set_model_input_names(destination)
    if "generation_config.json" in copied and (destination / "config.json").is_file():
        _fill_special_token_ids(destination / "generation_config.json", destination / "config.json")
    return copied


def _fill_special_token_ids(generation_path: Path, config_path: Path) -> None:
    generation = json.loads(generation_path.read_text())
    config = json.loads(config_path.read_text())
    missing = {
        field: config[field]
        for field in SPECIAL_TOKEN_FIELDS
        if generation.get(field) is None and config.get(field) is not None
    }
    if missing:
        generation.update(missing)
        generation_path.write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")


def convert_from_hf(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    revision: str | None = None,
) -> Path:
    """A HF checkpoint (directory or hub id) written as our checkpoint, tokenizer files included."""
    check_output_dir(out_dir, overwrite, ConversionError)  # before a download or a conversion
    directory = resolve_source(source, revision)
    model = from_hf(directory, dtype=dtype)
    with atomic_directory(out_dir, overwrite, ConversionError) as tmp:
        model.save_pretrained(tmp)
        copy_companion_files(directory, tmp)
    return Path(out_dir)
