"""Selective expert loading: drop (or merge) experts the router rarely uses, for a smaller checkpoint.

Legend: E = experts before, E' = experts kept, D = model dim, P = gate rows kept for the softmax denominator.

Usage comes from a router profile (`moe_core.analytics.profile.RouterProfile`: the kept slots per expert of
each MoE layer, `usage_from_profile`) or is counted here from ``model(x, output_routing=True)``
(`collect_usage`); either way it is ``{layer_id: LongTensor [E]}``.

Our config has one ``num_experts`` for all layers, so every MoE layer keeps the same number E' of experts:
``keep_experts`` if given, else the most experts any layer has at or above ``min_share`` of its slots (never
fewer than ``num_experts_per_tok``). Each layer keeps its own E' most used experts, in their original order.
The router is adjusted by keeping the gate rows (and any per-expert router buffer, e.g. the aux-loss-free
bias) of the kept experts. Tokens whose K choices were all kept get the same experts and, with
``norm_topk_prob`` (Mixtral), the same weights. Without it (OLMoE, Qwen2-MoE, Switch: the top-k weights are
raw softmax probabilities) a softmax over the kept experts only would scale every kept weight by
1 / (1 - dropped mass), a per-token change of scale the model was never trained with; so by default the
dropped experts' gate rows stay in the pruned router's softmax denominator (``router_pruned_experts``,
`moe_core.routing.keep_pruned_mass`) and every kept expert gets exactly the weight the unpruned router gave
it. On olmoe-small this cuts the loss at 32/64 experts from +1.18% to +0.37% (frequency) and at 16/64 from
+97% to +36% (REAP) (benchmarks/README.md).
``PruneConfig.pruned_choices="drop"`` also leaves empty the slot of a token whose top-k choice was dropped,
instead of refilling it with its next-best kept expert (an expert the layer never combined with that token
in training): the unpruned routing with the dropped experts' outputs taken as zero.
``PruneConfig.renormalize=True`` drops the rows instead (what REAP's reference implementation does; its
models mostly renormalize top-k, where the two agree), for a checkpoint Hugging Face's OLMoE / Qwen2-MoE
classes can express (`moe_core.convert` refuses the denominator rows rather than approximate them).

Two criteria rank a layer's experts (``PruneConfig.criterion``):
- ``frequency``: routed slots (the usage above).
- ``reap``: router-weighted expert activation (REAP, Lasby et al. 2025, "REAP the Experts: Why Pruning
  Prevails for One-Shot MoE Compression"): ``S_e = mean over the tokens routed to e of g_e(x) * ||f_e(x)||_2``
  with ``g_e`` the combine weight the router gave e and ``f_e(x)`` the expert's output, from calibration
  batches (`collect_saliency`). An expert that is often picked with a small weight, or whose output is small,
  contributes little to the layer's output however often it runs; the mean (not the sum) is REAP's choice.
  Never-routed experts have saliency 0.

``merge_similar``: each dropped expert is folded into the kept expert whose weights are most similar
(cosine of the flattened gate/up/down), a usage-weighted average (in the spirit of "merge, then compress",
Li et al. 2024, MC-SMoE), instead of being discarded.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moe_core.analytics.profile import RouterProfile
from moe_core.config import MoEConfig
from moe_core.convert import copy_companion_files
from moe_core.errors import MoELabError
from moe_core.experts import PROJECTIONS, StackedExperts
from moe_core.fileio import atomic_directory, check_output_dir
from moe_core.finetune.sizing import read_dtype
from moe_core.inference.evaluate import calibration_pass
from moe_core.loading import (
    MAPPABLE,
    PRUNE_FILE,
    adapter_to_merge,
    detect,
    load,
    merges_as_written,
    tokenizer_dir,
)
from moe_core.mapped import ExpertDeltas, MappedExperts, mapping_refusal, save_streaming
from moe_core.model import MoEForCausalLM, materialize_unsaved
from moe_core.routing import pruned_mass_matters

# the largest safetensors file written: from a memory-mapped model each shard's stacks are made in memory while
# it is written, so this bounds that copy (transformers' save_pretrained default, 50 GB, would be the model)
SHARD_BYTES = 2 * 10**9


class PruneError(MoELabError):
    """A pruning request that cannot be honoured; the message says why and what to do."""


@dataclass(frozen=True)
class PruneConfig:
    keep_experts: int | None = None  # experts kept per MoE layer; None: decided by min_share
    min_share: float = 0.0  # drop experts below this share of a layer's slots (0 drops only never-used ones)
    merge_similar: bool = False
    criterion: str = "frequency"  # "frequency" (routed slots) or "reap" (router-weighted activation)
    # True: softmax over the kept experts only; False: dropped experts' mass stays in the denominator
    renormalize: bool = False
    # a token's choice of a dropped expert: "refill" (next-best kept expert) or "drop" (its slot stays empty)
    pruned_choices: str = "refill"

    def __post_init__(self) -> None:
        if self.criterion not in ("frequency", "reap"):
            raise PruneError(f"PruneConfig.criterion={self.criterion!r}: choose 'frequency' or 'reap'")
        if self.pruned_choices not in ("refill", "drop"):
            raise PruneError(f"PruneConfig.pruned_choices={self.pruned_choices!r}: choose 'refill' or 'drop'")
        if self.pruned_choices == "drop" and self.renormalize:
            raise PruneError(
                "PruneConfig.pruned_choices='drop' ranks kept experts against the dropped experts' gate rows, "
                "which renormalize=True discards; choose one"
            )
        if self.keep_experts is not None and self.keep_experts < 1:
            raise PruneError(f"PruneConfig.keep_experts={self.keep_experts!r}: must be >= 1")
        if not 0.0 <= self.min_share < 1.0:
            raise PruneError(f"PruneConfig.min_share={self.min_share!r}: must be in [0, 1)")


@dataclass
class PruneReport:
    experts_before: int
    experts_after: int
    kept: dict[int, list[int]]  # per MoE layer, the original ids of the kept experts
    merged_into: dict[int, dict[int, int]] = field(default_factory=dict)  # layer -> dropped -> kept
    params_before: int = 0
    params_after: int = 0
    usage_share_kept: dict[int, float] = field(default_factory=dict)  # share of slots the kept experts took
    criterion: str = "frequency"
    router_pruned_experts: int = 0  # gate rows the pruned router keeps in its softmax denominator only
    perplexity: dict[str, float] = field(default_factory=dict)  # filled by callers that evaluate

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line for people (the whole report is ``pruning.json``)."""
        if self.experts_after == self.experts_before:
            return (
                f"pruned nothing: every MoE layer keeps its {self.experts_before} experts ({self.criterion}); "
                "give --keep N, or a --min-share above the least used experts' share"
            )
        fewer = 1 - self.params_after / self.params_before if self.params_before else 0.0
        shares = list(self.usage_share_kept.values())
        kept = (
            f"; the kept experts took {min(shares):.1%}-{max(shares):.1%} of each layer's slots"
            if shares
            else ""
        )
        return (
            f"{self.experts_before} -> {self.experts_after} experts per MoE layer ({self.criterion}), "
            f"{self.params_before:,} -> {self.params_after:,} parameters ({fewer:.0%} fewer){kept}"
        )


# ---------------------------------------------------------------------------------------------- usage
def usage_from_profile(profile) -> dict[int, torch.Tensor]:
    """``{layer_id: kept slots per expert}`` from a `RouterProfile` (or a path to its directory)."""
    if isinstance(profile, str | os.PathLike):
        profile = RouterProfile.from_dir(profile)
    return {layer.layer_id: torch.as_tensor(layer.kept_E, dtype=torch.long) for layer in profile.layers}


@torch.no_grad()
def collect_usage(model, batches: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Count each MoE layer's kept slots per expert over ``batches`` of token ids (eval mode, no grad)."""
    was_training = model.training
    model.eval()
    usage: dict[int, torch.Tensor] = {}
    try:
        for input_ids_BS in batches:
            routing = model(input_ids=input_ids_BS, use_cache=False, output_routing=True).routing
            for layer_id, record in zip(model.config.moe_layer_ids, routing):
                usage[layer_id] = usage.get(layer_id, 0) + record.tokens_per_expert_E.cpu()
    finally:
        model.train(was_training)
    return usage


@torch.no_grad()
def collect_saliency(model, batches: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """REAP saliency per MoE layer, ``{layer_id: FloatTensor [E]}``: per expert, the mean over the slots
    routed to it of (combine weight x L2 norm of the expert's output), over ``batches`` of token ids. A
    fine-tune's adapter as it trained (LoRA on the experts, unmerged: `moe_core.finetune.as_trained`) is in each
    expert's output, as its forward applies it."""
    layers = {  # the experts modules themselves (under a fine-tune's LoRA wrappers, the module they wrap)
        layer_id: next(
            (m for m in model.model.layers[layer_id].mlp.experts.modules() if isinstance(m, StackedExperts)),
            None,
        )
        for layer_id in model.config.moe_layer_ids
    }
    E = model.config.num_experts
    sums = {layer_id: torch.zeros(E, dtype=torch.float64) for layer_id in layers}
    counts = {layer_id: torch.zeros(E, dtype=torch.float64) for layer_id in layers}
    hooks = []
    for layer_id, experts in layers.items():
        if not isinstance(experts, StackedExperts):
            raise PruneError(f"layer {layer_id} has no stacked experts (an offloaded or dense model?)")

        def hook(module, args, kwargs, _out, layer_id=layer_id):
            x_TD, record = args[0], args[1]
            lora = kwargs.get("lora")  # an adapter's factors on these experts (`ExpertLoRA`), or None
            views = lora.unbound() if lora is not None else None
            for e in range(module.num_experts):  # each expert on its routed tokens, as forward_reference
                token_idx, slot_idx = torch.where((record.expert_ids_TK == e) & ~record.dropped_TK)
                if token_idx.numel() == 0:
                    continue
                norm_N = module.expert(e, x_TD[token_idx], lora=views).float().norm(dim=-1)
                sums[layer_id][e] += (record.weights_TK[token_idx, slot_idx].float() * norm_N).sum().double()
                counts[layer_id][e] += token_idx.numel()

        hooks.append((experts, hook))
    calibration_pass(model, batches, hooks, with_kwargs=True)
    if not any(float(c.sum()) for c in counts.values()):
        raise PruneError("the calibration batches routed no tokens; give token ids [B, S]")
    return {layer_id: (sums[layer_id] / counts[layer_id].clamp_min(1)).float() for layer_id in layers}


def _normalize_usage(usage, config, dtype=torch.long) -> dict[int, torch.Tensor]:
    if isinstance(usage, Mapping):
        usage = {int(k): torch.as_tensor(v, dtype=dtype) for k, v in usage.items()}
    else:
        usage = {layer: torch.as_tensor(v, dtype=dtype) for layer, v in zip(config.moe_layer_ids, usage)}
    missing = [layer for layer in config.moe_layer_ids if layer not in usage]
    if missing:
        raise PruneError(
            f"no expert usage for MoE layers {missing}; the profile must come from this model "
            f"(MoE layers {config.moe_layer_ids})"
        )
    for layer, counts in usage.items():
        if counts.shape != (config.num_experts,):
            raise PruneError(
                f"usage of layer {layer} has shape {tuple(counts.shape)}, expected "
                f"({config.num_experts},): the profile is of a different model"
            )
    return usage


def choose_experts(scores: dict[int, torch.Tensor], config, prune: PruneConfig) -> dict[int, list[int]]:
    """Per layer, the ids of the ``keep`` experts with the highest score (slots, or REAP saliency), sorted.
    Without ``keep_experts``, ``min_share`` applies to each layer's share of its total score."""
    K, E = config.num_experts_per_tok, config.num_experts
    if prune.keep_experts is not None:
        keep = prune.keep_experts
    else:
        keep = max(
            int((counts.float() / counts.float().sum().clamp_min(1e-12) >= max(prune.min_share, 1e-12)).sum())
            for counts in scores.values()
        )
    if keep > E:
        raise PruneError(f"keep_experts={keep} is more than the model's {E} experts")
    keep = max(keep, K)
    kept = {}
    for layer, counts in scores.items():
        order = sorted(range(E), key=lambda e: (-float(counts[e]), e))  # highest score first, ties by id
        kept[layer] = sorted(order[:keep])
    return kept


# ---------------------------------------------------------------------------------------------- pruning
@torch.no_grad()
def prune_experts(model, usage, prune: PruneConfig | None = None, saliency=None):
    """A new, smaller `MoEForCausalLM` keeping each layer's highest-ranked experts; returns (model, report). The
    tensors pruning does not cut (attention, norms, embeddings, dense layers), and the kept experts of memory-mapped
    `MappedExperts` (the file's tensors, renumbered), are ``model``'s own, shared, not copied: train one of the two
    and the other changes too (``copy.deepcopy`` first to keep both apart).

    ``usage``: routed slots per layer (ranks experts for ``criterion="frequency"``, weights merges, and gives
    the report's kept share); ``saliency``: `collect_saliency`'s REAP scores, required for ``"reap"``."""
    prune = prune or PruneConfig()
    config = model.config
    if config.num_experts == 0:
        raise PruneError("the model is dense (num_experts=0): nothing to prune")
    if config.router == "expert_choice":
        raise PruneError(
            "expert_choice routing sets capacity from the number of experts; prune a token-choice model"
        )
    usage = _normalize_usage(usage, config)
    if prune.criterion == "reap":
        if saliency is None:
            raise PruneError(
                "criterion='reap' needs REAP saliency from calibration data (collect_saliency; "
                "from the CLI, --data DIR)"
            )
        kept = choose_experts(_normalize_usage(saliency, config, torch.float32), config, prune)
    else:
        kept = choose_experts(usage, config, prune)
    E_new = len(next(iter(kept.values())))
    keep_mass = not prune.renormalize and pruned_mass_matters(config)
    data = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures"):
        data.pop(key, None)
    data["num_experts"] = E_new
    # rows already kept for the denominator by an earlier pruning, plus the experts dropped now
    data["router_pruned_experts"] = (
        config.router_pruned_experts + config.num_experts - E_new if keep_mass else 0
    )
    data["router_pruned_choices"] = prune.pruned_choices if keep_mass else "refill"
    try:
        new_config = MoEConfig.from_dict(data)
    except ValueError as err:  # e.g. pruned_choices="drop" on a router that selects with a bias
        raise PruneError(f"cannot prune this model so: {err}") from None
    with torch.device("meta"):  # the kept tensors are assigned to it below: no second model is allocated
        new_model = MoEForCausalLM(new_config).eval()

    state = model.state_dict()
    new_state = {}
    report = PruneReport(
        config.num_experts,
        E_new,
        kept,
        criterion=prune.criterion,
        router_pruned_experts=new_config.router_pruned_experts,
    )
    layers = model.model.layers
    for name, tensor in state.items():
        if not _mapped_expert_weight(model, name):  # those go in below, the kept ones under their new index
            new_state[name] = tensor
    for layer_id, ids in kept.items():
        prefix = f"model.layers.{layer_id}.mlp."
        index = torch.tensor(ids)
        experts = layers[layer_id].mlp.experts
        biases = {
            f"{p}_bias": experts.bias_stack(p).detach()
            for p in PROJECTIONS
            if experts.bias_stack(p) is not None
        }
        if isinstance(experts, MappedExperts) and not prune.merge_similar:
            # one tensor per expert, the file's: the kept ones, renumbered, still the file's (no copy)
            bias_dtype = getattr(experts, f"{experts.projections[0]}_0").dtype
            with torch.device("meta"):  # placeholders: the kept tensors are assigned below
                new_model.model.layers[layer_id].mlp.experts = MappedExperts.shaped_like(
                    experts, bias_dtype, num_experts=len(ids)
                )
            for j, e in enumerate(ids):
                for p in experts.projections:
                    new_state[f"{prefix}experts.{p}_{j}"] = getattr(experts, f"{p}_{e}")
            stacks = biases  # gpt-oss's expert biases [E, O], a few numbers per expert: copied
        else:  # the [E, O, I] stacks (mapped experts, merged: stacked into a copy)
            stacks = {
                p: w.detach() for p, w in zip(PROJECTIONS, experts.stacks(), strict=True) if w is not None
            }
            stacks.update(biases)  # gpt-oss's expert biases [E, O]: kept (or merged) with their experts
            if prune.merge_similar:  # merges into the kept rows in place: on a copy of the stacks
                stacks = {p: stack.clone() for p, stack in stacks.items()}
                report.merged_into[layer_id] = _merge(stacks, usage[layer_id], ids)
        for p, stack in stacks.items():
            new_state[f"{prefix}experts.{p}"] = stack.index_select(0, index)
        pruned_rows = prefix + "router.pruned_gate_weight"
        for name, tensor in state.items():  # router weights and per-expert router buffers
            if (
                name.startswith(prefix + "router.")
                and name != pruned_rows
                and tensor.dim() >= 1
                and tensor.shape[0] == config.num_experts
            ):
                new_state[name] = tensor.index_select(0, index)
        new_state.pop(pruned_rows, None)
        if new_config.router_pruned_experts:
            gate_ED = state[prefix + "router.gate.weight"]
            dropped = torch.tensor([e for e in range(config.num_experts) if e not in ids], dtype=torch.long)
            earlier_PD = state.get(pruned_rows, gate_ED[:0])
            new_state[pruned_rows] = torch.cat([earlier_PD, gate_ED.index_select(0, dropped)])
        share = usage[layer_id].float() / usage[layer_id].sum().clamp_min(1)
        report.usage_share_kept[layer_id] = float(share[index].sum())
    missing, unexpected = new_model.load_state_dict(new_state, strict=False, assign=True)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise PruneError(
            f"pruned state does not fit the pruned model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    if new_config.tie_word_embeddings:
        new_model.tie_weights()
    materialize_unsaved(new_model)
    report.params_before = sum(p.numel() for p in model.parameters())
    report.params_after = sum(p.numel() for p in new_model.parameters())
    return new_model, report


def _mapped_expert_weight(model, name: str) -> bool:
    """Whether state-dict entry ``name`` is one expert's weight of `MappedExperts` (``...experts.{p}_{e}``)."""
    prefix, _, leaf = name.rpartition(".")
    module = model.get_submodule(prefix)
    return isinstance(module, MappedExperts) and module.expert_weight(leaf) is not None


def _merge(stacks: dict[str, torch.Tensor], counts_E: torch.Tensor, kept: list[int]) -> dict[int, int]:
    """Fold each dropped expert into its most similar kept one (usage-weighted average), in place."""
    E = counts_E.shape[0]
    flat_EP = torch.cat([s.reshape(E, -1) for s in stacks.values()], dim=1).float()
    flat_EP = flat_EP / flat_EP.norm(dim=1, keepdim=True).clamp_min(1e-12)
    kept_t = torch.tensor(kept)
    weight_E = counts_E.float().clamp_min(1.0)  # a never-used expert still counts a little
    merged: dict[int, int] = {}
    totals = {k: float(weight_E[k]) for k in kept}
    sums = {p: {k: s[k].float() * weight_E[k] for k in kept} for p, s in stacks.items()}
    for d in range(E):
        if d in kept:
            continue
        target = kept[int((flat_EP[kept_t] @ flat_EP[d]).argmax())]
        merged[d] = target
        totals[target] += float(weight_E[d])
        for p, s in stacks.items():
            sums[p][target] = sums[p][target] + s[d].float() * weight_E[d]
    for p, s in stacks.items():
        for k in kept:
            s[k] = (sums[p][k] / totals[k]).to(s.dtype)
    return merged


def prune_checkpoint(
    model_dir: str | os.PathLike,
    profile: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    prune: PruneConfig | None = None,
    calibration: Iterable[torch.Tensor] | None = None,
    *,
    overwrite: bool = False,
) -> PruneReport:
    """`moe-lab prune`: load a checkpoint, rank its experts (slots from a router ``profile`` directory or
    counted on ``calibration`` batches; REAP saliency on ``calibration``), prune, save_pretrained. The output
    is staged (``out_dir`` is the old result or the new one, never a mix); a non-empty ``out_dir`` is
    replaced only with ``overwrite``."""
    prune = prune or PruneConfig()
    check_output_dir(out_dir, overwrite, PruneError)  # before anything expensive
    calibration = list(calibration) if calibration is not None else None
    if profile is None and calibration is None:
        raise PruneError("give a router profile (--profile DIR) or calibration data (--data DIR)")
    if prune.criterion == "reap" and calibration is None:
        raise PruneError(
            "--criterion reap measures expert outputs on calibration data: pass --data DIR "
            "(a prepared-data directory)"
        )
    dtype = read_dtype(model_dir, "prune")
    adapter_alone = (
        detect(model_dir) == "finetuned" and not prune.merge_similar and merges_as_written(model_dir)
    )
    if adapter_alone:
        # a fine-tune's adapter alone: the experts ranked by the routing (REAP: and the outputs) of the adapter over
        # its memory-mapped base (as it trained), then the adapter merged into the kept experts as they are written;
        # the merged model is never in memory (a base larger than memory prunes too)
        from moe_core.finetune.export import merged_for_writing  # peft: for adapters only
        from moe_core.finetune.methods import unwrap

        peft_model = adapter_to_merge(model_dir, dtype)
        ranked = unwrap(peft_model)
        companions = tokenizer_dir(model_dir)
    else:
        # a large model directory stays memory-mapped where it can (its kept experts are written from the file, a
        # shard at a time: the model is never copied); otherwise loaded, a fine-tune's adapter merged in
        mapped = (
            dtype is None
            and detect(model_dir) in MAPPABLE
            and not prune.merge_similar
            and mapping_refusal(model_dir) is None
        )
        loaded = load(model_dir, dtype=dtype, memory_map=mapped, merged=True)
        ranked = loaded.model
        # a training run or checkpoint keeps its tokenizer elsewhere (the data's): `load` knows where
        companions = loaded.tokenizer_dir or loaded.path
    usage = usage_from_profile(Path(profile)) if profile is not None else collect_usage(ranked, calibration)
    saliency = collect_saliency(ranked, calibration) if prune.criterion == "reap" else None
    model, deltas = merged_for_writing(peft_model) if adapter_alone else (ranked, None)
    new_model, report = prune_experts(model, usage, prune, saliency)
    with atomic_directory(out_dir, overwrite, PruneError) as tmp:
        if any(isinstance(m, MappedExperts) for m in new_model.modules()):
            # save_pretrained's files, a shard's stacks at a time, the adapter's deltas of the kept experts added
            save_streaming(new_model, tmp, SHARD_BYTES, _kept_deltas(model, new_model, report.kept, deltas))
        else:
            new_model.save_pretrained(tmp, max_shard_size=SHARD_BYTES)
        copy_companion_files(companions, tmp)
        # the marker moe_core.load tells a pruned model by, and what the pruning kept
        (tmp / PRUNE_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def _kept_deltas(
    model, new_model, kept: dict[int, list[int]], deltas: ExpertDeltas | None
) -> ExpertDeltas | None:
    """``deltas`` (`moe_core.finetune.export.merged_for_writing`: an adapter's, by ``model``'s experts modules) for
    the pruned model's experts: each layer's kept experts' rows, in their new order."""
    if not deltas:
        return None
    renumbered: dict = {}
    for layer_id, ids in kept.items():
        old = model.model.layers[layer_id].mlp.experts
        if old in deltas:
            rows = torch.tensor(ids)
            renumbered[new_model.model.layers[layer_id].mlp.experts] = {
                p: functools.partial(_rows, delta, rows) for p, delta in deltas[old].items()
            }
    return renumbered


def _rows(delta, rows: torch.Tensor) -> list[torch.Tensor]:
    return [delta_EOI.index_select(0, rows) for delta_EOI in delta()]
