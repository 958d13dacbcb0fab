"""Loss and perplexity over a split, and comparison tables of several models.

Legend: B = batch, S = sequence, V = vocabulary, N = predicted tokens.

Perplexity is ``exp(sum of token losses / number of predicted tokens)`` over the whole split: every token
weighs the same, whatever batch it was in (a mean of batch means would overweight short last batches).
Position s predicts token s+1, as in `MoEForCausalLM.forward`; labels equal to ``ignore_index`` are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moe_core.config import parameter_counts
from moe_core.errors import MoELabError
from moe_core.eval.batches import split_batches
from moe_core.flops import flops_per_token


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean loss in nats per token; inf past what a float holds (exp overflows near 709.8).
    The project's one perplexity: training's validation, evaluation, comparison tables."""
    return math.exp(loss) if loss < 700 else float("inf")


class EvaluationError(MoELabError):
    """An evaluation that cannot run (an empty split, a model and data that do not fit together)."""


@dataclass(frozen=True)
class LossResult:
    split: str
    loss: float  # mean next-token cross-entropy, nats per token
    tokens: int  # predicted tokens
    sequences: int

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)

    @property
    def bits_per_token(self) -> float:
        return self.loss / math.log(2)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "perplexity": self.perplexity, "bits_per_token": self.bits_per_token}

    def _repr_markdown_(self) -> str:  # a notebook shows one readable line
        return (
            f"**{self.split}**: perplexity {self.perplexity:.4g}, loss {self.loss:.4f} nats/token "
            f"({self.bits_per_token:.3f} bits/token) over {self.tokens:,} predicted tokens in "
            f"{self.sequences:,} sequences"
        )


@torch.no_grad()
def evaluate_loss(
    model, batches: Iterable, split: str = "eval", max_batches: int | None = None, ignore_index: int = -100
) -> LossResult:
    """Token-weighted mean loss of ``model`` over ``batches`` (LongTensor [B, S], or (ids, domains) pairs),
    in eval mode (restored afterwards): no router statistics move.

    The one perplexity of the project: ``moe_core.inference.evaluate.perplexity`` (the benchmark of model
    variants, ONNX Runtime included) scores through this function too, so the same model on the same batches
    gets the same number in every stage."""
    torch_module = isinstance(model, torch.nn.Module)
    device = next(model.parameters()).device if torch_module else torch.device("cpu")
    vocab_size = model.config.vocab_size
    total_nats = 0.0
    tokens = sequences = 0
    was_training = getattr(model, "training", False)
    if torch_module:
        model.eval()
    try:
        for n, batch in enumerate(batches):
            if max_batches is not None and n >= max_batches:
                break
            ids_BS = batch[0] if isinstance(batch, (tuple, list)) else batch
            ids_BS = ids_BS.to(device)
            if ids_BS.dim() == 1:
                ids_BS = ids_BS[None]
            if ids_BS.numel() and int(ids_BS.max()) >= vocab_size:
                raise EvaluationError(
                    f"token id {int(ids_BS.max())} >= the model's vocab_size {vocab_size}: "
                    "the data was prepared with another tokenizer"
                )
            if torch_module:
                logits_BSV = model(ids_BS, use_cache=False).logits
            else:  # an ONNX Runtime model (onnx_export.OrtCausalLM): keyword inputs, an explicit mask
                logits_BSV = torch.as_tensor(
                    model(input_ids=ids_BS, attention_mask=torch.ones_like(ids_BS)).logits
                )
            targets_N = ids_BS[:, 1:].reshape(-1)
            nats = F.cross_entropy(
                logits_BSV[:, :-1].float().reshape(-1, logits_BSV.shape[-1]),
                targets_N,
                ignore_index=ignore_index,
                reduction="sum",
            )
            total_nats += float(nats)
            tokens += int((targets_N != ignore_index).sum())
            sequences += ids_BS.shape[0]
    finally:
        if torch_module:
            model.train(was_training)
    if tokens == 0:
        raise EvaluationError(f"split {split!r}: no token to predict (empty split, or sequences of length 1)")
    return LossResult(split=split, loss=total_nats / tokens, tokens=tokens, sequences=sequences)


def evaluate_splits(
    model,
    data_dir: str | Path,
    splits: Sequence[str] = ("validation", "test"),
    batch_size: int = 8,
    max_batches: int | None = None,
) -> dict[str, LossResult]:
    """`evaluate_loss` on each split of a prepared-data directory (first blocks, in order)."""
    return {
        split: evaluate_loss(model, split_batches(data_dir, split, batch_size, max_batches), split=split)
        for split in splits
    }


def model_row(
    name: str,
    config,
    results: Mapping[str, LossResult],
    seq_len: int | None = None,
    tokens_trained: int | None = None,
) -> dict[str, Any]:
    """One row of a comparison table: sizes and FLOPs from the config, the training tokens behind it (when
    known), loss and perplexity per split."""
    counts = parameter_counts(config)
    flops = flops_per_token(config, seq_len or config.max_position_embeddings)
    row: dict[str, Any] = {
        "model": name,
        "experts": f"{config.num_experts_per_tok}/{config.num_experts}" if config.num_experts else "dense",
        "params_total": counts["total"],
        "params_active": counts["active"],
        "gflops_per_token": flops.forward_active / 1e9,
        "tokens_trained": tokens_trained,
    }
    for split, result in results.items():
        row[f"{split}_loss"] = result.loss
        row[f"{split}_ppl"] = result.perplexity
    return row


def unequal_training(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """A warning when the compared models saw different numbers of training tokens (a perplexity gap is then
    partly data, not architecture), or None."""
    known = {row["model"]: row.get("tokens_trained") for row in rows if row.get("tokens_trained") is not None}
    if len(set(known.values())) <= 1:
        return None
    seen = ", ".join(f"{name} {tokens:,}" for name, tokens in known.items())
    return (
        f"the models were trained on different numbers of tokens ({seen}): the comparison mixes the "
        "architecture with the training budget; train them for the same steps and batch size"
    )


def comparison_table(rows: Sequence[Mapping[str, Any]], reference: str | None = None):
    """A pandas DataFrame of `model_row` rows; with ``reference`` (a model name), adds ``<split>_ppl_ratio``
    columns: each model's perplexity over the reference's (below 1.0 is better)."""
    import pandas as pd  # here, not at the top: the trainer imports this module, and pandas costs every run 0.2-0.5 s

    df = pd.DataFrame(list(rows))
    if reference is not None:
        if reference not in set(df["model"]):
            raise EvaluationError(f"reference model {reference!r} is not in the table ({list(df['model'])})")
        ref = df[df["model"] == reference].iloc[0]
        for col in [c for c in df.columns if c.endswith("_ppl")]:
            df[f"{col}_ratio"] = df[col] / ref[col]
    return df


def to_markdown(df, floatfmt: str = ".4g") -> str:
    """A GitHub markdown table (no `tabulate` dependency)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return format(v, floatfmt)
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    header = "| " + " | ".join(map(str, df.columns)) + " |"
    rule = "|" + "|".join("---" for _ in df.columns) + "|"
    body = [
        "| " + " | ".join(cell(v.item() if hasattr(v, "item") else v) for v in row) + " |"
        for row in df.itertuples(index=False)
    ]
    return "\n".join([header, rule, *body])
