"""Optimization tasks over `moe_core.inference`: weight-only expert quantization, ONNX export (recorded in
MLflow's ONNX flavor) and a side-by-side benchmark table (perplexity, drift, tokens/s, size)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_table_artifact

from tasks import tracking
from tasks.stages import stage_run


@task(name="quantize-experts", retries=1, retry_delay_seconds=2)
def quantize_model(model_dir: str, out_dir: str, bits: int, method: str, group_size: int,
                   parent_run_id: str | None) -> str:
    from moe_core.inference.quantize import QuantConfig, quantize_checkpoint

    with stage_run("quantize", parent_run_id) as run_id:
        config = QuantConfig(bits=bits, method=method, group_size=group_size)
        report = quantize_checkpoint(model_dir, out_dir, config)
        tracking.log_config(run_id, config, prefix="quant")
        tracking.log_metrics(run_id, {f"quant.{k}": v for k, v in report.to_dict().items()})
        tracking.log_artifacts(run_id, out_dir, "quantized_model")
    return out_dir


@task(name="export-onnx", retries=1, retry_delay_seconds=2)
def export_onnx_model(model_dir: str, out_dir: str, parent_run_id: str | None) -> str:
    from moe_core.inference.onnx_export import export_onnx

    with stage_run("export_onnx", parent_run_id) as run_id:
        onnx_dir = export_onnx(model_dir, out_dir)
        tracking.log_onnx_model(run_id, onnx_dir / "model.onnx")
    return str(onnx_dir)


def _load_variant(kind: str, path: str):
    if kind == "onnx":
        from moe_core.inference.onnx_export import load_onnx

        return load_onnx(path)
    if kind == "quantized":
        from moe_core.inference.quantize import load_quantized

        return load_quantized(path)
    from moe_core import MoEForCausalLM

    return MoEForCausalLM.from_pretrained(path).eval()


@task(name="benchmark", retries=1, retry_delay_seconds=2)
def benchmark(variants: dict[str, str], data_dir: str, batches: int, out_dir: str, parent_run_id: str | None) -> dict:
    """``variants``: ``{"pytorch" | "quantized" | "onnx": directory}``; the first is the reference."""
    from moe_core.eval.batches import split_batches
    from moe_core.inference.evaluate import drift, perplexity

    with stage_run("benchmark", parent_run_id) as run_id:
        rows = []
        for kind, path in variants.items():
            model = _load_variant(kind, path)
            data = list(split_batches(data_dir, "validation", 4, batches))
            start = time.perf_counter()
            ppl = perplexity(model, data)
            seconds = time.perf_counter() - start
            size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
            rows.append({"variant": kind, "perplexity": ppl, "tokens_per_s": sum(b.numel() for b in data) / seconds,
                         "size_mb": size / 2**20})
        for row in rows:
            row["ppl_drift"] = drift(row["perplexity"], rows[0]["perplexity"])
            tracking.log_metrics(run_id, {f"bench.{row['variant']}.{k}": v for k, v in row.items() if k != "variant"})
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "benchmark.json").write_text(json.dumps(rows, indent=1) + "\n")
        tracking.log_artifacts(run_id, Path(out_dir) / "benchmark.json", "benchmark")
        create_table_artifact(rows, key="benchmark", description="quality and speed per model variant (validation)")
    return {"run_id": run_id, "rows": rows}
