"""optimum's own GPTQ route (`quantize_optimum_gptq`, ``optimum.gptq.GPTQQuantizer``).

It runs on the model's Hugging Face architecture and needs a CUDA GPU with ``gptqmodel``/``auto-gptq``;
`optimum_gptq_available` says whether this machine has them. Not exercised here: no GPU was lent to this
project's sessions. Our own ``method="gptq"`` (`calibrated`) runs on a CPU.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from moe_core.convert import copy_companion_files, to_hf
from moe_core.fileio import atomic_directory, check_output_dir
from moe_core.loading import load
from moe_core.quantized import QuantizationError


def optimum_gptq_available() -> bool:
    """optimum's GPTQ route needs a CUDA GPU and the gptqmodel (or auto-gptq) backend."""
    return torch.cuda.is_available() and any(
        importlib.util.find_spec(name) is not None for name in ("gptqmodel", "auto_gptq")
    )


def quantize_optimum_gptq(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    calibration: list[torch.Tensor] | None,
    *,
    bits: int = 4,
    group_size: int = 128,
    architecture: str | None = None,
    overwrite: bool = False,
) -> Path:
    """optimum's GPTQ (``optimum.gptq.GPTQQuantizer``) on a GPU, written as a Hugging Face GPTQ checkpoint.

    optimum quantizes ``nn.Linear`` modules; our experts are stacked parameters, so the model goes through
    its Hugging Face architecture first (`moe_core.convert.to_hf`, one
    ``nn.Linear`` per expert projection), is quantized there block by block on ``calibration`` (token-id
    batches [B, S]), and is refused if any expert projection stayed in float. The result loads with
    ``AutoModelForCausalLM.from_pretrained`` on a machine with the same backend. Rarely routed experts get
    few calibration rows here (GPTQ's dampening keeps them well-posed); our own ``method="gptq"`` force-routes
    them instead and runs on a CPU. The output is staged (complete or not at all); a non-empty ``out_dir`` is
    replaced only with ``overwrite``."""
    if not optimum_gptq_available():
        raise QuantizationError(
            "optimum's GPTQ route needs a CUDA GPU and the gptqmodel backend (pip install gptqmodel); "
            f"this machine has cuda={torch.cuda.is_available()}. Use --method gptq (ours, runs on a CPU)."
        )
    from optimum.gptq import GPTQQuantizer  # lazy: optional heavy dependency, it imports its GPU backend

    if not calibration:
        raise QuantizationError(
            "optimum GPTQ calibrates on real text: pass --data DIR (a prepared-data directory)"
        )
    check_output_dir(out_dir, overwrite, QuantizationError)  # before anything expensive
    model = load(model_dir, dtype=torch.float32, merged=True).model  # a fine-tune's adapter merged in
    with (
        tempfile.TemporaryDirectory(prefix="moe_gptq_") as tmp,
        atomic_directory(out_dir, overwrite, QuantizationError) as staging,
    ):
        to_hf(model, Path(tmp) / "hf", architecture)
        del model
        hf = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float16, device_map="cuda")
        dataset = [
            {"input_ids": row[None], "attention_mask": torch.ones_like(row)[None]}
            for batch in calibration
            for row in batch
        ]
        quantizer = GPTQQuantizer(
            bits=bits,
            dataset=dataset,
            group_size=group_size,
            block_name_to_quantize="model.layers",
            model_seqlen=calibration[0].shape[-1],
        )
        hf = quantizer.quantize_model(hf, tokenizer=None)
        left = [
            name for name, module in hf.named_modules() if type(module) is nn.Linear and ".experts." in name
        ]
        if left:
            raise QuantizationError(
                f"optimum GPTQ left {len(left)} expert projections in float "
                f"(e.g. {left[:3]}); refusing a partly quantized checkpoint"
            )
        quantizer.save(hf, str(staging))
        copy_companion_files(model_dir, staging)
    return Path(out_dir)
