"""A QLoRA fine-tune's output on the base it trained on (issue 31 §4: "the adapter then generates on the base it
was trained on").

A fine-tune with ``quantize.base`` (QLoRA, Dettmers et al. 2023) trains LoRA over frozen experts held in 4 bits
(`moe_core.quantized.QuantizedExperts`) and writes the adapter alone: LoRA on the full-precision model, with the
keys stock PEFT reads. Merged into the full-precision base it is the usual fine-tuned model; but a base larger
than memory (Qwen1.5-MoE-A2.7B's 26.7 GiB here) cannot be merged into, and the codes cannot hold a merge (the
delta is far below a 4-bit step). So the output is loaded the way it trained:

    base     the checkpoint ``model.path`` names, its experts (and shared experts) quantized while they stream
             in, with the recorded ``quantize.*`` (round to nearest: the same codes as training's, bit for bit)
    wrappers `apply_method` with the recorded config (ESFT's selection from ``moe_expert_selection.json``)
    factors  the adapter's tensors placed into those wrappers (HF-named ones through `hf_adapter`), every key
             of the file placed and every wrapper's factor given, else refused; a trained router's selection
             bias saved with it copied into the base router (`moe_core.finetune.selection_bias`)
    forward  unmerged: each expert's LoRA on its routed tokens over its dequantized slice, as in training

`moe_core.load(out_dir)` takes this path for a fine-tuning output whose ``finetune_config.json`` sets
``quantize.base`` and that holds no merged/ model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from moe_core.finetune.config import FinetuneConfig, FinetuneError
from moe_core.finetune.hf_adapter import apply_hf_adapter, is_hf_adapter
from moe_core.finetune.methods import apply_method, unwrap
from moe_core.finetune.selection_bias import BUFFER as BIAS_BUFFER
from moe_core.finetune.selection_bias import restore_router_biases
from moe_core.model import MoEForCausalLM
from moe_core.quantized import QuantConfig, load_quantizing_experts

CONFIG_FILE = "finetune_config.json"
ADAPTER_DIR = "adapter"
WEIGHTS_FILE = "adapter_model.safetensors"


def base_quant_config(config: FinetuneConfig) -> QuantConfig | None:
    """How the frozen base experts are held under QLoRA (``quantize.base``), or None."""
    base = config.quantize.base
    if base is None:
        return None
    if base == "int8":
        return QuantConfig(bits=8)
    group_size = config.quantize.group_size
    codebook = "nf4" if base == "nf4" else "int"
    return QuantConfig(  # block: GPTQ's; scales in bf16 (QuantConfig.scale_dtype)
        bits=4, group_size=group_size, block_size=group_size, codebook=codebook, scale_dtype="bfloat16"
    )


def quantizes_shared_experts(config: FinetuneConfig) -> bool:
    """QLoRA holds the shared experts in the same bits as the routed ones (`quantize_shared_experts`), adapted
    or not (``lora.shared_expert``: PEFT's LoRA over the codes, `QuantizedLinearLoRA`), unless
    ``quantize.shared_experts`` is false; ``None`` follows ``quantize.base``."""
    return config.quantize.base is not None and config.quantize.shared_experts is not False


def quantizes_attention(config: FinetuneConfig) -> bool:
    """QLoRA holds the attention projections in the experts' bits too (`quantize_attention`) unless
    ``quantize.attention`` is false; ``None`` follows ``quantize.base``."""
    return config.quantize.base is not None and config.quantize.attention is not False


def load_qlora(
    directory: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
) -> MoEForCausalLM:
    """Our model with the fine-tune's adapter over its quantized base, unmerged, in eval mode (module docstring).
    ``base``: the full-precision checkpoint to quantize (default: the recorded ``model.path``); ``dtype``: the
    non-expert weights' (default: the recorded ``model.dtype``)."""
    directory = Path(directory)
    config = FinetuneConfig.load(directory / CONFIG_FILE)
    adapter = directory / ADAPTER_DIR
    weights = adapter / WEIGHTS_FILE
    if not weights.is_file():
        raise FinetuneError(f"{adapter}: no {WEIGHTS_FILE}; only safetensors adapters are loaded")
    if config.method != "lora":
        raise FinetuneError(
            f"{directory / CONFIG_FILE}: method={config.method} with quantize.base; expected lora"
        )
    if config.routing.task_bias:
        raise FinetuneError(
            f"{directory / CONFIG_FILE}: a task router bias over a quantized base is not loaded yet; merge the "
            "adapter into the full-precision base (moe_core.load(OUT / 'adapter'))"
        )
    source = str(base) if base is not None else config.model.path
    model = load_quantizing_experts(
        source,
        base_quant_config(config),
        dtype or config.model.dtype,
        shared_experts=quantizes_shared_experts(config),
        attention=quantizes_attention(config),
    )
    selection = None
    if config.lora.experts == "esft":  # the experts ESFT chose for this run, recorded beside the adapter
        saved = json.loads((adapter / "moe_expert_selection.json").read_text())["expert_adapters"]
        selection = {int(layer): ids for layer, ids in saved.items()}
    peft_model, _ = apply_method(model, config, expert_selection=selection)
    if is_hf_adapter(adapter, model.config):
        apply_hf_adapter(model, adapter, into=peft_model)
    else:
        tensors = load_file(str(weights))
        # a trained router's selection bias is a buffer of the base, not an adapter tensor (`selection_bias`)
        tensors = {key: t for key, t in tensors.items() if not key.endswith(f".{BIAS_BUFFER}")}
        expected = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
        unplaced = sorted(set(tensors) ^ set(expected))
        if unplaced:
            raise FinetuneError(
                f"{weights}: {unplaced[:3]} do not match the adapter the recorded config builds; is this the "
                f"adapter of {source}?"
            )
        set_peft_model_state_dict(peft_model, tensors)
        restore_router_biases(peft_model, weights)
    trained = unwrap(peft_model)
    trained.requires_grad_(False)
    return trained.eval()
