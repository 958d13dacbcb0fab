"""Cost accounting: FLOPs per token, measured throughput, and what a token, an expert activation and a
training run cost on a given device.

FLOPs per token come from the lab's one FLOPs model, `moe_core.flops` (by component, from the config alone;
training = 3x forward, what the trainer's MFU counts).

Money: ``cost per 1M tokens = usd_per_hour / (tokens_per_s * 3600) * 1e6`` on one device. An expert
activation (one kept (token, slot) assignment) is charged its FLOP share: ``cost_per_token *
expert_flops / forward_flops / activations_per_token``. The saving against the dense model with as many
parameters as all experts together (`dense_baseline(config, "total")`) assumes the same FLOP throughput
(model FLOPs utilization) for both, so it is the FLOP ratio applied to the measured cost.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe_core.config import MoEConfig, dense_baseline
from moe_core.errors import MoELabError
from moe_core.flops import FlopsBreakdown, flops_per_token
from moe_core.train.telemetry import read_jsonl

# Rough on-demand cloud prices, USD per device-hour (one accelerator with its share of the host; "cpu" is a
# whole 8-vCPU general-purpose VM), as listed by the large clouds and GPU clouds in 2025. Ballpark defaults
# for comparing models, not quotes: pass your own rates with PriceTable(...) or PriceTable.from_file(path).
DEFAULT_USD_PER_HOUR: dict[str, float] = {
    "cpu": 0.40,
    "t4": 0.50,
    "l4": 0.80,
    "a10g": 1.20,
    "l40s": 1.90,
    "a100": 2.50,
    "h100": 4.00,
    "h200": 5.00,
}


class CostError(MoELabError):
    """A price or usage that cannot be costed (unknown device, non-positive throughput)."""


@dataclass(frozen=True)
class PriceTable:
    """USD per device-hour by device name (case-insensitive). Defaults: `DEFAULT_USD_PER_HOUR`."""

    usd_per_hour: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_USD_PER_HOUR))

    def __post_init__(self) -> None:
        for name, price in self.usd_per_hour.items():
            if not isinstance(price, (int, float)) or not math.isfinite(price) or price < 0:
                raise ValueError(f"PriceTable.usd_per_hour[{name!r}]={price!r}: must be a finite number >= 0")

    def price(self, device: str) -> float:
        table = {k.lower(): v for k, v in self.usd_per_hour.items()}
        key = device.lower()
        if key in table:
            return float(table[key])
        for name in sorted(table, key=len, reverse=True):  # "NVIDIA H100 80GB HBM3" -> "h100"
            if name in key:
                return float(table[name])
        raise CostError(
            f"no price for device {device!r}; known: {sorted(table)}. Add it to the price table "
            "(PriceTable(usd_per_hour={...}) or --price-table prices.json)"
        )

    @classmethod
    def from_file(cls, path: str | Path, merge_defaults: bool = True) -> PriceTable:
        """A JSON object ``{"h100": 3.1, ...}``, added to (or, with merge_defaults=False, replacing) the defaults."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise CostError(
                f"{path}: not valid JSON ({err.msg} at line {err.lineno}); expected "
                '{"device": usd_per_hour, ...}'
            ) from None
        if not isinstance(data, dict):
            raise CostError(f'{path}: expected a JSON object {{"device": usd_per_hour, ...}}')
        base = dict(DEFAULT_USD_PER_HOUR) if merge_defaults else {}
        return cls({**base, **{str(k).lower(): float(v) for k, v in data.items()}})


# ------------------------------------------------------------------------------------------------ throughput
@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    tokens: int
    seconds: float
    device: str
    batch_size: int
    seq_len: int


@torch.no_grad()
def measure_throughput(
    model, batch_size: int = 4, seq_len: int = 128, steps: int = 5, warmup: int = 1, seed: int = 0
) -> Throughput:
    """Forward-pass tokens per second on random token ids, in eval mode (no router state moves).

    A measurement, not a benchmark: run it on an otherwise idle device; the mode is restored afterwards.
    """
    if min(batch_size, seq_len, steps) < 1 or warmup < 0:
        raise ValueError("measure_throughput: batch_size, seq_len and steps must be >= 1, warmup >= 0")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids_BS = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=generator).to(device)
    was_training = model.training
    model.eval()
    try:
        for _ in range(warmup):
            model(ids_BS, use_cache=False)
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            model(ids_BS, use_cache=False)
        _sync(device)
        seconds = time.perf_counter() - start
    finally:
        model.train(was_training)
    tokens = batch_size * seq_len * steps
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return Throughput(tokens / max(seconds, 1e-9), tokens, seconds, name, batch_size, seq_len)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ money
def cost_per_million_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    """``usd_per_hour / (tokens_per_s * 3600) * 1e6``."""
    if not tokens_per_s > 0:
        raise CostError(f"tokens_per_s={tokens_per_s!r}: throughput must be positive to cost a token")
    return usd_per_hour / (tokens_per_s * 3600.0) * 1e6


@dataclass(frozen=True)
class TrainingUsage:
    """What a training run used so far: from the trainer's summary, its event file, or by hand."""

    tokens: int
    wall_seconds: float
    device: str
    num_devices: int = 1

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.wall_seconds < 0 or self.num_devices < 1:
            raise ValueError(
                f"TrainingUsage{(self.tokens, self.wall_seconds, self.num_devices)}: tokens and "
                "wall_seconds must be >= 0, num_devices >= 1"
            )


def usage_from_events(path: str | Path, device: str, num_devices: int = 1) -> TrainingUsage:
    """Tokens and wall time from a training JSONL event file (rows with ``time`` and ``tokens``).

    Wall time is last minus first logged ``time``: it misses the steps before the first log line.
    """
    rows = read_jsonl(path)  # the one JSONL reader: a torn last line (crash, full disk) is left out
    times = [float(r["time"]) for r in rows if isinstance(r.get("time"), (int, float))]
    tokens = [float(r["tokens"]) for r in rows if isinstance(r.get("tokens"), (int, float))]
    if not times or not tokens:
        raise CostError(
            f"{path}: no rows with both 'time' and 'tokens'; pass tokens and seconds by hand "
            "(--train-tokens, --train-seconds)"
        )
    return TrainingUsage(int(max(tokens)), max(times) - min(times), device, num_devices)


@dataclass(frozen=True)
class TrainingCost:
    usage: TrainingUsage
    usd_per_hour: float
    device_hours: float
    usd: float
    usd_per_million_tokens: float | None
    flops: float  # training FLOPs spent: tokens * training_active

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.usage), **{k: v for k, v in asdict(self).items() if k != "usage"}}


def training_cost(
    usage: TrainingUsage, config: MoEConfig, seq_len: int, prices: PriceTable | None = None
) -> TrainingCost:
    prices = prices or PriceTable()
    usd_per_hour = prices.price(usage.device)
    device_hours = usage.wall_seconds / 3600.0 * usage.num_devices
    usd = device_hours * usd_per_hour
    per_million = usd / usage.tokens * 1e6 if usage.tokens else None
    flops = usage.tokens * flops_per_token(config, seq_len).training_active
    return TrainingCost(usage, usd_per_hour, device_hours, usd, per_million, flops)


@dataclass(frozen=True)
class CostReport:
    device: str
    usd_per_hour: float
    tokens_per_s: float
    flops: FlopsBreakdown
    usd_per_million_tokens: float
    expert_activations_per_token: float
    usd_per_million_expert_activations: float | None
    dense_total_flops_per_token: float | None  # forward FLOPs of dense_baseline(config, "total")
    flop_saving: float | None  # 1 - active / dense-equal-total forward FLOPs
    dense_total_usd_per_million_tokens: float | None
    training: TrainingCost | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("flops", "training")}
        out["flops"] = self.flops.to_dict()
        out["training"] = self.training.to_dict() if self.training else None
        return out

    def _repr_markdown_(self) -> str:  # a notebook shows the table
        return self.to_markdown()

    def to_markdown(self) -> str:
        f = self.flops
        gf = _flops_text
        rows = [
            ("device", self.device),
            ("USD per device-hour", f"{self.usd_per_hour:.2f}"),
            ("throughput, tokens/s (forward)", f"{self.tokens_per_s:,.0f}"),
            ("forward FLOPs/token, active", gf(f.forward_active)),
            ("forward FLOPs/token, total (all experts)", gf(f.forward_total)),
            ("  attention (proj + scores)", gf(f.attention)),
            ("  experts active (routed + shared)", gf(f.experts)),
            ("training FLOPs/token", gf(f.training_active)),
            ("USD per 1M tokens", f"{self.usd_per_million_tokens:.4f}"),
            ("expert activations per token", f"{self.expert_activations_per_token:g}"),
        ]
        if self.usd_per_million_expert_activations is not None:
            rows.append(("USD per 1M expert activations", f"{self.usd_per_million_expert_activations:.4f}"))
        if self.flop_saving is not None:
            rows += [
                ("dense-equal-total FLOPs/token", gf(self.dense_total_flops_per_token)),
                (
                    "dense-equal-total USD per 1M tokens (same MFU)",
                    f"{self.dense_total_usd_per_million_tokens:.4f}",
                ),
                ("saving vs dense-equal-total", f"{100 * self.flop_saving:.1f}%"),
            ]
        if self.training is not None:
            t = self.training
            rows += [
                ("training tokens to date", f"{t.usage.tokens:,}"),
                ("training device-hours", f"{t.device_hours:.3f}"),
                ("training cost, USD", f"{t.usd:.2f}"),
            ]
        lines = ["| quantity | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
        return "\n".join(lines)


def _flops_text(value: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if value >= scale:
            return f"{value / scale:.3f} {unit}"
    return f"{value:.0f} FLOP"


def cost_report(
    config: MoEConfig,
    tokens_per_s: float,
    device: str,
    seq_len: int | None = None,
    prices: PriceTable | None = None,
    drop_rate: float = 0.0,
    training: TrainingUsage | None = None,
) -> CostReport:
    """What a token costs on ``device`` at the measured forward throughput ``tokens_per_s``.

    ``drop_rate`` (from a router profile) lowers the expert activations per token: dropped slots cost no
    expert FLOPs.
    """
    prices = prices or PriceTable()
    seq_len = seq_len or config.max_position_embeddings
    usd_per_hour = prices.price(device)
    flops = flops_per_token(config, seq_len)
    per_million = cost_per_million_tokens(usd_per_hour, tokens_per_s)
    activations = config.num_experts_per_tok * len(config.moe_layer_ids) * (1.0 - drop_rate)
    per_activation = None
    if activations > 0:
        # FLOP-proportional share of a token's cost, split over its expert activations
        per_activation = per_million * flops.experts_active / flops.forward_active / activations
    dense_flops = saving = dense_cost = None
    if config.num_experts > 0:
        dense_flops = flops_per_token(dense_baseline(config, "total"), seq_len).forward_active
        saving = 1.0 - flops.forward_active / dense_flops
        dense_cost = per_million * dense_flops / flops.forward_active
    train = training_cost(training, config, seq_len, prices) if training is not None else None
    return CostReport(
        device=device,
        usd_per_hour=usd_per_hour,
        tokens_per_s=tokens_per_s,
        flops=flops,
        usd_per_million_tokens=per_million,
        expert_activations_per_token=activations,
        usd_per_million_expert_activations=per_activation,
        dense_total_flops_per_token=dense_flops,
        flop_saving=saving,
        dense_total_usd_per_million_tokens=dense_cost,
        training=train,
    )
