"""Helpers for the dashboard tests: real tiny training runs (one with a starved expert) and a real server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import uvicorn

from moe_core.train import TrainConfig
from moe_core.train.loop import Trainer

DEAD_LAYER, DEAD_EXPERT = 0, 3


def tiny_config(steps: int, router: str = "aux_free", **log) -> TrainConfig:
    overrides = {"router": router}
    if router == "aux_free":
        overrides["router_bias_update_rate"] = 1e-3
    return TrainConfig.build(
        {
            "model": {"preset": "mixtral-tiny", "overrides": overrides},
            "steps": steps,
            "batch_size": 4,
            "data": {"source": "synthetic", "seq_len": 32, "synthetic_blocks": 64},
            "optim": {"warmup_steps": 2},
            "log": {"every": 1, "progress": "off", "alerts": {"dead_steps": 2}, **log},
            "checkpoint": {"every": 1000, "export": False},
            "eval": {"batches": 1, "every": 5},
        }
    )


def starve(trainer: Trainer, layer: int = DEAD_LAYER, expert: int = DEAD_EXPERT) -> None:
    """Inject a dead expert: an aux-free selection bias so low that the expert is never chosen (the bias
    update, 1e-3 per step, cannot bring it back within a test)."""
    trainer.model.routers()[layer].expert_bias[expert] = -1e4


def train_run(out: Path, steps: int, router: str = "aux_free", dead: bool = False):
    trainer = Trainer(tiny_config(steps, router), out)
    try:
        if dead:
            starve(trainer)
        return trainer.run()
    finally:
        trainer.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app):
    """Run ``app`` under uvicorn in a thread on a free local port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the dashboard server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def write_analysis(run_dir: Path):
    """A real router profile and cost report under ``<run>/analysis`` (where `moe-lab analyze` writes them)."""
    import json

    import torch

    from moe_core.analytics.cost import cost_report
    from moe_core.analytics.profile import TOKEN_CLASSES, RouterProfile, collect_profile
    from moe_core.model import MoEForCausalLM
    from moe_core.train.checkpoint import latest_checkpoint

    model = MoEForCausalLM.from_pretrained(latest_checkpoint(run_dir / "checkpoints"))
    batches = [
        torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(i))
        for i in range(2)
    ]
    classes_V = torch.arange(model.config.vocab_size) % len(
        TOKEN_CLASSES
    )  # synthetic ids: a fixed class each
    collect_profile(model, batches, token_classes_V=classes_V).to_dir(run_dir / "analysis" / "profile")
    report = cost_report(model.config, 1000.0, "cpu", seq_len=32)
    (run_dir / "analysis" / "cost.json").write_text(json.dumps(report.to_dict(), default=str))
    return RouterProfile.from_dir(run_dir / "analysis" / "profile"), report


def lifecycle_layout(trained_run: Path, out: Path) -> tuple[Path, Path]:
    """A lifecycle's two runs from one trained run: ``<out>/pretrain`` (the MoE) and ``<out>/dense-active``,
    whose saved config names it a dense baseline and whose event file is the newer (trained second)."""
    import json
    import os
    import shutil

    moe, dense = out / "pretrain", out / "dense-active"
    for run in (moe, dense):
        shutil.copytree(trained_run, run, ignore=shutil.ignore_patterns("analysis"))
    for config_file in dense.glob("checkpoints/*/train_config.json"):
        config = json.loads(config_file.read_text())
        config["model"]["baseline"] = "active"
        config_file.write_text(json.dumps(config))
    now = time.time()
    os.utime(moe / "metrics.jsonl", (now - 60, now - 60))
    os.utime(dense / "metrics.jsonl", (now, now))
    return moe, dense
