"""Silence, for one call, the library notices a normal run always triggers and a user cannot act on, so the
console shows only what matters (real warnings stay visible: filters match by logger or message, scoped to
the call, and restored after it)."""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR):
    """Drop these loggers' records below ``level`` for the duration of the block. A filter rather than
    setLevel: a library that creates its logger inside the block (DeepSpeed on import) sets the level itself."""
    loggers = [logging.getLogger(name) for name in names]

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= level

    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(keep)


# DeepSpeed's accelerator probe on a machine without a GPU: logged once per process, when deepspeed is first
# imported (by us under parallel.backend=deepspeed, and by accelerate's `extract_model_from_parallel`, which
# `PreTrainedModel.save_pretrained` calls and which imports DeepSpeed whenever it is installed)
DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU"


@contextlib.contextmanager
def quiet_deepspeed_cpu_notice():
    """Drop only DeepSpeed's "Setting accelerator to CPU" notice for the block; its other warnings stay."""
    logger = logging.getLogger("DeepSpeed")  # the logger DeepSpeed creates (deepspeed/utils/logging.py)

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(DEEPSPEED_CPU_NOTICE)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


@contextlib.contextmanager
def quiet_tracer_warnings():
    """``torch.jit.TracerWarning`` during an ONNX export: the exporter traces Python branches on tensor values
    (the KV cache's "is it empty", the mask check) and warns about each, while the export is validated
    against PyTorch at several shapes right after (`moe_core.inference.onnx_export.validate_export`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        yield


# torch 2.13's ONNX exporter (torch.onnx.export(dynamo=True)): its op registry logs, per torchvision op, that
# torchvision is absent (ops no model of ours uses); torch.export's pytree warns about its own deprecated LeafSpec check
ONNX_EXPORTER_NOISE = ("torch.onnx._internal.exporter._registration",)


@contextlib.contextmanager
def quiet_onnx_exporter():
    """The ONNX exporter's notices (`ONNX_EXPORTER_NOISE`) dropped for the block; its errors stay."""
    with quiet_loggers(*ONNX_EXPORTER_NOISE), warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        yield


# what MLflow's transformers flavor logs on every model of ours: the hub model card and license it cannot find
# for a local directory, the pipeline's "Device set to use cpu", DeepSpeed's accelerator probe (imported on the way)
MLFLOW_TRANSFORMERS_NOISE = ("mlflow.transformers", "transformers.pipelines.base", "DeepSpeed")
