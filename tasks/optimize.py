"""Optimization tasks over `moe_core.inference`: weight-only expert quantization, ONNX export (recorded in
MLflow's ONNX flavor) and a side-by-side benchmark table (perplexity, drift, tokens/s, size)."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from moe_core.fileio import staged_outputs
from moe_core.inference.evaluate import compare_variants
from moe_core.inference.onnx_export import export_onnx
from moe_core.inference.quantize import QuantConfig, quantize_checkpoint
from tasks import models_in_memory, tracking
from tasks.results import Benchmark
from tasks.stages import stage_run


@task(name="quantize-experts", retries=1, retry_delay_seconds=2)
def quantize_model(
    model_dir: str, out_dir: str, config: QuantConfig, parent_run_id: str | None, data_dir: str | None = None
) -> str:
    with stage_run("quantize", parent_run_id) as run_id:
        # gptq/awq calibrate on data_dir; the stage owns out_dir, so a retry replaces its own staged output
        report = quantize_checkpoint(model_dir, out_dir, config, data_dir=data_dir, overwrite=True)
        tracking.log_config(run_id, config, prefix="quant")
        tracking.log_metrics(run_id, {f"quant.{k}": v for k, v in report.to_dict().items()})
        tracking.log_artifacts(run_id, out_dir, "quantized_model")
    return out_dir


@task(name="export-onnx", retries=1, retry_delay_seconds=2)
def export_onnx_model(model_dir: str, out_dir: str, parent_run_id: str | None) -> str:
    with stage_run("export_onnx", parent_run_id) as run_id:
        onnx_dir = export_onnx(model_dir, out_dir, overwrite=True)  # the stage's own directory
        tracking.log_onnx_model(run_id, onnx_dir / "model.onnx")
    return str(onnx_dir)


@task(name="benchmark", retries=1, retry_delay_seconds=2)
def benchmark(
    variants: dict[str, str],
    data_dir: str,
    batches: int | None,
    out_dir: str,
    parent_run_id: str | None,
    batch_size: int = 4,
) -> Benchmark:
    """``variants``: ``{"pytorch" | "quantized" | "onnx": directory}``; the first is the reference. Given the
    evaluation's ``batches`` and ``batch_size``, the pytorch row's perplexity is the evaluation's."""
    with stage_run("benchmark", parent_run_id) as run_id:
        # the pytorch variant is the model the evaluation read: reuse it when it is still in memory
        loaded = {"pytorch": models_in_memory.get(variants["pytorch"]).model} if "pytorch" in variants else {}
        rows = compare_variants(variants, data_dir, batches, batch_size, loaded)
        for row in rows:
            tracking.log_metrics(
                run_id, {f"bench.{row['variant']}.{k}": v for k, v in row.items() if k != "variant"}
            )
        with staged_outputs(out_dir) as stage:  # a whole benchmark.json or none
            (stage / "benchmark.json").write_text(json.dumps(rows, indent=1) + "\n")
        tracking.log_artifacts(run_id, Path(out_dir) / "benchmark.json", "benchmark")
        create_table_artifact(
            rows, key="benchmark", description="quality and speed per model variant (validation)"
        )
    metrics = {f"bench.{row['variant']}.{k}": v for row in rows for k, v in row.items() if k != "variant"}
    return Benchmark(run_id, rows, metrics)
