"""`moe-lab train`: train from a config file, a preset and ``--set key=value`` overrides.

    moe-lab train --out runs/demo                                  # switch-tiny on the built-in corpus
    moe-lab train --config train.yaml --set optim.lr=1e-3 --out runs/a
    moe-lab train --out runs/a --resume                            # continue from the latest checkpoint
    moe-lab train --nproc 2 --set parallel.ep_size=2 --out runs/ep # launches torchrun for you
    moe-lab train --nproc 8 --set parallel.ep_size=8 --dry-run --out runs/x   # per-rank bytes; allocates nothing
    moe-lab train --nproc-per-node 8 --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400 --out /shared/runs/b
    moe-lab train --nproc 4 --max-restarts 3 --out runs/c          # elastic: a dead rank restarts the group
    moe-lab train --slurm --nnodes 4 --nproc-per-node 8 --slurm-gpus-per-node 8 --out /shared/runs/d [--submit]
    moe-lab plan --preset mixtral-base --gpus 8 --gpu-memory 80       # the layouts that fit, a recommendation

Before it launches, ``moe-lab train`` refuses (`moe_core.train.plan.check_layout`) an ep_size that does not divide
the world and the experts, and a layout whose predicted per-rank peak exceeds the device's memory.

With ``--nproc`` (or ``--nnodes`` > 1, or ``--max-restarts``) the command re-runs itself under ``torchrun``
(`moe_core.train.launch`); inside torchrun (``WORLD_SIZE`` set) it trains as one rank of the group, and a
group restarted by torchrun's elastic agent resumes from the newest complete checkpoint. ``--slurm`` writes
``<out>/launch.sbatch`` (``srun`` starts one torchrun agent per node) and with ``--submit`` hands it to sbatch.
``moe-lab train --dashboard`` (the app layer, `moe_lab.train`) starts the live dashboard beside this command.

Heavy imports happen inside the handlers (by design), so ``moe-lab --help`` stays fast (tests/test_cli_help.py).
The command's own help is `HELP` below: it speaks to users.
"""

from __future__ import annotations

# Lazy: each command imports what it runs (torch, the library, servers) inside its function, so `moe-lab --help`
# and a mistyped argument answer at once.
import argparse
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from moe_core.cli import add_config_help, add_router_module_option, preset_help
from moe_core.train import launch
from moe_core.train.launch import LaunchSpec

HELP = """Train an MoE (or its dense baseline) from a preset, a config file and --set key=value overrides.

    moe-lab train --out runs/demo                                  # switch-tiny on the built-in corpus
    moe-lab train --config train.yaml --set optim.lr=1e-3 --out runs/a
    moe-lab train --out runs/a --resume                            # continue from the latest checkpoint
    moe-lab train --nproc 2 --set parallel.ep_size=2 --out runs/ep # 2 processes, experts sharded over them
    moe-lab train --nproc 8 --set parallel.ep_size=8 --dry-run --out runs/x   # what each rank would own
    moe-lab train --nproc-per-node 8 --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400 --out /shared/runs/b
    moe-lab train --nproc 4 --max-restarts 3 --out runs/c          # elastic: a dead rank restarts the group
    moe-lab train --slurm --nnodes 4 --nproc-per-node 8 --slurm-gpus-per-node 8 --out /shared/runs/d [--submit]

--nproc (or --nnodes > 1, or --max-restarts) starts the processes with torchrun for you; a group restarted
after a failure resumes from the newest complete checkpoint. --slurm writes <out>/launch.sbatch and, with
--submit, hands it to sbatch. Ctrl-C or SIGTERM finishes the step, saves a checkpoint and says how to resume
(a second Ctrl-C stops at once). --resume may change --nproc, parallel.ep_size and parallel.dp_mode: checkpoints
reshard. --help-config lists every field --set takes.
"""


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="pretrain a model (MoE or dense baseline), one process or many",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML/JSON training config (the fields --help-config lists)")
    p.add_argument("--preset", help=preset_help("model preset (sets model.preset)"))
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set steps=200 --set model.overrides.num_experts=4 "
        "(all fields: --help-config)",
    )
    add_config_help(p, _config_class)
    p.add_argument("--out", required=True, help="output directory (checkpoints, metrics.jsonl, final export)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the model on the meta device, lay it out over the processes --nproc and --nnodes give, "
        "and print what each rank would own (parameters, gradients, AdamW state), allocating nothing; "
        "nothing is launched or written",
    )
    add_launch_options(
        p,
        restarts_help="elastic: restart the group up to N times when a worker dies; it resumes from the "
        "newest complete checkpoint",
    )
    s = p.add_argument_group("Slurm (writes an sbatch script running srun torchrun)")
    s.add_argument("--slurm", action="store_true", help="write <out>/launch.sbatch instead of training here")
    s.add_argument("--submit", action="store_true", help="with --slurm: submit the script with sbatch")
    s.add_argument("--slurm-partition", default=None)
    s.add_argument("--slurm-account", default=None)
    s.add_argument("--slurm-time", default="24:00:00", help="wall-clock limit, [D-]HH:MM:SS")
    s.add_argument("--slurm-gpus-per-node", type=int, default=0)
    s.add_argument("--slurm-cpus-per-task", type=int, default=8)
    s.add_argument(
        "--slurm-setup", default="", help="shell lines run on every node before srun (modules, venv)"
    )
    p.set_defaults(func=run_train)
    add_router_module_option(p)


def add_launch_options(p, restarts_help: str) -> None:
    """The torchrun launch options (`launch_spec` reads them), shared by ``train`` and ``finetune``."""
    g = p.add_argument_group("launch (torchrun)")
    g.add_argument(
        "--nproc",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        default=1,
        help="processes per node (launches torchrun when > 1)",
    )
    g.add_argument("--nnodes", type=int, default=1, help="number of nodes (multi-node c10d rendezvous)")
    g.add_argument("--node-rank", type=int, default=None, help="this node's rank (0 .. nnodes-1)")
    g.add_argument(
        "--rdzv-endpoint", default=None, help="host:port of the rendezvous, the same on every node"
    )
    g.add_argument("--rdzv-id", default="moe-lab", help="job id shared by all nodes of one run")
    g.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help=restarts_help,
    )


def _config_class(namespace):
    from moe_core.train.config import TrainConfig

    return (
        TrainConfig,
        "moe-lab train --set KEY=VALUE (fields of moe_core.train.TrainConfig; --config takes the same in YAML):",
    )


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


def launch_spec(args) -> LaunchSpec:
    return LaunchSpec(
        nproc_per_node=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
    )


def torchrun_command(args, argv: list[str]) -> list[str]:
    return launch.torchrun_command(launch_spec(args), argv)


def slurm_spec(args) -> launch.SlurmSpec:
    return launch.SlurmSpec(
        nodes=args.nnodes,
        nproc_per_node=args.nproc,
        gpus_per_node=args.slurm_gpus_per_node,
        cpus_per_task=args.slurm_cpus_per_task,
        time=args.slurm_time,
        partition=args.slurm_partition,
        account=args.slurm_account,
        max_restarts=args.max_restarts,
        setup=args.slurm_setup,
    )


def write_slurm_script(args) -> Path:
    """``<out>/launch.sbatch`` for this run (written atomically); the workers get absolute paths."""
    worker = worker_argv(args)
    worker[worker.index("--out") + 1] = str(Path(args.out).absolute())
    if args.config:
        worker[worker.index("--config") + 1] = str(Path(args.config).absolute())
    script = launch.render_sbatch(slurm_spec(args), worker)
    path = Path(args.out) / "launch.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(script)
    tmp.chmod(0o755)
    os.replace(tmp, path)  # never a half-written script for sbatch
    return path


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


def dry_run_report(config, world_size: int) -> str:
    """What each of ``world_size`` ranks would own under ``config`` (`moe_core.train.build.rank_parameter_bytes`),
    as a table; the vocabulary is the model config's (a data set's tokenizer may change it at launch)."""
    from moe_core.train.build import rank_parameter_bytes

    p = config.parallel
    rows = rank_parameter_bytes(config.model.build_config(), world_size, p.ep_size, p.dp_mode)
    lines = [
        f"moe-lab train --dry-run: {world_size} process(es), ep_size={p.ep_size}, dp_mode={p.dp_mode}; "
        f"whole model {_size(rows[0]['whole_model'])} (fp32); nothing allocated",
        f"{'rank':>4} {'ep_rank':>7} {'params':>10} {'experts':>10} {'dense':>10} {'grads':>10} {'AdamW':>10} "
        f"{'params bytes':>14}",
    ]
    for r in rows:
        sizes = (r[k] for k in ("params", "expert_params", "dense_params", "grads", "optimizer"))
        lines.append(
            f"{r['rank']:>4} {r['ep_rank']:>7} "
            + " ".join(f"{_size(b):>10}" for b in sizes)
            + f" {r['params']:>14}"
        )
    return "\n".join(lines)


def rank_memory_bytes(config, nproc_per_node: int) -> int | None:
    """What one rank may hold: the first CUDA device's memory when the run trains on CUDA, else this host's
    memory shared by its processes (None where neither is known)."""
    from moe_core.memory import process_memory_bytes  # lazy: torch, imported by the command that needs it

    return process_memory_bytes(config.device != "cpu", nproc_per_node)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def run_launcher(cmd: list[str]) -> int:
    """Run torchrun and wait for it; returns its exit status, or 128 + the signal's number when this process was
    asked to stop. A Ctrl-C reaches the workers from the terminal too (one foreground process group): they save
    a checkpoint and stop, so this process waits for them rather than killing torchrun (`subprocess.call`
    would). A SIGTERM sent to this process alone is passed on to torchrun, whose agent passes it to the
    workers. Both handlers are in place before torchrun starts: a signal that lands while it starts is not lost
    (a SIGTERM then is passed on as soon as torchrun exists)."""
    stopped_by: list[int] = []
    started: list[subprocess.Popen] = []

    def pass_on(signum, frame) -> None:
        stopped_by.append(signum)
        if started:
            started[0].send_signal(signum)

    def note(signum, frame) -> None:  # Ctrl-C: the terminal sent it to the workers too
        stopped_by.append(signum)

    main = threading.current_thread() is threading.main_thread()
    previous = {}
    if main:
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, pass_on)}
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, note)
    try:
        proc = subprocess.Popen(cmd)
        started.append(proc)
        if signal.SIGTERM in stopped_by:  # it came while torchrun started
            proc.send_signal(signal.SIGTERM)
        code = proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 + stopped_by[0] if stopped_by and code != 0 else code


def run_train(args, config=None) -> int:
    """Train as the arguments say; ``config``: `resolve_config(args)` when the caller already has it."""
    config = config or resolve_config(args)  # fail fast on a bad config, before launching anything
    if args.slurm:
        path = write_slurm_script(args)
        print(f"moe-lab train: wrote {path}", flush=True)
        if args.submit:
            if shutil.which("sbatch") is None:
                raise launch.LaunchError(
                    f"--submit: no `sbatch` on PATH; run it on a Slurm login node, or submit {path} yourself"
                )
            return subprocess.call(["sbatch", str(path)])
        return 0
    spec = launch_spec(args)
    if args.dry_run:
        print(dry_run_report(config, spec.world_size), flush=True)
        return 0
    if "WORLD_SIZE" not in os.environ:  # once, before torchrun starts and before anything is allocated
        from moe_core.train.plan import check_layout

        check_layout(config, spec.world_size, rank_memory_bytes(config, spec.nproc_per_node))
    if spec.needs_launcher and "WORLD_SIZE" not in os.environ:
        return run_launcher(launch.torchrun_command(spec, worker_argv(args)))

    from moe_core.train.loop import train

    result = train(config, args.out, resume=launch.resume_requested(args.resume))
    if int(os.environ.get("RANK", "0")) == 0:
        where = result.export_dir or result.checkpoint
        loss = f"{result.loss:.4f}" if result.loss is not None else "n/a"
        val = f", val_loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        stopped = f" (stopped by {result.stopped_by})" if result.stopped_by else ""
        print(
            f"moe-lab train: step {result.step}{stopped}, {result.tokens} tokens, loss {loss}{val}; "
            f"skipped {result.skipped_steps} steps; {where}",
            flush=True,
        )
        if result.data_dir is not None:
            print(f"moe-lab train: data (with its tokenizer) in {result.data_dir}", flush=True)
    return result.exit_code
