"""Flow: validate a data source with its great-expectations suite; a failure stops here, recorded in MLflow."""

from __future__ import annotations

from prefect import flow

from flows.common import out_dir_for
from flows.params import ValidateParams
from tasks import data
from tasks.stages import flow_record, open_journal

DEFAULTS = ValidateParams()  # what the Prefect form shows; flows never modify their parameters


@flow(name="validate-data")
def validate_data(params: ValidateParams = DEFAULTS) -> dict:
    out = out_dir_for("validate", None)
    journal = open_journal(out)  # where MLflow's records wait while it is unreachable
    with flow_record("validate_data", params, journal) as run_id:
        report = data.validate_data(
            params.source, params.kind, params.validation, params.max_documents, str(out), run_id
        )
    summary = {"passed": report.passed, "report": report.report, "run_id": report.run_id}
    return {**summary, "mlflow_run_id": run_id, **journal.summary()}
