"""Launchers over torchrun: the torchrun arguments for one node, several nodes and elastic runs, the Slurm
script (rendered, parsed by bash, its srun/torchrun line checked; no Slurm here), and bad launch options."""

import argparse
import shlex
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

from moe_core.train import launch
from moe_core.train.cli import add_cli, torchrun_command, worker_argv, write_slurm_script
from moe_core.train.launch import LaunchError, LaunchSpec, SlurmSpec, render_sbatch


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    return parser.parse_args(["train", *argv])


def test_multi_node_flags_map_onto_torchrun_c10d_rendezvous():
    args = parse(
        "--out",
        "o",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        "10.0.0.1:29400",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "3",
        "--rdzv-id",
        "job7",
    )
    cmd = torchrun_command(args, worker_argv(args))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    head = cmd[3 : cmd.index("-m", 3)]
    assert head == [
        "--nproc-per-node=4",
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=job7",
        "--node-rank=1",
        "--max-restarts=3",
        "--monitor-interval=1",
    ]
    assert cmd[cmd.index("-m", 3) :] == [
        "-m",
        "moe_core.cli",
        "train",
        "--out",
        "o",
    ]  # workers do not relaunch
    # torchrun itself accepts the arguments as we spell them
    parsed = get_args_parser().parse_args(cmd[3:])
    assert (parsed.nnodes, parsed.node_rank, parsed.max_restarts, parsed.rdzv_endpoint) == (
        "2",
        1,
        3,
        "10.0.0.1:29400",
    )


def test_elastic_single_node_needs_the_launcher_even_with_one_process():
    spec = LaunchSpec(max_restarts=2)
    assert spec.needs_launcher and "--standalone" in launch.torchrun_args(spec)
    assert not LaunchSpec().needs_launcher


def test_restarted_worker_resumes(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert not launch.resume_requested(False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert launch.restart_count() == 1 and launch.resume_requested(False)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"nnodes": 2}, "--rdzv-endpoint"),
        ({"nnodes": 2, "rdzv_endpoint": "host0"}, "host:port"),
        ({"nnodes": 2, "rdzv_endpoint": "h:1", "node_rank": 2}, "--node-rank 2"),
        ({"max_restarts": -1}, "--max-restarts"),
        ({"nproc_per_node": 0}, "--nproc-per-node"),
    ],
)
def test_bad_launch_options_are_refused(fields, match):
    with pytest.raises(LaunchError, match=match):
        LaunchSpec(**fields)


def test_bad_launch_option_exits_2_from_the_cli(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "moe_core.cli", "train", "--out", str(tmp_path / "o"), "--nnodes", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "--rdzv-endpoint" in result.stderr


def test_slurm_script_runs_one_torchrun_agent_per_node(tmp_path):
    args = parse(
        "--out",
        str(tmp_path / "run"),
        "--preset",
        "mixtral-tiny",
        "--set",
        "steps=5",
        "--slurm",
        "--nnodes",
        "4",
        "--nproc-per-node",
        "8",
        "--slurm-gpus-per-node",
        "8",
        "--max-restarts",
        "2",
        "--slurm-partition",
        "gpu",
        "--slurm-setup",
        "source /shared/venv/bin/activate",
    )
    path = write_slurm_script(args)
    script = path.read_text()
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    for directive in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu"):
        assert f"#SBATCH {directive}" in script
    assert script.index("source /shared/venv/bin/activate") < script.index("srun ")
    # the srun line, joined over its continuations and split as bash would (variables left unexpanded)
    line = script[script.index("srun ") :].replace("\\\n", " ").splitlines()[0]
    words = shlex.split(line)
    assert (
        words[:4] == ["srun", "--kill-on-bad-exit=1", "python", "-m"] and words[4] == "torch.distributed.run"
    )
    torchrun = words[5 : words.index("-m", 5)]
    assert torchrun == [
        "--nproc-per-node=8",
        "--nnodes=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=$HEAD_NODE:29500",
        "--rdzv-id=$SLURM_JOB_ID",
        "--max-restarts=2",
        "--monitor-interval=1",
    ]
    worker = words[words.index("-m", 5) :]
    assert worker[:3] == ["-m", "moe_core.cli", "train"]
    assert worker[worker.index("--out") + 1] == str(
        (tmp_path / "run").absolute()
    )  # every node: the same path
    assert "--slurm" not in worker and "--nnodes" not in worker
    # the head node comes from the allocation, the same on every node
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script


def test_slurm_spec_refuses_what_sbatch_would_misread():
    with pytest.raises(LaunchError, match="job name"):
        SlurmSpec(job_name="a b; rm")
    with pytest.raises(LaunchError, match="time"):
        SlurmSpec(time="tomorrow")
    assert "--gpus-per-node" not in render_sbatch(SlurmSpec(nodes=1), ["--out", "/x"])  # CPU nodes


def test_submit_without_sbatch_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "moe_core.cli", "train", "--out", str(tmp_path / "o"), "--slurm", "--submit"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "sbatch" in result.stderr
    assert (tmp_path / "o" / "launch.sbatch").is_file()  # written, ready to submit by hand
