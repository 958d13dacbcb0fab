"""Inference optimization, applied to a model from outside the model file.

- `fast_decode`: a decode path that reads only the chosen experts' weights (`enable_fast_decode`).
- `onnx_export`: ONNX through optimum-onnx with a KV cache; `load_onnx` gives an `ORTModelForCausalLM`.
- `compile`: ``torch.compile`` of the prefill and decode steps (dynamic or static KV cache), ``torch.export``.
- `quantize`: weight-only int8/int4 experts (round-to-nearest, GPTQ, AWQ) and ONNX Runtime dynamic int8.
- `prune`: drop (or merge) experts ranked by routed slots or by REAP saliency.
- `gguf_export`: a Hugging Face Mixtral directory as GGUF for llama.cpp.
- `expert_cache`: experts on disk, an LRU of resident experts, graceful degradation.
- `generate`: batched generation with padding-aware scheduling and streaming.
- `cli`: ``moe-lab export onnx|gguf``, ``quantize``, ``prune``, ``generate``.

Submodules are imported on use; importing this package loads nothing heavy.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "enable_fast_decode": "fast_decode",
    "disable_fast_decode": "fast_decode",
    "DecodeExperts": "fast_decode",
    "export_onnx": "onnx_export",
    "load_onnx": "onnx_export",
    "quantize_experts": "quantize",
    "QuantConfig": "quantize",
    "quantize_onnx_dynamic": "quantize",
    "prune_experts": "prune",
    "PruneConfig": "prune",
    "collect_saliency": "prune",
    "export_gguf": "gguf_export",
    "ExpertCache": "expert_cache",
    "offload_experts": "expert_cache",
    "batch_generate": "generate",
    "GenerationConfig": "generate",
    "compile_steps": "compile",
    "export_program": "compile",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"moe_core.inference.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'moe_core.inference' has no attribute {name!r}")
