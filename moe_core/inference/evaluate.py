"""Perplexity of a causal LM (PyTorch or ONNX Runtime) on token batches: the quality side of every trade-off
here (quantization drift, pruning, offloading)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F


@torch.no_grad()
def perplexity(model, batches: Iterable[torch.Tensor]) -> float:
    """``exp`` of the mean next-token cross-entropy over every predicted token of ``batches`` ([B, S] ids).

    Works for anything called as ``model(input_ids=..., attention_mask=...)`` returning ``.logits``: our
    model, a transformers model, or an optimum `ORTModelForCausalLM`."""
    total_nll, total_tokens = 0.0, 0
    for input_ids_BS in batches:
        logits_BSV = model(input_ids=input_ids_BS, attention_mask=torch.ones_like(input_ids_BS)).logits
        logits_BSV = torch.as_tensor(logits_BSV).float()
        nll = F.cross_entropy(logits_BSV[:, :-1].reshape(-1, logits_BSV.shape[-1]),
                              input_ids_BS[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += input_ids_BS[:, 1:].numel()
    if total_tokens == 0:
        raise ValueError("perplexity: no tokens to score (give batches of at least 2 tokens per row)")
    return math.exp(total_nll / total_tokens)


def drift(value: float, reference: float) -> float:
    """Relative change, e.g. perplexity drift of a quantized model: (value - reference) / reference."""
    return (value - reference) / reference
