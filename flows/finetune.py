"""Flow: fine-tune a trained model (SFT, DPO, ORPO, KTO, GRPO, or a reward model: ``config.objective``; full, LoRA
on attention/experts, router-only) and record it."""

from __future__ import annotations

from dataclasses import asdict

from prefect import flow
from pydantic import Field

from flows.common import out_dir_for
from flows.params import FlowParams
from moe_core.finetune import FinetuneConfig
from tasks.finetune import finetune_model
from tasks.stages import flow_record, open_journal


class FinetuneFlowParams(FlowParams):
    config: FinetuneConfig = Field(default_factory=FinetuneConfig)
    base_model_dir: str = Field(..., description="the model to start from (a training run's final/)")
    out_dir: str | None = None


@flow(name="finetune")
def finetune(params: FinetuneFlowParams) -> dict:
    out = out_dir_for("finetune", params.out_dir)
    journal = open_journal(out)  # where MLflow's records wait while it is unreachable
    with flow_record("finetune", params, journal) as run_id:
        result = finetune_model(params.config, params.base_model_dir, str(out), run_id)
    return {**asdict(result), "mlflow_run_id": run_id, "out_dir": str(out), **journal.summary()}
