"""MLflow runs for the dashboard, read through MLflow's own client (read-only): the listing, and the metric
history of a run, so a run known only to the tracking server (no run directory here) still shows its curves.

The dashboard uses ``mlflow`` directly rather than the flows' adapter (``tasks/tracking.py``): it sits beside
the library, not above the flows, and needs only reads. Runs are addressed by MLflow's run id (32 hex
digits, checked), never by a path.
"""

from __future__ import annotations

import math
import re

import numpy as np

from dashboard.runs import downsample_series

RUN_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_RUNS = 200


def _client(uri: str):
    from mlflow import MlflowClient  # MLflow is optional for the dashboard: imported only with --mlflow

    return MlflowClient(tracking_uri=uri)


def _finite(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}


def list_runs(uri: str, local_ids: dict[str, str] | None = None) -> list[dict]:
    """Every experiment's runs, newest first: ids, names, status, latest metrics; ``local`` is the id of the
    run directory under the runs roots that logged to it (its ``mlflow_run.json``), when there is one."""
    c = _client(uri)
    experiments = [e.experiment_id for e in c.search_experiments()]
    if not experiments:
        return []
    runs = c.search_runs(experiments, max_results=MAX_RUNS, order_by=["attribute.start_time DESC"])
    local_ids = local_ids or {}
    return [
        {
            "run_id": r.info.run_id,
            "name": r.info.run_name,
            "status": r.info.status,
            "start_time": r.info.start_time,
            "metrics": _finite(r.data.metrics),
            "parent": r.data.tags.get("mlflow.parentRunId"),
            "local": local_ids.get(r.info.run_id),
        }
        for r in runs
    ]


def run_summary(uri: str, run_id: str) -> dict:
    r = _client(uri).get_run(run_id)
    return {
        "run_id": run_id,
        "name": r.info.run_name,
        "status": r.info.status,
        "metrics": sorted(_finite(r.data.metrics)),
        "params": {k: v for k, v in r.data.params.items() if len(v) <= 200},  # config values, not text
    }


def metric_history(uri: str, run_id: str, keys: list[str], points: int) -> dict[str, dict]:
    """Each metric's history by step (the last value logged at a step), downsampled like local series."""
    c, out = _client(uri), {}
    for key in keys:
        history = c.get_metric_history(run_id, key)
        if not history:
            continue
        by_step = {}
        for m in sorted(history, key=lambda m: (m.step, m.timestamp)):
            by_step[m.step] = m.value
        steps = np.fromiter(by_step, dtype=np.float64, count=len(by_step))
        values = np.fromiter(by_step.values(), dtype=np.float64, count=len(by_step))
        out[key] = downsample_series(steps, values, points)
    return out
