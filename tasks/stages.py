"""What every stage task shares: a nested MLflow run tagged with the Prefect run it belongs to, closed as
FAILED (with the reason) when the stage raises, and links from Prefect to MLflow. And what a flow shares with
its stages: its offline journal (`open_journal`, made current for the flow's block by `flow_record`)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

from prefect.artifacts import create_link_artifact
from prefect.runtime import deployment, flow_run, task_run

from tasks import models_in_memory, pending, tracking


def prefect_tags() -> dict[str, str]:
    """Prefect ids of the current flow run, task run and deployment (empty outside a run)."""
    tags = {
        "prefect.flow_run_id": flow_run.id,
        "prefect.flow_run_name": flow_run.name,
        "prefect.flow_name": flow_run.flow_name,
        "prefect.deployment_id": deployment.id,
        "prefect.deployment_name": deployment.name,
    }
    if task_run.id:
        tags.update({"prefect.task_run_id": task_run.id, "prefect.attempt": str(task_run.run_count)})
    return {k: str(v) for k, v in tags.items() if v}


@contextmanager
def stage_run(name: str, parent_run_id: str | None):
    """A nested MLflow run for one stage; yields its id."""
    attempt = task_run.run_count if task_run.id else 1
    run_name = name if attempt <= 1 else f"{name} (attempt {attempt})"
    run_id = tracking.start_run(run_name, parent_run_id, tags={**prefect_tags(), "moe_lab.stage": name})
    try:
        yield run_id
    except BaseException as err:
        tracking.end_run(run_id, "FAILED", reason=f"{type(err).__name__}: {str(err)[:400]}")
        raise
    tracking.end_run(run_id)


def link_to_run(run_id: str, key: str, description: str) -> None:
    """A Prefect link artifact to the MLflow run (keys: lowercase letters, digits and dashes); none while
    the run waits for MLflow (it has no address yet)."""
    if pending.current().offline(run_id):
        return
    create_link_artifact(
        tracking.run_url(run_id), link_text=f"MLflow run {run_id[:8]}", key=key, description=description
    )


def open_journal(out_dir: str | Path) -> pending.Journal:
    """A top-level flow's offline journal in ``out_dir``, after a fresh look at the server (`tracking.probe`:
    seconds, not MLflow's minutes of retries): when MLflow cannot be reached, or stops answering mid-flow,
    the flow goes on and its records wait in ``<out_dir>/mlflow_pending.jsonl`` for ``moe-lab sync <out_dir>``
    (see `tasks.pending`). The flow passes it to `flow_record` and reads `Journal.summary` for its result."""
    journal = pending.Journal(out_dir, offline_reason=tracking.probe())
    if journal.offline_reason is not None:
        tracking.warn_offline(journal.offline_reason, journal)
    return journal


@contextmanager
def flow_record(name: str, params, journal: pending.Journal | None, parent_run_id: str | None = None):
    """The MLflow run of one flow run (nested under ``parent_run_id`` when given): tagged with the Prefect
    flow run and deployment, the full parameters as params, closed FAILED/KILLED with the reason. Inside the
    block ``journal`` (`open_journal`) is the current one, so every stage's records that MLflow cannot take
    go there; None for a flow nested in another, which keeps its parent's."""
    with pending.use(journal) if journal is not None else nullcontext():
        run_id = tracking.start_run(name, parent_run_id, tags={**prefect_tags(), "moe_lab.flow": name})
        tracking.log_config(run_id, params)
        link_to_run(run_id, f"mlflow-{name.replace('_', '-')}", f"MLflow run of this {name} flow run")
        try:
            yield run_id
        except Exception as err:
            tracking.end_run(run_id, "FAILED", reason=f"{type(err).__name__}: {str(err)[:400]}")
            raise
        except BaseException as err:  # cancelled (Prefect's TerminationSignal), interrupted
            tracking.end_run(run_id, "KILLED", reason=type(err).__name__)
            raise
        finally:
            if journal is not None:  # a top-level flow run's models leave memory with it
                models_in_memory.forget()
        tracking.end_run(run_id)


def record_summary(run_id: str, *results, **prefixed) -> dict[str, float]:
    """The headline figures of a flow's stages (each result's ``metrics``; those passed by keyword under
    ``<keyword>.``) on the flow's own run, so flow runs compare side by side in MLflow's runs table; returns
    what was recorded. A result is any `tasks.results` record with ``metrics``, or None (a skipped stage)."""
    merged: dict[str, float] = {}
    for result in results:
        merged.update(result.metrics if result is not None else {})
    for prefix, result in prefixed.items():
        merged.update({f"{prefix}.{k}": v for k, v in (result.metrics if result is not None else {}).items()})
    tracking.log_metrics(run_id, merged)
    return merged
