"""Collecting a router profile: `collect_profile` runs the model in eval mode over an evaluation set and feeds
each forward's `RoutingRecord`s to a `ProfileCollector`, which keeps count tables only (nothing re-derives
routing); `profile_split` does it for one split of a prepared-data directory.

Legend: B = batch, S = sequence, T = B*S tokens, K = expert slots per token, E = experts, C = token classes,
M = document domains, V = vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_core.analytics.profile.config import ProfileConfig, ProfileError
from moe_core.analytics.profile.layer import FlowProfile, LayerProfile, TopToken
from moe_core.analytics.profile.router_profile import RouterProfile
from moe_core.analytics.token_classes import TOKEN_CLASSES, token_class_table
from moe_core.data.shards import PackedTokens
from moe_core.data.tokenizer import load_tokenizer
from moe_core.eval.batches import split_batches
from moe_core.progress import Progress
from moe_core.routing import RoutingRecord


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
    """One MoE layer's running count tables (the [E, C], [E, M] and [E, V] ones flat, as bincount fills them)."""

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
        for i, (counts, record) in enumerate(zip(self.layers, routing)):
            ids_TK = record.expert_ids_TK.detach().to("cpu", torch.int64)
            kept_TK = ~record.dropped_TK.detach().cpu()
            if ids_TK.shape[0] != T:
                raise ProfileError(
                    f"MoE layer {self.layer_ids[i]}: record has {ids_TK.shape[0]} tokens, the batch {T}"
                )
            E, K = counts.E, ids_TK.shape[1]
            counts.K = K
            counts.tokens += T
            counts.kept_E += record.tokens_per_expert_E.detach().cpu().to(torch.int64)
            counts.routed_E += torch.bincount(ids_TK.flatten(), minlength=E)
            counts.dropped_slots += int((~kept_TK).sum())
            counts.dropped_tokens += int(record.dropped_tokens_T.sum())
            probs_TE = record.probs_TE.detach().cpu().double()
            probs_TE = probs_TE / probs_TE.sum(-1, keepdim=True).clamp_min(1e-30)
            counts.entropy_sum += float(torch.special.entr(probs_TE).sum())
            counts.confidence_sum += float(probs_TE.max(-1).values.sum())
            multihot_TE = (
                torch.zeros(T, E, dtype=torch.float64).scatter_add_(1, ids_TK, kept_TK.double()).clamp_(max=1)
            )
            counts.coactivation_EE += multihot_TE.t() @ multihot_TE
            slot_expert = ids_TK[kept_TK]  # kept slots, flattened in (token, slot) order
            slot_token = torch.arange(T)[:, None].expand(T, K)[kept_TK]
            if class_T is not None:
                counts.class_EC += torch.bincount(
                    slot_expert * counts.C + class_T[slot_token], minlength=E * counts.C
                )
            if domain_T is not None:
                counts.domain_EM += torch.bincount(
                    slot_expert * counts.M + domain_T[slot_token], minlength=E * counts.M
                )
            if counts.token_EV is not None:
                if ids_T.numel() and int(ids_T.max()) >= counts.V:
                    raise ProfileError(f"token id {int(ids_T.max())} >= vocab_size {counts.V}")
                counts.token_EV += torch.bincount(
                    slot_expert * counts.V + ids_T[slot_token], minlength=E * counts.V
                )
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
        for layer_id, counts in zip(self.layer_ids, self.layers):
            top_tokens: list[list[TopToken]] = []
            if counts.token_EV is not None:
                token_EV = counts.token_EV.view(counts.E, counts.V)
                for e in range(counts.E):
                    counts_V = token_EV[e]
                    n = min(n_top, int((counts_V > 0).sum()))  # top tokens this expert has
                    # sort by count, ties by token id, so the order does not depend on the sort algorithm
                    order = np.lexsort((np.arange(counts.V), -counts_V.numpy()))[:n]
                    decode = self.tokenizer is not None and self.profile_config.include_vocab_pieces
                    strings = (self.tokenizer.decode([int(t)]) for t in order) if decode else (None,) * n
                    top_tokens.append([TopToken(int(t), int(counts_V[t]), s) for t, s in zip(order, strings)])
            layers.append(
                LayerProfile(
                    layer_id=layer_id,
                    num_experts=counts.E,
                    slots_per_token=counts.K,
                    tokens=counts.tokens,
                    kept_E=counts.kept_E.numpy().copy(),
                    routed_E=counts.routed_E.numpy().copy(),
                    dropped_slots=counts.dropped_slots,
                    dropped_tokens=counts.dropped_tokens,
                    entropy_sum=counts.entropy_sum,
                    confidence_sum=counts.confidence_sum,
                    coactivation_EE=counts.coactivation_EE.round().to(torch.int64).numpy(),
                    class_counts_EC=counts.class_EC.view(counts.E, counts.C).numpy().copy(),
                    domain_counts_EM=counts.domain_EM.view(counts.E, counts.M).numpy().copy(),
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
