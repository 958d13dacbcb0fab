"""`RouterProfile`: what the router did, per MoE layer, over an evaluation set: the per-layer count tables and
the flows between layers, with a summary table, a notebook view and the versioned directory format."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moe_core.analytics.profile.files import PROFILE_VERSION, read_profile_fields, write_profile_dir
from moe_core.analytics.profile.layer import FlowProfile, LayerProfile


@dataclass(eq=False)
class RouterProfile:
    """A versioned router profile; the package docstring (`moe_core.analytics.profile`) says what each table holds."""

    model: dict[str, Any]  # config_hash, model_type, num_experts, experts_per_token, router, moe_layer_ids
    dataset: dict[str, Any]  # fingerprint (sha256 of the token ids), tokens, sequences, and caller's labels
    class_names: tuple[str, ...]
    domain_names: tuple[str, ...]
    rare_fraction: float
    layers: list[LayerProfile]
    flows: list[FlowProfile]
    version: int = PROFILE_VERSION

    def layer(self, layer_id: int) -> LayerProfile:
        for layer in self.layers:
            if layer.layer_id == layer_id:
                return layer
        raise KeyError(
            f"no MoE layer {layer_id} in this profile; MoE layers: {[layer.layer_id for layer in self.layers]}"
        )

    def summary(self):
        """One row per MoE layer (pandas DataFrame): balance, drops, entropy, confidence, specialization."""
        return pd.DataFrame([layer.summary(self.rare_fraction) for layer in self.layers])

    def _repr_html_(self) -> str:
        """In a notebook: what was profiled, then the per-layer summary table."""
        model, dataset = self.model, self.dataset
        head = (
            f"<p><b>Router profile</b>: {html.escape(str(model.get('model_type', 'model')))}, "
            f"{model.get('experts_per_token')}/{model.get('num_experts')} experts per token, router "
            f"{html.escape(str(model.get('router')))}; {dataset.get('tokens', 0):,} tokens in "
            f"{dataset.get('sequences', 0):,} sequences; {len(self.layers)} MoE layers</p>"
        )
        return head + self.summary().to_html(index=False, float_format=lambda v: f"{v:.4g}")

    def load_matrix_LE(self) -> np.ndarray:
        """Share of each layer's kept slots per expert, [MoE layers, E]."""
        return np.stack([layer.share_E for layer in self.layers]) if self.layers else np.zeros((0, 0))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouterProfile):
            return NotImplemented
        return _as_comparable(self) == _as_comparable(other)

    # ---------------------------------------------------------------------------------- files
    def to_dir(self, path: str | Path) -> Path:
        """Write profile.json and the parquet tables into ``path`` atomically (temp dir, then rename)."""
        return write_profile_dir(self, path)

    @classmethod
    def from_dir(cls, path: str | Path) -> RouterProfile:
        """A profile written by `to_dir`; `ProfileError` for a missing file or a newer format version."""
        return cls(**read_profile_fields(path))


def _as_comparable(profile: RouterProfile) -> tuple:
    def arrays(obj) -> tuple:
        return tuple((k, v.tolist() if isinstance(v, np.ndarray) else v) for k, v in vars(obj).items())

    return (
        profile.version,
        json.dumps(profile.model, sort_keys=True),
        json.dumps(profile.dataset, sort_keys=True),
        tuple(profile.class_names),
        tuple(profile.domain_names),
        profile.rare_fraction,
        tuple(arrays(layer) for layer in profile.layers),
        tuple(arrays(flow) for flow in profile.flows),
    )
