"""The Specialization and Cost pages' data: a run's saved router profile and cost report, as numbers.

Looked for in the run itself only (``<run>/profile``, ``<run>/analysis/profile``: where `moe-lab analyze` and
the lifecycle flow write them), always inside the runs root; never in a folder above the run, where a run
beside it (a lifecycle's dense baseline next to its MoE) would find another run's analysis. Served: per-layer
shares, expert x token-class and expert x domain shares, mutual information, co-activation and layer-to-layer
flow. Never served: the profile's top tokens (vocabulary strings) or anything else that is text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from dashboard.runs import RunData, is_inside, json_floats
from moe_core.analytics.profile import PROFILE_FILES, RouterProfile


def _candidates(run: RunData) -> list[Path]:
    return [run.path, run.path / "analysis"]


def find_profile(run: RunData) -> Path | None:
    for base in _candidates(run):
        d = base / "profile"
        if all((d / f).is_file() and is_inside(d / f, run.root) for f in PROFILE_FILES):
            return d
    return None


def find_cost(run: RunData) -> Path | None:
    for base in _candidates(run):
        f = base / "cost.json"
        if f.is_file() and is_inside(f, run.root):
            return f
    return None


def _rows_normalized(counts: np.ndarray) -> list[list[float | None]]:
    """Each row as shares of its sum (an expert's slots over classes/domains); empty rows stay null."""
    counts = np.asarray(counts, dtype=np.float64)
    sums = counts.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return [json_floats(r) for r in counts / sums]


def specialization(run: RunData) -> dict | None:
    path = find_profile(run)
    if path is None:
        return None
    profile = RouterProfile.from_dir(path)
    layers = []
    for layer in profile.layers:
        co = np.asarray(layer.coactivation_EE, dtype=np.float64)
        diag = np.diag(co)[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):
            co_given = co / diag  # P(j used | i used)
        layers.append(
            {
                "layer": layer.layer_id,
                "experts": layer.num_experts,
                "tokens": layer.tokens,
                "share": json_floats(layer.share_E),
                "mi_class_bits": _num(layer.mi_class_bits),
                "mi_domain_bits": _num(layer.mi_domain_bits),
                "drop_rate": _num(layer.drop_rate),
                "normalized_entropy": _num(layer.normalized_entropy),
                "dead_experts": layer.dead_experts(),
                "class_share": _rows_normalized(layer.class_counts_EC),
                "domain_share": _rows_normalized(layer.domain_counts_EM),
                "coactivation": [json_floats(r) for r in co_given],
            }
        )
    flows = [
        {"from_layer": f.from_layer, "to_layer": f.to_layer, "top1": _rows_normalized(f.top1_EF)}
        for f in profile.flows
    ]
    return {
        "classes": list(profile.class_names),
        "domains": list(profile.domain_names),
        "dataset": {
            k: v for k, v in profile.dataset.items() if isinstance(v, int | float) or k == "fingerprint"
        },
        "layers": layers,
        "flows": flows,
    }


def cost(run: RunData) -> dict | None:
    path = find_cost(run)
    if path is None:
        return None
    return _numbers(json.loads(path.read_text()), keep_strings=("device",))


def _num(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def _numbers(data, keep_strings=()):
    """Numbers (and the named short labels) of a nested dict; any other string is dropped."""
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            if isinstance(v, str):
                if k in keep_strings:
                    out[k] = v[:64]
            elif isinstance(v, bool) or v is None:
                out[k] = v
            elif isinstance(v, int | float):
                out[k] = _num(v)
            elif isinstance(v, dict | list):
                out[k] = _numbers(v, keep_strings)
        return out
    if isinstance(data, list):
        return [
            _num(v) if isinstance(v, int | float) and not isinstance(v, bool) else _numbers(v, keep_strings)
            for v in data
            if not isinstance(v, str)
        ]
    return data
