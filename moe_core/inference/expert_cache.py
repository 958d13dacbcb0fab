"""Dynamic expert cache: experts live on disk and an LRU keeps a configurable number of them in memory.

Legend: T = tokens, D = model dim, E = experts, K = slots per token.

    from moe_core.inference import offload_experts
    cache = offload_experts(model, "experts_dir", capacity=16, prefetch=True)
    model.generate(...)          # outputs equal the full model's; cache.stats has hits, misses, fallbacks

`offload_experts` writes every expert of every MoE layer to its own safetensors file
(``layer{L}_expert{E}.safetensors`` holding ``gate_proj``, ``up_proj``, ``down_proj``), then replaces each
`GroupedExperts` by an `OffloadedExperts` holding no expert weights. On each forward the layer asks the
`ExpertCache` for the experts its tokens chose; a miss reads the file through ``safetensors.safe_open``
(memory-mapped) and may evict the least recently used expert. The experts run one at a time on their own
tokens (the per-expert loop of `DecodeExperts`), so outputs match the full model to float rounding.

Prefetch (``prefetch=True``): after layer l routes, the *next* MoE layer's router is applied to layer l's
MoE input (the residual stream changes little from one layer to the next) and its top-K experts are loaded
before they are asked for (``stats.prefetched``, and the hits they turn into, ``stats.prefetch_hits``).

Graceful degradation: an expert that cannot be used is marked unavailable, a warning is issued once (naming
the file and why), ``stats.unavailable`` counts such experts and ``stats.fallbacks`` each rerouted slot, and its
tokens go to their best available expert by router probability (keeping the slot's combine weight);
generation continues. "Cannot be used" is any of: the file is missing or unreadable (not safetensors), a
projection is missing, or a tensor has the wrong shape, dtype or non-finite values. Rerouting repeats until
every slot lands on an expert that loaded (several of a token's top choices may be missing at once); only a
layer with no usable expert left raises `ExpertCacheError`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from moe_core.errors import MoELabError
from moe_core.experts import ExpertModule, GroupedExperts, ffn_act
from moe_core.routing import RoutingRecord

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
INDEX_FILE = "experts_index.json"


class ExpertCacheError(MoELabError):
    """The expert store cannot serve a request at all (e.g. no expert of a layer can be loaded)."""


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetched: int = 0  # experts loaded ahead of use
    prefetch_hits: int = 0  # hits on an expert that a prefetch brought in
    fallbacks: int = 0  # slots rerouted because their expert could not be loaded
    unavailable: int = 0  # experts found unusable (missing, unreadable, wrong names/shapes/dtype, non-finite)

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


def expert_file(directory: Path, layer: int, expert: int) -> Path:
    return directory / f"layer{layer}_expert{expert}.safetensors"


class ExpertCache:
    """An LRU of ``capacity`` experts (across all layers), loaded from per-expert safetensors files."""

    def __init__(
        self, directory: str | os.PathLike, capacity: int, device: torch.device | str = "cpu"
    ) -> None:
        if capacity < 1:
            raise ExpertCacheError(f"ExpertCache capacity={capacity}: must hold at least one expert")
        self.directory, self.capacity, self.device = Path(directory), capacity, torch.device(device)
        self.resident: OrderedDict[tuple[int, int], dict[str, torch.Tensor]] = OrderedDict()
        self.unavailable: set[tuple[int, int]] = set()
        self.prefetched_keys: set[tuple[int, int]] = set()
        # per layer, what each expert file must hold: projection name -> (shape, dtype)
        self.expected: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
        self.stats = CacheStats()

    def expect(self, layer: int, spec: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Declare the tensors every expert file of ``layer`` must hold; anything else counts as unusable."""
        self.expected[layer] = spec

    def _check(self, layer: int, weights: dict[str, torch.Tensor]) -> str | None:
        """Why these tensors cannot stand in for the layer's expert (None when they can)."""
        for name, (shape, dtype) in self.expected.get(layer, {}).items():
            if name not in weights:
                return f"no tensor {name!r}"
            tensor = weights[name]
            if tuple(tensor.shape) != shape:
                return f"{name} has shape {tuple(tensor.shape)}, expected {shape}"
            if tensor.dtype != dtype:
                return f"{name} has dtype {tensor.dtype}, expected {dtype}"
            if not bool(torch.isfinite(tensor).all()):
                return f"{name} holds non-finite values"
        return None

    def _load(self, key: tuple[int, int]) -> dict[str, torch.Tensor] | None:
        path = expert_file(self.directory, *key)
        try:
            with safe_open(str(path), framework="pt", device=str(self.device)) as f:
                weights = {name: f.get_tensor(name) for name in f.keys()}
            problem = self._check(key[0], weights)
        except Exception as err:  # missing, truncated or corrupt file: degrade, do not stop generation
            problem = f"unreadable: {type(err).__name__}"
        if problem is None:
            return weights
        self.unavailable.add(key)
        self.stats.unavailable += 1
        warnings.warn(
            f"expert {key[1]} of layer {key[0]} cannot be used from {path} ({problem}); its tokens go to "
            "their best available expert",
            RuntimeWarning,
            stacklevel=3,
        )
        return None

    def _insert(self, key, weights) -> None:
        self.resident[key] = weights
        while len(self.resident) > self.capacity:
            old, _ = self.resident.popitem(last=False)
            self.prefetched_keys.discard(old)
            self.stats.evictions += 1

    def get(self, layer: int, expert: int) -> dict[str, torch.Tensor] | None:
        key = (layer, expert)
        if key in self.resident:
            self.resident.move_to_end(key)
            self.stats.hits += 1
            if key in self.prefetched_keys:
                self.stats.prefetch_hits += 1
                self.prefetched_keys.discard(key)
            return self.resident[key]
        if key in self.unavailable:
            return None
        self.stats.misses += 1
        weights = self._load(key)
        if weights is not None:
            self._insert(key, weights)
        return weights

    def available(self, layer: int, expert: int) -> bool:
        return (layer, expert) not in self.unavailable

    def prefetch(self, layer: int, experts: list[int]) -> None:
        for e in experts:
            key = (layer, e)
            if key in self.resident or key in self.unavailable:
                continue
            weights = self._load(key)
            if weights is not None:
                self._insert(key, weights)
                self.prefetched_keys.add(key)
                self.stats.prefetched += 1


class OffloadedExperts(nn.Module, ExpertModule):
    """An `ExpertModule` standing in for a `GroupedExperts`, whose weights come from an `ExpertCache`; ``impl``
    is ignored (its experts run one at a time on their own tokens)."""

    def __init__(self, layer_id: int, num_experts: int, activation: str, cache: ExpertCache) -> None:
        super().__init__()
        self.layer_id, self.num_experts, self.activation, self.cache = (
            layer_id,
            num_experts,
            activation,
            cache,
        )
        # (next MoE layer id, its router), set by offload_experts when prefetching; a tuple, so the router is
        # not registered twice as a submodule
        self.prefetch_from: tuple[int, nn.Module] | None = None

    def _reroute(self, record: RoutingRecord) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots whose expert is unavailable move to the best available expert not already chosen."""
        ids_TK, dropped_TK = record.expert_ids_TK.clone(), record.dropped_TK
        bad_E = torch.tensor([not self.cache.available(self.layer_id, e) for e in range(self.num_experts)])
        if not bad_E.any():
            return ids_TK, dropped_TK
        moved = bad_E[ids_TK] & ~dropped_TK
        if bad_E.all():
            raise ExpertCacheError(
                f"no expert of layer {self.layer_id} can be loaded from {self.cache.directory}"
            )
        for t, k in moved.nonzero().tolist():
            probs_E = record.probs_TE[t].clone()
            probs_E[bad_E] = -1.0
            probs_E[ids_TK[t]] = -1.0  # not an expert this token already uses
            best = int(probs_E.argmax())
            if probs_E[best] < 0:  # every available expert is already among the token's choices
                dropped_TK = dropped_TK.clone()
                dropped_TK[t, k] = True
            ids_TK[t, k] = best
            self.cache.stats.fallbacks += 1
        return ids_TK, dropped_TK

    def forward(self, x_TD: torch.Tensor, record: RoutingRecord, impl: str | None = None) -> torch.Tensor:
        # A load failing now marks that expert unavailable, so the slots may need to move again. Each round
        # reroutes the router's ORIGINAL choices against every expert known bad so far (not the previous round's
        # result), so where a slot lands does not depend on the order failures were found in; each round marks
        # at least one more expert unavailable, so this ends, and _reroute raises once the layer has none left.
        for _ in range(self.num_experts + 1):
            ids_TK, dropped_TK = self._reroute(record)
            needed = sorted(set(ids_TK.masked_select(~dropped_TK).tolist()))
            weights = {e: self.cache.get(self.layer_id, e) for e in needed}
            if all(w is not None for w in weights.values()):
                break
        if self.prefetch_from is not None:
            next_layer, next_router = self.prefetch_from
            with torch.no_grad():
                predicted = next_router(x_TD).expert_ids_TK.unique().tolist()
            self.cache.prefetch(next_layer, predicted)

        weights_TK = record.weights_TK.to(x_TD.dtype)
        y_TD = torch.zeros_like(x_TD)
        for e, w in weights.items():
            token_idx, slot_idx = torch.where((ids_TK == e) & ~dropped_TK)
            h_gate = F.linear(x_TD[token_idx], w["gate_proj"]) if "gate_proj" in w else None
            h = ffn_act(self.activation, h_gate, F.linear(x_TD[token_idx], w["up_proj"]))
            out_ND = F.linear(h, w["down_proj"]) * weights_TK[token_idx, slot_idx, None]
            y_TD = y_TD.index_add(0, token_idx, out_ND)
        return y_TD


@torch.no_grad()
def write_experts(model, directory: str | os.PathLike) -> Path:
    """Every expert of every MoE layer to ``directory/layer{L}_expert{E}.safetensors`` plus an index."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index = {"layers": {}}
    for layer_id, layer in enumerate(model.model.layers):
        if not layer.is_moe:
            continue
        experts = layer.mlp.experts
        if not isinstance(experts, GroupedExperts):
            raise ExpertCacheError(f"layer {layer_id} holds {type(experts).__name__}; offload a plain model")
        for e in range(experts.num_experts):
            tensors = {
                p: getattr(experts, p)[e].detach().contiguous().clone()
                for p in PROJECTIONS
                if getattr(experts, p) is not None
            }
            save_file(tensors, str(expert_file(directory, layer_id, e)))
        index["layers"][str(layer_id)] = experts.num_experts
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return directory


def offload_experts(
    model, directory: str | os.PathLike, capacity: int, *, prefetch: bool = False, write: bool = True
) -> ExpertCache:
    """Move ``model``'s experts to disk behind one LRU `ExpertCache` of ``capacity`` experts; in place.

    ``write=False`` reuses files an earlier call wrote (the model's expert weights are still dropped)."""
    config = model.config
    if config.expert_bias or config.swiglu_limit is not None:  # OffloadedExperts computes the plain FFN only
        raise ExpertCacheError(
            f"expert_bias={config.expert_bias}, swiglu_limit={config.swiglu_limit} (gpt-oss experts): the expert "
            "cache stores and runs weights without biases or the clamped SwiGLU; run this model without it"
        )
    directory = Path(directory)
    if write:
        write_experts(model, directory)
    elif not (directory / INDEX_FILE).is_file():
        raise ExpertCacheError(f"{directory}: no {INDEX_FILE}; call offload_experts with write=True first")
    cache = ExpertCache(directory, capacity, device=next(model.parameters()).device)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if layer.is_moe]
    per_token = len(moe_layers) * model.config.num_experts_per_tok
    if capacity < per_token:
        warnings.warn(
            f"expert cache capacity {capacity} is below the {per_token} experts one token uses "
            f"({len(moe_layers)} MoE layers x top-{model.config.num_experts_per_tok}): the LRU evicts each "
            f"expert before the next token needs it again (hit rate near 0); give a capacity of at least "
            f"{per_token}",
            RuntimeWarning,
            stacklevel=2,
        )
    for i in moe_layers:
        block = model.model.layers[i].mlp
        experts = block.experts
        cache.expect(
            i,
            {
                p: (tuple(getattr(experts, p).shape[1:]), getattr(experts, p).dtype)
                for p in PROJECTIONS
                if getattr(experts, p) is not None
            },
        )
        block.experts = OffloadedExperts(i, experts.num_experts, experts.activation, cache)
    if prefetch:
        for here, nxt in zip(moe_layers, moe_layers[1:]):
            model.model.layers[here].mlp.experts.prefetch_from = (nxt, model.model.layers[nxt].mlp.router)
    return cache
