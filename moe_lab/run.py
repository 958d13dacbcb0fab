"""`moe-lab run | ui | sync`: the flows' commands (`flows.cli`) plus ``run --dashboard``, which starts the
live dashboard (the `dashboard` package, beside the flows rather than under them) for the flow's runs.

    moe-lab run lifecycle --dashboard    # prints the dashboard's URL; the flow's steps link to it

Heavy imports happen inside the handlers (by design), so ``moe-lab --help`` stays fast (tests/test_cli_help.py).
"""

from __future__ import annotations

import os

from dashboard.cli import add_dashboard_option, start_beside
from flows import cli as flows_cli
from tasks import settings


def add_cli(subparsers) -> None:
    flows_cli.add_cli(subparsers)
    add_dashboard_option(
        subparsers.choices["run"],
        "start the live dashboard (moe-lab dashboard) beside the flow and print its URL",
        run_flow,
    )


def run_flow(args) -> int:
    if not args.dashboard:
        return flows_cli.run_flow(args)
    settings.apply_defaults()  # before prefect is imported
    from flows.common import DASHBOARD_URL_ENV  # flows.common imports Prefect: only when a flow runs

    params = flows_cli.build_params(args.flow, args.params, args.size, args.overrides)  # fails fast
    dashboard, url = start_beside([settings.runs_dir()])
    os.environ[DASHBOARD_URL_ENV] = url
    print(f"moe-lab run {args.flow}: live dashboard {url}", flush=True)
    try:
        return flows_cli.run_flow(args, params)  # SIGTERM raises there (`sigterm_exits`): this finally runs
    finally:
        dashboard.terminate()
