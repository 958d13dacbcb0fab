"""Launching a training run as a process group: torchrun is the one launch contract; Slurm and Ray are thin
layers over it (as in torchtitan, LLaMA-Factory and axolotl).

- `torchrun_command`: the ``torchrun`` command line for one node (single node: a standalone rendezvous;
  several nodes: a c10d rendezvous at ``rdzv_endpoint``, started by whichever agent comes first). With
  ``max_restarts`` > 0 torchrun's elastic agent restarts the whole group when a worker dies; every restarted
  worker resumes from the newest complete checkpoint (`resume_requested`).
- `render_sbatch`: an sbatch script that runs one torchrun agent per node with ``srun`` (rendezvous on the
  first node of the allocation), for clusters managed by Slurm.
- `moe_core.train.ray_launch` (optional extra ``ray``): the same training function under Ray Train.

The output-directory lock (`moe_core.fileio.OutputLock`) is a kernel ``flock`` held by rank 0: when a worker
dies the agent stops the whole group before restarting it, so the dead rank 0's lock is released by the kernel
and the restarted rank 0 takes it over (it names the dead holder on stderr).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass

from moe_core.errors import MoELabError


class LaunchError(MoELabError):
    """Launch options that cannot work together (nodes, rendezvous, restarts)."""


@dataclass
class LaunchSpec:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int | None = None  # informative for c10d (the rendezvous assigns group ranks in join order)
    rdzv_endpoint: str | None = None  # host:port, the same on every node
    rdzv_id: str = "moe-lab"
    max_restarts: int = 0  # elastic: restart the group this many times when a worker fails

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise LaunchError(
                f"--nproc-per-node ({self.nproc_per_node}) and --nnodes ({self.nnodes}) must be >= 1"
            )
        if self.max_restarts < 0:
            raise LaunchError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise LaunchError("--nnodes > 1 needs --rdzv-endpoint host:port (the same on every node)")
        if self.rdzv_endpoint and not re.fullmatch(r"[^\s:]+:\d+", self.rdzv_endpoint):
            raise LaunchError(f"--rdzv-endpoint {self.rdzv_endpoint!r} is not host:port")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def needs_launcher(self) -> bool:
        return self.world_size > 1 or self.max_restarts > 0


def torchrun_args(spec: LaunchSpec) -> list[str]:
    """torchrun's own options for ``spec`` (what follows ``torchrun`` and precedes the script)."""
    args = [f"--nproc-per-node={spec.nproc_per_node}"]
    if spec.nnodes > 1:
        args += [
            f"--nnodes={spec.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={spec.rdzv_id}",
        ]
        if spec.node_rank is not None:
            args.append(f"--node-rank={spec.node_rank}")
    else:
        args.append("--standalone")
    if spec.max_restarts:
        # the agent checks its workers every monitor interval; a dead one stops the group, which restarts
        args += [f"--max-restarts={spec.max_restarts}", "--monitor-interval=1"]
    return args


def torchrun_command(spec: LaunchSpec, worker_argv: list[str], command: str = "train") -> list[str]:
    """The command that starts this node's torchrun agent, whose workers run ``moe-lab <command> <worker_argv>``
    (``train``, or ``finetune``)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *torchrun_args(spec),
        "-m",
        "moe_core.cli",
        command,
        *worker_argv,
    ]


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this worker's group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resume_requested(resume: bool) -> bool:
    """A restarted worker always resumes: its group died, and the output directory holds the run it continues."""
    return resume or restart_count() > 0


# ------------------------------------------------------------------------------------------------ Slurm
@dataclass
class SlurmSpec:
    job_name: str = "moe-lab-train"
    nodes: int = 2
    gpus_per_node: int = 0  # 0: CPU nodes, one process per --cpus-per-task slice
    nproc_per_node: int = 1
    cpus_per_task: int = 8
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    rdzv_port: int = 29500
    max_restarts: int = 0
    setup: str = ""  # shell lines run before srun on every node (modules, a virtual environment)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise LaunchError(
                f"slurm: nodes ({self.nodes}) and nproc_per_node ({self.nproc_per_node}) must be >= 1"
            )
        if not re.fullmatch(r"[\w.-]+", self.job_name):
            raise LaunchError(
                f"slurm: job name {self.job_name!r} may hold letters, digits, '.', '_' and '-' only"
            )
        if not re.fullmatch(r"(\d+-)?\d{1,2}(:\d{2}){0,2}", self.time):
            raise LaunchError(f"slurm: time {self.time!r} is not Slurm's [D-]HH:MM:SS")


def render_sbatch(slurm: SlurmSpec, worker_argv: list[str], python: str = "python") -> str:
    """An sbatch script: one task per node, each running a torchrun agent; the rendezvous is on the first node
    of the allocation and the job id names it, so every node joins the same group."""
    directives = [
        f"#SBATCH --job-name={slurm.job_name}",
        f"#SBATCH --nodes={slurm.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={slurm.cpus_per_task}",
        f"#SBATCH --time={slurm.time}",
        f"#SBATCH --output={slurm.job_name}-%j.out",
    ]
    if slurm.gpus_per_node:
        directives.append(f"#SBATCH --gpus-per-node={slurm.gpus_per_node}")
    if slurm.partition:
        directives.append(f"#SBATCH --partition={slurm.partition}")
    if slurm.account:
        directives.append(f"#SBATCH --account={slurm.account}")
    torchrun = [
        f"--nproc-per-node={slurm.nproc_per_node}",
        f"--nnodes={slurm.nodes}",
        "--rdzv-backend=c10d",
        f'--rdzv-endpoint="$HEAD_NODE:{slurm.rdzv_port}"',
        '--rdzv-id="$SLURM_JOB_ID"',
    ]
    if slurm.max_restarts:
        torchrun += [f"--max-restarts={slurm.max_restarts}", "--monitor-interval=1"]
    worker = " ".join(shlex.quote(a) for a in worker_argv)
    return "\n".join(
        [
            "#!/bin/bash",
            *directives,
            "# written by `moe-lab train --slurm`: one torchrun agent per node, c10d rendezvous on the first node",
            "set -euo pipefail",
            *([slurm.setup.rstrip()] if slurm.setup.strip() else []),
            'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
            f"srun --kill-on-bad-exit=1 {shlex.quote(python)} -m torch.distributed.run \\",
            *[f"    {a} \\" for a in torchrun],
            f"    -m moe_core.cli train {worker}",
            "",
        ]
    )
