"""`moe-lab plan`: which parallel layouts fit a model on N GPUs (`moe_core.train.plan` does the work; its
config options are `moe-lab train`'s: --config, --preset, --set). Its own module, as each command table entry
names the one module that adds it (tests/test_cli_help.py)."""

from __future__ import annotations

import argparse

from moe_core.cli import preset_help
from moe_core.train.cli import resolve_config

PLAN_HELP = """Which parallel layouts fit a model on your GPUs: per rank weights, gradients, AdamW state, activations
at the configured batch and sequence length, all-to-all and data-parallel buffers, the predicted peak, the
communication per step, and a recommended layout. Allocates nothing; moe-lab train checks the same numbers.

    moe-lab plan --preset mixtral-base --gpus 8 --gpu-memory 80
    moe-lab plan --config train.yaml --gpus 8 --gpu-memory 80 --nodes 4 --json
    moe-lab plan --preset olmoe-small --gpus 4 --gpu-memory 24 --set batch_size=64 --set data.seq_len=2048
"""


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="which parallel layouts fit on N GPUs: per-rank memory, communication, a recommendation",
        description=PLAN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", help="YAML/JSON training config (the fields `moe-lab train --help-config` lists)"
    )
    p.add_argument("--preset", help=preset_help("model preset (sets model.preset)"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--gpus", type=int, required=True, help="GPUs (processes) per node")
    p.add_argument("--gpu-memory", type=float, required=True, help="memory of one GPU, GiB")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--headroom", type=float, default=0.0, help="GiB per GPU kept free (CUDA context, NCCL)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object instead of a table")
    p.set_defaults(func=run_plan, resume=False)


def run_plan(args) -> int:
    # (torch, through the meta model: not for `moe-lab --help`, tests/test_cli_help.py)
    from moe_core.train.plan import make_plan, plan_table

    config = resolve_config(args)
    plan = make_plan(config, args.gpus, args.gpu_memory, args.nodes, args.headroom)
    print(plan.as_json() if args.json else plan_table(plan), flush=True)
    return 0 if plan.recommended else 1
