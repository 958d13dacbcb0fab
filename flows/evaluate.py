"""Flow: evaluate a trained model on prepared data: loss and perplexity (against baselines), the router
profile and its plots, and the cost report."""

from __future__ import annotations

from prefect import flow
from pydantic import Field

from flows.common import out_dir_for
from flows.params import EvaluateParams
from moe_core.data.shards import read_manifest
from tasks import evaluate as ev
from tasks.stages import flow_record, open_journal, record_summary


class EvaluateFlowParams(EvaluateParams):
    model_dir: str = Field(..., description="an exported model (a training run's final/) or checkpoint")
    data_dir: str = Field(..., description="a prepared-data directory (its tokenizer matches the model)")
    baselines: dict[str, str] = Field(default_factory=dict, description="name -> model directory")
    events: str | None = Field(None, description="the training's metrics.jsonl, for the training cost")
    out_dir: str | None = None


@flow(name="evaluate")
def evaluate(params: EvaluateFlowParams) -> dict:
    out = out_dir_for("evaluate", params.out_dir)
    journal = open_journal(out)  # where MLflow's records wait while it is unreachable
    with flow_record("evaluate", params, journal) as run_id:
        models = {"model": params.model_dir, **params.baselines}
        result = ev.evaluate_model(models, params.data_dir, str(out / "eval"), params, run_id)
        profile = ev.profile_router(params.model_dir, params.data_dir, str(out / "analysis"), params, run_id)
        cost = ev.cost_report(
            params.model_dir,
            params.events,
            str(out / "analysis"),
            params.device_name,
            _seq_len(params.data_dir),
            run_id,
        )
        headline = record_summary(run_id, result, profile, cost)  # the flow's run compares in the runs table
    return {
        "metrics": result.metrics,
        "summary_metrics": headline,
        "profile_dir": profile.profile_dir,
        "run_id": cost.run_id,
        "usd_per_million_tokens": cost.usd_per_million_tokens,
        "mlflow_run_id": run_id,
        **journal.summary(),
    }


def _seq_len(data_dir: str) -> int:
    return int(read_manifest(data_dir)["seq_len"])
