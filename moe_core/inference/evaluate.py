"""Perplexity of a causal LM (PyTorch or ONNX Runtime) on token batches: the quality side of every trade-off
here (quantization drift, pruning, offloading), and a side-by-side table of model variants."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch

from moe_core.data.shards import PackedTokens
from moe_core.errors import MoELabError
from moe_core.eval.batches import split_batches
from moe_core.eval.perplexity import evaluate_loss
from moe_core.inference.onnx_export import load_onnx
from moe_core.loading import load
from moe_core.progress import Progress


def perplexity(model, batches: Iterable[torch.Tensor]) -> float:
    """``exp`` of the mean next-token cross-entropy over every predicted token of ``batches`` ([B, S] ids):
    `moe_core.eval.perplexity.evaluate_loss`, the one perplexity (so a benchmark on the evaluation's batches
    repeats the evaluation's number). Works for our model, a quantized one, or an ONNX export
    (`moe_core.inference.onnx_export.OrtCausalLM`)."""
    return evaluate_loss(model, batches, split="benchmark").perplexity


def calibration_batches(
    data_dir: str | Path, batches: int = 16, batch_size: int = 8, split: str = "train"
) -> list[torch.Tensor]:
    """The first ``batches`` batches [B, S] of a prepared-data directory's ``split``: the calibration data of
    GPTQ / AWQ quantization and of REAP pruning (``--data DIR``)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise MoELabError(
            f"--data {data_dir}: not a directory; give a prepared-data directory (moe-lab data prepare)"
        )
    try:
        PackedTokens(data_dir, split, verify=False)
    except MoELabError as err:
        raise MoELabError(f"--data {data_dir}: cannot read its {split!r} split ({err})") from err
    out = list(split_batches(data_dir, split, batch_size, batches))
    if not out:
        raise MoELabError(f"--data {data_dir}: the {split!r} split has no sequences")
    return out


@torch.no_grad()
def calibration_pass(
    model,
    batches: Iterable[torch.Tensor],
    hooks: list[tuple[torch.nn.Module, object]],
    with_kwargs: bool = False,
) -> None:
    """Run ``batches`` of token ids through ``model`` in eval mode with each ``(module, fn)`` forward hook
    registered (how GPTQ/AWQ see expert inputs and REAP expert outputs; ``with_kwargs``: ``fn(module, args,
    kwargs, output)``, as `torch.nn.Module.register_forward_hook`); hooks removed and mode restored after.
    The hooks read what the layers see, not the logits: only the last position's are computed (a batch's full
    ``[B, S, V]`` logits were the pass's largest tensor)."""
    handles = [module.register_forward_hook(fn, with_kwargs=with_kwargs) for module, fn in hooks]
    was_training = model.training
    model.eval()
    try:
        for input_ids_BS in batches:
            model(input_ids=input_ids_BS, use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)


def drift(value: float, reference: float) -> float:
    """Relative change, e.g. perplexity drift of a quantized model: (value - reference) / reference."""
    return (value - reference) / reference


def compare_variants(
    variants: dict[str, str | Path],
    data_dir: str | Path,
    batches: int | None,
    batch_size: int = 4,
    loaded: dict[str, torch.nn.Module] | None = None,
) -> list[dict[str, float | str]]:
    """Quality, speed and size of each variant (``{"pytorch" | "quantized" | "onnx": directory}``) on the
    same validation batches (the first ``batches`` of ``batch_size`` sequences, as `evaluate_splits` takes
    them: with the evaluation's batch size and count, the pytorch row repeats its validation perplexity);
    the first variant is the reference for the perplexity drift. ``loaded``: variants the caller holds in
    memory already (the weights of their directory), used instead of reading them again."""
    data = list(split_batches(data_dir, "validation", batch_size, batches))
    tokens = sum(b.numel() for b in data)
    rows: list[dict[str, float | str]] = []
    with Progress(len(variants), "benchmark", unit="variant") as bar:
        for kind, path in variants.items():
            bar.set_postfix(variant=kind)
            rows.append(_benchmark_variant(kind, path, data, tokens, (loaded or {}).get(kind)))
            bar.update(1)
    for row in rows:
        row["ppl_drift"] = drift(row["perplexity"], rows[0]["perplexity"])
    return rows


def _benchmark_variant(kind: str, path, data: list, tokens: int, model=None) -> dict[str, float | str]:
    if model is None and kind == "onnx":  # an ONNX Runtime session, not a torch checkpoint
        model = load_onnx(path)
    elif model is None:  # "pytorch" or "quantized": whichever checkpoint kind the directory holds
        model = load(path).model
    start = time.perf_counter()
    ppl = perplexity(model, data)
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    return {"variant": kind, "perplexity": ppl, "tokens_per_s": tokens / seconds, "size_mb": size / 2**20}
