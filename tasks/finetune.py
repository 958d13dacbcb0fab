"""The fine-tuning task over `moe_core.finetune.finetune` (any objective: sft, dpo, orpo, kto, reward, grpo): base
model in as a path, the merged model out as a path (the fine-tuning directory when only the adapter was written),
telemetry and the adapter into MLflow."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from moe_core.finetune import FinetuneConfig
from tasks import tracking
from tasks.process import stop_as_the_signal_asked
from tasks.results import ModelResult
from tasks.stages import stage_run


@task(name="finetune", retries=1, retry_delay_seconds=3, cache_policy=NO_CACHE)
def finetune_model(
    config: FinetuneConfig,
    base_model_dir: str,
    out_dir: str,
    parent_run_id: str | None,
    stage: str = "finetune",
) -> ModelResult:
    """Fine-tune ``base_model_dir`` (unless ``config.model.path`` names another base) into ``out_dir``; ``stage``
    names the nested MLflow run (the lifecycle's alignment stage is ``align``)."""
    from moe_core.finetune import finetune  # lazy: TRL and datasets (~2 s), only when a finetune stage runs

    if config.model.path is None:
        config = config.model_copy(update={"model": config.model.model_copy(update={"path": base_model_dir})})
    with stage_run(stage, parent_run_id) as run_id:
        tracking.log_config(run_id, config, prefix="finetune")
        result = finetune(config, out_dir, sinks=[tracking.MlflowSink(run_id, out_dir)])
        stop_as_the_signal_asked(result.stopped_by)  # its outputs cover the steps done: not a model to ship
        tracking.log_metrics(
            run_id,
            {
                "final.loss": result.final_loss,
                "trainable_params": result.report.trainable_params,
                "total_params": result.report.total_params,
            },
        )
        if result.adapter_dir is not None:
            tracking.log_artifacts(run_id, result.adapter_dir, "adapter")
        # adapter only (the default for a large LoRA base, moe_core.finetune.sizing): the fine-tuning directory
        # is the model (moe_core.load applies its adapter/), and the adapter above is what MLflow keeps
        model_dir = result.merged_dir or Path(out_dir)
        if result.merged_dir is not None and config.objective == "reward":
            # a reward model scores text, it generates none: its files, not the text-generation flavor
            tracking.log_artifacts(run_id, result.merged_dir, "model")
            models = {"files": f"runs:/{run_id}/model"}
        else:
            models = tracking.log_model(run_id, model_dir) if result.merged_dir is not None else {}
    return ModelResult(
        run_id, str(out_dir), str(model_dir), models.get("transformers") or models.get("files")
    )
