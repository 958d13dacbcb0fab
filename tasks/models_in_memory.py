"""The models a flow run's tasks share in one process: each model directory is read from disk once.

Tasks still pass paths to each other (a task can run in another process, and a retry must find its input);
this cache only saves the reloads when they run in the same process, as the lifecycle's tasks do (its export
is evaluated, profiled and priced: one read instead of three; MLflow logs its files, unread). A cached model is shared:
tasks use it for inference only (evaluation restores train/eval mode, profiling removes its hooks); a stage
that changes a model (quantization, pruning, ONNX export) loads its own copy through `moe_core.load`.

The key is the directory and the size and mtime of every file in it, so a directory rewritten in place (a
resumed run's new export) is read again. At most `KEEP` models are kept; `forget()` drops them all (a
top-level flow does so when it ends).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from moe_core.loading import Loaded, load

KEEP = 2  # the candidate and one baseline: what the lifecycle evaluates side by side
_models: OrderedDict[tuple, Loaded] = OrderedDict()
_lock = threading.Lock()


def get(model_dir: str | Path) -> Loaded:
    """``moe_core.load(model_dir, dtype=float32)`` on the CPU, read once per process while unchanged."""
    key = _key(Path(model_dir))
    with _lock:
        if key in _models:
            _models.move_to_end(key)
            return _models[key]
        loaded = load(model_dir, dtype=torch.float32)
        _models[key] = loaded
        while len(_models) > KEEP:
            _models.popitem(last=False)
        return loaded


def forget() -> None:
    with _lock:
        _models.clear()


def _key(directory: Path) -> tuple:
    directory = directory.resolve()
    files = sorted(p for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else []
    return (str(directory), tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))
