"""The lab's Prefect deployments, defined once: a nightly retraining of the lifecycle and an on-demand
lifecycle, plus the stage flows on demand.

    moe-lab serve     # serve them from this process (no work pool needed; schedules fire while it runs)
    moe-lab deploy    # register them with a Prefect server on the process work pool; then
                      # prefect worker start --pool moe-lab-process

``prefect.yaml`` beside this file declares the same deployments for ``prefect deploy --all`` (a test keeps the
two in step). CI triggers: ``prefect deployment run lifecycle/on-demand --watch`` (see .github/workflows).

Prefect and the flows (pydantic) are imported inside `serve` and `deploy`: ``moe-lab deploy --help`` imports
this module through deployments/cli.py and must load neither (tests/test_cli_help.py).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from tasks.settings import apply_defaults

WORK_POOL = "moe-lab-process"
REPO_ROOT = Path(__file__).resolve().parents[1]
NIGHTLY_CRON = "0 2 * * *"  # 02:00 every night, in TIMEZONE
TIMEZONE = "UTC"

# name -> (entrypoint, schedule or None, parameters)
DEPLOYMENTS: dict[str, tuple[str, str | None, dict]] = {
    "nightly-retrain": ("flows/lifecycle.py:lifecycle", NIGHTLY_CRON, {}),
    "on-demand": ("flows/lifecycle.py:lifecycle", None, {}),
    "pretrain": ("flows/pretrain.py:pretrain", None, {}),
    "validate-data": ("flows/validate_data.py:validate_data", None, {}),
}


def _flow(entrypoint: str):
    path, name = entrypoint.split(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


def _nightly_params() -> dict:
    from flows.params import LifecycleParams, small_train_config  # lazy: pydantic, kept off `--help`

    return {"params": LifecycleParams(train=small_train_config()).model_dump(mode="json")}


def serve() -> None:
    """Serve every deployment from this process (Ctrl-C stops)."""
    # lazy: Prefect, kept off `moe-lab serve --help`
    from prefect import serve as prefect_serve
    from prefect.schedules import Cron

    runners = []
    for name, (entrypoint, cron, params) in DEPLOYMENTS.items():
        params = _nightly_params() if name == "nightly-retrain" else params
        schedules = [Cron(cron, timezone=TIMEZONE)] if cron else None
        runners.append(
            _flow(entrypoint).to_deployment(
                name=name, schedules=schedules, parameters=params, tags=["moe-lab"]
            )
        )
    prefect_serve(*runners)


def deploy(work_pool: str | None = None) -> list[str]:
    """Register the deployments with the configured Prefect server on a process work pool (created if
    missing); the code is pulled from this checkout. Returns the deployment names."""
    # lazy: Prefect, kept off `moe-lab deploy --help`
    from prefect import flow as prefect_flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.schedules import Cron

    pool = work_pool or WORK_POOL
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            pass
    names = []
    for name, (entrypoint, cron, params) in DEPLOYMENTS.items():
        params = _nightly_params() if name == "nightly-retrain" else params
        remote = prefect_flow.from_source(str(REPO_ROOT), entrypoint)
        remote.deploy(
            name=name,
            work_pool_name=pool,
            schedules=[Cron(cron, timezone=TIMEZONE)] if cron else None,
            parameters=params,
            tags=["moe-lab"],
            build=False,
            push=False,
        )
        names.append(f"{remote.name}/{name}")
    return names


if __name__ == "__main__":
    apply_defaults()
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        print("\n".join(deploy()))
