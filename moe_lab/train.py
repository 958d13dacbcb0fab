"""`moe-lab train`: the library's command (`moe_core.train.cli`) plus ``--dashboard``, which starts the live
dashboard (the `dashboard` package, above the library) beside the run.

    moe-lab train --out runs/a --dashboard    # prints the dashboard's URL; on a terminal it stays up after
                                              # training until Ctrl-C

The torchrun workers and a Slurm job run the library's command (``python -m moe_core.cli train``): the
dashboard runs once, in the process the user started.

Heavy imports happen inside the handlers (by design), so ``moe-lab --help`` stays fast (tests/test_cli_help.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dashboard.cli import add_dashboard_option, start_beside
from moe_core.train import cli as train_cli


def add_cli(subparsers) -> None:
    train_cli.add_cli(subparsers)
    add_dashboard_option(
        subparsers.choices["train"],
        "start the live dashboard (moe-lab dashboard) on this run and print its URL",
        run_train,
    )


def run_train(args) -> int:
    if not args.dashboard or args.slurm or "WORLD_SIZE" in os.environ:
        return train_cli.run_train(args)
    from tasks.process import sigterm_exits  # torch, through the checkpoint reader: not for `--help`

    config = train_cli.resolve_config(args)  # a bad config fails before the dashboard starts
    Path(args.out).mkdir(parents=True, exist_ok=True)
    dashboard, url = start_beside([args.out])
    print(f"moe-lab train: live dashboard {url}", flush=True)
    try:
        with sigterm_exits():  # SIGTERM, like Ctrl-C, stops the dashboard too (below)
            code = train_cli.run_train(args, config)
            if code == 0 and sys.stdin.isatty():  # a run stopped by a signal stops the dashboard too
                print(f"moe-lab train: done; the dashboard stays at {url} (Ctrl-C stops it)", flush=True)
                dashboard.wait()
        return code
    except KeyboardInterrupt:
        return 130
    except SystemExit as stop:
        return int(stop.code)
    finally:
        dashboard.terminate()
