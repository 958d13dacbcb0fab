"""`moe-lab`: the command line. Each area adds its own subcommands through an ``add_cli(subparsers)``
function in its module; heavy imports happen inside the handlers so ``moe-lab --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

from moe_core.errors import MoELabError

# modules that contribute subcommands; each defines add_cli(subparsers)
COMMAND_MODULES = (
    "moe_core.convert",
    "moe_core.data.cli",
    "moe_core.train.cli",
    "moe_core.analytics.cli",
    "moe_core.inference.cli",
    "flows.cli",
    "moe_core.finetune.cli",
    "dashboard.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-lab", description="Open MoE Trainer Lab")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (MoELabError, ValueError, FileNotFoundError) as err:
        print(f"moe-lab {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
