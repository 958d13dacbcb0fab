"""ONNX Runtime dynamic int8 (`quantize_onnx_dynamic`) on an exported directory, through ONNX Runtime's own
``onnxruntime.quantization.quantize_dynamic``.

The static expert path runs each projection of a layer as one wide MatMul over all E experts ([D, E*F] or
[E*F, D]), so per-channel scales are per expert row and ONNX Runtime runs three int8 MatMuls a layer instead
of 3E small ones. ONNX Runtime's quantizer only quantizes MatMuls whose weight is an initializer (the export
writes every projection as a MatMul: `moe_core.inference.onnx_export.linear_as_matmul`), and a weight may sit
behind a Reshape/Transpose of its stack, so the graph is first constant-folded by ONNX Runtime (basic level:
standard ONNX ops only). Router MatMuls stay in float; weight-times-activation MatMuls only (no
activation-times-activation). The settings are those of optimum's ``AutoQuantizationConfig.avx2(is_static=False)``,
which this module used before: uint8 activations (asymmetric), uint8 weights (symmetric), per channel.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from moe_core.fileio import atomic_directory
from moe_core.inference.onnx_export import ONNX_FILES
from moe_core.quantized import QuantizationError


def fold_onnx_constants(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Constant-fold an ONNX file with ONNX Runtime's basic optimizations (standard ONNX ops only), so that
    every expert's weight becomes a MatMul initializer the quantizer can see."""
    import onnxruntime as ort  # optional heavy dependency: ONNX Runtime, only for this backend

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
    return Path(dst)


def weight_matmuls(onnx_path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(MatMul nodes whose weight is an initializer, outside the router; router MatMul nodes)."""
    import onnx  # optional heavy dependency, only for this backend

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    weights, routers = [], []
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            # the export names nodes by module path (/model/model/layers/0/mlp/router/...)
            (routers if "/router/" in node.name or ".router." in node.input[1] else weights).append(node.name)
    return weights, routers


def quantize_onnx_dynamic(
    onnx_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    per_channel: bool = True,
    keep_router_float: bool = True,
    overwrite: bool = False,
) -> Path:
    """Dynamic int8 (weights 8-bit per channel, activations quantized at run time) through ONNX Runtime's
    ``quantize_dynamic``; writes ``model_quantized.onnx`` and the configs into ``out_dir``, staged (complete or
    not at all); a non-empty ``out_dir`` is replaced only with ``overwrite``."""
    # optional heavy dependency: ONNX Runtime's quantization tooling, only for this backend
    from onnxruntime.quantization import QuantType, quantize_dynamic

    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    src = next((onnx_dir / f for f in ONNX_FILES if (onnx_dir / f).is_file()), None)
    if src is None:
        raise QuantizationError(
            f"{onnx_dir}: no exported ONNX model ({', '.join(ONNX_FILES)}); run `moe-lab export onnx` first"
        )
    with atomic_directory(out_dir, overwrite, QuantizationError) as stage:
        folded_dir = stage / "_folded"
        folded_dir.mkdir()
        folded = fold_onnx_constants(src, folded_dir / "model.onnx")
        for companion in ("config.json", "generation_config.json"):
            if (onnx_dir / companion).is_file():
                shutil.copy(onnx_dir / companion, stage / companion)
        weights, routers = weight_matmuls(folded)
        nodes = weights if keep_router_float else weights + routers
        if not weights:
            raise QuantizationError(
                f"{src}: no MatMul with a constant weight to quantize; export again with `moe-lab export onnx`"
            )
        settings = {
            "per_channel": per_channel,
            "reduce_range": False,
            "weight_type": QuantType.QUInt8,
            "op_types_to_quantize": ["MatMul"],
            "nodes_to_quantize": nodes,
            "extra_options": {"WeightSymmetric": True, "ActivationSymmetric": False},
        }
        quantize_dynamic(folded, stage / "model_quantized.onnx", **settings)
        (stage / "ort_quantization.json").write_text(
            json.dumps(
                {
                    **settings,
                    "weight_type": "QUInt8",
                    "activation_type": "QUInt8 (dynamic)",
                    "source": src.name,
                },
                indent=2,
            )
        )
        shutil.rmtree(folded_dir)
    return out_dir
