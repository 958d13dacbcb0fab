"""Flow: validate a data source with its great-expectations suite; a failure stops here, recorded in MLflow."""

from __future__ import annotations

from prefect import flow

from flows.common import out_dir_for
from flows.params import ValidateParams
from tasks import data
from tasks.stages import flow_record, pending_summary

DEFAULTS = ValidateParams()  # what the Prefect form shows; flows never modify their parameters


@flow(name="validate-data")
def validate_data(params: ValidateParams = DEFAULTS) -> dict:
    out = out_dir_for("validate", None)
    with flow_record("validate_data", params, out_dir=out) as run_id:
        report = data.validate_data(
            params.source, params.kind, params.validation, params.max_documents, str(out), run_id
        )
    summary = {"passed": report.passed, "report": report.report, "run_id": report.run_id}
    return {**summary, "mlflow_run_id": run_id, **pending_summary()}
