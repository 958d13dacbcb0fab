"""`moe-lab finetune`: fine-tune from a config file and ``--set key=value`` overrides.

moe-lab finetune --config finetune.yaml --out runs/ft
moe-lab finetune --config finetune.yaml --set method=full --set freeze.router=true --out runs/full
moe-lab finetune --config dpo.yaml --set objective=dpo --set dpo.beta=0.2 --out runs/dpo

Heavy imports happen inside the handlers (by design), so ``moe-lab --help`` stays fast (tests/test_cli_help.py).
The command's own help is `HELP` below: it speaks to users.
"""

from __future__ import annotations

import argparse

from moe_core.cli import add_config_help, add_router_module_option

HELP = """Fine-tune a model (LoRA on attention and experts, ESFT, router tuning, full; SFT or DPO) from a config
file and --set key=value overrides.

    moe-lab finetune --config finetune.yaml --out runs/ft
    moe-lab finetune --config finetune.yaml --set method=full --set freeze.router=true --out runs/full
    moe-lab finetune --config dpo.yaml --set objective=dpo --set dpo.beta=0.2 --out runs/dpo

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


def run_finetune(args) -> int:
    from moe_core.paths import require_model_source

    config = resolve_config(args)  # fail fast on a bad config, before loading anything
    if config.model.path:
        require_model_source(config.model.path, "model.path")
    from moe_core.finetune.run import finetune

    result = finetune(config, args.out, overwrite=args.overwrite)
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
