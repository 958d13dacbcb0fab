"""`finetune`: base model + data + method + objective -> trained adapter / merged weights, in one call.

    from moe_core.finetune import FinetuneConfig, finetune
    result = finetune(FinetuneConfig.load("finetune.yaml"), out_dir="runs/ft")

Base models: our checkpoints load as they are; Hugging Face Mixtral / OLMoE / Qwen2-MoE checkpoints (a local
directory or a hub id) go through the exact converter (`moe_core.convert.from_hf`), so every architecture trains
through one code path: the same LoRA targets on the stacked experts, our router losses in the objective, routing
telemetry, and an exact export back to the architecture it came from (`<out>/hf`).

Written to ``out_dir``: ``finetune_config.json`` (the full config), ``trainable_parameters.json`` (the report),
``metrics.jsonl`` (every log step), ``esft_selection.json`` (ESFT: routing counts and the chosen experts),
``summary.json`` (counts, hashes and final metrics; never text), and the exports (`moe_core.finetune.export`).

The rules every run command follows: ``out_dir`` is locked for the life of the run (`moe_core.fileio.OutputLock`);
one that holds an earlier fine-tune's outputs is refused unless ``overwrite``; every output is staged and moved
into ``out_dir`` only when the run succeeded (`moe_core.fileio.staged_outputs`), so a failed run leaves nothing.
Steps with a non-finite loss or gradient are skipped and counted (`objectives.FiniteStepGuard`); a run whose
last step was skipped, or whose weights are not finite, raises `FinetuneDivergedError` and writes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_core.fileio import OutputLock, refuse_previous_outputs, staged_outputs
from moe_core.finetune.config import FinetuneConfig, FinetuneDivergedError, FinetuneError
from moe_core.finetune.methods import (
    MethodPlan,
    apply_method,
    routing_usage,
    select_esft_experts,
)
from moe_core.finetune.report import TrainableReport, trainable_parameter_report
from moe_core.loading import load

logger = logging.getLogger(__name__)


@dataclass
class FinetuneResult:
    out_dir: Path
    model: Any  # the trained model (a PEFT model for lora), in memory
    plan: MethodPlan
    report: TrainableReport
    metrics: list[dict[str, Any]]
    adapter_dir: Path | None = None
    merged_dir: Path | None = None
    hf_dir: Path | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    last_step_loss: float | None = None  # the loss of the very last optimizer step

    @property
    def final_loss(self) -> float | None:
        losses = [row["loss"] for row in self.metrics if "loss" in row and "train_runtime" not in row]
        return losses[-1] if losses else None


# what a fine-tune writes into its output directory (an earlier run's are refused unless overwrite)
OUTPUTS = (
    "finetune_config.json",
    "trainable_parameters.json",
    "esft_selection.json",
    "metrics.jsonl",
    "summary.json",
    "adapter",
    "merged",
    "hf",
    "trainer",
)


# ------------------------------------------------------------------------------------------------ loading
def _base_model(path: str, dtype: str):
    """Any full-precision checkpoint `moe_core.load` reads: ours (a training run, checkpoint or export, an
    earlier fine-tune), or a Hugging Face Mixtral / OLMoE / Qwen2-MoE checkpoint converted exactly."""
    loaded = load(path, dtype=dtype)
    if loaded.kind == "quantized":
        raise FinetuneError(
            f"model.path={path!r} is a quantized model; fine-tune the full-precision checkpoint it came from"
        )
    return loaded.model


def prepare_tokenizer(tokenizer, model_config):
    if getattr(tokenizer, "chat_template", None) is None:
        raise FinetuneError(
            "the tokenizer has no chat template; SFT/DPO data is framed with it. Use a tokenizer "
            "from moe_core.data.tokenizer (it has one) or set tokenizer.chat_template"
        )
    if len(tokenizer) > model_config.vocab_size:
        raise FinetuneError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{model_config.vocab_size}; use the model's own tokenizer"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_records(config: FinetuneConfig):
    from moe_core.data.sources import load_source

    if not config.data.source:
        raise FinetuneError("data.source is not set; give an instruction (SFT) or preference (DPO) file")
    kind = "instruction" if config.objective == "sft" else "preference"
    loaded = load_source(
        config.data.source,
        kind=kind,
        hub_config=config.data.hub_config,
        split=config.data.split,
        max_documents=config.data.max_examples,
    )
    if config.data.validate_data:
        from moe_core.data.validation import validate

        validate(loaded.dataset, kind, source=loaded.spec.name).raise_for_failure()
    return loaded.dataset


def _records_hash(records) -> str:
    from moe_core.data.sources import canonical_json

    h = hashlib.sha256()
    for record in records:
        h.update(canonical_json(dict(record)).encode())
    return h.hexdigest()


@contextlib.contextmanager
def _quiet_datasets():
    """No `datasets` progress bars while TRL maps the data (noise in logs and tests)."""
    import datasets

    was = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------ ESFT
def esft_selection(model, tokenizer, records, config: FinetuneConfig, frozen: dict[int, list[int]]):
    """Route the first ``lora.esft_examples`` training examples (full conversations, chat template) through the
    base model and pick the experts (`select_esft_experts`)."""
    from moe_core.finetune.objectives import _messages

    batches = []
    n = min(config.lora.esft_examples, len(records))
    for start in range(0, n, config.batch_size):
        texts = [
            tokenizer.apply_chat_template(_messages(records[i], i), tokenize=False)
            for i in range(start, min(start + config.batch_size, n))
        ]
        enc = tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=config.data.max_length,
            add_special_tokens=False,
        )
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    usage = routing_usage(model, batches)
    selection = select_esft_experts(
        usage, config.lora.esft_share, config.lora.esft_score, config.lora.esft_max_experts, exclude=frozen
    )
    return usage, selection


# ------------------------------------------------------------------------------------------------ run
def finetune(
    config: FinetuneConfig,
    out_dir: str | Path,
    *,
    model=None,
    tokenizer=None,
    records=None,
    sinks=(),
    overwrite: bool = False,
) -> FinetuneResult:
    """Fine-tune per ``config`` and write the outputs to ``out_dir``.

    ``model`` (our `MoEForCausalLM`), ``tokenizer`` and ``records`` (a `datasets.Dataset` or list of dicts:
    alpaca/chat rows for SFT, prompt/chosen/rejected for DPO) override ``config.model`` / ``config.data``.
    Extra ``sinks`` (`moe_core.train.telemetry.MetricsSink`) receive the metrics beside ``metrics.jsonl``.
    ``out_dir`` holding an earlier fine-tune's outputs is refused unless ``overwrite`` (then they are replaced
    once this run succeeded); see the module docstring for the locking and staging rules.
    """
    out_dir = Path(out_dir)
    with OutputLock(out_dir, "fine-tuning run"):
        if not overwrite:
            refuse_previous_outputs(
                out_dir, OUTPUTS, "pass --overwrite (overwrite=True) to replace them", error_cls=FinetuneError
            )
        with staged_outputs(out_dir, replace=OUTPUTS if overwrite else ()) as stage:
            result = _finetune(config, stage, model=model, tokenizer=tokenizer, records=records, sinks=sinks)
    for name in ("adapter_dir", "merged_dir", "hf_dir"):  # where the outputs are now
        if getattr(result, name) is not None:
            setattr(result, name, out_dir / getattr(result, name).name)
    result.out_dir = out_dir
    return result


def check_finite_weights(model, where: str) -> None:
    """Refuse weights that are not finite (a diverged run) before anything is written."""
    bad = [
        name
        for name, tensor in model.state_dict().items()
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all()
    ]
    if bad:
        raise FinetuneDivergedError(
            f"{where}: {len(bad)} tensors hold non-finite values (first: {bad[0]}); nothing "
            f"written. Lower optim.lr, keep optim.grad_clip on, or use method=lora"
        )


def _finetune(config: FinetuneConfig, out_dir: Path, *, model, tokenizer, records, sinks) -> FinetuneResult:
    from transformers import PrinterCallback

    from moe_core.data.tokenizer import load_tokenizer
    from moe_core.finetune import export
    from moe_core.finetune.methods import resolve_expert_ids
    from moe_core.finetune.objectives import (
        FiniteStepGuard,
        MoEDPOTrainer,
        MoESFTTrainer,
        MoEStepCallback,
        ProgressCallback,
        SinkCallback,
        TaskCollator,
        dpo_dataset,
        sft_dataset,
        task_names_of,
        trainer_args,
    )
    from moe_core.train.telemetry import JsonlSink, read_jsonl

    config.save(out_dir / "finetune_config.json")
    _seed(config.seed)

    if model is None:
        if not config.model.path:
            raise FinetuneError("model.path is not set; give our checkpoint or a Hugging Face MoE checkpoint")
        model = _base_model(config.model.path, config.model.dtype)
    if tokenizer is None:
        source = config.model.tokenizer or config.model.path
        if not source:
            raise FinetuneError(
                "no tokenizer: set model.tokenizer (or model.path to a directory holding one)"
            )
        tokenizer = load_tokenizer(source)
    tokenizer = prepare_tokenizer(tokenizer, model.config)
    if records is None:
        records = load_records(config)
    if isinstance(records, list):
        import datasets

        records = datasets.Dataset.from_list(records)
    if len(records) == 0:
        raise FinetuneError("the training data has no rows")

    task_names = task_names_of(records, config.data.task_column)
    model.train()
    ref_model = None
    if config.objective == "dpo" and config.method != "lora":
        import copy

        ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # the frozen policy at step 0

    selection = None
    summary: dict[str, Any] = {
        "examples": len(records),
        "data_sha256": _records_hash(records),
        "tasks": {
            name: sum(1 for r in records if str(r[config.data.task_column]) == name) for name in task_names
        },
    }
    if config.method == "lora" and config.lora.experts == "esft" and model.config.num_experts:
        frozen = resolve_expert_ids(config.freeze.experts, model.config, "freeze.experts")
        usage, selection = esft_selection(model, tokenizer, records, config, frozen)
        (out_dir / "esft_selection.json").write_text(
            json.dumps(
                {
                    "usage": usage.to_dict(),
                    "selection": {str(k): v for k, v in selection.items()},
                    "share": config.lora.esft_share,
                    "score": config.lora.esft_score,
                },
                indent=2,
            )
            + "\n"
        )

    train_model, plan = apply_method(model, config, expert_selection=selection, task_names=task_names)
    report = trainable_parameter_report(train_model, plan)
    report.save(out_dir / "trainable_parameters.json")
    logger.info("%s", report.to_text())
    if config.method == "lora" and config.lora.experts != "none" and model.config.num_experts:
        report.require_expert_adapters()
    if report.trainable_params == 0:
        raise FinetuneError("nothing trains: every parameter is frozen; check method and freeze")

    jsonl = JsonlSink(out_dir / "metrics.jsonl")
    guard = FiniteStepGuard(config.faults.max_bad_steps_in_a_row)
    callbacks = [guard, SinkCallback([jsonl, *sinks]), MoEStepCallback(train_model, plan, guard)]
    if config.log.progress != "off":
        callbacks.append(ProgressCallback(config.log.progress))
    args = trainer_args(config, out_dir / "trainer")
    common = dict(
        args=args,
        processing_class=tokenizer,
        callbacks=callbacks,
        plan=plan,
        log_routing=config.log.routing,
        per_expert=config.log.per_expert,
    )
    try:
        with _quiet_datasets():
            if config.objective == "sft":
                dataset = sft_dataset(records, config.data.task_column, task_names)
                trainer = MoESFTTrainer(train_model, train_dataset=dataset, **common)
                if config.data.task_column:
                    trainer.data_collator = TaskCollator(trainer.data_collator)
            else:
                trainer = MoEDPOTrainer(
                    train_model, ref_model=ref_model, train_dataset=dpo_dataset(records), **common
                )
        trainer.remove_callback(PrinterCallback)  # metrics go to the sinks; the log line is ours
        trainer.train()
    finally:
        jsonl.close()
    metrics = read_jsonl(out_dir / "metrics.jsonl")
    if guard.last_step_skipped:  # the weights gave a non-finite loss or gradient: not a model to write
        raise FinetuneDivergedError(
            f"the last {guard.bad_in_row} step(s) had a non-finite loss or gradient ({guard.skipped_steps} of "
            f"{config.steps} skipped); nothing written. Lower optim.lr, keep optim.grad_clip on, or use method=lora"
        )
    check_finite_weights(train_model, "fine-tuned model")

    result = FinetuneResult(
        out_dir,
        train_model,
        plan,
        report,
        metrics,
        summary=summary,
        skipped_steps=guard.skipped_steps,
        last_step_loss=guard.last_step_loss,
    )
    if config.method == "lora" and config.export.adapters:
        result.adapter_dir = export.save_adapter(train_model, out_dir / "adapter", plan)
    want_hf = config.export.hf if config.export.hf is not None else bool(model.config.hf_origin)
    if config.export.merged or want_hf:
        bias = plan.task_bias
        merged = export.merged_model(train_model, plan)
        check_finite_weights(merged, "merged model")
        result.model = merged
        if config.export.merged:
            result.merged_dir = export.save_merged(merged, out_dir / "merged", tokenizer, plan)
        if want_hf:
            result.hf_dir = export.save_hf(merged, out_dir / "hf", tokenizer, plan)
        if bias is not None:
            bias.attach(merged)  # the in-memory model keeps routing with the trained task bias
    final = [row for row in metrics if "loss" in row]
    summary.update(
        {
            "steps": config.steps,
            "skipped_steps": guard.skipped_steps,
            "trainable_params": report.trainable_params,
            "final_metrics": final[-1] if final else {},
            "expert_adapters": {str(k): v for k, v in plan.expert_selection.items()},
        }
    )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return result
