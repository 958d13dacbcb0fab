"""Models compared on the same prepared data: the composition `moe-lab eval --compare` and the flows' evaluation
stage share, callable from Python.

    from moe_core.eval.compare import compare_models
    comparison = compare_models({"moe": "runs/a", "dense": "runs/dense"}, "runs/data")
    print(comparison.markdown())
    comparison.write("runs/a/eval")            # comparison.md, eval.json

Per model: loss and perplexity per split (`perplexity.evaluate_splits`), its size, FLOPs and training tokens
(`perplexity.model_row`), and with ``bits_per_byte`` the loss per UTF-8 byte on the raw validation text with
the model's own tokenizer (comparable across tokenizers; a model saved without one is read with the data's).
The first model is the candidate: its metrics are ``eval.*``, the others' ``baseline.<name>.*``, and the
table's ratios are against it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_core.data.shards import read_manifest
from moe_core.data.tokenizer import load_tokenizer, tokenizer_hash
from moe_core.eval.bits_per_byte import evaluate_bits_per_byte, split_texts
from moe_core.eval.perplexity import (
    LossResult,
    comparison_table,
    evaluate_splits,
    model_row,
    to_markdown,
    unequal_training,
)
from moe_core.loading import load
from moe_core.train.checkpoint import tokens_trained


@dataclass
class ModelComparison:
    rows: list[dict[str, Any]]  # one per model: `model_row` (+ validation_bpb)
    metrics: dict[str, float]  # eval.<split>_loss/_ppl, eval.validation_bpb, baseline.<name>.*
    judged_on: dict[str, str] = field(default_factory=dict)  # the candidate's text and tokenizer (hashes)
    warning: str | None = None  # the models trained on different numbers of tokens
    results: dict[str, dict[str, LossResult]] = field(default_factory=dict)  # model name -> split -> result

    @property
    def nonfinite(self) -> list[str]:
        """Metric names that are NaN or infinite (a diverged model)."""
        return sorted(k for k, v in self.metrics.items() if not math.isfinite(v))

    def table(self):
        return comparison_table(self.rows, reference=self.rows[0]["model"])

    def markdown(self) -> str:
        return to_markdown(self.table())

    def records(self) -> list[dict[str, Any]]:
        return json.loads(self.table().to_json(orient="records"))

    def write(self, out_dir: str | Path) -> list[Path]:
        """``comparison.md`` and ``eval.json`` (the metrics) in ``out_dir``; returns their paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.md").write_text(self.markdown() + "\n")
        (out / "eval.json").write_text(json.dumps(self.metrics, indent=1) + "\n")
        return [out / "comparison.md", out / "eval.json"]


def compare_models(
    models: Mapping[str, str],
    data_dir: str | Path,
    splits: Sequence[str] = ("validation",),
    batch_size: int = 8,
    max_batches: int | None = None,
    *,
    bits_per_byte: bool = True,
    load: Callable[[str], Any] = load,
) -> ModelComparison:
    """Evaluate each of ``models`` (name -> any checkpoint `moe_core.load` reads; the first is the candidate)
    on ``data_dir``'s ``splits``. ``load`` reads a model (returns an object with ``.model`` and
    ``.tokenizer``, as `moe_core.load`): a flow passes its per-process cache."""
    rows, metrics, judged_on, all_results = [], {}, {}, {}
    seq_len = int(read_manifest(data_dir)["seq_len"])
    texts = None
    if bits_per_byte:
        texts = split_texts(data_dir, "validation", None if max_batches is None else max_batches * batch_size)
    for i, (name, model_dir) in enumerate(models.items()):
        loaded = load(model_dir)
        model = loaded.model
        results = all_results[name] = evaluate_splits(model, data_dir, splits, batch_size, max_batches)
        row = model_row(name, model.config, results, tokens_trained=tokens_trained(model_dir))
        prefix = "eval" if i == 0 else f"baseline.{name}"
        for split, r in results.items():
            metrics.update({f"{prefix}.{split}_loss": r.loss, f"{prefix}.{split}_ppl": r.perplexity})
        if bits_per_byte:
            tokenizer = loaded.tokenizer
            if tokenizer is None:  # a model saved without one: the data's, which it was trained on
                tokenizer = load_tokenizer(Path(data_dir) / "tokenizer")
            per_byte = evaluate_bits_per_byte(model, tokenizer, texts, window=seq_len, batch_size=batch_size)
            row["validation_bpb"] = metrics[f"{prefix}.validation_bpb"] = per_byte.bits_per_byte
            if i == 0:
                judged_on = {
                    "eval.text_sha256": per_byte.text_sha256,
                    "eval.text_bytes": str(per_byte.bytes),
                    "eval.tokenizer_sha256": tokenizer_hash(tokenizer),
                    "eval.model_dir": str(model_dir),
                }
        rows.append(row)
    return ModelComparison(rows, metrics, judged_on, unequal_training(rows), all_results)
