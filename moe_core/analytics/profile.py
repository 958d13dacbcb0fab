"""Router profile: what the router did, per MoE layer, over an evaluation set.

Legend: B = batch, S = sequence, T = B*S tokens, K = expert slots per token, E = experts (F = experts of the
next MoE layer), C = token classes, M = document domains, V = vocabulary.

`collect_profile` runs the model in eval mode under ``torch.no_grad`` with ``output_routing=True`` (so
evaluation never moves load-balancing state: routers only observe in training) and feeds each batch's
`RoutingRecord`s to a `ProfileCollector`, which keeps count tables only; nothing re-derives routing.

What is counted, per MoE layer (a "slot" is one (token, k) assignment; "kept" = not dropped over capacity;
for ``expert_choice`` a dropped slot is an expert that did not pick the token):
- ``kept_E``: the router's ``tokens_per_expert_E`` summed; ``routed_E``: slots sent before capacity.
- dropped slots and dropped tokens (tokens none of whose slots was kept).
- router entropy ``-sum_e p log p`` (nats) and confidence ``max_e p`` per token, summed; scores are
  normalized per token first (so sigmoid routers read like softmax ones).
- co-activation ``[E, E]``: tokens whose kept slots include both i and j; the diagonal is tokens using i.
- flow between consecutive MoE layers ``[E, F]``, two ways: ``top1`` counts each token once, from its
  primary expert in layer l to its primary expert in layer l+1 (primary = the kept slot with the largest
  combine weight; tokens with no kept slot in either layer are left out), and ``pairs`` counts every
  (kept slot in l, kept slot in l+1) pair of a token, i.e. ``multihot_l^T @ multihot_l+1``.
- ``[E, C]`` kept slots per token class and ``[E, M]`` per document domain; their mutual information with
  the expert choice, in bits, is taken over kept slots (a token with K kept slots counts K times).
- top tokens per expert: the most frequent token ids among its kept slots, with their decoded strings
  (vocabulary entries, never running text) only when ``ProfileConfig.include_vocab_pieces`` asks for them.

A `RouterProfile` is saved as a versioned directory (`to_dir`, written to a temporary directory and renamed
into place) that the inference-optimization work reads back with `RouterProfile.from_dir`::

    profile.json            version, model (config hash, experts, layers), dataset fingerprint, per-layer
                            scalars and summaries, top tokens per expert
    experts.parquet         layer, expert, kept, routed, share
    coactivation.parquet    layer, expert_i, expert_j, tokens
    flow.parquet            from_layer, to_layer, from_expert, to_expert, top1, pairs
    expert_classes.parquet  layer, expert, token_class, slots
    expert_domains.parquet  layer, expert, domain, slots
    top_tokens.parquet      layer, expert, rank, token_id, count, token
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_core.analytics import stats
from moe_core.analytics.token_classes import TOKEN_CLASSES
from moe_core.errors import MoELabError
from moe_core.fileio import atomic_directory
from moe_core.routing import RoutingRecord

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


class ProfileError(MoELabError):
    """A profile that cannot be collected, written or read (bad inputs, missing files, newer version)."""


@dataclass(frozen=True)
class ProfileConfig:
    """How to collect a router profile."""

    top_tokens: int = 10  # most frequent token ids kept per expert
    rare_fraction: float = 0.1  # an expert below this fraction of the mean load is "rare"
    max_batches: int | None = None  # stop after this many batches (None: the whole iterable)
    # decode each top token id into its vocabulary piece (a string from the tokenizer). Off by default:
    # pieces with counts say which words a corpus uses, so whoever records a profile (MLflow) opts in.
    include_vocab_pieces: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.top_tokens, int) or self.top_tokens < 0:
            raise ValueError(f"ProfileConfig.top_tokens={self.top_tokens!r}: must be an integer >= 0")
        if not 0.0 <= self.rare_fraction <= 1.0:
            raise ValueError(f"ProfileConfig.rare_fraction={self.rare_fraction!r}: must be within [0, 1]")
        if self.max_batches is not None and self.max_batches < 1:
            raise ValueError(f"ProfileConfig.max_batches={self.max_batches!r}: must be >= 1 or None")


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


@dataclass(eq=False)
class RouterProfile:
    """A versioned router profile; see the module docstring for what each table holds."""

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
            f"no MoE layer {layer_id} in this profile; MoE layers: {[x.layer_id for x in self.layers]}"
        )

    def summary(self):
        """One row per MoE layer (pandas DataFrame): balance, drops, entropy, confidence, specialization."""
        import pandas as pd

        return pd.DataFrame([layer.summary(self.rare_fraction) for layer in self.layers])

    def _repr_html_(self) -> str:
        """In a notebook: what was profiled, then the per-layer summary table."""
        import html

        m, d = self.model, self.dataset
        head = (
            f"<p><b>Router profile</b>: {html.escape(str(m.get('model_type', 'model')))}, "
            f"{m.get('experts_per_token')}/{m.get('num_experts')} experts per token, router "
            f"{html.escape(str(m.get('router')))}; {d.get('tokens', 0):,} tokens in {d.get('sequences', 0):,} "
            f"sequences; {len(self.layers)} MoE layers</p>"
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
        import pandas as pd

        path = Path(path)
        with atomic_directory(path, overwrite=True, error_cls=ProfileError) as tmp:
            (tmp / "profile.json").write_text(json.dumps(self._json(), indent=2, allow_nan=False) + "\n")
            for name, rows in self._tables().items():
                pd.DataFrame(rows["rows"], columns=rows["columns"]).to_parquet(
                    tmp / f"{name}.parquet", index=False
                )
        return path

    @classmethod
    def from_dir(cls, path: str | Path) -> RouterProfile:
        import pandas as pd

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
            lid, E = info["layer_id"], info["num_experts"]
            experts = tables["experts"][tables["experts"].layer == lid].sort_values("expert")
            top_rows = tables["top_tokens"][tables["top_tokens"].layer == lid].sort_values(["expert", "rank"])
            top_tokens = [
                [
                    TopToken(int(r.token_id), int(r.count), None if pd.isna(r.token) else str(r.token))
                    for r in top_rows[top_rows.expert == e].itertuples()
                ]
                for e in range(E)
            ]
            layers.append(
                LayerProfile(
                    layer_id=lid,
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
                        tables["coactivation"], lid, "expert_i", "expert_j", "tokens", E, range(E)
                    ),
                    class_counts_EC=_matrix(
                        tables["expert_classes"], lid, "expert", "token_class", "slots", E, class_names
                    ),
                    domain_counts_EM=_matrix(
                        tables["expert_domains"], lid, "expert", "domain", "slots", E, domain_names
                    ),
                    top_tokens=top_tokens,
                )
            )
        flows = []
        flow = tables["flow"]
        for info in meta["flows"]:
            rows = flow[(flow.from_layer == info["from_layer"]) & (flow.to_layer == info["to_layer"])]
            shape = (info["from_experts"], info["to_experts"])
            top1, pairs = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
            top1[rows.from_expert.to_numpy(), rows.to_expert.to_numpy()] = rows.top1.to_numpy()
            pairs[rows.from_expert.to_numpy(), rows.to_expert.to_numpy()] = rows.pairs.to_numpy()
            flows.append(FlowProfile(info["from_layer"], info["to_layer"], top1, pairs))
        return cls(
            model=meta["model"],
            dataset=meta["dataset"],
            class_names=class_names,
            domain_names=domain_names,
            rare_fraction=meta["rare_fraction"],
            layers=layers,
            flows=flows,
            version=version,
        )

    def _json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "model": self.model,
            "dataset": self.dataset,
            "class_names": list(self.class_names),
            "domain_names": list(self.domain_names),
            "rare_fraction": self.rare_fraction,
            "layers": [
                {
                    "layer_id": x.layer_id,
                    "num_experts": x.num_experts,
                    "slots_per_token": x.slots_per_token,
                    "tokens": x.tokens,
                    "dropped_slots": x.dropped_slots,
                    "dropped_tokens": x.dropped_tokens,
                    "entropy_sum": x.entropy_sum,
                    "confidence_sum": x.confidence_sum,
                    # derived, for readers of the JSON alone; recomputed from the counts when loaded
                    "summary": _json_safe(x.summary(self.rare_fraction)),
                    "top_tokens": [[t.__dict__ for t in expert] for expert in x.top_tokens],
                }
                for x in self.layers
            ],
            "flows": [
                {
                    "from_layer": f.from_layer,
                    "to_layer": f.to_layer,
                    "from_experts": f.top1_EF.shape[0],
                    "to_experts": f.top1_EF.shape[1],
                }
                for f in self.flows
            ],
        }

    def _tables(self) -> dict[str, dict[str, Any]]:
        experts, coact, classes, domains, top, flow = [], [], [], [], [], []
        for x in self.layers:
            share_E = x.share_E
            for e in range(x.num_experts):
                experts.append((x.layer_id, e, int(x.kept_E[e]), int(x.routed_E[e]), float(share_E[e])))
                coact.extend((x.layer_id, e, j, int(x.coactivation_EE[e, j])) for j in range(x.num_experts))
                classes.extend(
                    (x.layer_id, e, name, int(x.class_counts_EC[e, c]))
                    for c, name in enumerate(self.class_names)
                )
                domains.extend(
                    (x.layer_id, e, name, int(x.domain_counts_EM[e, m]))
                    for m, name in enumerate(self.domain_names)
                )
                if e < len(x.top_tokens):
                    top.extend(
                        (x.layer_id, e, rank, t.token_id, t.count, t.token)
                        for rank, t in enumerate(x.top_tokens[e])
                    )
        for f in self.flows:
            E, F_ = f.top1_EF.shape
            flow.extend(
                (f.from_layer, f.to_layer, i, j, int(f.top1_EF[i, j]), int(f.pairs_EF[i, j]))
                for i in range(E)
                for j in range(F_)
            )
        return {
            "experts": {"columns": ["layer", "expert", "kept", "routed", "share"], "rows": experts},
            "coactivation": {"columns": ["layer", "expert_i", "expert_j", "tokens"], "rows": coact},
            "expert_classes": {"columns": ["layer", "expert", "token_class", "slots"], "rows": classes},
            "expert_domains": {"columns": ["layer", "expert", "domain", "slots"], "rows": domains},
            "top_tokens": {"columns": ["layer", "expert", "rank", "token_id", "count", "token"], "rows": top},
            "flow": {
                "columns": ["from_layer", "to_layer", "from_expert", "to_expert", "top1", "pairs"],
                "rows": flow,
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
        tuple(arrays(x) for x in profile.layers),
        tuple(arrays(f) for f in profile.flows),
    )


# ------------------------------------------------------------------------------------------------ collection
def config_hash(config) -> str:
    """sha256 of the model config's content (sorted JSON, without the transformers version)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    data.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def model_info(config) -> dict[str, Any]:
    return {
        "config_hash": config_hash(config),
        "model_type": getattr(config, "model_type", None),
        "num_experts": config.num_experts,
        "experts_per_token": config.num_experts_per_tok,
        "router": config.router,
        "capacity_factor": config.capacity_factor,
        "eval_capacity_factor": config.eval_capacity_factor,
        "num_hidden_layers": config.num_hidden_layers,
        "moe_layer_ids": list(config.moe_layer_ids),
        "vocab_size": config.vocab_size,
    }


class _LayerCounts:
    def __init__(self, E: int, C: int, M: int, V: int, track_tokens: bool) -> None:
        self.E, self.C, self.M, self.V = E, C, M, V
        self.K = 0
        self.tokens = 0
        self.kept_E = torch.zeros(E, dtype=torch.int64)
        self.routed_E = torch.zeros(E, dtype=torch.int64)
        self.dropped_slots = self.dropped_tokens = 0
        self.entropy_sum = self.confidence_sum = 0.0
        self.coactivation_EE = torch.zeros(E, E, dtype=torch.float64)
        self.class_EC = torch.zeros(E * C, dtype=torch.int64)
        self.domain_EM = torch.zeros(E * M, dtype=torch.int64)
        self.token_EV = torch.zeros(E * V, dtype=torch.int64) if track_tokens else None


class ProfileCollector:
    """Accumulates count tables from `RoutingRecord`s, one forward at a time.

    ``token_classes_V``: class index (into `class_names`) of every token id, e.g. from
    `moe_core.analytics.token_classes.token_class_table`; None skips class statistics.
    ``domain_names``: names of the domain ids passed to `update`; empty skips domain statistics.
    """

    def __init__(
        self,
        config,
        profile_config: ProfileConfig | None = None,
        *,
        token_classes_V: np.ndarray | torch.Tensor | None = None,
        class_names: Sequence[str] = TOKEN_CLASSES,
        domain_names: Sequence[str] = (),
        tokenizer=None,
    ) -> None:
        if config.num_experts == 0 or not config.moe_layer_ids:
            raise ProfileError("the model has no MoE layer (num_experts=0): there is no router to profile")
        self.config = config
        self.profile_config = profile_config or ProfileConfig()
        self.tokenizer = tokenizer
        self.class_names = tuple(class_names) if token_classes_V is not None else ()
        self.token_classes_V = (
            None if token_classes_V is None else torch.as_tensor(token_classes_V, dtype=torch.int64)
        )
        if (
            self.token_classes_V is not None
            and self.token_classes_V.numel()
            and (self.token_classes_V.min() < 0 or self.token_classes_V.max() >= len(self.class_names))
        ):
            raise ProfileError(f"token_classes_V holds class ids outside 0..{len(self.class_names) - 1}")
        self.domain_names = tuple(domain_names)
        self.layer_ids = list(config.moe_layer_ids)
        E, C, M, V = config.num_experts, len(self.class_names), len(self.domain_names), config.vocab_size
        self.layers = [_LayerCounts(E, C, M, V, self.profile_config.top_tokens > 0) for _ in self.layer_ids]
        self.flow_top1 = [torch.zeros(E, E, dtype=torch.int64) for _ in self.layer_ids[1:]]
        self.flow_pairs = [torch.zeros(E, E, dtype=torch.float64) for _ in self.layer_ids[1:]]
        self._hash = hashlib.sha256()
        self.sequences = 0

    @torch.no_grad()
    def update(
        self,
        input_ids_BS: torch.Tensor,
        routing: Sequence[RoutingRecord],
        domains_BS: torch.Tensor | None = None,
    ) -> None:
        """Add one forward's records (one per MoE layer, in layer order) for the tokens ``input_ids_BS``."""
        if len(routing) != len(self.layer_ids):
            raise ProfileError(
                f"got {len(routing)} routing records for {len(self.layer_ids)} MoE layers "
                f"{self.layer_ids}; call the model with output_routing=True"
            )
        ids_T = input_ids_BS.reshape(-1).to("cpu", torch.int64)
        T = ids_T.numel()
        self._hash.update(str(tuple(input_ids_BS.shape)).encode())
        self._hash.update(ids_T.numpy().tobytes())
        self.sequences += input_ids_BS.shape[0] if input_ids_BS.dim() > 1 else 1
        class_T = self.token_classes_V[ids_T] if self.token_classes_V is not None else None
        domain_T = None
        if self.domain_names:
            if domains_BS is None:
                raise ProfileError(
                    "domain_names were given but this batch has no domain ids; pass domains_BS"
                )
            domain_T = domains_BS.reshape(-1).to("cpu", torch.int64)
            if domain_T.numel() != T:
                raise ProfileError(f"domain ids have {domain_T.numel()} entries for {T} tokens")
            if domain_T.min() < 0 or domain_T.max() >= len(self.domain_names):
                raise ProfileError(
                    f"domain ids outside 0..{len(self.domain_names) - 1} ({self.domain_names})"
                )

        previous = None
        for i, (acc, record) in enumerate(zip(self.layers, routing)):
            ids_TK = record.expert_ids_TK.detach().to("cpu", torch.int64)
            kept_TK = ~record.dropped_TK.detach().cpu()
            if ids_TK.shape[0] != T:
                raise ProfileError(
                    f"MoE layer {self.layer_ids[i]}: record has {ids_TK.shape[0]} tokens, the batch {T}"
                )
            E, K = acc.E, ids_TK.shape[1]
            acc.K = K
            acc.tokens += T
            acc.kept_E += record.tokens_per_expert_E.detach().cpu().to(torch.int64)
            acc.routed_E += torch.bincount(ids_TK.flatten(), minlength=E)
            acc.dropped_slots += int((~kept_TK).sum())
            acc.dropped_tokens += int(record.dropped_tokens_T.sum())
            probs_TE = record.probs_TE.detach().cpu().double()
            probs_TE = probs_TE / probs_TE.sum(-1, keepdim=True).clamp_min(1e-30)
            acc.entropy_sum += float(torch.special.entr(probs_TE).sum())
            acc.confidence_sum += float(probs_TE.max(-1).values.sum())
            multihot_TE = (
                torch.zeros(T, E, dtype=torch.float64).scatter_add_(1, ids_TK, kept_TK.double()).clamp_(max=1)
            )
            acc.coactivation_EE += multihot_TE.t() @ multihot_TE
            slot_expert = ids_TK[kept_TK]  # kept slots, flattened in (token, slot) order
            slot_token = torch.arange(T)[:, None].expand(T, K)[kept_TK]
            if class_T is not None:
                acc.class_EC += torch.bincount(slot_expert * acc.C + class_T[slot_token], minlength=E * acc.C)
            if domain_T is not None:
                acc.domain_EM += torch.bincount(
                    slot_expert * acc.M + domain_T[slot_token], minlength=E * acc.M
                )
            if acc.token_EV is not None:
                if ids_T.numel() and int(ids_T.max()) >= acc.V:
                    raise ProfileError(f"token id {int(ids_T.max())} >= vocab_size {acc.V}")
                acc.token_EV += torch.bincount(slot_expert * acc.V + ids_T[slot_token], minlength=E * acc.V)
            # primary expert: the kept slot with the largest combine weight, -1 when no slot was kept
            weights_TK = record.weights_TK.detach().cpu().float().masked_fill(~kept_TK, -1.0)
            primary_T = ids_TK.gather(1, weights_TK.argmax(1, keepdim=True)).squeeze(1)
            primary_T = primary_T.masked_fill(~kept_TK.any(1), -1)
            if previous is not None:
                prev_primary_T, prev_multihot_TE = previous
                both = (prev_primary_T >= 0) & (primary_T >= 0)
                self.flow_top1[i - 1] += torch.bincount(
                    prev_primary_T[both] * E + primary_T[both], minlength=E * E
                ).view(E, E)
                self.flow_pairs[i - 1] += prev_multihot_TE.t() @ multihot_TE
            previous = (primary_T, multihot_TE)

    def result(self, dataset_labels: dict[str, Any] | None = None) -> RouterProfile:
        """The profile of everything seen so far; ``dataset_labels`` (e.g. split, data_dir) go into its
        dataset section beside the fingerprint."""
        n_top = self.profile_config.top_tokens
        layers = []
        for layer_id, acc in zip(self.layer_ids, self.layers):
            top_tokens: list[list[TopToken]] = []
            if acc.token_EV is not None:
                token_EV = acc.token_EV.view(acc.E, acc.V)
                for e in range(acc.E):
                    counts_V = token_EV[e]
                    n = min(n_top, int((counts_V > 0).sum()))
                    # sort by count, ties by token id, so the order does not depend on the sort algorithm
                    order = np.lexsort((np.arange(acc.V), -counts_V.numpy()))[:n]
                    decode = self.tokenizer is not None and self.profile_config.include_vocab_pieces
                    strings = (self.tokenizer.decode([int(t)]) for t in order) if decode else (None,) * n
                    top_tokens.append([TopToken(int(t), int(counts_V[t]), s) for t, s in zip(order, strings)])
            layers.append(
                LayerProfile(
                    layer_id=layer_id,
                    num_experts=acc.E,
                    slots_per_token=acc.K,
                    tokens=acc.tokens,
                    kept_E=acc.kept_E.numpy().copy(),
                    routed_E=acc.routed_E.numpy().copy(),
                    dropped_slots=acc.dropped_slots,
                    dropped_tokens=acc.dropped_tokens,
                    entropy_sum=acc.entropy_sum,
                    confidence_sum=acc.confidence_sum,
                    coactivation_EE=acc.coactivation_EE.round().to(torch.int64).numpy(),
                    class_counts_EC=acc.class_EC.view(acc.E, acc.C).numpy().copy(),
                    domain_counts_EM=acc.domain_EM.view(acc.E, acc.M).numpy().copy(),
                    top_tokens=top_tokens,
                )
            )
        flows = [
            FlowProfile(a, b, top1.numpy().copy(), pairs.round().to(torch.int64).numpy())
            for a, b, top1, pairs in zip(self.layer_ids, self.layer_ids[1:], self.flow_top1, self.flow_pairs)
        ]
        dataset = {
            "fingerprint": self._hash.hexdigest(),
            "tokens": self.layers[0].tokens,
            "sequences": self.sequences,
            **(dataset_labels or {}),
        }
        return RouterProfile(
            model=model_info(self.config),
            dataset=dataset,
            class_names=self.class_names,
            domain_names=self.domain_names,
            rare_fraction=self.profile_config.rare_fraction,
            layers=layers,
            flows=flows,
        )


def _split_batch(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict):
        return batch["input_ids"], batch.get("domains")
    raise ProfileError(
        f"a batch must be a LongTensor [B, S], a (input_ids, domains) pair or a dict; "
        f"got {type(batch).__name__}"
    )


@torch.no_grad()
def collect_profile(
    model,
    batches: Iterable,
    profile_config: ProfileConfig | None = None,
    *,
    token_classes_V: np.ndarray | torch.Tensor | None = None,
    class_names: Sequence[str] = TOKEN_CLASSES,
    domain_names: Sequence[str] = (),
    tokenizer=None,
    dataset_labels: dict[str, Any] | None = None,
) -> RouterProfile:
    """Run ``model`` in eval mode over ``batches`` and return its `RouterProfile`.

    A batch is a LongTensor ``[B, S]`` of token ids, a ``(input_ids_BS, domains_BS)`` pair, or a dict with
    ``input_ids`` and optionally ``domains``. The model's train/eval mode is restored afterwards.
    """
    profile_config = profile_config or ProfileConfig()
    collector = ProfileCollector(
        model.config,
        profile_config,
        token_classes_V=token_classes_V,
        class_names=class_names,
        domain_names=domain_names,
        tokenizer=tokenizer,
    )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    from moe_core.progress import Progress

    total = profile_config.max_batches
    if hasattr(batches, "__len__"):
        total = len(batches) if total is None else min(total, len(batches))
    bar = Progress(total, "profile", unit="batch")
    try:
        for n, batch in enumerate(batches):
            if profile_config.max_batches is not None and n >= profile_config.max_batches:
                break
            bar.update(1)
            input_ids_BS, domains_BS = _split_batch(batch)
            if input_ids_BS.dim() == 1:
                input_ids_BS = input_ids_BS[None]
                domains_BS = None if domains_BS is None else domains_BS[None]
            out = model(input_ids_BS.to(device), output_routing=True, use_cache=False)
            collector.update(input_ids_BS, out.routing, domains_BS)
    finally:
        bar.close()
        model.train(was_training)
    if collector.sequences == 0:
        raise ProfileError("no batch was given: the evaluation set is empty")
    return collector.result(dataset_labels)


def profile_split(
    model,
    data_dir: str | Path,
    split: str = "validation",
    batch_size: int = 8,
    max_batches: int | None = None,
    profile_config: ProfileConfig | None = None,
    tokenizer=None,
) -> RouterProfile:
    """The router profile of ``model`` on one split of a prepared-data directory (``moe-lab data prepare``):
    token classes from the data's tokenizer (or ``tokenizer``), domains from its manifest."""
    from moe_core.analytics.token_classes import token_class_table
    from moe_core.data.shards import PackedTokens
    from moe_core.data.tokenizer import load_tokenizer
    from moe_core.eval.batches import split_batches

    data = PackedTokens(data_dir, split)
    if tokenizer is None and (Path(data_dir) / "tokenizer").is_dir():
        tokenizer = load_tokenizer(Path(data_dir) / "tokenizer")
    classes_V = token_class_table(tokenizer, model.config.vocab_size) if tokenizer is not None else None
    batches = split_batches(
        data_dir, split, batch_size, max_batches, with_domains=True, verify=False
    )  # PackedTokens above checked the shards
    return collect_profile(
        model,
        batches,
        profile_config,
        token_classes_V=classes_V,
        class_names=TOKEN_CLASSES,
        domain_names=data.domain_names,
        tokenizer=tokenizer,
        dataset_labels={
            "data_dir": str(data_dir),
            "split": split,
            "data_manifest_tokenizer_hash": data.manifest["tokenizer"]["hash"],
        },
    )
