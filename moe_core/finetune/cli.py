"""`moe-lab finetune`: fine-tune from a config file and ``--set key=value`` overrides.

moe-lab finetune --config finetune.yaml --out runs/ft
moe-lab finetune --config finetune.yaml --set method=full --set freeze.router=true --out runs/full
moe-lab finetune --config dpo.yaml --set objective=dpo --set dpo.beta=0.2 --out runs/dpo
moe-lab finetune --config finetune.yaml --nproc 8 --set parallel.ep_size=8 --out runs/ep8

With ``--nproc`` (or ``--nnodes`` > 1, or ``--max-restarts``) the command re-runs itself under ``torchrun``
(`moe_core.train.launch`, as ``moe-lab train`` does); inside torchrun (``WORLD_SIZE`` set) it fine-tunes as one
rank of the group (`moe_core.finetune.parallel`).

Heavy imports happen inside the handlers (by design), so ``moe-lab --help`` stays fast (tests/test_cli_help.py).
The command's own help is `HELP` below: it speaks to users.
"""

from __future__ import annotations

# Lazy: each command imports what it runs (torch, the library, servers) inside its function, so `moe-lab --help`
# and a mistyped argument answer at once.
import argparse
import os
from pathlib import Path

from moe_core.cli import add_config_help, add_router_module_option
from moe_core.train import launch
from moe_core.train.cli import add_launch_options, launch_spec, run_launcher

HELP = """Fine-tune a model (LoRA on attention and experts, ESFT, router tuning, full; SFT, DPO, ORPO, KTO, a
reward model, or GRPO with MoE routing replay) from a config file and --set key=value overrides.

    moe-lab finetune --config finetune.yaml --out runs/ft
    moe-lab finetune --config finetune.yaml --set method=full --set freeze.router=true --out runs/full
    moe-lab finetune --config dpo.yaml --set objective=dpo --set dpo.beta=0.2 --out runs/dpo
    moe-lab finetune --config examples/grpo.yaml --set grpo.importance_sampling=sequence --out runs/gspo
    moe-lab finetune --config finetune.yaml --nproc 8 --set parallel.ep_size=8 --out runs/ep8

--nproc N runs N processes (torchrun, one per GPU): each trains on its own batch_size sequences, and with
parallel.ep_size the experts and their LoRA factors are split over that many of them; the adapter written is
the one a single process would write. --set checkpoint.every=K keeps a checkpoint every K steps; after a
crash, the same command with --resume continues from the newest one (with --max-restarts, torchrun restarts a
failed group and it resumes by itself).

A base model without a chat template: --set data.chat_template=plain frames the data without one (the
prompt's text and a newline, then the answer), or name a template (lab, chatml, or a Jinja file); generate and
eval frame prompts the same way afterwards.

Above 1 B parameters the defaults suit the size (each says so when it applies): gradient checkpointing on
(--set gradient_checkpointing=false turns it off) and, for LoRA, the adapter alone (--set export.merged=true
--set export.hf=true write the merged copies too).

Ctrl-C or SIGTERM finishes the step and writes the outputs of the steps done. --help-config lists every
field --set takes.
"""


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "finetune",
        help="fine-tune a model (LoRA on experts, ESFT, router tuning; SFT/DPO)",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML/JSON fine-tuning config (the fields --help-config lists)")
    p.add_argument(
        "--model", help="base model: our checkpoint or a HF Mixtral/OLMoE/Qwen2-MoE dir (sets model.path)"
    )
    p.add_argument("--data", help="training data source (sets data.source)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set lora.experts=esft --set steps=100 (all fields: "
        "--help-config)",
    )
    add_config_help(p, _config_class)
    p.add_argument(
        "--out", required=True, help="output directory (adapter, merged, hf, metrics.jsonl, report)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the outputs of an earlier fine-tune in --out (once this one succeeded)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --out/checkpoints (needs checkpoint.every)",
    )
    add_launch_options(
        p,
        restarts_help="elastic: restart the group up to N times when a worker dies; it resumes from the "
        "newest checkpoint (needs checkpoint.every)",
    )
    p.set_defaults(func=run_finetune)
    add_router_module_option(p)


def _config_class(namespace):
    from moe_core.finetune.config import FinetuneConfig

    return FinetuneConfig, (
        "moe-lab finetune --set KEY=VALUE (fields of moe_core.finetune.FinetuneConfig; "
        "--config takes the same in YAML):"
    )


def resolve_config(args):
    from moe_core.finetune.config import FinetuneConfig

    config = FinetuneConfig.load(args.config) if args.config else FinetuneConfig()
    overrides = list(args.overrides)
    if args.model:
        overrides.insert(0, f"model.path={args.model}")
    if args.data:
        overrides.insert(0, f"data.source={args.data}")
    return config.with_overrides(overrides) if overrides else config


def worker_argv(args) -> list[str]:
    """The arguments each torchrun worker gets: everything but the launch options."""
    argv = ["--out", args.out]
    for flag, value in (("--config", args.config), ("--model", args.model), ("--data", args.data)):
        if value:
            argv += [flag, value]
    for item in args.overrides:
        argv += ["--set", item]
    argv += [flag for flag, on in (("--overwrite", args.overwrite), ("--resume", args.resume)) if on]
    return argv


def run_finetune(args) -> int:
    from moe_core.paths import require_model_source

    config = resolve_config(args)  # fail fast on a bad config, before loading anything
    if config.model.path:
        require_model_source(config.model.path, "model.path")
    spec = launch_spec(args)
    if spec.needs_launcher and "WORLD_SIZE" not in os.environ:
        if args.max_restarts and config.checkpoint.every is None:
            from moe_core.finetune.config import FinetuneError

            raise FinetuneError(
                "--max-restarts restarts a failed group from its newest checkpoint; set checkpoint.every too"
            )
        return run_launcher(launch.torchrun_command(spec, worker_argv(args), command="finetune"))
    from moe_core.finetune.parallel import CHECKPOINTS, has_checkpoint
    from moe_core.finetune.run import finetune

    resume = args.resume
    if launch.restart_count() > 0 and config.checkpoint.every is not None:
        # a group torchrun restarted continues from its newest checkpoint, or starts again when it has none
        resume = has_checkpoint(Path(args.out) / CHECKPOINTS)
    result = finetune(config, args.out, overwrite=args.overwrite, resume=resume)
    if int(os.environ.get("RANK", "0")) != 0:
        return result.exit_code
    loss = f"{result.last_step_loss:.4f}" if result.last_step_loss is not None else "n/a"
    outputs = ", ".join(
        str(p) for p in (result.adapter_dir, result.merged_dir, result.hf_dir) if p is not None
    )
    steps = (
        f"stopped by {result.stopped_by} after {result.steps_done} of {config.steps} steps"
        if result.stopped_by
        else f"{config.steps} steps"
    )
    print(
        f"moe-lab finetune: {config.method}/{config.objective}, {steps}, final loss {loss}, "
        f"skipped {result.skipped_steps} steps, {result.report.trainable_params:,} trainable parameters; "
        f"{outputs or args.out}",
        flush=True,
    )
    return result.exit_code
