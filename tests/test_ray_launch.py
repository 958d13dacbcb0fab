"""The training function under Ray Train's TorchTrainer (optional extra `ray`): a local Ray cluster on CPU,
2 workers with the experts sharded over both, following the 1-process run of the same global batch."""

import pytest
import ray.train.torch  # noqa: F401  (the test extra installs ray[train], so this test always runs in CI)

from moe_core.train import TrainConfig, train
from tests.dist_helpers import STEPS, assert_comm_metrics, assert_same_run


def config(**parallel) -> TrainConfig:
    return TrainConfig.build(
        {
            "model": {"preset": "mixtral-tiny"},
            "steps": STEPS,
            "batch_size": 8,
            "device": "cpu",
            "data": {"source": "synthetic", "seq_len": 32, "synthetic_blocks": 128},
            "optim": {"lr": 1e-2, "warmup_steps": 2},
            "log": {"every": 1, "progress": "off"},
            "checkpoint": {"every": 4, "export": False},
            "eval": {"batches": 1},
            "parallel": parallel,
        }
    )


@pytest.mark.slow
def test_ray_torch_trainer_with_two_workers_follows_one_process(tmp_path, monkeypatch, local_ray):
    from moe_core.train.ray_launch import train_with_ray

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    train(config(), tmp_path / "one")
    train_with_ray(config(ep_size=2), tmp_path / "ray", num_workers=2)  # on the session's local cluster
    assert_same_run(tmp_path / "one", tmp_path / "ray")
    assert_comm_metrics(tmp_path / "ray", world=2, ep_size=2)
