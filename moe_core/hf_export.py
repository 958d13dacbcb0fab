"""`moe-lab convert to-hf`: any checkpoint `moe_core.load` reads, written as a Hugging Face checkpoint.

    from moe_core.hf_export import convert_to_hf
    convert_to_hf("runs/a/final", "runs/a/hf", architecture="mixtral")

It sits above the loader, which sits above the format readers in `moe_core.convert` (`from_hf`, `to_hf`); the
writing itself is `moe_core.convert.to_hf` (staged: the output appears complete or not at all). A fine-tune's output
that holds its adapter alone is written from its base memory-mapped, the adapter merged into each expert
projection as it is written (`moe_core.finetune.export.merged_for_writing`): the merged model is never in memory.
"""

from __future__ import annotations

import os
from pathlib import Path

from moe_core.convert import ConversionError, to_hf
from moe_core.fileio import check_output_dir
from moe_core.loading import adapter_to_merge, detect, load, merges_as_written, tokenizer_dir


def convert_to_hf(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    architecture: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Our checkpoint directory (any kind `moe_core.load` reads, in its stored dtype) written as a HF
    checkpoint, tokenizer files included."""
    check_output_dir(out_dir, overwrite, ConversionError)  # before anything expensive
    kind = detect(Path(source).expanduser())
    if kind == "hf":
        raise ConversionError(
            f"{source} is a Hugging Face checkpoint already; use from_hf / `moe-lab convert from-hf` to bring it in"
        )
    if kind == "quantized":
        raise ConversionError(f"{source} is quantized; convert the full-precision checkpoint it came from")
    if kind == "finetuned" and merges_as_written(source):
        # a fine-tune's adapter alone: merged into its memory-mapped base's experts as they are written, the
        # merged model never in memory (its copy of the full Qwen1.5-MoE-A2.7B would be 26.7 GiB)
        from moe_core.finetune.export import merged_for_writing  # peft: for adapters only
        from moe_core.mapped import MappedExperts, stacked_tensors

        model, deltas = merged_for_writing(adapter_to_merge(source))
        mapped = any(isinstance(m, MappedExperts) for m in model.modules())
        return to_hf(
            model,
            out_dir,
            architecture,
            tokenizer_dir=tokenizer_dir(source),
            overwrite=overwrite,
            tensors=stacked_tensors(model, deltas) if mapped else None,
        )
    loaded = load(source, merged=True)  # weights written out: a fine-tune's adapter merged in
    # a training checkpoint keeps no tokenizer files of its own: it names its data's tokenizer
    return to_hf(
        loaded.model,
        out_dir,
        architecture,
        tokenizer_dir=loaded.tokenizer_dir or loaded.path,
        overwrite=overwrite,
    )
