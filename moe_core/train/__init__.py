"""Pretraining engine: one process or many (expert x data parallel via torchrun), exact resume, routing
telemetry, dense baselines.

Train a tiny Switch model on the built-in corpus::

    from moe_core.train import TrainConfig, train

    config = TrainConfig.from_preset("switch-tiny", steps=40, data={"max_documents": 300})
    result = train(config, out_dir="runs/switch-tiny")
    print(f"val loss {result.val_loss:.3f}, Hugging Face model in {result.export_dir}")

The same from the command line: ``moe-lab train --preset switch-tiny --set steps=30 --out runs/switch-tiny``;
``--nproc 2 --set parallel.ep_size=2`` shards the experts over two processes; ``--resume`` continues from
the latest checkpoint (at any layout: checkpoints reshard). Modules: `config` (TrainConfig), `loop` (Trainer,
train), `build` (the meta-device start: each rank materializes what it owns; the dry run's accounting),
`parallel` (expert and data parallelism), `checkpoint`, `optim` (AdamW and the LR schedule), `interval` (what a logged row averages),
`telemetry` (metrics sinks, routing statistics), `batches`, `cli`; the FLOPs model behind throughput and MFU is
`moe_core.flops`.

The names above are resolved on first use (moe_core._lazy): `moe-lab train --help` imports this package through
moe_core.train.cli and must not pay for pydantic, torch and torch.distributed it does not need.
"""

from typing import TYPE_CHECKING

from moe_core._lazy import lazy_exports

if TYPE_CHECKING:
    from moe_core.train.checkpoint import export_checkpoint
    from moe_core.train.config import TrainConfig, TrainConfigError
    from moe_core.train.loop import Trainer, TrainingDivergedError, TrainResult, read_result, train
    from moe_core.train.telemetry import ConsoleSink, JsonlSink, MetricsSink, read_jsonl

_EXPORTS = {
    "TrainConfig": ".config",
    "TrainConfigError": ".config",
    "ConsoleSink": ".telemetry",
    "JsonlSink": ".telemetry",
    "MetricsSink": ".telemetry",
    "read_jsonl": ".telemetry",
    "train": ".loop",
    "Trainer": ".loop",
    "TrainResult": ".loop",
    "read_result": ".loop",
    "TrainingDivergedError": ".loop",
    "export_checkpoint": ".checkpoint",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "MetricsSink",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "Trainer",
    "TrainingDivergedError",
    "export_checkpoint",
    "read_jsonl",
    "read_result",
    "train",
]
