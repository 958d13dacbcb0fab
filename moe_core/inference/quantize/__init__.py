"""Quantization of a trained model, applied from outside the model file; one module per backend.

- `weight_only`: PyTorch weight-only int8/int4 experts (`quantize_experts`, `QuantizedExperts`), dequantized
  per expert as it runs; `save_quantized` / `load_quantized` / `quantize_checkpoint` (``moe-lab quantize``).
- `calibrated`: how those integers are chosen from calibration data: GPTQ (Frantar et al. 2022) and AWQ
  (Lin et al. 2024), with force-routing of rarely picked experts and a round-to-nearest fallback.
- `onnx_dynamic`: ONNX Runtime dynamic int8 on an exported directory (`quantize_onnx_dynamic`).
- `optimum_gptq`: optimum's own GPTQ on the Hugging Face architecture (CUDA only).
- `common`: what they share: `QuantConfig`, the integer codes (`quantize_rtn`, `pack_int4`, ...),
  `QuantReport`, `QuantizationError`.

Every public name is importable from here, as it was when this was one module.
"""

from moe_core.inference.quantize.calibrated import (
    awq_alphas,
    awq_output_error,
    awq_quantize,
    awq_search_scale,
    calibrated_codes,
    gptq_quantize,
)
from moe_core.inference.quantize.common import (
    PROJECTIONS,
    QuantConfig,
    QuantizationError,
    QuantReport,
    compute_scales,
    dequantize,
    fake_quantize,
    pack_int4,
    quantize_rtn,
    unpack_int4,
)
from moe_core.inference.quantize.onnx_dynamic import (
    fold_onnx_constants,
    quantize_onnx_dynamic,
    weight_matmuls,
)
from moe_core.inference.quantize.optimum_gptq import optimum_gptq_available, quantize_optimum_gptq
from moe_core.inference.quantize.weight_only import (
    QUANT_FILE,
    QuantizedExperts,
    check_experts_quantized,
    expert_modules,
    load_quantized,
    quantize_checkpoint,
    quantize_experts,
    save_quantized,
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
    "calibrated_codes",
    "check_experts_quantized",
    "compute_scales",
    "dequantize",
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
