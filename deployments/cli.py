"""`moe-lab deploy | serve`: register the lab's Prefect deployments (`deployments.deploy`) with a server, or
serve them from this process. See deployments/README.md.

Heavy imports happen inside the handlers (by design), so ``moe-lab --help`` stays fast (tests/test_cli_help.py).
"""

from __future__ import annotations

import sys

from deployments.deploy import WORK_POOL, deploy, serve
from tasks.settings import apply_defaults


def add_cli(subparsers) -> None:
    deploy = subparsers.add_parser(
        "deploy",
        help="register the nightly and on-demand deployments with Prefect",
        description="Register the nightly retraining and the on-demand deployments "
        "with the Prefect server at PREFECT_API_URL, on a process work "
        "pool; a worker (prefect worker start --pool POOL) runs them. "
        "See deployments/README.md.",
    )
    deploy.add_argument("--work-pool", default=None, help=f"process work pool (default: {WORK_POOL})")
    deploy.set_defaults(func=run_deploy)

    serve = subparsers.add_parser(
        "serve",
        help="serve the deployments from this process (schedules run here)",
        description="Serve the nightly and on-demand deployments from this process: "
        "no work pool or worker needed; scheduled and triggered runs "
        "execute here until Ctrl-C. See deployments/README.md.",
    )
    serve.set_defaults(func=run_serve)


def run_deploy(args) -> int:
    apply_defaults()  # before prefect is imported
    for name in deploy(args.work_pool):
        print(f"deployment {name}")
    print(
        f"start a worker: prefect worker start --pool {args.work_pool or WORK_POOL}",
        file=sys.stderr,
    )
    return 0


def run_serve(args) -> int:
    apply_defaults()  # before prefect is imported
    serve()
    return 0
