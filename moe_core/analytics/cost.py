"""Cost accounting: FLOPs per token, measured throughput, and what a token, an expert activation and a
training run cost on a given device.

FLOPs per token, forward pass, from the config alone (`flops_per_token`); a matmul of an [n, m] weight
costs 2*n*m FLOPs per token (Kaplan et al. 2020), norms, softmax, RoPE and dispatch bookkeeping are left out:

- attention projections: ``2 * D * Hd * (2H + 2G)`` per layer (q, o: H heads; k, v: G kv heads);
- attention scores: ``2 * 2 * S * H * Hd`` per layer (QK^T and AV over a context of S tokens, not halved
  for causality, as PaLM appendix B counts it);
- dense FFN layers: ``2 * ffn_params``; MoE layers: router ``2 * D * E``, routed experts
  ``2 * K * expert_params`` active (``2 * E * expert_params`` if every expert ran on every token: the
  ``total`` column, what the dense-equal-total model pays), shared experts and their gate;
- LM head ``2 * D * V`` (the input embedding is a lookup).

Training costs 3x the forward (backward = 2x forward), so ``training = 6 * N_active + 12 * L * H * Hd * S``,
the same count as ``moe_core.train.flops``.

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


# ------------------------------------------------------------------------------------------------ FLOPs
@dataclass(frozen=True)
class FlopsBreakdown:
    """Forward FLOPs per token by component (see the module docstring)."""

    attention_proj: float
    attention_scores: float
    dense_ffn: float
    router: float
    experts_active: float
    experts_total: float  # every routed expert on every token
    shared_experts: float
    lm_head: float
    seq_len: int

    @property
    def attention(self) -> float:
        return self.attention_proj + self.attention_scores

    @property
    def experts(self) -> float:
        """Active routed + shared expert FLOPs (the MoE FFN part of the forward)."""
        return self.experts_active + self.shared_experts

    @property
    def forward_active(self) -> float:
        return (
            self.attention
            + self.dense_ffn
            + self.router
            + self.experts_active
            + self.shared_experts
            + self.lm_head
        )

    @property
    def forward_total(self) -> float:
        return (
            self.attention
            + self.dense_ffn
            + self.router
            + self.experts_total
            + self.shared_experts
            + self.lm_head
        )

    @property
    def training_active(self) -> float:
        return 3.0 * self.forward_active

    def to_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "attention": self.attention,
            "experts": self.experts,
            "forward_active": self.forward_active,
            "forward_total": self.forward_total,
            "training_active": self.training_active,
        }


def _ffn_matrix_params(config: MoEConfig, width: int) -> int:
    return (3 if config.ffn_activation == "swiglu" else 2) * config.hidden_size * width


def flops_per_token(config: MoEConfig, seq_len: int) -> FlopsBreakdown:
    """Forward FLOPs per token of ``config`` at context length ``seq_len``, by component."""
    if seq_len < 1:
        raise ValueError(f"flops_per_token: seq_len={seq_len} must be >= 1")
    D, H, G, Hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    L = config.num_hidden_layers
    moe_layers = len(config.moe_layer_ids)
    dense_layers = L - moe_layers
    expert = _ffn_matrix_params(config, config.expert_intermediate_size) if moe_layers else 0
    shared = 0
    if moe_layers and config.num_shared_experts:
        shared = config.num_shared_experts * _ffn_matrix_params(
            config, config.shared_expert_intermediate_size
        )
        shared += D if config.shared_expert_gate else 0
    return FlopsBreakdown(
        attention_proj=2.0 * D * Hd * (2 * H + 2 * G) * L,
        attention_scores=2.0 * 2 * seq_len * H * Hd * L,
        dense_ffn=2.0 * _ffn_matrix_params(config, config.intermediate_size) * dense_layers,
        router=2.0 * D * config.num_experts * moe_layers,
        experts_active=2.0 * config.num_experts_per_tok * expert * moe_layers,
        experts_total=2.0 * config.num_experts * expert * moe_layers,
        shared_experts=2.0 * shared * moe_layers,
        lm_head=2.0 * D * config.vocab_size,
        seq_len=seq_len,
    )


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
