"""Live figures of a model in use, for the dashboard's Inference page: numbers only, never prompts or text.

`InferenceMonitor` counts generated tokens through `batch_generate`'s ``on_token`` hook and, at most every
``every_s`` seconds, appends a row to ``<out_dir>/inference.jsonl`` (the same `JsonlSink` format as training
telemetry; ``step`` is the number of tokens generated so far):

    tokens_per_s        over the last interval          tokens          generated so far
    cache_hit_rate      expert cache hits / requests    cache_hits, cache_misses, prefetch_hits
    rerouted_tokens     slots sent to another expert because theirs could not be loaded (cache fallbacks)
    experts_resident    experts held in the cache now
"""

from __future__ import annotations

import time
from pathlib import Path

from moe_core.train.telemetry import JsonlSink

EVENTS = "inference.jsonl"


class InferenceMonitor:
    def __init__(self, out_dir: str | Path, cache=None, every_s: float = 0.5) -> None:
        self.sink = JsonlSink(Path(out_dir) / EVENTS)
        self.cache, self.every_s = cache, every_s
        self.tokens = 0
        self._last_t, self._last_tokens = time.perf_counter(), 0

    def on_token(self, _prompt: int, _token: int, _text: str | None) -> None:
        self.tokens += 1
        if time.perf_counter() - self._last_t >= self.every_s:
            self.flush()

    def flush(self) -> None:
        now = time.perf_counter()
        seconds = max(now - self._last_t, 1e-9)
        row = {"tokens": float(self.tokens), "tokens_per_s": (self.tokens - self._last_tokens) / seconds}
        if self.cache is not None:
            s = self.cache.stats
            row.update(
                cache_hit_rate=s.hit_rate,
                cache_hits=float(s.hits),
                cache_misses=float(s.misses),
                prefetch_hits=float(s.prefetch_hits),
                rerouted_tokens=float(s.fallbacks),
                experts_resident=float(len(self.cache.resident)),
            )
        self.sink.log(self.tokens, row)
        self._last_t, self._last_tokens = now, self.tokens

    def close(self) -> None:
        if self.tokens != self._last_tokens:
            self.flush()
        self.sink.close()
