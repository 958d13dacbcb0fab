"""Training telemetry: routing statistics per MoE layer, and sinks the metrics go to.

A sink is anything with ``log(step, metrics)`` and ``close()`` (`MetricsSink`). The JSONL event file
(`JsonlSink`) is always on, so a dashboard or a later upload (the MLflow adapter) can read it; the console
sink draws a progress bar with rate and ETA on a terminal and prints plain log lines otherwise.

Metrics are flat ``name -> float``; per MoE layer ``moe/layer_<i>/<stat>``:
``drop_rate`` (routed slots dropped over capacity; for expert choice, whose slots are every expert, the
share of tokens no expert took), ``entropy`` (mean over tokens of -sum_e p log p, nats),
``max_over_mean_load`` (1.0 is perfect balance), ``expert_<e>_frac`` (fraction of routed slots, before
capacity, sent to expert e). Only numbers are logged: never text, tokens or weights.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
import warnings
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from moe_core.fileio import append_record, cut_torn_tail, disk_full_guard
from moe_core.progress import Progress
from moe_core.router_losses import slot_counts
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


RANK_FILE = "metrics.rank{rank}.jsonl"  # <out>/: a non-zero rank's own figures, beside rank 0's metrics.jsonl
# a rank's own figures, in every rank's row: its step time and throughput (a straggler is slower), peak memory,
# and its own training loss before the all-reduce (distributed runs only: `Trainer.train_step`)
RANK_KEYS = ("step_time_s", "tokens_per_s", "max_memory_mb", "rank_loss")


def reset_peak_memory(device: torch.device) -> None:
    """Start this run's peak memory afresh: a second run in the same process (a notebook, a sweep, a baseline
    trained beside its MoE, the GPU suite) must not report the first one's. CUDA: the allocator's peak; elsewhere
    the kernel's peak resident set (``VmHWM``), which Linux resets when "5" is written to /proc/self/clear_refs."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the figure stays the process's peak (see max_memory_mb)
        pass


def max_memory_mb(device: torch.device) -> float:
    """Peak memory since `reset_peak_memory`, MiB: the device's allocator peak on CUDA, else the peak resident set
    (``VmHWM`` from /proc/self/status; off Linux ``ru_maxrss``, the process's peak, which cannot be reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank_row(metrics: dict[str, float], rank: int) -> dict[str, float]:
    """The figures of logged row ``metrics`` that are rank ``rank``'s own (`RANK_KEYS`, and its
    ``comm/rank_<r>/...`` all-to-all time and bytes under their bare names), for its ``metrics.rank<r>.jsonl``:
    a slow rank (a straggler) shows as a longer step time there. Nothing here needs a collective: each rank
    measures its own, and `moe_core.train.parallel.comm_metrics` has already gathered the comm figures."""
    row = {key: metrics[key] for key in RANK_KEYS if key in metrics}
    prefix = f"comm/rank_{rank}/"
    row.update({key[len(prefix) :]: value for key, value in metrics.items() if key.startswith(prefix)})
    return row


class ConsoleSink:
    """The training progress display (`moe_core.progress.Progress`): one bar that moves every step, with rate,
    ETA and the last logged metrics as its postfix; when not on a terminal, one plain line per logging step
    (``step 40/150 (27%) 1.52 step/s, ETA 1m12s loss=3.2 ...``), and one when the first step of the process is
    done (``train: first step done, step 1/150 (1%) 0.4 step/s, ETA 6m``: a log file shows the run is alive
    long before step ``log_every``); a widget in a notebook. The trainer calls `on_step` after every optimizer
    step and `log` at logging steps."""

    SHOWN = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "val_loss")
    SHORT = {"tokens_per_s": "tok/s", "grad_norm": "gnorm"}

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        mode: str = "auto",
        stream=None,
        desc: str = "train",
        log_every: int = 1,
    ) -> None:
        self.total = total_steps
        self.log_every = log_every
        self.progress = Progress(
            total_steps, desc, unit="step", mode=mode, initial=start_step, stream=stream, every_s=math.inf
        )  # lines: one per logging step (log.every decides)
        self.mode = self.progress.mode
        self._first_step_due = True

    def on_step(self, step: int) -> None:
        self.progress.advance_to(step)
        if self._first_step_due:
            self._first_step_due = False
            if step % self.log_every and step < self.total:  # (a logging step prints its own line next)
                self.progress.print_line(f"train: first step done, step {step}/{self.total}")

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
ENTROPY_TOKENS = 512  # router entropy: averaged over an evenly strided sample of at most ~2x this many tokens


class RoutingStats:
    """Sums routing statistics over the steps between two log lines, per MoE layer.

    The sums live in one tensor ``[L, E + 3]`` (L = MoE layers, E = experts): routed slots per expert, then
    dropped slots, the sum of per-token entropies and the token count, so several ranks can all-reduce them
    in one call. They stay on the routing records' device and are read back once per logging step
    (`metrics`), never per micro-step: a ``.cpu()`` per layer per step would stall an accelerator
    4 x L times a step. The entropy is the mean over an evenly strided sample of each step's tokens (at
    most ~2 x `ENTROPY_TOKENS`): it is the only statistic that reads every ``[T, E]`` probability, and a
    full pass per layer per step cost more than the rest of the telemetry together at T = 4096, E = 128.
    """

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        self.sums_LX = torch.zeros(num_layers, num_experts + 3, dtype=torch.float64)
        self.last_sums_LX: torch.Tensor | None = None  # the interval last logged, on the CPU
        self._cpu_sums_LX: torch.Tensor | None = None  # `metrics`' read-back, kept by `reset`
        self._keys: dict[tuple, list[tuple[str, ...]]] = {}  # metric names per (layers, per_expert)

    @torch.no_grad()
    def add(self, records: tuple[RoutingRecord, ...]) -> None:
        if not records:
            return
        device = records[0].expert_ids_TK.device
        if self.sums_LX.device != device:  # first step on an accelerator: the sums move there (MPS: no fp64)
            dtype = torch.float32 if device.type == "mps" else torch.float64
            self.sums_LX = self.sums_LX.to(device, dtype)
        E = self.num_experts
        for i, record in enumerate(records):
            row = self.sums_LX[i]
            row[:E] += slot_counts(record.expert_ids_TK, E).to(row.dtype)
            if record.slots_are_choices:
                row[E] += record.dropped_TK.sum().to(row.dtype)
            else:  # expert choice: the tokens no expert took, on the scale of slots (K per token)
                row[E] += (record.dropped_tokens_T.sum() * record.dropped_TK.shape[-1]).to(row.dtype)
            probs_TE = record.probs_TE[:: max(1, record.probs_TE.shape[0] // ENTROPY_TOKENS)].float()
            # entropy of p / s per token (s = sum_e p: sigmoid scores do not sum to 1) without normalizing:
            # H = -sum (p/s) log(p/s) = sum entr(p) / s + log s, one fused pass over [T, E]
            s_T = probs_TE.sum(-1)
            entropy_T = torch.special.entr(probs_TE).sum(-1) / s_T + s_T.log()
            row[E + 1] += entropy_T.sum().to(row.dtype)
            row[E + 2] += probs_TE.shape[0]

    def loads(self) -> torch.Tensor:
        return self.sums_LX[:, : self.num_experts]

    def metrics(self, layer_ids: list[int], per_expert: bool = True) -> dict[str, float]:
        """The interval's statistics as flat metrics: one read-back of the sums, names built once per run."""
        E = self.num_experts
        sums_LX = self.sums_LX.detach().to("cpu", torch.float64, copy=True)
        self._cpu_sums_LX = sums_LX  # what `reset` keeps for the routing monitor, without a second copy
        table = sums_LX.numpy()
        slots_L = table[:, :E].sum(-1)
        names = self._keys.get((tuple(layer_ids), per_expert))
        if names is None:
            names = self._keys[(tuple(layer_ids), per_expert)] = [
                (
                    f"moe/layer_{layer}/drop_rate",
                    f"moe/layer_{layer}/entropy",
                    f"moe/layer_{layer}/max_over_mean_load",
                    *([f"moe/layer_{layer}/expert_{e}_frac" for e in range(E)] if per_expert else []),
                )
                for layer in layer_ids
            ]
        out: dict[str, float] = {}
        for i, keys in enumerate(names):
            slots = float(slots_L[i])
            if slots == 0:
                continue
            frac_E = table[i, :E] / slots
            stats = (
                float(table[i, E]) / slots,
                float(table[i, E + 1]) / max(float(table[i, E + 2]), 1.0),
                float(frac_E.max()) * E,
            )
            out.update(zip(keys, (*stats, *frac_E.tolist()) if per_expert else stats))
        return out

    def reset(self) -> None:
        cpu = self._cpu_sums_LX
        if cpu is None or cpu.shape != self.sums_LX.shape:  # not read back by `metrics` this interval
            cpu = self.sums_LX.detach().to("cpu", torch.float64, copy=True)
        self.last_sums_LX = cpu  # the interval just logged, for `alerts.RoutingMonitor`
        self._cpu_sums_LX = None
        self.sums_LX.zero_()
