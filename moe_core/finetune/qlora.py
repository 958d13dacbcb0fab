"""How QLoRA holds the frozen base (Dettmers et al. 2023): `base_quant_config` and which modules are quantized.

A fine-tune with ``quantize.base`` trains LoRA over frozen experts held in 4 bits
(`moe_core.quantized.QuantizedExperts`), and optionally the shared experts and the attention projections, and
writes the adapter alone: LoRA on the full-precision model, with the keys stock PEFT reads. Its output loads on the
base quantized again as it trained, the adapter unmerged (`moe_core.finetune.as_trained`).
"""

from __future__ import annotations

import math

from moe_core.finetune.config import FinetuneConfig
from moe_core.quantized import QuantConfig


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


def group_size_hint(widths) -> str:
    """What to set when ``quantize.group_size`` does not divide one of the quantized input widths: the largest
    common group size up to 128 (even, as `QuantConfig` requires), or why none exists."""
    common = math.gcd(*widths)
    fits = [size for size in (128, 64, 32, 16, 8, 4, 2) if common % size == 0]
    if not fits:
        return f"the widths have no even common divisor (their greatest is {common}): set quantize.base=int8"
    return f"--set quantize.group_size={fits[0]} divides them all"
