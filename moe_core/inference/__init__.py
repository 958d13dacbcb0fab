"""Inference optimization, applied to a model from outside the model file.

- `fast_decode`: a decode path that reads only the chosen experts' weights (`enable_fast_decode`).
- `onnx_export`: ONNX through ``torch.onnx.export(dynamo=True)`` with a KV cache; `load_onnx` gives the lab's
  ONNX Runtime wrapper (`OrtCausalLM`: logits and cache from a call, ``generate``).
- `compile`: ``torch.compile`` of the prefill and decode steps (dynamic or static KV cache), ``torch.export``.
- `quantize`: weight-only int8/int4 experts (round-to-nearest, GPTQ, AWQ) and ONNX Runtime dynamic int8.
- `prune`: drop (or merge) experts ranked by routed slots or by REAP saliency.
- `gguf_export`: a Hugging Face MoE directory (Mixtral, OLMoE, Qwen2/3-MoE, DeepSeek-V3/V2, gpt-oss, GLM-4.5) as
  GGUF for llama.cpp.
- `expert_cache`: experts on disk, an LRU of resident experts, graceful degradation.
- `generate`: batched generation with padding-aware scheduling and streaming.
- `cli`: ``moe-lab export onnx|gguf``, ``quantize``, ``prune``, ``generate``.

The names below are resolved on first use (moe_core._lazy): `moe-lab quantize --help` and the other inference
commands import this package through moe_core.inference.cli and must not pay for torch, transformers, optimum,
onnxscript and ONNX Runtime they do not need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_core._lazy import lazy_exports

if TYPE_CHECKING:
    from moe_core.inference.compile import compile_steps, export_program
    from moe_core.inference.expert_cache import ExpertCache, offload_experts
    from moe_core.inference.fast_decode import DecodeExperts, disable_fast_decode, enable_fast_decode
    from moe_core.inference.generate import GenerationConfig, batch_generate
    from moe_core.inference.gguf_export import export_gguf
    from moe_core.inference.onnx_export import export_onnx, load_onnx
    from moe_core.inference.prune import PruneConfig, collect_saliency, prune_experts
    from moe_core.inference.quantize import QuantConfig, quantize_experts, quantize_onnx_dynamic

_EXPORTS = {
    "enable_fast_decode": ".fast_decode",
    "disable_fast_decode": ".fast_decode",
    "DecodeExperts": ".fast_decode",
    "export_onnx": ".onnx_export",
    "load_onnx": ".onnx_export",
    "quantize_experts": ".quantize",
    "QuantConfig": ".quantize",
    "quantize_onnx_dynamic": ".quantize",
    "prune_experts": ".prune",
    "PruneConfig": ".prune",
    "collect_saliency": ".prune",
    "export_gguf": ".gguf_export",
    "ExpertCache": ".expert_cache",
    "offload_experts": ".expert_cache",
    "batch_generate": ".generate",
    "GenerationConfig": ".generate",
    "compile_steps": ".compile",
    "export_program": ".compile",
}
__all__ = [
    "DecodeExperts",
    "ExpertCache",
    "GenerationConfig",
    "PruneConfig",
    "QuantConfig",
    "batch_generate",
    "collect_saliency",
    "compile_steps",
    "disable_fast_decode",
    "enable_fast_decode",
    "export_gguf",
    "export_onnx",
    "export_program",
    "load_onnx",
    "offload_experts",
    "prune_experts",
    "quantize_experts",
    "quantize_onnx_dynamic",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
