"""A `RouterProfile` on disk: a versioned directory written atomically (temporary directory, then rename) and
read back exactly; the layout is in the package docstring (`moe_core.analytics.profile`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from moe_core.analytics.profile.config import ProfileError
from moe_core.analytics.profile.layer import FlowProfile, LayerProfile, TopToken
from moe_core.fileio import atomic_directory

if TYPE_CHECKING:  # annotations only: router_profile imports this module
    from moe_core.analytics.profile.router_profile import RouterProfile

PROFILE_VERSION = 1
PROFILE_FILES = (
    "profile.json",
    "experts.parquet",
    "coactivation.parquet",
    "flow.parquet",
    "expert_classes.parquet",
    "expert_domains.parquet",
    "top_tokens.parquet",
)


def write_profile_dir(profile: RouterProfile, path: str | Path) -> Path:
    """Write profile.json and the parquet tables into ``path`` atomically (temp dir, then rename)."""
    path = Path(path)
    with atomic_directory(path, overwrite=True, error_cls=ProfileError) as tmp:
        (tmp / "profile.json").write_text(json.dumps(profile_json(profile), indent=2, allow_nan=False) + "\n")
        for name, rows in profile_tables(profile).items():
            pd.DataFrame(rows["rows"], columns=rows["columns"]).to_parquet(
                tmp / f"{name}.parquet", index=False
            )
    return path


def read_profile_fields(path: str | Path) -> dict[str, Any]:
    """The fields of the `RouterProfile` saved in ``path`` (`RouterProfile.from_dir` builds it)."""
    path = Path(path)
    missing = [name for name in PROFILE_FILES if not (path / name).is_file()]
    if missing:
        raise ProfileError(
            f"{path}: not a router profile directory, missing {missing}; "
            "write one with RouterProfile.to_dir or `moe-lab analyze`"
        )
    meta = json.loads((path / "profile.json").read_text())
    version = meta.get("version")
    if not isinstance(version, int) or version > PROFILE_VERSION:
        raise ProfileError(
            f"{path}/profile.json: version {version!r} is not readable by this code "
            f"(reads up to {PROFILE_VERSION}); upgrade open-moe-trainer-lab"
        )
    tables = {
        name: pd.read_parquet(path / f"{name}.parquet")
        for name in ("experts", "coactivation", "flow", "expert_classes", "expert_domains", "top_tokens")
    }
    class_names, domain_names = tuple(meta["class_names"]), tuple(meta["domain_names"])
    layers = []
    for info in meta["layers"]:
        layer_id, E = info["layer_id"], info["num_experts"]
        experts = tables["experts"][tables["experts"].layer == layer_id].sort_values("expert")
        top_rows = tables["top_tokens"][tables["top_tokens"].layer == layer_id].sort_values(
            ["expert", "rank"]
        )
        top_tokens = [
            [
                TopToken(int(r.token_id), int(r.count), None if pd.isna(r.token) else str(r.token))
                for r in top_rows[top_rows.expert == e].itertuples()
            ]
            for e in range(E)
        ]
        layers.append(
            LayerProfile(
                layer_id=layer_id,
                num_experts=E,
                slots_per_token=info["slots_per_token"],
                tokens=info["tokens"],
                kept_E=np.array(experts.kept, dtype=np.int64),
                routed_E=np.array(experts.routed, dtype=np.int64),
                dropped_slots=info["dropped_slots"],
                dropped_tokens=info["dropped_tokens"],
                entropy_sum=info["entropy_sum"],
                confidence_sum=info["confidence_sum"],
                coactivation_EE=_matrix(
                    tables["coactivation"], layer_id, "expert_i", "expert_j", "tokens", E, range(E)
                ),
                class_counts_EC=_matrix(
                    tables["expert_classes"], layer_id, "expert", "token_class", "slots", E, class_names
                ),
                domain_counts_EM=_matrix(
                    tables["expert_domains"], layer_id, "expert", "domain", "slots", E, domain_names
                ),
                top_tokens=top_tokens,
            )
        )
    flows = []
    flow_table = tables["flow"]
    for info in meta["flows"]:
        rows = flow_table[
            (flow_table.from_layer == info["from_layer"]) & (flow_table.to_layer == info["to_layer"])
        ]
        shape = (info["from_experts"], info["to_experts"])
        top1, pairs = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
        top1[rows.from_expert.to_numpy(), rows.to_expert.to_numpy()] = rows.top1.to_numpy()
        pairs[rows.from_expert.to_numpy(), rows.to_expert.to_numpy()] = rows.pairs.to_numpy()
        flows.append(FlowProfile(info["from_layer"], info["to_layer"], top1, pairs))
    return dict(
        model=meta["model"],
        dataset=meta["dataset"],
        class_names=class_names,
        domain_names=domain_names,
        rare_fraction=meta["rare_fraction"],
        layers=layers,
        flows=flows,
        version=version,
    )


def profile_json(profile: RouterProfile) -> dict[str, Any]:
    """``profile.json``: what was profiled, the per-layer scalars and summaries, the flows' shapes."""
    return {
        "version": profile.version,
        "model": profile.model,
        "dataset": profile.dataset,
        "class_names": list(profile.class_names),
        "domain_names": list(profile.domain_names),
        "rare_fraction": profile.rare_fraction,
        "layers": [
            {
                "layer_id": layer.layer_id,
                "num_experts": layer.num_experts,
                "slots_per_token": layer.slots_per_token,
                "tokens": layer.tokens,
                "dropped_slots": layer.dropped_slots,
                "dropped_tokens": layer.dropped_tokens,
                "entropy_sum": layer.entropy_sum,
                "confidence_sum": layer.confidence_sum,
                # derived, for readers of the JSON alone; recomputed from the counts when loaded
                "summary": _json_safe(layer.summary(profile.rare_fraction)),
                "top_tokens": [[t.__dict__ for t in expert] for expert in layer.top_tokens],
            }
            for layer in profile.layers
        ],
        "flows": [
            {
                "from_layer": flow.from_layer,
                "to_layer": flow.to_layer,
                "from_experts": flow.top1_EF.shape[0],
                "to_experts": flow.top1_EF.shape[1],
            }
            for flow in profile.flows
        ],
    }


def profile_tables(profile: RouterProfile) -> dict[str, dict[str, Any]]:
    """The parquet tables as columns and rows, by file name (without ``.parquet``)."""
    experts, coact, classes, domains, top, flow_rows = [], [], [], [], [], []
    for layer in profile.layers:
        share_E = layer.share_E
        for e in range(layer.num_experts):
            experts.append(
                (layer.layer_id, e, int(layer.kept_E[e]), int(layer.routed_E[e]), float(share_E[e]))
            )
            coact.extend(
                (layer.layer_id, e, j, int(layer.coactivation_EE[e, j])) for j in range(layer.num_experts)
            )
            classes.extend(
                (layer.layer_id, e, name, int(layer.class_counts_EC[e, c]))
                for c, name in enumerate(profile.class_names)
            )
            domains.extend(
                (layer.layer_id, e, name, int(layer.domain_counts_EM[e, m]))
                for m, name in enumerate(profile.domain_names)
            )
            if e < len(layer.top_tokens):
                top.extend(
                    (layer.layer_id, e, rank, t.token_id, t.count, t.token)
                    for rank, t in enumerate(layer.top_tokens[e])
                )
    for flow in profile.flows:
        E, F = flow.top1_EF.shape
        flow_rows.extend(
            (flow.from_layer, flow.to_layer, i, j, int(flow.top1_EF[i, j]), int(flow.pairs_EF[i, j]))
            for i in range(E)
            for j in range(F)
        )
    return {
        "experts": {"columns": ["layer", "expert", "kept", "routed", "share"], "rows": experts},
        "coactivation": {"columns": ["layer", "expert_i", "expert_j", "tokens"], "rows": coact},
        "expert_classes": {"columns": ["layer", "expert", "token_class", "slots"], "rows": classes},
        "expert_domains": {"columns": ["layer", "expert", "domain", "slots"], "rows": domains},
        "top_tokens": {"columns": ["layer", "expert", "rank", "token_id", "count", "token"], "rows": top},
        "flow": {
            "columns": ["from_layer", "to_layer", "from_expert", "to_expert", "top1", "pairs"],
            "rows": flow_rows,
        },
    }


def _matrix(df, layer_id: int, row_col: str, col_col: str, value_col: str, rows: int, col_keys) -> np.ndarray:
    col_keys = list(col_keys)
    out = np.zeros((rows, len(col_keys)), dtype=np.int64)
    index = {k: i for i, k in enumerate(col_keys)}
    for r in df[df.layer == layer_id].itertuples():
        out[int(getattr(r, row_col)), index[getattr(r, col_col)]] = int(getattr(r, value_col))
    return out


def _json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
