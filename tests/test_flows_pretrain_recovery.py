"""Automatic recovery: the training process of a pretrain task is SIGKILLed mid-run; Prefect retries the
task, it resumes from the last checkpoint and ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def _config():
    from moe_core.train import TrainConfig

    return TrainConfig.build(
        {
            "model": {"preset": "switch-tiny"},
            "steps": 40,
            "batch_size": 4,
            "data": {"source": "synthetic", "synthetic_blocks": 64, "seq_len": 16},
            "checkpoint": {"every": 5},
            "log": {"every": 5, "progress": "off"},
            "eval": {"batches": 1},
            "device": "cpu",
        }
    )


def test_killed_training_process_is_retried_and_resumes_to_identical_weights(lab_env, tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from safetensors.torch import load_file

    from flows.params import PretrainParams
    from flows.pretrain import pretrain
    from tasks.process import CHAOS_ENV

    def run(name: str) -> dict:
        return pretrain(
            PretrainParams(train=_config(), subprocess=True, log_model=False, out_dir=str(tmp_path / name))
        )

    clean = run("uninterrupted")
    monkeypatch.setenv(
        CHAOS_ENV, "10"
    )  # SIGKILL the process group once step 10 is checkpointed (1st attempt)
    killed = run("killed")
    assert clean["step"] == killed["step"] == 40

    client = MlflowClient()
    attempts = {
        r.data.tags["mlflow.runName"]: r
        for r in client.search_runs(
            [client.get_run(killed["mlflow_run_id"]).info.experiment_id],
            f"tags.mlflow.parentRunId = '{killed['mlflow_run_id']}'",
        )
    }
    assert attempts["pretrain"].info.status == "FAILED"
    assert "exited with -9" in attempts["pretrain"].data.tags["failure_reason"]
    resumed = attempts["pretrain (attempt 2)"]
    assert resumed.info.status == "FINISHED" and resumed.data.tags["moe_lab.resumed"] == "True"

    a = load_file(tmp_path / "uninterrupted" / "final" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a), "resumed weights differ from the uninterrupted run"


def test_ctrl_c_in_an_in_process_pretrain_flow_checkpoints_and_stops_the_flow(lab_env, tmp_path):
    """The trainer saves a checkpoint on Ctrl-C and returns; the task then stops the flow (no retry that would
    resume at once, nothing run on a half-trained model), its MLflow run is closed KILLED, and running the
    flow again resumes from that checkpoint."""
    import os
    import signal
    import threading
    import time

    from mlflow import MlflowClient

    from flows.params import PretrainParams
    from flows.pretrain import pretrain
    from moe_core.train.checkpoint import list_checkpoints
    from tasks.tracking import experiment_id

    out = tmp_path / "run"
    config = _config().with_overrides(["steps=2000", "checkpoint.every=1000", "log.every=1"])

    def ctrl_c_after_the_first_logged_step():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and metrics.read_text().strip():
                os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread, where the trainer runs
                return
            time.sleep(0.05)

    threading.Thread(target=ctrl_c_after_the_first_logged_step, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        pretrain(PretrainParams(train=config, log_model=False, out_dir=str(out)))
    (checkpoint,) = list_checkpoints(out / "checkpoints")
    assert not (out / "final").exists()
    flow_run = MlflowClient().search_runs(
        [experiment_id()], "tags.moe_lab.flow = 'pretrain'", order_by=["attributes.start_time DESC"]
    )[0]
    assert flow_run.info.status == "KILLED"

    step = int(checkpoint.name.split("_")[1])
    finished = pretrain(
        PretrainParams(train=config.with_overrides([f"steps={step + 2}"]), log_model=False, out_dir=str(out))
    )
    assert finished["step"] == step + 2


def test_sigterm_to_moe_lab_run_checkpoints_its_training_process_and_exits_143(lab_env, tmp_path):
    """`moe-lab run` used to die on SIGTERM at once (Python's default), leaving its training process group
    (its own session) training on; now the flow's `finally` stops the group, which checkpoints."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from prefect.settings import PREFECT_API_URL

    from moe_core.train.checkpoint import list_checkpoints

    # the session's stores and Prefect server (lab_env): a fresh home would spend most of this test migrating
    # a new MLflow store and starting an ephemeral Prefect server
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "OMP_NUM_THREADS": "1",
        "PREFECT_API_URL": PREFECT_API_URL.value(),
    }
    sets = ["subprocess=true", f"out_dir={out}", "log_model=false", "train.steps=3000", "train.log.every=1"]
    sets += ["train.log.progress=lines", "train.data.source=synthetic", "train.checkpoint.every=10000"]
    cmd = [sys.executable, "-m", "moe_lab", "run", "pretrain", "--size", "tiny"]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            proc.send_signal(signal.SIGTERM)  # to `moe-lab run` alone
            break
    output = "".join(lines) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    (ckpt,) = list_checkpoints(out / "checkpoints")
    assert f"SIGTERM at step {int(ckpt.name.split('_')[1])}: checkpoint {ckpt} saved" in output
