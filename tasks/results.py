"""What the stage tasks return to their flow: small typed records (paths, run ids, numbers), never models.

Every result names the stage's MLflow run (``run_id``); those with headline figures carry them in ``metrics``
(numbers, keyed as recorded in MLflow), which `tasks.stages.record_summary` copies onto the flow's own run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_core.data.validation import ValidationResult


@dataclass(frozen=True)
class Validation:
    run_id: str
    report: str  # validation.md
    result: ValidationResult  # the suite's outcome (counts and failed expectations; never the documents)

    @property
    def passed(self) -> bool:
        return self.result.success


@dataclass(frozen=True)
class ModelResult:
    """A stage that produced a model: where it is on disk and where MLflow logged it."""

    run_id: str
    out_dir: str
    export_dir: str  # the model directory (`moe_core.load` reads it)
    model_uri: str | None  # None: not logged (log_model off, or MLflow unreachable: pending)


@dataclass(frozen=True)
class TrainedModel(ModelResult):
    """The pretraining stage's model, with where the run ended."""

    step: int = 0
    tokens: int = 0
    loss: float | None = None  # the last logged training loss
    val_loss: float | None = None
    restarts: int | None = None  # process-group restarts (torchrun's elastic agent), when it ran as one
    metrics_path: str | None = None  # the run's event file (the cost report reads the training cost there)

    @property
    def metrics(self) -> dict[str, float]:
        figures = {"step": self.step, "tokens": self.tokens, "loss": self.loss, "val_loss": self.val_loss}
        figures["restarts"] = self.restarts
        return {f"final.{k}": v for k, v in figures.items() if v is not None}


@dataclass(frozen=True)
class Evaluation:
    run_id: str
    metrics: dict[str, float]  # eval.<split>_loss/_ppl, eval.validation_bpb, baseline.<name>.*
    judged_on: dict[str, str] = field(default_factory=dict)  # the text and tokenizer (hashes), the model
    nonfinite: list[str] = field(default_factory=list)  # metric names that are NaN or infinite


@dataclass(frozen=True)
class RouterProfile:
    run_id: str
    profile_dir: str
    metrics: dict[str, float]  # router health over the layers (dead experts, imbalance, drops, entropy)


@dataclass(frozen=True)
class CostResult:
    run_id: str
    usd_per_million_tokens: float
    metrics: dict[str, float]


@dataclass(frozen=True)
class Benchmark:
    run_id: str
    rows: list[dict]  # one per variant: perplexity, drift, tokens/s, size
    metrics: dict[str, float]
