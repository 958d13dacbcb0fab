"""A profile's count tables, per MoE layer (`LayerProfile`) and between consecutive MoE layers (`FlowProfile`),
and every statistic computed from them (balance, drops, entropy, confidence, mutual information, dead experts).

Legend: E = experts (F = experts of the next MoE layer), C = token classes, M = document domains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe_core.analytics import stats


@dataclass(frozen=True)
class TopToken:
    token_id: int
    count: int
    token: str | None  # the decoded vocabulary entry, None when no tokenizer was given


@dataclass(eq=False)
class LayerProfile:
    """Count tables of one MoE layer; every statistic is a property computed from them."""

    layer_id: int  # index among all decoder layers
    num_experts: int
    slots_per_token: int  # K of the router's record
    tokens: int
    kept_E: np.ndarray  # int64
    routed_E: np.ndarray  # int64, before capacity
    dropped_slots: int
    dropped_tokens: int
    entropy_sum: float  # nats, summed over tokens
    confidence_sum: float  # top-1 probability, summed over tokens
    coactivation_EE: np.ndarray  # int64
    class_counts_EC: np.ndarray  # int64, [E, 0] without token classes
    domain_counts_EM: np.ndarray  # int64, [E, 0] without domains
    top_tokens: list[list[TopToken]] = field(default_factory=list)  # per expert, most frequent first

    @property
    def slots(self) -> int:
        return self.tokens * self.slots_per_token

    @property
    def share_E(self) -> np.ndarray:
        total = self.kept_E.sum()
        return self.kept_E / total if total else np.zeros(self.num_experts)

    @property
    def cv(self) -> float:
        return stats.coefficient_of_variation(self.kept_E)

    @property
    def max_over_mean(self) -> float:
        return stats.max_over_mean(self.kept_E)

    @property
    def drop_rate(self) -> float:
        return self.dropped_slots / self.slots if self.slots else 0.0

    @property
    def dropped_token_rate(self) -> float:
        return self.dropped_tokens / self.tokens if self.tokens else 0.0

    @property
    def entropy(self) -> float:
        """Mean router entropy per token, nats."""
        return self.entropy_sum / self.tokens if self.tokens else float("nan")

    @property
    def normalized_entropy(self) -> float:
        """Mean entropy over log(E): 1.0 is a uniform router, 0.0 a one-hot one."""
        return self.entropy / math.log(self.num_experts) if self.num_experts > 1 else 0.0

    @property
    def confidence(self) -> float:
        """Mean top-1 router probability per token."""
        return self.confidence_sum / self.tokens if self.tokens else float("nan")

    @property
    def mi_class_bits(self) -> float:
        return stats.mutual_information_bits(self.class_counts_EC)

    @property
    def mi_domain_bits(self) -> float:
        return stats.mutual_information_bits(self.domain_counts_EM)

    def dead_experts(self) -> list[int]:
        return stats.dead_experts(self.kept_E)

    def rare_experts(self, rare_fraction: float) -> list[int]:
        return stats.rare_experts(self.kept_E, rare_fraction)

    def summary(self, rare_fraction: float) -> dict[str, Any]:
        return {
            "layer": self.layer_id,
            "tokens": self.tokens,
            "cv": self.cv,
            "max_over_mean": self.max_over_mean,
            "drop_rate": self.drop_rate,
            "dropped_token_rate": self.dropped_token_rate,
            "entropy": self.entropy,
            "normalized_entropy": self.normalized_entropy,
            "confidence": self.confidence,
            "mi_class_bits": self.mi_class_bits,
            "class_entropy_bits": stats.entropy_bits(self.class_counts_EC.sum(0)),
            "mi_domain_bits": self.mi_domain_bits,
            "domain_entropy_bits": stats.entropy_bits(self.domain_counts_EM.sum(0)),
            "dead_experts": self.dead_experts(),
            "rare_experts": self.rare_experts(rare_fraction),
        }


@dataclass(eq=False)
class FlowProfile:
    """Routing flow from MoE layer `from_layer` to the next MoE layer `to_layer`."""

    from_layer: int
    to_layer: int
    top1_EF: np.ndarray  # int64, tokens: primary expert in from_layer -> primary expert in to_layer
    pairs_EF: np.ndarray  # int64, kept-slot pairs of each token
