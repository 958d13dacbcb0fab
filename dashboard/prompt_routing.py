"""The token-to-expert view's data: a run's model routing the project's prompt set
(`moe_core.analytics.token_routing.prompt_set_routing`), per prompt, token and MoE layer.

The model is the run's exported ``final/`` model, else its newest complete checkpoint (the rule of
`moe_core.load` for a run directory), read with `moe_core.load` on the CPU. Loading and a forward pass take a
second or more, so the view is computed once per (model directory, newest file time) on one worker thread
and cached; requests wait a little for it and otherwise get "computing" and ask again. Only the prompt set's
own text is shown (the project's prompts, `moe_core.eval.prompts`), never training data or user text.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path

from dashboard.runs import RunData, is_inside
from moe_core.analytics.token_routing import prompt_set_routing
from moe_core.errors import MoELabError
from moe_core.loading import load
from moe_core.train.checkpoint import latest_checkpoint

MAX_CACHED = 4  # models' views kept (each is a few hundred KB of numbers)


class NoModelError(MoELabError):
    """The run has no exported model and no complete checkpoint yet."""


def model_dir(run: RunData) -> Path:
    """The directory `moe_core.load` takes a run's model from: ``final/`` once exported, else the newest
    complete checkpoint; inside the runs root, or `NoModelError`."""
    final = run.path / "final"
    found = final if (final / "config.json").is_file() else latest_checkpoint(run.path / "checkpoints")
    if found is None or not is_inside(found, run.root):
        raise NoModelError(
            f"run {run.name!r} has no exported model (final/) or complete checkpoint yet; the token-to-expert "
            "view appears after its first checkpoint"
        )
    return found


def _stamp(directory: Path) -> float:
    """The newest modification time under ``directory``: a rewritten model (or a tokenizer saved beside it)
    gives a new cache key."""
    return max([directory.stat().st_mtime, *(p.stat().st_mtime for p in directory.rglob("*") if p.is_file())])


def _compute(directory: Path) -> dict:
    # torch's own thread count is left alone: it is process-wide, and `moe-lab train --dashboard` may share it
    loaded = load(directory, device="cpu")
    view = prompt_set_routing(loaded.model, loaded.tokenizer)
    return {**view, "model": {"kind": loaded.kind, "dir": directory.name}}


class PromptRoutingCache:
    """Views by (model directory, stamp), computed on one worker thread; a failure is cached like a result, so
    a model without a tokenizer is not reloaded on every request."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-routing")
        self._lock = threading.Lock()
        self._futures: dict[tuple[str, float], concurrent.futures.Future] = {}

    def get(self, run: RunData, wait_s: float) -> dict | None:
        """The run's view, or None while it is still computing after ``wait_s`` seconds. Raises
        `NoModelError`, or the `MoELabError` its computation raised."""
        directory = model_dir(run)
        key = (str(directory), _stamp(directory))
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                future = self._futures[key] = self._pool.submit(_compute, directory)
                while len(self._futures) > MAX_CACHED:
                    self._futures.pop(next(iter(self._futures)))
        try:
            return future.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            return None
