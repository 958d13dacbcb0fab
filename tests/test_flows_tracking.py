"""The MLflow adapter on its own: flattened configs, the telemetry sink, offline training and `sync`."""

from __future__ import annotations

import json

import pytest


def test_flatten_keeps_configs_small_and_complete():
    from flows.params import LifecycleParams
    from tasks.tracking import flatten

    flat = flatten(LifecycleParams())
    assert flat["train.model.preset"] == "switch-tiny"
    assert flat["train.optim.betas"] == "[0.9, 0.95]"
    assert flat["promotion.margin"] == "0.0"
    assert all(len(v) <= 6000 for v in flat.values())


def test_training_goes_on_when_mlflow_is_unreachable_and_sync_uploads_later(lab_env, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from moe_core.train import TrainConfig, read_jsonl, train
    from tasks import tracking

    run_id = tracking.start_run("offline-training")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    unreachable = MlflowClient(tracking_uri="http://127.0.0.1:9")  # nothing listens on the discard port
    sink = tracking.MlflowSink(run_id, tmp_path, mlflow_client=unreachable, close_timeout=20)
    config = TrainConfig.build(
        {
            "model": {"preset": "switch-tiny"},
            "steps": 6,
            "batch_size": 4,
            "data": {"source": "synthetic", "synthetic_blocks": 16, "seq_len": 16},
            "log": {"every": 2, "progress": "off"},
            "checkpoint": {"export": False},
        }
    )
    result = train(config, tmp_path, sinks=[sink])
    assert result.step == 6  # training finished
    assert sink.offline_from_step == 2 and sink.error
    assert json.loads((tmp_path / "mlflow_run.json").read_text())["offline_from_step"] == 2
    events = read_jsonl(tmp_path / "metrics.jsonl")
    assert [e["step"] for e in events] == [2, 4, 6]
    assert MlflowClient().get_metric_history(run_id, "loss") == []

    synced_run, uploaded = tracking.sync_events(tmp_path)
    assert (synced_run, uploaded) == (run_id, 3)
    history = MlflowClient().get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [2, 4, 6]
    assert [m.value for m in history] == pytest.approx([e["loss"] for e in events])
    tracking.end_run(run_id)


def test_sync_command_creates_a_run_for_an_untracked_directory(lab_env, tmp_path):
    from mlflow import MlflowClient

    from moe_lab.cli import main

    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "time": 1.0, "loss": 3.5}\n{"step": 2, "time": 2.0, "loss": 3.0}\n'
    )
    assert main(["sync", str(tmp_path)]) == 0
    run_id = json.loads((tmp_path / "mlflow_run.json").read_text())["run_id"]
    assert [m.value for m in MlflowClient().get_metric_history(run_id, "loss")] == [3.5, 3.0]
