"""Routing health at each logging step: alerts, the aux-free bias, and a compact binary log of expert loads.

`RoutingMonitor.observe(step, metrics)` is called by the training loop (rank 0) with the metrics of one
logging step, before they go to the sinks, and returns metrics to add to that row:

- ``moe/layer_<i>/expert_<e>_bias``: the aux-loss-free router bias (DeepSeek-V3, Wang et al. 2024
  "Auxiliary-Loss-Free Load Balancing") per expert, where that router is used (with ``log.per_expert``, like
  the shares; the load log below always has both);
- ``alert/dead_expert/layer_<i>/expert_<e>``: the expert's share of routed slots, logged while it has stayed
  under ``dead_share`` x the uniform share (1/E) for ``dead_steps`` logging steps in a row;
- ``alert/load_collapse/layer_<i>``: max/mean load, while it is over ``max_over_mean``;
- ``alert/drops/layer_<i>``: the drop rate, while it is over ``drop_rate``.

Alerts are plain numbers in the run's event file (``metrics.jsonl``), so the dashboard, MLflow and
``moe-lab sync`` see them without a second format; a line on stderr marks when one is first raised.

It also appends one float32 row per logging step to the binary load log (``routing_loads.f32``): its layout,
writer and reader live in `moe_core.train.load_log`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from moe_core.train.load_log import LAYER_STATS, LoadLogLayout, LoadLogWriter


class AlertThresholds(BaseModel):
    """When the trainer raises a routing alert (``log.alerts`` in the training config)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = True
    dead_share: float = Field(0.05, ge=0, le=1)  # share < dead_share / E counts as dead (5% of uniform)
    dead_steps: int = Field(3, ge=1)  # ... for this many logging steps in a row
    max_over_mean: float = Field(3.0, gt=1)  # max/mean expert load over this: load collapse
    drop_rate: float = Field(0.2, gt=0, le=1)  # dropped slots over this fraction


class RoutingMonitor:
    """Alerts, biases and the binary load log of one run; see the module docstring."""

    def __init__(
        self,
        out_dir: str | Path,
        layer_ids: list[int],
        num_experts: int,
        thresholds: AlertThresholds,
        routers: list | None = None,
        routing_stats=None,
        start_step: int = 0,
        per_expert: bool = True,
        stream=None,
    ) -> None:
        self.layer_ids, self.E = list(layer_ids), num_experts
        self.per_expert = (
            per_expert  # `log.per_expert`: bias keys in the event file too (always in the load log)
        )
        self.routing_stats = routing_stats  # `telemetry.RoutingStats`: shares even with log.per_expert off
        self.thresholds = thresholds
        self.routers = list(routers or [])
        self.stream = stream or sys.stderr
        self._under_LE = np.zeros(
            (len(self.layer_ids), num_experts), dtype=np.int64
        )  # dead streak per expert
        self._raised: set[str] = set()
        self._log: LoadLogWriter | None = None
        self._prefixes = [f"moe/layer_{layer}/" for layer in self.layer_ids]
        self._stat_keys = [[prefix + name for name in LAYER_STATS] for prefix in self._prefixes]
        self.has_bias = False
        if self.layer_ids:
            self.has_bias = any(getattr(r, "expert_bias", None) is not None for r in self.routers)
            layout = LoadLogLayout(tuple(self.layer_ids), num_experts, self.has_bias)
            self._log = LoadLogWriter(out_dir, layout, start_step=start_step)

    def _bias_LE(self) -> np.ndarray | None:
        """The aux-free routers' biases ``[L, E]`` (NaN for a layer without one); one read-back per router."""
        if not self.has_bias:
            return None
        bias_LE = np.full((len(self.layer_ids), self.E), np.nan)
        for i, router in enumerate(self.routers[: len(self.layer_ids)]):
            bias_E = getattr(router, "expert_bias", None)
            if bias_E is not None:
                bias_LE[i] = bias_E.detach().double().cpu().numpy()
        return bias_LE

    def biases(self) -> dict[str, float]:
        bias_LE = self._bias_LE()
        if bias_LE is None:
            return {}
        return {
            f"moe/layer_{layer}/expert_{e}_bias": float(bias_LE[i, e])
            for i, layer in enumerate(self.layer_ids)
            for e in range(self.E)
            if np.isfinite(bias_LE[i, e])
        }

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        if not self.layer_ids:
            return {}
        L = len(self.layer_ids)
        bias_LE = self._bias_LE()
        added = {}
        if self.per_expert and bias_LE is not None:  # per-expert keys stay out of the event file if asked
            added = self.biases()
        get = metrics.get
        stats_LS = np.array([[get(k, np.nan) for k in keys] for keys in self._stat_keys], dtype=np.float64)
        last = getattr(self.routing_stats, "last_sums_LX", None)
        if last is not None and last.shape[0] == L:  # the trainer's sums: no per-expert keys needed
            with np.errstate(invalid="ignore", divide="ignore"):  # a layer that saw no slots: NaN, not dead
                counts_LE = last[:, : self.E].numpy()
                shares_LE = counts_LE / counts_LE.sum(-1, keepdims=True)
        else:  # shares from the metrics alone (``expert_<e>_frac`` keys)
            shares_LE = np.array(
                [
                    [get(f"{prefix}expert_{e}_frac", np.nan) for e in range(self.E)]
                    for prefix in self._prefixes
                ],
                dtype=np.float64,
            )
        if self.thresholds.enabled:
            added.update(self._alerts(shares_LE, stats_LS, step))
        if bias_LE is None:
            bias_LE = np.full((L, self.E), np.nan)
        self._log.append(step, metrics.get("tokens", np.nan), shares_LE, stats_LS, bias_LE)
        return added

    def _alerts(self, shares_LE: np.ndarray, stats_LS: np.ndarray, step: int) -> dict[str, float]:
        t, out = self.thresholds, {}
        dead_LE = shares_LE < t.dead_share / self.E  # NaN (no per-expert telemetry) compares False
        self._under_LE = np.where(dead_LE, self._under_LE + 1, 0)
        layers = self.layer_ids  # whole-array tests; Python only for what is flagged (NaN compares False)
        for i, e in zip(*np.nonzero(self._under_LE >= t.dead_steps)):
            out[f"alert/dead_expert/layer_{layers[i]}/expert_{e}"] = float(shares_LE[i, e])
        drop_L, max_over_mean_L = stats_LS[:, 0], stats_LS[:, 2]
        for i in np.flatnonzero(max_over_mean_L > t.max_over_mean):
            out[f"alert/load_collapse/layer_{layers[i]}"] = float(max_over_mean_L[i])
        for i in np.flatnonzero(drop_L > t.drop_rate):
            out[f"alert/drops/layer_{layers[i]}"] = float(drop_L[i])
        for key, value in out.items():
            if key not in self._raised:
                print(
                    f"moe-lab train: step {step}: routing alert {key} = {value:.4g}",
                    file=self.stream,
                    flush=True,
                )
        self._raised = set(out)
        return out

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
