"""Perplexity of a causal LM (PyTorch or ONNX Runtime) on token batches: the quality side of every trade-off
here (quantization drift, pruning, offloading), and a side-by-side table of model variants."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F

from moe_core.errors import MoELabError


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


def calibration_batches(data_dir: str | Path, batches: int = 16, batch_size: int = 8,
                        split: str = "train") -> list[torch.Tensor]:
    """The first ``batches`` batches [B, S] of a prepared-data directory's ``split``: the calibration data of
    GPTQ / AWQ quantization and of REAP pruning (``--data DIR``)."""
    from moe_core.data.shards import PackedTokens
    from moe_core.eval.batches import split_batches

    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise MoELabError(f"--data {data_dir}: not a directory; give a prepared-data directory (moe-lab data prepare)")
    try:
        PackedTokens(data_dir, split, verify=False)
    except MoELabError as err:
        raise MoELabError(f"--data {data_dir}: cannot read its {split!r} split ({err})") from err
    out = list(split_batches(data_dir, split, batch_size, batches))
    if not out:
        raise MoELabError(f"--data {data_dir}: the {split!r} split has no sequences")
    return out


def drift(value: float, reference: float) -> float:
    """Relative change, e.g. perplexity drift of a quantized model: (value - reference) / reference."""
    return (value - reference) / reference


def load_variant(kind: str, path: str | Path):
    """A model variant from its directory: ``"onnx"`` (an `ORTModelForCausalLM`), ``"quantized"`` (weight-only
    quantized experts) or ``"pytorch"`` (our checkpoint)."""
    if kind == "onnx":
        from moe_core.inference.onnx_export import load_onnx

        return load_onnx(path)
    if kind == "quantized":
        from moe_core.inference.quantize import load_quantized

        return load_quantized(path)
    from moe_core import MoEForCausalLM

    return MoEForCausalLM.from_pretrained(path).eval()


def compare_variants(variants: dict[str, str | Path], data_dir: str | Path, batches: int,
                     batch_size: int = 4) -> list[dict[str, float | str]]:
    """Quality, speed and size of each variant (``{"pytorch" | "quantized" | "onnx": directory}``) on the
    same validation batches; the first variant is the reference for the perplexity drift."""
    from moe_core.eval.batches import split_batches

    data = list(split_batches(data_dir, "validation", batch_size, batches))
    tokens = sum(b.numel() for b in data)
    rows: list[dict[str, float | str]] = []
    for kind, path in variants.items():
        model = load_variant(kind, path)
        start = time.perf_counter()
        ppl = perplexity(model, data)
        seconds = time.perf_counter() - start
        size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
        rows.append({"variant": kind, "perplexity": ppl, "tokens_per_s": tokens / seconds, "size_mb": size / 2**20})
    for row in rows:
        row["ppl_drift"] = drift(row["perplexity"], rows[0]["perplexity"])
    return rows
