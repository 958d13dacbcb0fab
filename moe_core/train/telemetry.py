"""Training telemetry: routing statistics per MoE layer, and sinks the metrics go to.

A sink is anything with ``log(step, metrics)`` and ``close()`` (`MetricsSink`). The JSONL event file
(`JsonlSink`) is always on, so a dashboard or a later upload (the MLflow adapter) can read it; the console
sink draws a progress bar with rate and ETA on a terminal and prints plain log lines otherwise.

Metrics are flat ``name -> float``; per MoE layer ``moe/layer_<i>/<stat>``:
``drop_rate`` (routed slots dropped over capacity), ``entropy`` (mean over tokens of -sum_e p log p, nats),
``max_over_mean_load`` (1.0 is perfect balance), ``expert_<e>_frac`` (fraction of routed slots, before
capacity, sent to expert e). Only numbers are logged: never text, tokens or weights.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from moe_core.fileio import append_record, cut_torn_tail, disk_full_guard
from moe_core.routing import RoutingRecord


@runtime_checkable
class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: ``{"step": 10, "time": 1712.3, "loss": 3.2, ...}``; appends on resume.

    Each line goes out in one append that is all or nothing (`moe_core.fileio.append_record`: a full disk cuts the
    partial line back off and raises `DiskFullError`), so readers never meet a torn record we left. Opening the
    file cuts a torn tail left by a crash; with ``start_step`` (a resume) rows past that step are dropped, since
    the run repeats those steps.
    """

    def __init__(self, path: str | Path, start_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut_torn_tail(self.path)
        if start_step is not None and self.path.is_file():
            _drop_rows_after(self.path, start_step)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        row.update({k: _finite_or_str(v) for k, v in metrics.items()})
        append_record(self._fd, (json.dumps(row) + "\n").encode(), self.path)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _drop_rows_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without the rows logged after ``step``."""
    lines = path.read_bytes().splitlines(keepends=True)
    kept = [line for line in lines if (row := _parse(line)) is None or row.get("step", 0) <= step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with disk_full_guard(tmp):
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, path)


def _finite_or_str(value: float):
    value = float(value)
    return value if math.isfinite(value) else str(value)  # JSON has no NaN/Inf


def _parse(line: bytes | str) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSONL event file. A torn last line (a crash or a full disk while a writer appended) is left
    out; a damaged line elsewhere is left out with a warning naming the file and line."""
    lines = Path(path).read_bytes().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = _parse(line)
        if row is None:
            if number != len(lines):
                warnings.warn(f"{path}:{number}: not a JSON object; line skipped", stacklevel=2)
            continue
        rows.append(row)
    return rows


class ConsoleSink:
    """The training progress display (`moe_core.progress.Progress`): one bar that moves every step, with rate,
    ETA and the last logged metrics as its postfix; when not on a terminal, one plain line per logging step
    (``step 40/150 (27%) 1.52 step/s, ETA 1m12s loss=3.2 ...``); a widget in a notebook. The trainer calls
    `on_step` after every optimizer step and `log` at logging steps."""

    SHOWN = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "val_loss")
    SHORT = {"tokens_per_s": "tok/s", "grad_norm": "gnorm"}

    def __init__(
        self, total_steps: int, start_step: int = 0, mode: str = "auto", stream=None, desc: str = "train"
    ) -> None:
        from moe_core.progress import Progress

        self.total = total_steps
        self.progress = Progress(
            total_steps, desc, unit="step", mode=mode, initial=start_step, stream=stream, every_s=math.inf
        )  # lines: one per logging step (log.every decides)
        self.mode = self.progress.mode

    def on_step(self, step: int) -> None:
        self.progress.advance_to(step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = {self.SHORT.get(k, k): metrics[k] for k in self.SHOWN if k in metrics}
        if "tok/s" in shown:
            shown["tok/s"] = f"{shown['tok/s']:.0f}"
        self.progress.set_postfix(**shown)
        self.progress.advance_to(step)
        self.progress.print_line(f"step {step}/{self.total}")

    def close(self) -> None:
        self.progress.close(final_line=False)  # the last logging step printed it


# ------------------------------------------------------------------------------------------------ routing
class RoutingStats:
    """Sums routing statistics over the steps between two log lines, per MoE layer.

    The sums live in one float64 tensor per layer, ``[E + 3]``: routed slots per expert, then dropped slots,
    the sum of per-token entropies and the token count, so several ranks can all-reduce them in one call.
    """

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.sums_LX = torch.zeros(num_layers, num_experts + 3, dtype=torch.float64)

    @torch.no_grad()
    def add(self, records: tuple[RoutingRecord, ...]) -> None:
        for i, record in enumerate(records):
            E = self.num_experts
            row = self.sums_LX[i]
            row[:E] += torch.bincount(record.expert_ids_TK.flatten(), minlength=E).double().cpu()
            row[E] += record.dropped_TK.sum().double().cpu()
            probs_TE = record.probs_TE.float()
            probs_TE = probs_TE / probs_TE.sum(-1, keepdim=True)  # sigmoid scores: normalize per token
            entropy_T = -(probs_TE * probs_TE.clamp_min(1e-12).log()).sum(-1)
            row[E + 1] += entropy_T.sum().double().cpu()
            row[E + 2] += probs_TE.shape[0]

    def loads(self) -> torch.Tensor:
        return self.sums_LX[:, : self.num_experts]

    def metrics(self, layer_ids: list[int], per_expert: bool = True) -> dict[str, float]:
        out: dict[str, float] = {}
        E = self.num_experts
        for i, layer in enumerate(layer_ids):
            row = self.sums_LX[i]
            slots = row[:E].sum().item()
            if slots == 0:
                continue
            frac_E = row[:E] / slots
            prefix = f"moe/layer_{layer}/"
            out[prefix + "drop_rate"] = row[E].item() / slots
            out[prefix + "entropy"] = row[E + 1].item() / max(row[E + 2].item(), 1.0)
            out[prefix + "max_over_mean_load"] = (frac_E.max() * E).item()
            if per_expert:
                for e in range(E):
                    out[prefix + f"expert_{e}_frac"] = frac_E[e].item()
        return out

    def reset(self) -> None:
        self.last_sums_LX = self.sums_LX.clone()  # the interval just logged, for `alerts.RoutingMonitor`
        self.sums_LX.zero_()
