"""Is a saved model's every weight a finite number? A diverged run can write NaN or inf tensors that still
load and generate (garbage); nothing downstream may register or serve such a model."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def nonfinite_tensors(model_dir: str | Path) -> dict[str, int]:
    """``{tensor name: count of NaN/inf values}`` over every ``*.safetensors`` file of ``model_dir``
    (empty when all are finite). Reads one tensor at a time, never unpickles."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights to check")
    bad: dict[str, int] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and (n := int((~torch.isfinite(tensor)).sum())):
                    bad[name] = n
    return bad
