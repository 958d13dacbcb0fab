"""The library's commands and the argparse helpers every ``moe-lab`` command shares.

``python -m moe_core COMMAND`` runs the library's commands (data, train, finetune, eval, analyze, generate,
export, quantize, prune, convert) with no Prefect, MLflow or dashboard import; the ``moe-lab`` program
(`moe_lab.cli`, above the flows) runs the same commands plus the orchestration ones (run, ui, sync, deploy,
serve, dashboard). Both dispatch the same way (`make_parser`, `run_command`): a table names every
command and its one-line help, and only the module of the command that was asked for is imported, so
``--help`` and argument errors answer in well under a second; each module adds its commands through an
``add_cli(subparsers)`` function and imports torch, transformers, Prefect or MLflow inside its handlers."""

from __future__ import annotations

# Lazy: each command imports what it runs (torch, the library, servers) inside its function, so `moe-lab --help`
# and a mistyped argument answer at once.
import argparse
import importlib
import os
import sys
from collections.abc import Callable

from moe_core.errors import MoELabError, did_you_mean

# command -> (module whose add_cli(subparsers) adds it, one-line help shown by `--help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("moe_core.data.cli", "validate and prepare training data (tokenizer + packed shards)"),
    "train": ("moe_core.train.cli", "pretrain a model (MoE or dense baseline), one process or many"),
    "plan": (
        "moe_core.train.plan_cli",
        "which parallel layouts fit on N GPUs: per-rank memory, communication",
    ),
    "finetune": (
        "moe_core.finetune.cli",
        "fine-tune a model (LoRA on experts, ESFT, router tuning; SFT/DPO)",
    ),
    "eval": ("moe_core.eval.cli", "loss/perplexity per split, comparison table, generations, lm-eval"),
    "analyze": ("moe_core.analytics.cli", "router profile, pictures and cost report"),
    "generate": ("moe_core.inference.cli", "generate text from a model, streamed"),
    "export": ("moe_core.inference.cli", "export a model for deployment (ONNX, GGUF)"),
    "quantize": ("moe_core.inference.cli", "int8/int4 weight-only experts, or ONNX Runtime dynamic int8"),
    "prune": ("moe_core.inference.cli", "drop (or merge) low-ranked experts: routed slots or REAP saliency"),
    "convert": ("moe_core.convert_cli", "exact conversion to and from Hugging Face MoE checkpoints"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the examples in a description as written and shows each option's default, when it has one
    worth showing (not None, False or an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, [], argparse.SUPPRESS) or not action.help:
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Every moe-lab (sub)parser: defaults shown in help, "did you mean" for a mistyped option."""

    def __init__(self, *args, **kwargs):
        if kwargs.get("formatter_class") in (
            None,
            argparse.HelpFormatter,
            argparse.RawDescriptionHelpFormatter,
        ):
            kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if message.startswith(
            "unrecognized arguments:"
        ):  # reported by the top parser: look in the commands too
            options = _option_strings(self)
            unknown = [a.split("=")[0] for a in message.split(":", 1)[1].split() if a.startswith("--")]
            message += "".join(did_you_mean(a, options) for a in unknown[:1])
        super().error(message)


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    options = []
    for action in parser._actions:
        options += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                options += _option_strings(child)
    return options


def add_router_module_option(parser: argparse.ArgumentParser) -> None:
    """``--router-module MODULE`` for commands that build or load models: the only way (besides the
    MOE_LAB_ROUTER_MODULES variable and the ``moe_lab.routers`` entry points) a router's code gets imported."""
    parser.add_argument(
        "--router-module",
        dest="router_modules",
        action="append",
        default=[],
        metavar="MODULE",
        help="import this module of your own routers (repeatable); a model's config.json naming "
        "a router never imports code by itself",
    )


def preset_help(what: str = "model preset") -> str:
    """``--preset`` help that lists the presets (plain data: no torch import)."""
    from moe_core.presets import FAMILIES, SIZES

    return (
        f"{what}, <family>-<size>: families {', '.join(FAMILIES)}; sizes {', '.join(SIZES)} "
        "(e.g. switch-tiny, mixtral-small)"
    )


class _ConfigHelp(argparse.Action):
    """``--help-config``: print the config fields ``--set`` takes, with type, default and help, and exit."""

    def __init__(self, option_strings, dest, config_class, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.config_class = config_class

    def __call__(self, parser, namespace, values, option_string=None):
        from moe_core.configfile import format_config_fields

        config_class, title = self.config_class(namespace)
        print(format_config_fields(config_class, title))
        parser.exit()


def add_config_help(parser: argparse.ArgumentParser, config_class) -> None:
    """``--help-config`` on a command whose ``--set`` takes config fields; ``config_class(namespace)`` returns
    ``(pydantic class, title)`` and is called (imports and all) only when the option is given."""
    parser.add_argument(
        "--help-config",
        action=_ConfigHelp,
        config_class=config_class,
        help="list every config field --set takes (type, default, help) and exit",
    )


def allow_router_modules(modules: list[str]) -> None:
    """Import the modules and pass them on to subprocesses (torchrun workers, flows) through the environment."""
    from moe_core.routing import ROUTER_MODULES_ENV, allow_router_module  # torch: only when asked for

    for module in modules:
        try:
            allow_router_module(module)
        except (ImportError, ValueError) as err:
            raise MoELabError(f"--router-module: {err}") from None
    known = [m for m in os.environ.get(ROUTER_MODULES_ENV, "").split(",") if m]
    os.environ[ROUTER_MODULES_ENV] = ",".join(dict.fromkeys(known + list(modules)))


PROGRAM = "Open MoE Trainer Lab: train, analyze, optimize and ship Mixture-of-Experts language models."


def make_parser(
    commands: dict[str, tuple[str, str]],
    command: str | None = None,
    *,
    listing_only: bool = False,
    description: str = PROGRAM,
) -> argparse.ArgumentParser:
    """The parser with ``command`` (only its module imported), or with every command of ``commands`` (all
    modules imported: for programs and tests), or with ``listing_only`` the top-level one that lists every
    command without importing any (what ``--help`` uses)."""
    parser = Parser(
        prog="moe-lab",
        description=description,
        epilog="`moe-lab COMMAND --help` shows a command's options and examples.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    if listing_only:
        for name, (_, help_line) in commands.items():
            sub.add_parser(name, help=help_line, add_help=False)
        return parser
    modules = (
        [commands[command][0]]
        if command in commands
        else list(dict.fromkeys(m for m, _ in commands.values()))
    )
    for module in modules:
        importlib.import_module(module).add_cli(sub)
    return parser


def run_command(
    argv: list[str] | None,
    commands: dict[str, tuple[str, str]],
    build_parser: Callable[..., argparse.ArgumentParser],
) -> int:
    """Parse ``argv`` against ``commands`` and run the command; returns its exit status (argparse's usage
    errors and --help too, so a caller in Python, a notebook or a test gets a number rather than
    SystemExit). A `MoELabError` (bad input) prints one line and exits 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    try:
        if command not in commands:
            parser = build_parser(listing_only=True)
            if command is not None:
                parser.error(
                    f"unknown command {command!r}{did_you_mean(command, commands)} "
                    f"(choose from {', '.join(commands)})"
                )
            parser.parse_args(argv)  # --help, or the usage error for a missing command
        args = build_parser(command).parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    out = getattr(args, "out", None)
    out_existed = out is None or os.path.lexists(out)
    code = 1
    try:
        if getattr(args, "router_modules", None):
            allow_router_modules(args.router_modules)
        from moe_core.progress import quiet_library_bars

        quiet_library_bars()
        code = int(args.func(args) or 0)
    except (MoELabError, ValueError, FileNotFoundError) as err:
        print(f"moe-lab {args.command}: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    finally:
        if code != 0 and not out_existed:
            _remove_if_empty(out)
    return code


def build_parser(command: str | None = None, *, listing_only: bool = False) -> argparse.ArgumentParser:
    """`make_parser` over the library's commands."""
    return make_parser(
        COMMANDS,
        command,
        listing_only=listing_only,
        description=f"{PROGRAM} The library's commands (python -m moe_core); the moe-lab program adds "
        "the orchestration ones: run, ui, sync, deploy, serve, dashboard.",
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_core``: run one of the library's commands (no orchestration); returns its status."""
    return run_command(argv, COMMANDS, build_parser)


def _remove_if_empty(path) -> None:
    """A command that failed on its input leaves no empty output directory behind (one it created itself;
    anything with files in it stays, for the user to look at)."""
    try:
        os.rmdir(path)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
