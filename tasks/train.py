"""The pretraining task: `moe_core.train.train` in this process, or ``moe-lab train`` as a process group
(``nproc`` > 1 goes through torchrun). Never cached; retried, and every attempt resumes from the output
directory's last checkpoint, so a killed run ends with the weights an uninterrupted one would have."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from moe_core.config import MoEConfig
from moe_core.train import TrainConfig, TrainResult, read_result, train
from moe_core.train.checkpoint import TRAINER_STATE, latest_checkpoint
from moe_core.train.loop import EXPORT_DIR
from tasks import tracking
from tasks.process import run_group, stop_as_the_signal_asked
from tasks.results import TrainedModel
from tasks.stages import stage_run


@task(name="pretrain", retries=2, retry_delay_seconds=3, cache_policy=NO_CACHE)
def pretrain(
    config: TrainConfig,
    out_dir: str,
    parent_run_id: str | None,
    nproc: int = 1,
    subprocess: bool = False,
    log_model: bool = True,
    stage: str = "pretrain",
    max_restarts: int = 0,
    launcher: str = "torchrun",
    ray_address: str | None = None,
    log_checkpoint: bool = False,
) -> TrainedModel:
    """Train into ``out_dir``; returns step, losses, the export directory and the MLflow run/model ids.

    MLflow gets the model once (``log_model``: the transformers flavor the registry serves) and the last
    checkpoint's configs and trainer state; its weights and optimizer state (about 3x the model) only with
    ``log_checkpoint`` (they stay in ``out_dir/checkpoints`` for resuming either way)."""
    out = Path(out_dir)
    resume = latest_checkpoint(out / "checkpoints") is not None
    with stage_run(stage, parent_run_id) as run_id:
        tracking.log_config(run_id, config, prefix="train")
        if config.data.path:
            tracking.log_dataset(run_id, config.data.path, context="training")
        if launcher == "ray":
            from moe_core.train.ray_launch import train_with_ray  # optional extra: pip install .[ray]

            follower = tracking.EventFollower(run_id, out)
            train_with_ray(config, out, nproc, resume=resume, address=ray_address, max_failures=max_restarts)
            follower.poll()
            result = read_result(out)  # the run ended in other processes: what it wrote
        elif nproc > 1 or subprocess:
            _train_in_process_group(config, out, run_id, nproc, resume, max_restarts)
            result = read_result(out)
        else:
            result = train(config, out, resume=resume, sinks=[tracking.MlflowSink(run_id, out)])
            stop_as_the_signal_asked(result.stopped_by)  # the flow stops too; a rerun resumes
        trained = _trained_model(result, run_id)
        tracking.log_metrics(run_id, trained.metrics, trained.step)
        tracking.set_tags(run_id, {"moe_lab.resumed": resume, "moe_lab.out_dir": str(out)})
        ckpt = result.checkpoint
        tracking.log_architecture(run_id, MoEConfig.from_pretrained(ckpt))
        if log_checkpoint:
            tracking.log_artifacts(run_id, ckpt, "checkpoint")
        else:  # what the run was (configs, step, RNG-free trainer state), not another copy of the weights
            for name in (TRAINER_STATE, "train_config.json", "config.json"):
                if (ckpt / name).is_file():
                    tracking.log_artifacts(run_id, ckpt / name, "checkpoint")
        models = tracking.log_model(run_id, trained.export_dir) if log_model else {}
    return replace(trained, model_uri=models.get("transformers") or models.get("files"))


def _train_in_process_group(
    config: TrainConfig, out: Path, run_id: str, nproc: int, resume: bool, max_restarts: int = 0
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / "flow_train_config.json")
    cmd = [
        sys.executable,
        "-m",
        "moe_core.cli",
        "train",
        "--config",
        str(out / "flow_train_config.json"),
        "--out",
        str(out),
        "--nproc",
        str(nproc),
    ] + (["--resume"] if resume else [])
    if nproc > 1 and max_restarts:  # torchrun's elastic agent: a dead rank restarts the group, which resumes
        cmd += ["--max-restarts", str(max_restarts)]
    follower = tracking.EventFollower(run_id, out)
    run_group(cmd, out, follower.poll, first_attempt=task_run.run_count <= 1, poll_s=2.0)


def _trained_model(result: TrainResult, run_id: str) -> TrainedModel:
    restarts = next(
        (row["elastic/restarts"] for row in reversed(result.history) if "elastic/restarts" in row), None
    )
    return TrainedModel(
        run_id=run_id,
        out_dir=str(result.out_dir),
        export_dir=str(result.export_dir or result.out_dir / EXPORT_DIR),
        model_uri=None,
        step=result.step,
        tokens=result.tokens,
        loss=result.loss,
        val_loss=result.val_loss,
        restarts=restarts,
        metrics_path=str(result.metrics_path),
    )
