"""Statistics of routing counts: pure numpy functions, each small enough to check by hand.

Legend: E = experts, C = classes (token classes or document domains), T = tokens.
"""

from __future__ import annotations

import numpy as np


def coefficient_of_variation(counts_E: np.ndarray) -> float:
    """Population std / mean of the load (ddof=0); 0.0 is perfect balance, NaN when nothing was routed."""
    counts_E = np.asarray(counts_E, dtype=np.float64)
    mean = counts_E.mean()
    return float(counts_E.std() / mean) if mean > 0 else float("nan")


def max_over_mean(counts_E: np.ndarray) -> float:
    """Busiest expert's load over the mean load; 1.0 is perfect balance (the capacity an expert must have)."""
    counts_E = np.asarray(counts_E, dtype=np.float64)
    mean = counts_E.mean()
    return float(counts_E.max() / mean) if mean > 0 else float("nan")


def entropy_bits(counts: np.ndarray) -> float:
    """Shannon entropy, in bits, of the distribution proportional to ``counts`` (any shape)."""
    p = np.asarray(counts, dtype=np.float64).ravel()
    total = p.sum()
    if total <= 0:
        return 0.0
    p = p[p > 0] / total
    return float(-(p * np.log2(p)).sum()) + 0.0  # + 0.0: a single class gives 0.0, not -0.0


def mutual_information_bits(joint_EC: np.ndarray) -> float:
    """I(expert; class) in bits from a joint count table: ``sum p(e,c) log2 p(e,c) / (p(e) p(c))``.

    Computed as H(E) + H(C) - H(E, C); 0 when expert choice says nothing about the class, at most
    min(H(E), H(C)).
    """
    joint_EC = np.asarray(joint_EC, dtype=np.float64)
    if joint_EC.sum() <= 0:
        return 0.0
    value = entropy_bits(joint_EC.sum(1)) + entropy_bits(joint_EC.sum(0)) - entropy_bits(joint_EC)
    return max(0.0, value)  # clamp float round-off below zero


def dead_experts(counts_E: np.ndarray) -> list[int]:
    """Experts that processed no token slot at all."""
    return [int(e) for e in np.flatnonzero(np.asarray(counts_E) == 0)]


def rare_experts(counts_E: np.ndarray, rare_fraction: float) -> list[int]:
    """Experts used, but less than ``rare_fraction`` times the mean load (dead experts are listed apart)."""
    counts_E = np.asarray(counts_E, dtype=np.float64)
    limit = rare_fraction * counts_E.mean()
    return [int(e) for e in np.flatnonzero((counts_E > 0) & (counts_E < limit))]
