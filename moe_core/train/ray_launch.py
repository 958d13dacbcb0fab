"""The training function under Ray Train (optional extra: ``pip install .[ray]``).

    from moe_core.train.ray_launch import train_with_ray
    train_with_ray(config, "/shared/runs/a", num_workers=8, use_gpu=True, address="auto")

Ray Train's `TorchTrainer` starts ``num_workers`` workers on the Ray cluster, joins them in one
torch.distributed process group (gloo on CPU, NCCL on GPUs) and sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
as torchrun would; each worker then runs `moe_core.train.train`, the same function torchrun's workers run,
which finds the process group already initialized (`parallel.init_parallel`). Checkpoints, metrics.jsonl and
the output-directory lock are the engine's own, in ``out_dir`` (on storage every node sees); Ray's own run
records go to ``<out_dir>/ray``. With ``max_failures`` Ray restarts a failed group, which resumes from the
newest complete checkpoint as under torchrun's elastic agent.
"""

from __future__ import annotations

from pathlib import Path

from moe_core.fileio import refuse_previous_outputs
from moe_core.train.checkpoint import any_checkpoint_dir
from moe_core.train.config import TrainConfig
from moe_core.train.launch import LaunchError
from moe_core.train.loop import train


def _worker(cfg: dict) -> None:
    """One Ray Train worker: the engine's training function. A retried attempt finds the checkpoints of the
    attempt that failed and resumes (the driver refused to start a fresh run over older checkpoints)."""
    resume = cfg["resume"] or any_checkpoint_dir(Path(cfg["out_dir"]) / "checkpoints") is not None
    train(TrainConfig.model_validate(cfg["config"]), cfg["out_dir"], resume=resume)


def train_with_ray(
    config: TrainConfig,
    out_dir: str | Path,
    num_workers: int,
    resume: bool = False,
    use_gpu: bool = False,
    address: str | None = None,
    max_failures: int = 0,
) -> Path:
    """Train ``config`` into ``out_dir`` on ``num_workers`` Ray workers; returns ``out_dir``. ``address``: a
    running cluster ("auto", "ray://head:10001"); None starts a local one (or uses the one this process has)."""
    try:
        import ray  # optional: the ray extra
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        raise LaunchError(
            "the Ray launcher needs Ray Train: pip install 'moe-lab[ray]' (or 'ray[train]')"
        ) from None
    if num_workers < 1:
        raise LaunchError(f"num_workers must be >= 1, got {num_workers}")
    out = Path(out_dir).absolute()
    if not resume:  # as `train` does: a fresh run never lands on an older run's checkpoints
        refuse_previous_outputs(
            out, ("checkpoints/step_*",), "pass resume=True to continue that run", what="checkpoints"
        )
    if not ray.is_initialized():
        ray.init(address=address)
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"config": config.model_dump(mode="json"), "out_dir": str(out), "resume": resume},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu, resources_per_worker={"CPU": 1}
        ),
        run_config=RunConfig(
            name="moe-lab-train",
            storage_path=str(out / "ray"),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    trainer.fit()
    return out
