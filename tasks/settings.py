"""Where the orchestration keeps its state, and the embedded defaults used when nothing is configured.

The project data directory is ``$MOE_LAB_HOME`` or ``./.moe_lab``. With no servers configured:

    PREFECT_HOME          <home>/prefect          Prefect's ephemeral server keeps its SQLite database here
    MLFLOW_TRACKING_URI   sqlite:///<home>/mlflow.db
    artifact root         <home>/mlartifacts      (new experiments are created with this location)
    runs                  <home>/runs/<flow run>  checkpoints, exports, reports

With ``PREFECT_API_URL`` / ``MLFLOW_TRACKING_URI`` set, those servers are used and nothing here overrides
them. `apply_defaults()` must run before ``prefect`` is imported (Prefect reads its settings on import);
the ``moe-lab`` orchestration commands call it first thing. Imports nothing heavy.
"""

from __future__ import annotations

import os
from pathlib import Path

EXPERIMENT = "moe-lab"  # the MLflow experiment every flow records into (override: $MOE_LAB_EXPERIMENT)
REGISTERED_MODEL = "moe-lab-lm"  # the registry name lifecycle runs register versions under


def lab_home() -> Path:
    return Path(os.environ.get("MOE_LAB_HOME") or ".moe_lab").resolve()


def runs_dir() -> Path:
    return lab_home() / "runs"


def artifact_root() -> Path:
    return lab_home() / "mlartifacts"


def experiment_name() -> str:
    return os.environ.get("MOE_LAB_EXPERIMENT", EXPERIMENT)


def apply_defaults() -> Path:
    """Point Prefect and MLflow at the project data directory unless servers are configured; returns it."""
    home = lab_home()
    home.mkdir(parents=True, exist_ok=True)
    if not os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not os.environ.get("MLFLOW_TRACKING_URI"):  # unset or empty (CI passes empty secrets)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow.db'}"
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")  # a busy 2-core machine
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # MLflow's client retries a dead server for minutes (7 retries, doubling waits); a lab run notices an
    # outage within seconds instead and keeps its records for `moe-lab sync` (see tasks.pending)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    return home


def describe() -> dict[str, str]:
    """Where things go, for the messages the CLI prints."""
    return {
        "home": str(lab_home()),
        "prefect": os.environ.get("PREFECT_API_URL")
        or f"ephemeral (PREFECT_HOME={os.environ.get('PREFECT_HOME')})",
        "mlflow": os.environ.get("MLFLOW_TRACKING_URI", ""),
    }
