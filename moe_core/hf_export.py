"""`moe-lab convert to-hf`: any checkpoint `moe_core.load` reads, written as a Hugging Face checkpoint.

    from moe_core.hf_export import convert_to_hf
    convert_to_hf("runs/a/final", "runs/a/hf", architecture="mixtral")

It sits above the loader, which sits above the format readers in `moe_core.convert` (`from_hf`, `to_hf`); the
writing itself is `moe_core.convert.to_hf` (staged: the output appears complete or not at all).
"""

from __future__ import annotations

import os
from pathlib import Path

from moe_core.convert import ConversionError, to_hf
from moe_core.fileio import check_output_dir
from moe_core.loading import detect, load


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
    loaded = load(source, merged=True)  # weights written out: a fine-tune's adapter merged in
    # a training checkpoint keeps no tokenizer files of its own: it names its data's tokenizer
    tokenizer_dir = loaded.tokenizer_dir or loaded.path
    return to_hf(loaded.model, out_dir, architecture, tokenizer_dir=tokenizer_dir, overwrite=overwrite)
