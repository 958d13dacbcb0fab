"""Quantization of a trained model, applied from outside the model file; one module per backend.

- `weight_only`: PyTorch weight-only int8/int4 experts (`quantize_experts`), dequantized per expert as they
  run; `quantize_checkpoint` (``moe-lab quantize``).
- `calibrated`: how those integers are chosen from calibration data: GPTQ (Frantar et al. 2022) and AWQ
  (Lin et al. 2024), with force-routing of rarely picked experts and a round-to-nearest fallback.
- `onnx_dynamic`: ONNX Runtime dynamic int8 on an exported directory (`quantize_onnx_dynamic`).
- `optimum_gptq`: optimum's own GPTQ on the Hugging Face architecture (CUDA only).
- what they share lives one level down, in `moe_core.quantized` (the quantized-checkpoint format, which
  `moe_core.load` reads without importing this package): `QuantConfig`, the integer codes (`quantize_rtn`,
  `pack_int4`, ...), `QuantizedExperts`, `QuantReport`, `QuantizationError`, `save_quantized` /
  `load_quantized`.

Every public name is importable from here, as it was when this was one module.
"""

from moe_core.inference.quantize.calibrated import (
    awq_alphas,
    awq_output_error,
    awq_quantize,
    awq_search_scale,
    calibrated_experts,
    expert_inputs,
    gptq_quantize,
)
from moe_core.inference.quantize.onnx_dynamic import (
    fold_onnx_constants,
    quantize_onnx_dynamic,
    weight_matmuls,
)
from moe_core.inference.quantize.optimum_gptq import optimum_gptq_available, quantize_optimum_gptq
from moe_core.inference.quantize.weight_only import quantize_checkpoint, quantize_experts
from moe_core.quantized import (
    PROJECTIONS,
    QUANT_FILE,
    QuantConfig,
    QuantizationError,
    QuantizedExperts,
    QuantReport,
    check_experts_quantized,
    compute_scales,
    dequantize,
    expert_modules,
    fake_quantize,
    load_quantized,
    pack_int4,
    quantize_rtn,
    save_quantized,
    unpack_int4,
)

__all__ = [
    "PROJECTIONS",
    "QUANT_FILE",
    "QuantConfig",
    "QuantReport",
    "QuantizationError",
    "QuantizedExperts",
    "awq_alphas",
    "awq_output_error",
    "awq_quantize",
    "awq_search_scale",
    "calibrated_experts",
    "check_experts_quantized",
    "compute_scales",
    "dequantize",
    "expert_inputs",
    "expert_modules",
    "fake_quantize",
    "fold_onnx_constants",
    "gptq_quantize",
    "load_quantized",
    "optimum_gptq_available",
    "pack_int4",
    "quantize_checkpoint",
    "quantize_experts",
    "quantize_onnx_dynamic",
    "quantize_optimum_gptq",
    "quantize_rtn",
    "save_quantized",
    "unpack_int4",
    "weight_matmuls",
]
