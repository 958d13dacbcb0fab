"""The lifecycle's plumbing without a flow run: the source is validated once, a finished run's result reads
the same from its files as from the trainer, models are read from disk once per process, cost figures reach
MLflow as numbers, and the lifecycle's default trains the dense baseline."""

import json

import pytest

from moe_core.analytics.cost import cost_report
from moe_core.data import prepare as prepare_module
from moe_core.data.prepare import PrepareConfig, prepare, read_manifest
from moe_core.data.validation import validate_source
from moe_core.train import TrainConfig, read_result, train
from tasks import models_in_memory
from tasks.tracking import flatten, numbers
from tests.helpers import tiny_mixtral

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

SMALL = dict(max_documents=24, vocab_size=300, seq_len=32, num_proc=1, val_fraction=0.1, test_fraction=0.1)


def test_a_validated_source_is_not_validated_again_and_the_data_is_the_same(tmp_path, monkeypatch):
    config = PrepareConfig(**SMALL)
    report = validate_source(
        config.source, config.kind, config.validation, max_documents=config.max_documents
    )
    reference = prepare(config, tmp_path / "validated-inside")

    def no_second_validation(*args, **kwargs):
        raise AssertionError("the documents were validated a second time")

    monkeypatch.setattr(prepare_module, "validate", no_second_validation)
    out = prepare(config, tmp_path / "validated-before", validated=report)
    a, b = read_manifest(reference), read_manifest(out)
    assert a["fingerprint"] == b["fingerprint"] and a["splits"] == b["splits"]  # same cache key, same data
    assert b["validation"] == {"suite": report.suite, "success": True, "rows_checked": report.rows_checked}


def test_a_run_read_from_its_files_equals_the_trainers_result(tmp_path):
    config = TrainConfig.build(
        {
            "model": {"preset": "switch-tiny"},
            "steps": 4,
            "batch_size": 2,
            "data": {"source": "synthetic", "seq_len": 16, "synthetic_blocks": 32},
            "log": {"every": 2, "progress": "off"},
            "checkpoint": {"every": 2},
            "eval": {"batches": 1, "every": 2},
        }
    )
    direct, read = train(config, tmp_path), read_result(tmp_path)
    assert (read.step, read.tokens, read.val_loss) == (direct.step, direct.tokens, direct.val_loss)
    assert (read.checkpoint, read.export_dir, read.metrics_path) == (
        direct.checkpoint,
        direct.export_dir,
        direct.metrics_path,
    )
    assert read.loss == next(r["loss"] for r in reversed(direct.history) if "loss" in r)


def test_a_model_directory_is_read_once_per_process_until_it_changes(tmp_path):
    tiny_mixtral().save_pretrained(tmp_path)
    models_in_memory.forget()
    first = models_in_memory.get(tmp_path)
    assert models_in_memory.get(str(tmp_path)) is first
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 1}))
    changed = models_in_memory.get(tmp_path)
    assert changed is not first and changed.config.num_experts_per_tok == 1
    models_in_memory.forget()
    assert models_in_memory.get(tmp_path) is not changed


def test_cost_figures_reach_mlflow_as_numbers():
    report = cost_report(tiny_mixtral().config, 1000.0, "cpu", 16).to_dict()
    metrics = numbers(report, "cost")
    assert metrics["cost.usd_per_million_tokens"] == report["usd_per_million_tokens"]
    assert all(type(v) in (int, float) for v in metrics.values())
    assert set(metrics) < set(flatten(report, "cost"))  # params keep every field as text; metrics the numbers
    assert numbers({"a": {"ok": True, "name": "x", "list": [1, 2], "n": 3}}) == {"a.n": 3}


def test_the_lifecycle_trains_the_dense_baseline_unless_told_not_to():
    from flows.cli import build_params

    assert build_params("lifecycle", None, "tiny", []).baseline == "active"
    assert build_params("lifecycle", None, "tiny", ["baseline=none"]).baseline == "none"


def test_the_closing_summary_prints_the_comparison_the_baseline_was_trained_for(capsys, tmp_path):
    """It printed the MoE's perplexity only, after training a dense baseline to compare it with."""
    from flows.cli import _print_where_to_look

    comparison = {
        "file": str(tmp_path / "eval" / "comparison.md"),
        "validation_ppl": {"moe": 41.5, "dense-active": 47.25},
    }
    result = {"out_dir": str(tmp_path), "metrics": {"eval.validation_ppl": 41.5}, "comparison": comparison}
    _print_where_to_look("lifecycle", result, {"prefect": "ephemeral", "home": str(tmp_path)})
    line = next(line for line in capsys.readouterr().out.splitlines() if "validation ppl" in line)
    assert "moe 41.50, dense-active 47.25" in line and "comparison.md" in line
