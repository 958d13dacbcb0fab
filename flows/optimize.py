"""Flow: optimize a trained model for inference: quantize its experts, export ONNX, benchmark the variants."""

from __future__ import annotations

from prefect import flow
from pydantic import Field

from flows.common import out_dir_for
from flows.params import OptimizeParams
from tasks import optimize as opt
from tasks.stages import flow_record, open_journal, record_summary


class OptimizeFlowParams(OptimizeParams):
    model_dir: str = Field(..., description="an exported model directory (a training run's final/)")
    data_dir: str = Field(..., description="prepared data for the perplexity side of the benchmark")
    out_dir: str | None = None


@flow(name="optimize")
def optimize(params: OptimizeFlowParams) -> dict:
    out = out_dir_for("optimize", params.out_dir)
    journal = open_journal(out)  # where MLflow's records wait while it is unreachable
    with flow_record("optimize", params, journal) as run_id:
        quantized = opt.quantize_model(
            params.model_dir, str(out / "quantized"), params.quant_config(), run_id, params.data_dir
        )
        variants = {"pytorch": params.model_dir, "quantized": quantized}
        if params.onnx:
            variants["onnx"] = opt.export_onnx_model(params.model_dir, str(out / "onnx"), run_id)
        bench = opt.benchmark(variants, params.data_dir, params.benchmark_batches, str(out), run_id)
        record_summary(run_id, bench)  # the flow's run compares in the runs table
    return {"variants": variants, "benchmark": bench.rows, "mlflow_run_id": run_id, **journal.summary()}
