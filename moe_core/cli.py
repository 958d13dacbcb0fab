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


def add_router_module_option(parser: argparse.ArgumentParser) -> None:
    """``--router-module MODULE`` for commands that build or load models: the only way (besides the
    MOE_LAB_ROUTER_MODULES variable and the ``moe_lab.routers`` entry points) a router's code gets imported."""
    parser.add_argument("--router-module", dest="router_modules", action="append", default=[], metavar="MODULE",
                        help="import this module of your own routers (repeatable); a model's config.json naming "
                             "a router never imports code by itself")


def allow_router_modules(modules: list[str]) -> None:
    """Import the modules and pass them on to subprocesses (torchrun workers, flows) through the environment."""
    import os

    from moe_core.routing import ROUTER_MODULES_ENV, allow_router_module  # torch: only when asked for

    for module in modules:
        try:
            allow_router_module(module)
        except (ImportError, ValueError) as err:
            raise MoELabError(f"--router-module: {err}") from None
    known = [m for m in os.environ.get(ROUTER_MODULES_ENV, "").split(",") if m]
    os.environ[ROUTER_MODULES_ENV] = ",".join(dict.fromkeys(known + list(modules)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-lab", description="Open MoE Trainer Lab")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "router_modules", None):
            allow_router_modules(args.router_modules)
        return int(args.func(args) or 0)
    except (MoELabError, ValueError, FileNotFoundError) as err:
        print(f"moe-lab {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
