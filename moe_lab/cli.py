"""`moe-lab`: the command line. The table below knows every command's name and one-line help and names the
one module that adds it (through ``add_cli(subparsers)``); only the module of the command that was asked for
is imported, so ``moe-lab --help`` and argument errors answer in well under a second. The library's
commands come from `moe_core.cli.COMMANDS`; the dispatching itself (`make_parser`, `run_command`) and the
argparse helpers every command shares live there too, one home for both programs."""

from __future__ import annotations

import argparse

from moe_core import cli as library

# command -> (module whose add_cli(subparsers) adds it, one-line help shown by `moe-lab --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    **library.COMMANDS,
    # the library's train command plus --dashboard (the dashboard sits above the library)
    "train": ("moe_lab.train", library.COMMANDS["train"][1]),
    "run": (
        "moe_lab.run",
        "run a Prefect flow (lifecycle, pretrain, validate-data, evaluate, optimize, finetune)",
    ),
    "ui": ("moe_lab.run", "open the MLflow UI (or Prefect's) on 127.0.0.1"),
    "sync": ("moe_lab.run", "upload what a flow or training run kept while MLflow was unreachable"),
    "deploy": ("deployments.cli", "register the nightly and on-demand deployments with a Prefect server"),
    "serve": ("deployments.cli", "serve the deployments from this process (schedules run here)"),
    "dashboard": ("dashboard.cli", "live web dashboard: training, routing, compare, inference"),
}


def build_parser(command: str | None = None, *, listing_only: bool = False) -> argparse.ArgumentParser:
    """The parser with ``command`` (only its module imported), with every command (all modules imported:
    for programs and tests), or with ``listing_only`` the one ``moe-lab --help`` prints (no module
    imported)."""
    return library.make_parser(COMMANDS, command, listing_only=listing_only)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (argparse's usage errors and --help too, so a caller in
    Python, a notebook or a test gets a number rather than SystemExit)."""
    return library.run_command(argv, COMMANDS, build_parser)
