"""Data tasks: validate a source (great-expectations report into MLflow), prepare it (cached by config and
source fingerprint). Paths and run ids in, paths and small dicts out."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact

from moe_core.data.errors import DataValidationError
from moe_core.data.prepare import PrepareConfig, config_fingerprint, prepare
from moe_core.data.sources import parse_source, source_fingerprint
from moe_core.data.validation import ValidationConfig, validate_source
from moe_core.fileio import staged_outputs
from tasks import tracking
from tasks.results import Validation
from tasks.stages import stage_run


def _not_a_validation_failure(task, task_run, state) -> bool:
    """Retry I/O errors, never a failed suite (the data will not change by waiting)."""
    return not isinstance(state.result(raise_on_failure=False), DataValidationError)


@task(name="validate-data", retries=2, retry_delay_seconds=2, retry_condition_fn=_not_a_validation_failure)
def validate_data(
    source: str,
    kind: str,
    config: ValidationConfig,
    max_documents: int | None,
    out_dir: str,
    parent_run_id: str | None,
) -> Validation:
    """Run the kind's suite; the report goes to ``out_dir``, MLflow and Prefect. Raises `DataValidationError`
    (the stage's MLflow run marked FAILED) when the data fails it."""
    with stage_run("validate_data", parent_run_id) as run_id:
        result = validate_source(source, kind, config, max_documents=max_documents)
        out = Path(out_dir)
        with staged_outputs(out) as stage:  # whole reports or none, beside what the flow's other stages wrote
            (stage / "validation.md").write_text(result.to_markdown())
            (stage / "validation.json").write_text(json.dumps(result.to_dict(), indent=1))
        tracking.log_config(run_id, config, prefix="validation")
        tracking.log_metrics(
            run_id,
            {
                "validation.passed": float(result.success),
                "validation.rows_checked": result.rows_checked,
                "validation.failed_expectations": len(result.failed),
            },
        )
        tracking.log_artifacts(run_id, out / "validation.md", "validation")
        tracking.log_artifacts(run_id, out / "validation.json", "validation")
        tracking.set_tags(
            run_id,
            {"validation.status": "passed" if result.success else "failed", "validation.suite": result.suite},
        )
        create_markdown_artifact(
            result.to_markdown(), key="data-validation", description=result.summary() or "passed"
        )
        result.raise_for_failure()
    return Validation(run_id, str(out / "validation.md"), result)


def _prepare_cache_key(context, parameters) -> str:
    """Same config + same source content = same prepared data (and the directory is still there)."""
    config: PrepareConfig = parameters["config"]
    source_fp = source_fingerprint(parse_source(config.source), config.hub_config, config.split)
    present = (Path(parameters["out_dir"]) / "manifest.json").is_file()
    return f"prepare-{config_fingerprint(config, source_fp)[:32]}-{'present' if present else 'absent'}"


@task(
    name="prepare-data",
    retries=2,
    retry_delay_seconds=2,
    cache_key_fn=_prepare_cache_key,
    persist_result=True,
    result_serializer="json",
)  # the cached path as JSON: Prefect's default is a pickle
def prepare_data(
    config: PrepareConfig, out_dir: str, parent_run_id: str | None, validated: Validation | None = None
) -> str:
    """Tokenize and pack into ``out_dir`` (reused when it already holds the same data); returns the path.
    ``validated``: the validate stage's result for this source, so its documents are not validated twice."""
    with stage_run("prepare_data", parent_run_id) as run_id:
        data_dir = prepare(config, out_dir, validated=validated.result if validated else None)
        tracking.log_config(run_id, config, prefix="prepare")
        tracking.log_dataset(run_id, data_dir, context="training")
        tracking.log_artifacts(run_id, data_dir / "manifest.json", "data")
        tracking.log_artifacts(run_id, data_dir / "tokenizer", "tokenizer")
    return str(data_dir)
