"""`moe-lab train`: train from a config file, a preset and ``--set key=value`` overrides.

    moe-lab train --out runs/demo                                  # switch-tiny on the built-in corpus
    moe-lab train --config train.yaml --set optim.lr=1e-3 --out runs/a
    moe-lab train --out runs/a --resume                            # continue from the latest checkpoint
    moe-lab train --nproc 2 --set parallel.ep_size=2 --out runs/ep # launches torchrun for you
    moe-lab train --nproc 8 --nnodes 2 --rdzv-endpoint host0:29400 --out /shared/runs/b   # on each node

With ``--nproc`` (or ``--nnodes`` > 1) the command re-runs itself under ``torchrun``; inside torchrun
(``WORLD_SIZE`` set) it trains as one rank of the group.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from moe_core.cli import add_config_help, add_router_module_option, preset_help


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("train", help="pretrain a model (MoE or dense baseline), one process or many",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML/JSON training config (fields of moe_core.train.TrainConfig)")
    p.add_argument("--preset", help=preset_help("model preset (sets model.preset)"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set steps=200 --set model.overrides.num_experts=4 "
                        "(all fields: --help-config)")
    add_config_help(p, _config_class)
    p.add_argument("--out", required=True, help="output directory (checkpoints, metrics.jsonl, final export)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--dashboard", action="store_true",
                   help="start the live dashboard (moe-lab dashboard) on this run and print its URL")
    g = p.add_argument_group("launch (torchrun)")
    g.add_argument("--nproc", type=int, default=1, help="processes per node (launches torchrun when > 1)")
    g.add_argument("--nnodes", type=int, default=1, help="number of nodes (multi-node rendezvous)")
    g.add_argument("--rdzv-endpoint", default=None, help="host:port of the rendezvous (multi-node)")
    g.add_argument("--rdzv-id", default="moe-lab", help="job id shared by all nodes of one run")
    p.set_defaults(func=run_train)
    add_router_module_option(p)


def _config_class(namespace):
    from moe_core.train.config import TrainConfig

    return TrainConfig, "moe-lab train --set KEY=VALUE (fields of moe_core.train.TrainConfig; --config takes the same in YAML):"


def resolve_config(args):
    """The TrainConfig from --config (or, when resuming without one, the checkpoint's), --preset, --set."""
    from pathlib import Path

    from moe_core.train.checkpoint import latest_checkpoint
    from moe_core.train.config import TrainConfig

    if args.config:
        config = TrainConfig.load(args.config)
    elif args.resume and (latest := latest_checkpoint(Path(args.out) / "checkpoints")) is not None:
        config = TrainConfig.load(latest / "train_config.json")
    else:
        config = TrainConfig()
    overrides = list(args.overrides)
    if args.preset:
        overrides.insert(0, f"model.preset={args.preset}")
    return config.with_overrides(overrides) if overrides else config


def torchrun_command(args, argv: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"]
    if args.nnodes > 1:
        if not args.rdzv_endpoint:
            from moe_core.errors import MoELabError

            raise MoELabError("--nnodes > 1 needs --rdzv-endpoint host:port (the same on every node)")
        cmd += [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
                f"--rdzv-id={args.rdzv_id}"]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", "moe_core.cli", "train", *argv]


def worker_argv(args) -> list[str]:
    """The arguments each torchrun worker gets: everything but the launch options."""
    argv = ["--out", args.out]
    if args.config:
        argv += ["--config", args.config]
    if args.preset:
        argv += ["--preset", args.preset]
    for item in args.overrides:
        argv += ["--set", item]
    if args.resume:
        argv.append("--resume")
    return argv


def run_train(args) -> int:
    config = resolve_config(args)  # fail fast on a bad config, before launching anything
    if getattr(args, "dashboard", False) and "WORLD_SIZE" not in os.environ:
        return _with_dashboard(args)
    if (args.nproc > 1 or args.nnodes > 1) and "WORLD_SIZE" not in os.environ:
        return subprocess.call(torchrun_command(args, worker_argv(args)))

    from moe_core.train.loop import train

    result = train(config, args.out, resume=args.resume)
    if int(os.environ.get("RANK", "0")) == 0:
        where = result.export_dir or result.checkpoint
        loss = f"{result.loss:.4f}" if result.loss is not None else "n/a"
        val = f", val_loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        stopped = f" (stopped by {result.stopped_by})" if result.stopped_by else ""
        print(f"moe-lab train: step {result.step}{stopped}, {result.tokens} tokens, loss {loss}{val}; "
              f"skipped {result.skipped_steps} steps; {where}", flush=True)
        if result.data_dir is not None:
            print(f"moe-lab train: data (with its tokenizer) in {result.data_dir}", flush=True)
    return 0


def _with_dashboard(args) -> int:
    """Train with the dashboard serving ``--out`` beside it (a child process; the dashboard lives in the
    `dashboard` package, above the library). On a terminal it stays up after training until Ctrl-C."""
    from pathlib import Path

    from dashboard.cli import start_beside

    Path(args.out).mkdir(parents=True, exist_ok=True)
    dashboard, url = start_beside([args.out])
    print(f"moe-lab train: live dashboard {url}", flush=True)
    try:
        args.dashboard = False
        code = run_train(args)
        if sys.stdin.isatty():
            print(f"moe-lab train: done; the dashboard stays at {url} (Ctrl-C stops it)", flush=True)
            dashboard.wait()
        return code
    except KeyboardInterrupt:
        return 130
    finally:
        dashboard.terminate()
