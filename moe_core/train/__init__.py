"""Pretraining engine: one process or many (expert x data parallel via torchrun), exact resume, routing
telemetry, dense baselines.

Train a tiny Switch model on the built-in corpus::

    from moe_core.train import TrainConfig, train

    config = TrainConfig.from_preset("switch-tiny", steps=40, data={"max_documents": 300})
    result = train(config, out_dir="runs/switch-tiny")
    print(f"val loss {result.val_loss:.3f}, Hugging Face model in {result.export_dir}")

The same from the command line: ``moe-lab train --preset switch-tiny --set steps=30 --out runs/switch-tiny``;
``--nproc 2 --set parallel.ep_size=2`` shards the experts over two processes; ``--resume`` continues from
the latest checkpoint. Modules: `config` (TrainConfig), `loop` (Trainer, train), `parallel` (expert and data
parallelism), `checkpoint`, `telemetry` (metrics sinks, routing statistics), `flops`, `batches`, `cli`.
"""

from moe_core.train.config import TrainConfig, TrainConfigError
from moe_core.train.telemetry import ConsoleSink, JsonlSink, MetricsSink, read_jsonl


def __getattr__(name: str):  # the loop imports the model and torch.distributed: only when asked for
    if name in ("train", "Trainer", "TrainResult", "TrainingDivergedError"):
        from moe_core.train import loop

        return getattr(loop, name)
    if name == "export_checkpoint":
        from moe_core.train.checkpoint import export_checkpoint

        return export_checkpoint
    raise AttributeError(f"module 'moe_core.train' has no attribute {name!r}")


__all__ = ["ConsoleSink", "JsonlSink", "MetricsSink", "TrainConfig", "TrainConfigError", "TrainResult",
           "Trainer", "TrainingDivergedError", "export_checkpoint", "read_jsonl", "train"]
