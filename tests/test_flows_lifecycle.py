"""End to end: the lifecycle on the built-in corpus with a tiny preset, then the stage flows on its outputs,
asserted through MlflowClient (nested runs, metrics, artifacts, registry aliases)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def stage_runs(client, parent_id: str) -> dict:
    runs = client.search_runs(
        [client.get_run(parent_id).info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'"
    )
    return {r.data.tags["mlflow.runName"]: r for r in runs}


def artifact_paths(client, run, path: str = "") -> set[str]:
    return {f.path for f in client.list_artifacts(run.info.run_id, path)}


@pytest.fixture(scope="module")
def lifecycle_result(lab_env):
    from flows.lifecycle import lifecycle
    from flows.params import LifecycleParams, PromotionParams

    # the default trains the dense baseline with equal active parameters (asserted below)
    return lifecycle(LifecycleParams(promotion=PromotionParams(model_name="test-lm")))


def test_lifecycle_records_runs_metrics_artifacts_and_registry(lifecycle_result):
    from mlflow import MlflowClient

    client = MlflowClient()
    parent = client.get_run(lifecycle_result["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"] and parent.data.tags["prefect.flow_name"] == "lifecycle"
    assert parent.data.params["train.model.preset"] == "switch-tiny"  # the full config, flattened
    assert parent.data.params["train.steps"] == "12"
    out = Path(lifecycle_result["out_dir"])  # the MoE's analysis is written into the MoE's own run directory
    assert Path(lifecycle_result["profile_dir"]) == out / "pretrain" / "analysis" / "profile"
    assert (out / "pretrain" / "analysis" / "cost.json").is_file() and not (out / "analysis").exists()

    stages = stage_runs(client, parent.info.run_id)
    assert {
        "validate_data",
        "prepare_data",
        "pretrain",
        "pretrain_dense_active",
        "evaluate",
        "profile",
        "cost",
        "quantize",
        "export_onnx",
        "benchmark",
    } <= set(stages)
    assert all(run.info.status == "FINISHED" for run in stages.values())

    pretrain = stages["pretrain"]
    assert len(client.get_metric_history(pretrain.info.run_id, "loss")) >= 3  # telemetry through the sink
    assert any(k.startswith("moe/layer_") for k in pretrain.data.metrics)
    assert pretrain.data.params["train.data.path"] == lifecycle_result["data_dir"]
    assert pretrain.inputs.dataset_inputs  # recorded with mlflow.data, by fingerprint
    assert {"eval.validation_ppl", "baseline.dense-active.validation_ppl"} <= set(
        stages["evaluate"].data.metrics
    )
    assert any(k.startswith("router.layer_") for k in stages["profile"].data.metrics)
    assert "cost.usd_per_million_tokens" in stages["cost"].data.metrics
    assert "bench.quantized.ppl_drift" in stages["benchmark"].data.metrics

    assert "validation/validation.md" in artifact_paths(client, stages["validate_data"], "validation")
    assert "tokenizer" in artifact_paths(client, stages["prepare_data"])
    assert "routing_profile/profile.json" in artifact_paths(client, stages["profile"], "routing_profile")
    plots = artifact_paths(client, stages["profile"], "plots")
    assert {"plots/expert_load.png", "plots/token_routing.png", "plots/routing_flow.html"} <= set(plots), (
        plots
    )
    checkpoint = artifact_paths(client, pretrain, "checkpoint")  # what the run was, not the weights again
    assert "checkpoint/trainer_state.json" in checkpoint, checkpoint
    assert not any(p.endswith((".safetensors", ".pt")) for p in checkpoint), checkpoint  # no optimizer state
    assert pretrain.data.params["arch.num_experts"] == "8" and "arch.params_active" in pretrain.data.params
    assert len(client.get_metric_history(pretrain.info.run_id, "val_loss")) >= 2  # a curve, not one point
    for name in (
        "eval.validation_ppl",
        "eval.test_ppl",
        "eval.validation_bpb",
        "baseline.dense-active.validation_ppl",
        "cost.usd_per_million_tokens",
        "router.dead_experts",
        "bench.quantized.ppl_drift",
    ):
        assert name in parent.data.metrics, name  # the parent run compares in the runs table
    # one perplexity per model and split: the benchmark scores the evaluation's batches
    assert parent.data.metrics["bench.pytorch.perplexity"] == pytest.approx(
        parent.data.metrics["eval.validation_ppl"], rel=1e-5
    )
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    html = client.download_artifacts(stages["profile"].info.run_id, "plots/routing_flow.html")
    assert 'src="plotly.min.js"' not in open(html).read() and "plots/plotly.min.js" not in plots
    models = client.search_logged_models([parent.info.experiment_id])
    flavors = {
        m.name for m in models if m.source_run_id in (pretrain.info.run_id, stages["export_onnx"].info.run_id)
    }
    assert {"transformers", "onnx"} <= flavors and "pytorch" not in flavors  # nothing pickled

    for key, value in {**parent.data.params, **pretrain.data.params}.items():  # configs, never text
        assert len(value) < 500, key
    champion = client.get_model_version_by_alias("test-lm", "champion")
    assert str(champion.version) == lifecycle_result["version"] == "1"
    assert str(client.get_model_version_by_alias("test-lm", "candidate").version) == "1"
    assert champion.tags["promotion.decision"] == "promoted"
    assert parent.data.tags["registry.champion"] == "1"


def test_evaluate_and_optimize_flows_on_a_trained_model(lifecycle_result, tmp_path):
    from mlflow import MlflowClient

    from flows.evaluate import EvaluateFlowParams, evaluate
    from flows.optimize import OptimizeFlowParams, optimize

    model, data = lifecycle_result["export_dir"], lifecycle_result["data_dir"]
    ev = evaluate(
        EvaluateFlowParams(
            model_dir=model, data_dir=data, profile_batches=2, plots=False, out_dir=str(tmp_path / "eval")
        )
    )
    assert ev["metrics"]["eval.validation_ppl"] == pytest.approx(
        lifecycle_result["metrics"]["eval.validation_ppl"]
    )
    opt = optimize(
        OptimizeFlowParams(
            model_dir=model, data_dir=data, onnx=False, benchmark_batches=1, out_dir=str(tmp_path / "opt")
        )
    )
    assert [row["variant"] for row in opt["benchmark"]] == ["pytorch", "quantized"]
    client = MlflowClient()
    assert {"evaluate", "profile", "cost"} <= set(stage_runs(client, ev["mlflow_run_id"]))
    assert {"quantize", "benchmark"} <= set(stage_runs(client, opt["mlflow_run_id"]))


def test_failing_validation_stops_before_training_and_shows_in_mlflow(lab_env):
    from mlflow import MlflowClient

    from flows.lifecycle import lifecycle
    from flows.params import LifecycleParams, PromotionParams
    from moe_core.data import DataValidationError
    from moe_core.data.validation import ValidationConfig

    params = LifecycleParams(
        validation=ValidationConfig(min_rows=10**6), promotion=PromotionParams(model_name="never-registered")
    )
    started_ms = int(time.time() * 1000)  # the session's store may hold other tests' failed lifecycles
    state = lifecycle(params, return_state=True)
    assert state.is_failed()
    with pytest.raises(DataValidationError):
        state.result()
    client = MlflowClient()
    failed = client.search_runs(
        [client.get_experiment_by_name("moe-lab").experiment_id],
        "tags.`moe_lab.flow` = 'lifecycle' and attributes.status = 'FAILED' "
        f"and attributes.start_time >= {started_ms}",
    )
    assert len(failed) == 1 and "DataValidationError" in failed[0].data.tags["failure_reason"]
    stages = stage_runs(client, failed[0].info.run_id)
    assert set(stages) == {"validate_data"}  # nothing was prepared or trained
    assert stages["validate_data"].info.status == "FAILED"
    assert stages["validate_data"].data.tags["validation.status"] == "failed"
    assert stages["validate_data"].data.metrics["validation.passed"] == 0.0
    assert "validation/validation.md" in artifact_paths(client, stages["validate_data"], "validation")


def test_finetune_flow_on_the_pretrained_model(lifecycle_result, tmp_path):
    import json

    from mlflow import MlflowClient

    from flows.finetune import FinetuneFlowParams, finetune
    from moe_core.finetune import FinetuneConfig
    from tests.finetune_helpers import instruction_records

    data_file = tmp_path / "sft.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in instruction_records(8)))
    config = FinetuneConfig.build(
        {
            "data": {"source": str(data_file), "max_length": 32},
            "method": "full",
            "freeze": {"router": True},
            "steps": 2,
            "batch_size": 2,
        }
    )
    result = finetune(
        FinetuneFlowParams(
            config=config, base_model_dir=lifecycle_result["export_dir"], out_dir=str(tmp_path / "ft")
        )
    )
    client = MlflowClient()
    stages = stage_runs(client, result["mlflow_run_id"])
    assert stages["finetune"].info.status == "FINISHED"
    assert stages["finetune"].data.params["finetune.model.path"] == lifecycle_result["export_dir"]
    assert client.get_metric_history(stages["finetune"].info.run_id, "loss")  # telemetry through the sink
    assert result["model_uri"].startswith("models:/")
