"""Sparse upcycling: an MoE started from a dense Hugging Face checkpoint (Komatsuzaki et al. 2022, "Sparse
Upcycling: Training Mixture-of-Experts from Dense Checkpoints", arXiv 2212.05055).

    config = upcycled_config("dense_dir", get_config("switch-tiny"), {"num_experts": 8})   # refuses first
    model = upcycle("dense_dir", "switch-tiny", num_experts=8, num_experts_per_tok=2)      # one process
    load_upcycled(rank_model, "dense_dir")   # the trainer (``model.upcycle_from=DIR``): this rank's tensors only

Sources: ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` safetensors directories (read with
``safetensors.safe_open`` through `moe_core.convert.CheckpointReader`; pickled ``.bin`` files are refused).

What is copied (the paper's §3.1): embeddings, attention, every RMSNorm and the LM head are the dense model's.
In an MoE layer each expert starts from the dense layer's SwiGLU FFN (``mlp.{gate,up,down}_proj``); a dense
layer of the MoE (``moe_every_n`` / ``dense_layers``) keeps the dense FFN itself. The router is new: the paper
initializes it randomly; ours draws the model's own small router init (Switch Transformer §2.4: truncated
normal, std sqrt(0.1 / fan_in)), per unit and seeded as `moe_core.train.build` does, so the start is the same
at every layout.

Fine-grained experts (``expert_intermediate_size = F = I / m`` for the dense width ``I``, ``m > 1``), as
Qwen1.5-MoE-A2.7B was upcycled from Qwen-1.8B (Qwen team, "Qwen1.5-MoE", 2024: the FFN partitioned into
segments along its intermediate dimension, each segment an expert, replicated to fill the expert count): global
expert ``g`` takes segment ``s = g mod m``, the intermediate neurons ``s*F .. (s+1)*F - 1`` (rows of gate_proj
and up_proj, columns of down_proj), so every segment appears ``E / m`` times. Differs from Qwen1.5-MoE: no
shuffling of the intermediate dimension before slicing and no added noise (deterministic; both can be done to
the dense checkpoint beforehand). With ``m = 1``, identical experts and top-k weights that sum to one, the MoE
computes the dense model exactly at step 0 (``tests/test_upcycle.py``); with ``m > 1`` it does not (a token
sees K segments, each scaled by its routing weight).

Refused before any weight is read, naming the field: a dense config the lab cannot express exactly
(non-SiLU activation, MLP bias, Llama/Mistral attention bias (o_proj too), RoPE scaling, a sliding window
shorter than the context, partial rotary), and MoE fields that contradict the dense model (an architecture
override that differs from config.json, shared experts, an expert width that does not divide the dense one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import CONFIG_MAPPING

from moe_core.config import MoEConfig, get_config
from moe_core.convert import CheckpointReader, ffn_and_rope_refusals, rope_theta
from moe_core.errors import MoELabError
from moe_core.experts import EXPERTS_MARK
from moe_core.model import MoEForCausalLM
from moe_core.train import parallel as par
from moe_core.train.build import build_meta_model, copy_owned, expert_offsets, materialize_owned


class UpcycleError(MoELabError):
    """A dense checkpoint, or MoE settings, that cannot be upcycled; the message names the field."""


DENSE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


# ================================================================================================ configs
def read_dense_config(path: str | os.PathLike) -> tuple[Path, Any]:
    """The directory and the transformers config of a dense Llama / Mistral / Qwen2 checkpoint."""
    directory = Path(path).expanduser()
    file = directory / "config.json"
    if not file.is_file():
        raise UpcycleError(
            f"model.upcycle_from={path}: no config.json; give a Hugging Face checkpoint directory"
        )
    raw = json.loads(file.read_text())
    model_type = raw.get("model_type")
    if model_type not in DENSE_ARCHITECTURES:
        raise UpcycleError(
            f"{file}: model_type {model_type!r} cannot be upcycled; supported dense architectures: "
            + ", ".join(f"{t} ({c})" for t, c in DENSE_ARCHITECTURES.items())
        )
    return directory, CONFIG_MAPPING[model_type](**{k: v for k, v in raw.items() if k != "model_type"})


def dense_refusals(hf) -> list[str]:
    """Every field of a dense transformers config our model cannot express exactly (empty when it can)."""
    reasons = ffn_and_rope_refusals(hf)
    if getattr(hf, "mlp_bias", False):
        reasons.append("mlp_bias=True: our FFNs and experts have no bias")
    if hf.model_type != "qwen2" and getattr(hf, "attention_bias", False):
        reasons.append(
            f"attention_bias=True: {DENSE_ARCHITECTURES[hf.model_type]} then biases o_proj too, ours has no "
            "o_proj bias"
        )
    window = getattr(hf, "sliding_window", None)
    if hf.model_type == "mistral" and window is not None and window < hf.max_position_embeddings:
        reasons.append(f"sliding_window={window}: our attention is full causal attention")
    if hf.model_type == "qwen2" and getattr(hf, "use_sliding_window", False):
        reasons.append("use_sliding_window=True: our attention is full causal attention")
    return reasons


def dense_fields(hf) -> dict[str, Any]:
    """The `MoEConfig` fields the dense model fixes (architecture, not routing)."""
    return dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        max_position_embeddings=hf.max_position_embeddings,
        rope_theta=rope_theta(hf),
        rms_norm_eps=hf.rms_norm_eps,
        attention_bias=hf.model_type == "qwen2",  # Qwen2 biases q/k/v (not o), as ours does
        qk_norm=False,
        clip_qkv=None,
        attention_dropout=hf.attention_dropout,
        ffn_activation="swiglu",
        intermediate_size=hf.intermediate_size,
        tie_word_embeddings=hf.tie_word_embeddings,
        initializer_range=hf.initializer_range,
    )


def upcycled_config(
    path: str | os.PathLike,
    preset: str = "switch-tiny",
    overrides: dict[str, Any] | None = None,
    balance: str = "lab",
) -> MoEConfig:
    """The MoE config upcycled from the dense checkpoint at ``path``: the architecture from its config.json, the
    MoE fields (num_experts, num_experts_per_tok, router, ...) from ``preset`` (its ``balance``, `get_config`) and
    ``overrides``. Reads only config.json; refuses (every reason at once) what cannot be expressed."""
    directory, hf = read_dense_config(path)
    overrides = dict(overrides or {})
    reasons = dense_refusals(hf)
    fields = dense_fields(hf)
    for key, value in overrides.items():
        if key in fields and value != fields[key]:
            reasons.append(
                f"model.overrides.{key}={value!r}: the dense model has {key}={fields[key]!r}; drop the override"
            )
    dense_width = hf.intermediate_size
    width = overrides.get("expert_intermediate_size", dense_width)
    try:
        # the dense model's special token ids are defaults: the data's tokenizer, or model.overrides, may set them
        ids = {name: getattr(hf, name, None) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
        settings = {**ids, **overrides, **fields, "expert_intermediate_size": width}
        config = get_config(preset, balance=balance, **settings)
    except (TypeError, ValueError) as err:
        reasons.append(str(err))
        config = None
    if config is not None and config.num_experts:
        if dense_width % width:
            reasons.append(
                f"expert_intermediate_size={width}: must divide the dense intermediate_size={dense_width} "
                "(each expert a copy of the dense FFN, or a 1/m slice of it)"
            )
        elif config.num_experts % (dense_width // width):
            reasons.append(
                f"num_experts={config.num_experts}: must be a multiple of the {dense_width // width} slices of "
                f"width {width} the dense FFN is cut into"
            )
        if config.num_shared_experts:
            reasons.append(
                f"num_shared_experts={config.num_shared_experts}: upcycling makes routed experts only; set "
                "model.overrides.num_shared_experts=0"
            )
    if reasons:
        raise UpcycleError(f"cannot upcycle {directory} exactly:\n  - " + "\n  - ".join(reasons))
    return config


# ================================================================================================ weights
def dense_name(whole: str) -> str | None:
    """The dense checkpoint's tensor for our parameter ``whole`` (its whole-model name); None for the router,
    which is new. An expert stack ``model.layers.i.mlp.experts.gate_proj`` maps to the layer's dense FFN."""
    if ".mlp.router." in whole:
        return None
    if EXPERTS_MARK in whole:
        return whole.replace(EXPERTS_MARK, ".mlp.") + ".weight"
    return whole


def open_dense(path: str | os.PathLike, model: MoEForCausalLM) -> CheckpointReader:
    """The dense checkpoint's safetensors, checked to hold every tensor ``model`` needs and no weight it would
    drop (names only: nothing is read)."""
    directory, _ = read_dense_config(path)
    reader = CheckpointReader(directory)
    pickled = sorted({f.name for f in reader.file_of.values() if f.suffix != ".safetensors"})
    if pickled:
        raise UpcycleError(
            f"{directory}: weights in {pickled}; upcycling reads safetensors only (save the dense model with "
            "save_pretrained(safe_serialization=True))"
        )
    tied = model.config.tie_word_embeddings
    needed = set()
    for name, _ in model.named_parameters(remove_duplicate=False):
        source = dense_name(par.full_model_name(name))
        if source is not None and not (tied and name == "lm_head.weight"):
            needed.add(source)
    available = reader.names()
    missing = sorted(needed - available)
    unused = sorted(
        n
        for n in available - needed
        if not n.endswith("rotary_emb.inv_freq") and not (tied and n == "lm_head.weight")
    )
    if missing or unused:
        raise UpcycleError(
            f"{directory}: the checkpoint does not match its config.json (missing {missing[:3]}, with no place in "
            f"the MoE {unused[:3]}); is it complete?"
        )
    return reader


def expert_segment(global_expert: int, granularity: int) -> int:
    """Which of the dense FFN's ``granularity`` slices expert ``global_expert`` starts from (module docstring)."""
    return global_expert % granularity


def expert_rows(weight: torch.Tensor, name: str, first: int, count: int, width: int) -> torch.Tensor:
    """Experts ``first .. first+count-1``'s slices of a dense FFN weight, stacked: ``[count, F, D]`` for
    gate/up (rows of the dense ``[I, D]``), ``[count, D, F]`` for down (columns of the dense ``[D, I]``)."""
    m = (weight.shape[1] if name == "down_proj" else weight.shape[0]) // width
    parts = []
    for g in range(first, first + count):
        s = expert_segment(g, m)
        piece = (
            weight[:, s * width : (s + 1) * width]
            if name == "down_proj"
            else weight[s * width : (s + 1) * width]
        )
        parts.append(piece)
    return torch.stack(parts)


@torch.no_grad()
def load_upcycled(model: MoEForCausalLM, path: str | os.PathLike) -> MoEForCausalLM:
    """Copy the dense checkpoint at ``path`` into ``model`` (built from `upcycled_config`, materialized, possibly
    laid out by `moe_core.train.parallel`): each rank writes only what it holds (its experts; under FSDP2 its
    rows), one dense tensor read at a time; the routers keep their initial values."""
    reader = open_dense(path, model)
    offsets = expert_offsets(model)
    width = model.config.expert_intermediate_size
    for name, param in model.named_parameters():
        whole = par.full_model_name(name)
        source = dense_name(whole)
        if source is None:
            continue
        value = reader.get(source)
        if ".mlp.experts." in whole:
            value = expert_rows(
                value, whole.rsplit(".", 1)[1], offsets(name), par.local(param).shape[0], width
            )
        try:
            copy_owned(param, value, f"{path}: {source}")
        except ValueError as err:
            raise UpcycleError(f"{err}; {whole}") from None
    return model


def upcycle(
    path: str | os.PathLike, preset: str = "switch-tiny", seed: int = 0, **overrides: Any
) -> MoEForCausalLM:
    """One process: the whole upcycled MoE (built on meta, materialized with the seeded init, then the dense
    weights copied in), in float32 and train mode."""
    config = upcycled_config(path, preset, overrides)
    model = materialize_owned(build_meta_model(config), torch.device("cpu"), seed)
    return load_upcycled(model, path)
