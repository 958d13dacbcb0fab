"""Routers: which experts each token goes to, and with what weight.

Legend (one per file, shapes in names): T = tokens, D = model dim, E = experts, K = expert slots per token,
C = capacity (tokens per expert), P = gate rows of experts removed by pruning.

Every router maps hidden states ``x_TD`` to one `RoutingRecord`. The record is the single source of truth
for the experts (which slot goes where, with what weight), the router losses (`moe_core.router_losses`, which
computes them from the records), training telemetry and analytics; nothing downstream re-derives routing, and
nothing writes into a record after the router returned it (it is frozen). Router math runs in fp32, whatever
the model dtype or autocast.

Routers here:
- ``topk``: token choice. Softmax (or sigmoid) scores then top-k, optionally renormalized (Mixtral, OLMoE,
  Qwen2-MoE), or top-k logits then softmax over the k (``router_topk_order="topk_then_softmax"``).
  Dropless by default; with a capacity factor it drops overflow in GShard's priority order (every token's
  first choice before any second choice, then token order). Dropped slots pass through the residual.
- ``switch``: top-1 token choice with capacity (Fedus et al. 2021, "Switch Transformers").
- ``expert_choice``: each expert takes its top-C tokens (Zhou et al. 2022, "Mixture-of-Experts with Expert
  Choice Routing"), C = capacity_factor * T / E. Caveat for causal LMs: an expert's choice over the batch
  looks at later tokens, so train/inference routing differs from strictly causal routing.
- ``aux_free``: scores plus a per-expert bias used only for selection, and the bias nudged toward uniform
  load after each optimizer step, outside the gradient, in training only (DeepSeek-V3, Wang et al. 2024,
  "Auxiliary-Loss-Free Load Balancing").
- ``deepseek``: DeepSeek-V2/V3's group-limited token choice (DeepSeek-V3 report §2.1.2, DeepSeek-V2 §2.2;
  transformers ``models/deepseek_v3/modeling_deepseek_v3.py`` ``DeepseekV3TopkRouter`` and
  ``models/deepseek_v2/modeling_deepseek_v2.py`` ``DeepseekV2TopkRouter``): sigmoid (V3) or softmax (V2)
  scores, the aux-loss-free bias (``aux_free``'s, HF's ``e_score_correction_bias``) for selection only, top-k
  among the best ``router_topk_groups`` of ``router_groups`` expert groups, weights times
  ``routed_scaling_factor``.

Pruned experts (``config.router_pruned_experts = P > 0``, written by `moe_core.inference.prune`): when the
top-k weights are raw softmax probabilities (OLMoE, Qwen2-MoE, Switch: ``norm_topk_prob=False``), removing
experts' gate rows would renormalize the softmax over the kept experts and scale every kept weight up by
1 / (1 - dropped mass), a per-token change of scale the layers after it were never trained with. A pruned
router instead keeps the P removed rows (``pruned_gate_weight``, a buffer) in the softmax denominator only,
so a kept expert's weight is exactly the probability the unpruned router gave it (`keep_pruned_mass`);
they are never selected and have no expert. A token whose top-k included a pruned expert gets the next-best
kept expert in that slot (``router_pruned_choices="refill"``), or, with ``"drop"``, the slot stays empty
(`drop_pruned_choices`): the unpruned routing with the pruned experts' outputs taken as zero.

Routing replay (`RoutingReplay`, R3; Ma et al. 2025): the experts recorded while a rollout was sampled are routed to
again in the training forward over the same tokens, the gate weights recomputed from its logits (`replay_weights`);
hooks on the token-choice routers, from outside them (GRPO fine-tuning, `moe_core.finetune.grpo`).

Losses: a router says how its layer is balanced (``balancing``: ``"loss"``, the Switch/GShard load-balancing
loss with its gradient; ``"bias"``, aux-loss-free, the loss only reported; ``"none"``, balanced by
construction); `moe_core.router_losses` computes the losses from the records, in one place for every trainer.

Adding a router (register it, then name it in the config: ``MoEConfig(router="my_router")``)::

    from moe_core.routing import Router, RoutingRecord, register_router

    @register_router("hash")
    class HashRouter(Router):
        '''Roller et al. 2021: a fixed hash of the position picks the expert; no learned choice.'''

        def route(self, logits_TE):
            T, E = logits_TE.shape
            probs_TE = logits_TE.softmax(-1)
            expert_ids_TK = (torch.arange(T, device=logits_TE.device) % E)[:, None]
            weights_TK = torch.ones_like(expert_ids_TK, dtype=torch.float32)
            return self.record(logits_TE, probs_TE, expert_ids_TK, weights_TK)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.router_losses import BALANCING, slot_counts


@dataclass(frozen=True)
class RoutingRecord:
    """Everything a routing decision produced, for the experts, the losses, telemetry and analytics.

    Slot ``k`` of token ``t`` goes to expert ``expert_ids_TK[t, k]`` with combine weight ``weights_TK[t, k]``
    unless ``dropped_TK[t, k]`` (capacity overflow, or a token an expert-choice expert did not pick). A fact:
    frozen; a step that changes the routing (pruned rows) makes a new record with `dataclasses.replace`.
    """

    expert_ids_TK: torch.Tensor  # long
    weights_TK: torch.Tensor  # fp32 combine weights, 0 where dropped
    dropped_TK: torch.Tensor  # bool
    probs_TE: torch.Tensor  # fp32 full router probabilities (scores), for analytics and the aux loss
    logits_TE: torch.Tensor  # fp32
    tokens_per_expert_E: torch.Tensor  # long, slots each expert actually processes
    capacity: int | torch.Tensor | None = None  # tokens per expert (0-dim tensor when traced); None: dropless
    # logits of the pruned experts' gate rows (`Router.apply_pruned_rows`); None: nothing pruned
    pruned_logits_TP: torch.Tensor | None = None
    # False when the K slots enumerate the experts (expert choice, K = E): a dropped slot is then an expert
    # that did not pick the token, not a choice lost to capacity, and what counts as dropped is a token no
    # expert took (`dropped_tokens_T`; telemetry's drop rate)
    slots_are_choices: bool = True

    @property
    def num_experts(self) -> int:
        return self.probs_TE.shape[-1]

    @property
    def dropped_tokens_T(self) -> torch.Tensor:
        """Tokens none of whose slots was processed: they pass through on the residual alone."""
        return self.dropped_TK.all(dim=-1)

    def detach(self) -> RoutingRecord:
        values = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return RoutingRecord(**values)


# ------------------------------------------------------------------------------------------------ registry
ROUTERS: dict[str, type[Router]] = {}


def register_router(name: str):
    """Class decorator: make a `Router` subclass available as ``MoEConfig(router=name)``."""

    def wrap(cls: type[Router]) -> type[Router]:
        if not (isinstance(cls, type) and issubclass(cls, Router)):
            raise TypeError(f"register_router({name!r}): {cls!r} is not a Router subclass")
        if cls.balancing not in BALANCING:
            raise ValueError(
                f"register_router({name!r}): balancing={cls.balancing!r}, choose one of {BALANCING}"
            )
        ROUTERS[name] = cls
        cls.registry_name = name
        return cls

    return wrap


# Where a router class may come from. A config names a router; a config can come from a model folder someone
# else wrote, so naming a module must never run it. Code is imported only from modules the user allowed:
# ``allow_router_module`` (the CLI's ``--router-module``), the environment variable below, or an installed
# package's entry point in the group below. A dotted path in a config then resolves only inside a module that
# is already imported (the user's own code ran it) and only to a Router subclass.
ROUTER_MODULES_ENV = "MOE_LAB_ROUTER_MODULES"  # comma-separated module names
ROUTER_ENTRY_POINT_GROUP = "moe_lab.routers"  # entry points ``name = "pkg.module:RouterClass"``
_ALLOWED_MODULES: set[str] = set()


class RouterNotAllowedError(KeyError):
    """A config names a router that is neither registered nor in a module the user allowed."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


def _check_module_name(name: str) -> str:
    name = name.strip()
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"router module {name!r} is not a module name like 'mypkg.routers'")
    return name


def allow_router_module(name: str) -> None:
    """Import ``name`` (the routers it registers become available) and allow dotted paths into it."""
    name = _check_module_name(name)
    try:
        importlib.import_module(name)
    except ImportError as err:
        raise ImportError(f"router module {name!r} could not be imported: {err}") from None
    _ALLOWED_MODULES.add(name)


def _router_entry_points() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ROUTER_ENTRY_POINT_GROUP)}


def _allowed_from_environment() -> list[str]:
    return [_check_module_name(m) for m in os.environ.get(ROUTER_MODULES_ENV, "").split(",") if m.strip()]


def _not_allowed(name: str, module_name: str | None) -> RouterNotAllowedError:
    example = module_name or "mypkg.routers"
    where = (
        f"its module {module_name!r} is not imported and was not allowed"
        if module_name
        else "no allowed module registers it"
    )
    return RouterNotAllowedError(
        f"unknown router {name!r}: {where} (a config, e.g. a model folder's config.json, never imports code by "
        f"itself). Registered: {sorted(ROUTERS)}. To use a router of your own, allow the module that defines it: "
        f"`--router-module {example}` on the command line, {ROUTER_MODULES_ENV}={example} in the environment, "
        f"an entry point in group {ROUTER_ENTRY_POINT_GROUP!r}, or moe_core.routing.allow_router_module("
        f"{example!r}) in Python"
    )


def resolve_router(name: str) -> type[Router]:
    """A router class: from the registry, an allowed module (which may register it), an entry point of group
    ``moe_lab.routers``, or a dotted path (``pkg.module.Class`` / ``pkg.module:Class``) into a module that is
    already imported or allowed. Never imports a module only because a config names it; never evaluates code."""
    if name in ROUTERS:
        return ROUTERS[name]
    for module_name in _allowed_from_environment():  # may register ``name``
        if module_name not in _ALLOWED_MODULES:
            allow_router_module(module_name)
    if name in ROUTERS:
        return ROUTERS[name]
    entry_points = _router_entry_points()
    if (
        name in entry_points
    ):  # an installed package declared this router: loading it is what the user installed
        cls = entry_points[name].load()
        module_name = None
    elif "." in name or ":" in name:
        module_name, _, attr = name.replace(":", ".").rpartition(".")
        ep_modules = {ep.value.partition(":")[0] for ep in entry_points.values()}
        module = sys.modules.get(module_name)  # allowed modules were imported when they were allowed
        if module is None and module_name in ep_modules:
            module = importlib.import_module(module_name)
        if module is None:
            raise _not_allowed(name, module_name)
        cls = vars(module).get(attr)  # not getattr: a module-level __getattr__ could import or run code
        if cls is None:
            raise RouterNotAllowedError(
                f"router {name!r}: module {module_name!r} defines no {attr!r}; registered: {sorted(ROUTERS)}"
            )
    else:
        raise _not_allowed(name, None)
    if not (isinstance(cls, type) and issubclass(cls, Router)):
        raise TypeError(f"router {name!r} is not a moe_core.routing.Router subclass")
    return cls


# ------------------------------------------------------------------------------------------------ capacity
def kept_slot_counts(expert_ids_TK: torch.Tensor, dropped_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots each expert actually processes (after capacity and pruned-choice drops). A scatter-add, not
    bincount of the kept ids: no data-dependent shape, so it compiles into the graph."""
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=expert_ids_TK.device)
    return counts_E.scatter_add_(0, expert_ids_TK.flatten(), (~dropped_TK).flatten().long())


def capacity_for(
    capacity_factor: float | None, num_tokens: int | torch.Tensor, slots_per_token: int, num_experts: int
) -> int | torch.Tensor | None:
    """Tokens each expert may take, ``ceil(capacity_factor * T * K / E)`` and at least 1 (GShard, Switch).

    Under the TorchScript tracer (ONNX export) ``T = logits_TE.shape[0]`` is a 0-dim tensor; the capacity is
    then computed with tensor ops, so the exported graph derives it from each input's token count instead of
    freezing the sample input's capacity as a constant (which dropped the wrong tokens at any other shape).
    The tensor path computes in float64 in Python's order of operations, so both give the same integer."""
    if capacity_factor is None:
        return None
    if isinstance(num_tokens, torch.Tensor):
        exact = num_tokens.to(torch.float64) * capacity_factor * slots_per_token / num_experts
        return torch.ceil(exact).clamp(min=1).to(torch.long)
    return max(1, math.ceil(capacity_factor * num_tokens * slots_per_token / num_experts))


def drop_over_capacity(expert_ids_TK: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """GShard priority: position of each slot in its expert's buffer, first choices of all tokens first."""
    T, K = expert_ids_TK.shape
    onehot_KTE = F.one_hot(expert_ids_TK.t(), num_experts)  # [K, T, E]
    position_KTE = onehot_KTE.reshape(K * T, num_experts).cumsum(0).reshape(K, T, num_experts) - 1
    position_TK = (position_KTE * onehot_KTE).sum(-1).t()
    return position_TK >= capacity


def pruned_mass_matters(config) -> bool:
    """Whether removed experts' softmax mass changes the kept experts' weights: token-choice softmax scores
    whose top-k probabilities are used as they are (not renormalized over the k, not a softmax over the k)."""
    renormalized = config.norm_topk_prob and config.router != "switch"  # SwitchRouter never renormalizes
    return (
        config.router in ("topk", "switch", "aux_free")
        and config.router_score == "softmax"
        and config.router_topk_order == "softmax_then_topk"
        and not renormalized
    )


def keep_pruned_mass(record: RoutingRecord, pruned_logits_TP: torch.Tensor) -> RoutingRecord:
    """Scale a pruned router's combine weights back to the unpruned softmax: the route's softmax ran over the
    kept logits only, so each weight is p_e / (1 - m) with m the pruned rows' mass; multiply by
    (1 - m) = exp(a) / (exp(a) + exp(b)) = sigmoid(a - b), a and b the logsumexp of the kept and of the
    pruned logits (sigmoid, not logaddexp: ONNX has no logaddexp). ``probs_TE`` stays normalized over the
    experts that exist (analytics read it as a distribution)."""
    lse_kept_T1 = record.logits_TE.logsumexp(dim=-1, keepdim=True)
    kept_mass_T1 = torch.sigmoid(lse_kept_T1 - pruned_logits_TP.logsumexp(dim=-1, keepdim=True))
    return dataclasses.replace(record, weights_TK=record.weights_TK * kept_mass_T1)


def drop_pruned_choices(record: RoutingRecord, pruned_logits_TP: torch.Tensor, top_k: int) -> RoutingRecord:
    """Mark dropped the slots the unpruned router would have given to a pruned expert: a chosen kept expert
    stays only while fewer than K logits (chosen kept ones and pruned rows) beat it. For a dropless router
    selecting by logit (the kept experts above a chosen one are all chosen too)."""
    chosen_TK = record.logits_TE.gather(-1, record.expert_ids_TK)
    above_kept_TK = (chosen_TK[:, None, :] > chosen_TK[:, :, None]).sum(dim=-1)
    above_pruned_TK = (pruned_logits_TP[:, None, :] > chosen_TK[:, :, None]).sum(dim=-1)
    dropped_TK = record.dropped_TK | (above_kept_TK + above_pruned_TK >= top_k)
    return dataclasses.replace(
        record,
        dropped_TK=dropped_TK,
        weights_TK=record.weights_TK.masked_fill(dropped_TK, 0.0),
        tokens_per_expert_E=kept_slot_counts(record.expert_ids_TK, dropped_TK, record.num_experts),
    )


# ------------------------------------------------------------------------------------------------ routers
class Router(nn.Module):
    """Base router: a linear gate producing fp32 logits, then `route` turns them into a `RoutingRecord`."""

    registry_name = "base"
    # how this router's layer is balanced (`moe_core.router_losses`): "loss" (the Switch/GShard load-balancing
    # loss, with its gradient), "bias" (aux-loss-free: reported, not trained on) or "none" (by construction)
    balancing = "loss"

    @classmethod
    def check_config(cls, config) -> None:
        """Raise ValueError when this router cannot work with ``config`` (called when the config is built)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.score_fn = config.router_score
        self.norm_topk_prob = config.norm_topk_prob
        self.topk_order = config.router_topk_order
        self.capacity_factor = config.capacity_factor
        self.eval_capacity_factor = config.eval_capacity_factor
        self.jitter = config.router_jitter
        # gpt-oss's router has a bias per expert (router_bias); the others none
        self.gate = nn.Linear(
            config.hidden_size, config.num_experts, bias=getattr(config, "router_bias", False)
        )
        P = config.router_pruned_experts
        # pruned experts' gate rows: in the softmax denominator only (module docstring, `keep_pruned_mass`)
        self.register_buffer("pruned_gate_weight", torch.zeros(P, config.hidden_size) if P else None)
        self.pruned_choices = config.router_pruned_choices

    @property
    def active_capacity_factor(self) -> float | None:
        if not self.training and self.eval_capacity_factor is not None:
            return self.eval_capacity_factor
        return self.capacity_factor

    def forward(self, x_TD: torch.Tensor) -> RoutingRecord:
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            x_TD = x_TD.float()
            if self.training and self.jitter > 0:  # Switch: multiplicative jitter on the router input
                x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            # an fp32 gate runs its own forward: under compile_steps a ReductionLinear, whose single-row form
            # inductor fuses with the norm before it (an extern GEMM call per layer otherwise, 3% of a step)
            weight = self.gate.weight
            bias = self.gate.bias.float() if self.gate.bias is not None else None
            logits_TE = (
                self.gate(x_TD) if weight.dtype == torch.float32 else F.linear(x_TD, weight.float(), bias)
            )
            record = self.route(logits_TE)
            if self.pruned_gate_weight is not None:
                record = self.apply_pruned_rows(record, F.linear(x_TD, self.pruned_gate_weight.float()))
            return record

    def apply_pruned_rows(self, record: RoutingRecord, pruned_logits_TP: torch.Tensor) -> RoutingRecord:
        """A pruned router's record: kept weights at their unpruned probability, and with
        ``router_pruned_choices="drop"`` the slots of pruned choices left empty (module docstring)."""
        record = keep_pruned_mass(record, pruned_logits_TP)
        if self.pruned_choices == "drop":
            record = drop_pruned_choices(record, pruned_logits_TP, self.top_k)
        return dataclasses.replace(record, pruned_logits_TP=pruned_logits_TP)

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits_TE) if self.score_fn == "sigmoid" else logits_TE.softmax(dim=-1)

    def route(self, logits_TE: torch.Tensor) -> RoutingRecord:
        raise NotImplementedError

    def record(
        self,
        logits_TE: torch.Tensor,
        probs_TE: torch.Tensor,
        expert_ids_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        dropped_TK: torch.Tensor | None = None,
        capacity: int | None = None,
        slots_are_choices: bool = True,
    ) -> RoutingRecord:
        """Assemble a record; fills in the per-expert counts."""
        if dropped_TK is None:
            dropped_TK = torch.zeros_like(expert_ids_TK, dtype=torch.bool)
        weights_TK = weights_TK.masked_fill(dropped_TK, 0.0)
        tokens_per_expert_E = kept_slot_counts(expert_ids_TK, dropped_TK, self.num_experts)
        return RoutingRecord(
            expert_ids_TK=expert_ids_TK,
            weights_TK=weights_TK,
            dropped_TK=dropped_TK,
            probs_TE=probs_TE,
            logits_TE=logits_TE,
            tokens_per_expert_E=tokens_per_expert_E,
            capacity=capacity,
            slots_are_choices=slots_are_choices,
        )

    def observe(self, record: RoutingRecord) -> None:
        """Called once per training forward with this router's record (stateful routers keep statistics)."""

    def update_bias(self, load_E: torch.Tensor | None = None) -> None:
        """Called after each optimizer step; only stateful routers do anything."""


@register_router("topk")
class TokenChoiceTopKRouter(Router):
    """Each token picks its K best experts (GShard, Mixtral, OLMoE, Qwen2-MoE)."""

    def selection_scores(self, scores_TE: torch.Tensor) -> torch.Tensor:
        return scores_TE

    def route(self, logits_TE: torch.Tensor) -> RoutingRecord:
        T, E = logits_TE.shape
        probs_TE = self.scores(logits_TE)
        if self.topk_order == "topk_then_softmax":
            topk_logits_TK, expert_ids_TK = logits_TE.topk(self.top_k, dim=-1)
            weights_TK = topk_logits_TK.softmax(dim=-1)
        else:
            _, expert_ids_TK = self.selection_scores(probs_TE).topk(self.top_k, dim=-1)
            weights_TK = probs_TE.gather(-1, expert_ids_TK)
            if self.norm_topk_prob:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        capacity = capacity_for(self.active_capacity_factor, T, self.top_k, E)
        dropped_TK = None if capacity is None else drop_over_capacity(expert_ids_TK, E, capacity)
        return self.record(logits_TE, probs_TE, expert_ids_TK, weights_TK, dropped_TK, capacity)


@register_router("switch")
class SwitchRouter(TokenChoiceTopKRouter):
    """Switch Transformer: top-1, the weight is the router probability itself, capacity-bound when set."""

    @classmethod
    def check_config(cls, config) -> None:
        if config.num_experts_per_tok != 1:
            raise ValueError("router 'switch' routes each token to 1 expert; set num_experts_per_tok=1")

    def __init__(self, config) -> None:
        super().__init__(config)
        self.norm_topk_prob = False


@register_router("expert_choice")
class ExpertChoiceRouter(Router):
    """Each expert takes its top-C tokens by router probability; a token may get 0..E experts.

    The record uses K = E slots per token (slot e is expert e), with unchosen slots marked dropped, so the
    experts and analytics read it like any other record. ``capacity_factor`` is the average number of
    experts per token (default: num_experts_per_tok); C = ceil(capacity_factor * T / E), at most T.
    """

    balancing = "none"  # every expert takes exactly C tokens: balanced by construction, no loss

    def route(self, logits_TE: torch.Tensor) -> RoutingRecord:
        T, E = logits_TE.shape
        probs_TE = logits_TE.softmax(dim=-1)
        factor = self.active_capacity_factor or float(self.top_k)
        capacity = min(T, capacity_for(factor, T, 1, E))
        weights_EC, token_ids_EC = probs_TE.t().topk(capacity, dim=-1)
        weights_ET = torch.zeros(E, T, dtype=probs_TE.dtype, device=probs_TE.device).scatter(
            1, token_ids_EC, weights_EC
        )
        chosen_ET = torch.zeros(E, T, dtype=torch.bool, device=probs_TE.device).scatter(1, token_ids_EC, True)
        expert_ids_TK = torch.arange(E, device=probs_TE.device).expand(T, E)
        return self.record(
            logits_TE,
            probs_TE,
            expert_ids_TK,
            weights_ET.t(),
            ~chosen_ET.t(),
            capacity,
            slots_are_choices=False,
        )


@register_router("aux_free")
class AuxLossFreeRouter(TokenChoiceTopKRouter):
    """DeepSeek-V3 bias balancing: select with ``scores + bias``, weight with the scores alone.

    After each optimizer step, ``bias_e += rate * sign(mean_load - load_e)`` over the load seen since the
    last update (in training only; eval forwards never touch it). The bias is a buffer, saved with the
    checkpoint. With several data-parallel ranks, pass the all-reduced load to `update_bias`.

    The bias stays fp32 whatever the model's dtype, as transformers keeps ``e_score_correction_bias``
    (modeling_deepseek_v3.py / modeling_glm4_moe.py: an fp32 buffer, ``_keep_in_fp32_modules_strict``): in
    bf16 (8 bits of mantissa) a step of rate 1e-3 rounds away once the bias passes about 0.25, so a bf16
    model would stop balancing. Built fp32, it stays so through ``model.to(bf16)``, ``.half()`` and the loaders
    that build the model in a dtype (`_apply`), and is updated in fp32.
    """

    balancing = "bias"  # its load-balancing loss is reported, detached: the bias balances, not a gradient

    def __init__(self, config) -> None:
        super().__init__(config)
        self.update_rate = config.router_bias_update_rate
        # (explicitly fp32: transformers builds the model under the requested default dtype)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.register_buffer(
            "pending_load", torch.zeros(config.num_experts, dtype=torch.float32), persistent=False
        )

    def _apply(self, fn, recurse=True):
        # every dtype/device move of the module (to, half, bfloat16, cuda, to_empty) passes here (torch's RNNBase
        # overrides it the same way); the bias, and the load counts it is updated from (bf16 counts exactly only
        # up to 256), take the move's device and stay fp32, converted from their values before the move
        before = {name: getattr(self, name) for name in ("expert_bias", "pending_load")}
        out = super()._apply(fn, recurse)
        for name, fp32 in before.items():
            moved = getattr(self, name)
            if moved is not None and moved.dtype != torch.float32:
                setattr(self, name, fp32.to(device=moved.device, dtype=torch.float32))
        return out

    def selection_scores(self, scores_TE: torch.Tensor) -> torch.Tensor:
        return scores_TE + self.expert_bias.float()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """What no checkpoint holds (`moe_core.model.materialize`): no load observed yet."""
        self.pending_load.zero_()

    def observe(self, record: RoutingRecord) -> None:
        counts_E = slot_counts(record.expert_ids_TK, self.num_experts)
        self.pending_load += counts_E.to(self.pending_load.dtype)

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor | None = None) -> None:
        load_E = self.pending_load if load_E is None else load_E.to(self.pending_load)
        # no load observed: every sign is 0 (a test of the sum would make the host wait for the device)
        if self.update_rate > 0:
            self.expert_bias += self.update_rate * torch.sign(load_E.mean() - load_E).float()
        self.pending_load.zero_()


@register_router("deepseek")
class DeepSeekRouter(AuxLossFreeRouter):
    """DeepSeek-V2/V3 routing: group-limited top-k on ``scores + bias``, weighted by the scores alone.

    One implementation for both, as transformers 5.24 implements them:
    - V3 (``router_score="sigmoid"``, ``router_group_score="top2_sum"``): a group's score is the sum of its two
      best biased scores; experts outside the chosen groups are masked to -inf; top-k weights renormalized
      (``norm_topk_prob``, + 1e-20 as HF) and scaled by ``routed_scaling_factor``.
    - V2 (``router_score="softmax"``, ``router_group_score="max"``): ``topk_method="greedy"`` is one group;
      ``"group_limited_greedy"`` scores a group by its best softmax score (no bias in V2: it stays 0 unless
      ``router_bias_update_rate`` moves it); weights are the softmax probabilities times the scaling factor.
    The bias is `AuxLossFreeRouter`'s ``expert_bias`` (HF's ``e_score_correction_bias``), updated by the same
    rule after each optimizer step when ``router_bias_update_rate > 0`` (then the layer is balanced by the bias,
    its load-balancing loss only reported); with a rate of 0 the loss balances (DeepSeek-V2's expert-level
    balance loss: ``aux_loss_alpha`` is exactly our coefficient, see `moe_core.convert`).
    """

    @classmethod
    def check_config(cls, config) -> None:
        E, G, Gk = config.num_experts, config.router_groups, config.router_topk_groups
        if not isinstance(G, int) or G < 1 or E % G:
            raise ValueError(f"router 'deepseek': router_groups={G} must be >= 1 and divide num_experts={E}")
        if not isinstance(Gk, int) or not 1 <= Gk <= G:
            raise ValueError(
                f"router 'deepseek': router_topk_groups={Gk} must be between 1 and router_groups={G}"
            )
        if config.num_experts_per_tok > Gk * (E // G):
            raise ValueError(
                f"router 'deepseek': num_experts_per_tok={config.num_experts_per_tok} exceeds the "
                f"{Gk * (E // G)} experts in router_topk_groups={Gk} groups"
            )
        if config.router_group_score not in ("top2_sum", "max"):
            raise ValueError(f"router_group_score={config.router_group_score!r}: choose 'top2_sum' or 'max'")
        if config.router_group_score == "top2_sum" and G > 1 and E // G < 2:
            raise ValueError("router_group_score='top2_sum' needs at least 2 experts per group")
        if config.router_topk_order != "softmax_then_topk":
            raise ValueError("router 'deepseek' selects on scores: set router_topk_order='softmax_then_topk'")
        if config.capacity_factor is not None or config.eval_capacity_factor is not None:
            raise ValueError(
                "router 'deepseek' is dropless: set capacity_factor and eval_capacity_factor to None"
            )
        if not config.routed_scaling_factor > 0:
            raise ValueError(f"routed_scaling_factor={config.routed_scaling_factor} must be positive")

    def __init__(self, config) -> None:
        super().__init__(config)
        self.groups = config.router_groups
        self.topk_groups = config.router_topk_groups
        self.group_score = config.router_group_score
        self.scaling = config.routed_scaling_factor
        # the bias balances only when it moves; otherwise the load-balancing loss does (an instance attribute:
        # `MoEForCausalLM` reads ``router.balancing``)
        self.balancing = "bias" if self.update_rate > 0 else "loss"

    def route(self, logits_TE: torch.Tensor) -> RoutingRecord:
        T, E = logits_TE.shape
        G = self.groups
        probs_TE = self.scores(logits_TE)
        choice_TE = self.selection_scores(probs_TE)
        if self.topk_groups < G:  # group-limited (node-limited) routing
            choice_TGe = choice_TE.view(T, G, E // G)
            if self.group_score == "top2_sum":
                group_TG = choice_TGe.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_TG = choice_TGe.max(dim=-1).values
            group_ids = group_TG.topk(self.topk_groups, dim=-1, sorted=False)[1]
            keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter(1, group_ids, True)
            keep_TE = keep_TG[:, :, None].expand(T, G, E // G).reshape(T, E)
            choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
        _, expert_ids_TK = choice_TE.topk(self.top_k, dim=-1)
        weights_TK = probs_TE.gather(-1, expert_ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return self.record(logits_TE, probs_TE, expert_ids_TK, weights_TK * self.scaling)


def build_router(config) -> Router:
    cls = resolve_router(config.router)
    cls.check_config(config)
    return cls(config)


# ------------------------------------------------------------------------------------------------ routing replay
class RoutingReplayError(RuntimeError):
    """Routing replay asked of a router it cannot replay, or replayed routing that does not fit the forward."""


def replay_weights(router: Router, record: RoutingRecord, expert_ids_TK: torch.Tensor) -> torch.Tensor:
    """Combine weights of the experts ``expert_ids_TK`` computed from this forward's logits, by the rule
    ``router`` applies to its own choice: softmax over the k logits (``topk_then_softmax``), or the scores
    gathered, renormalized over the k when the router renormalizes, times DeepSeek's scaling factor. For the
    routers that renormalize over their k (Mixtral, Qwen3, DeepSeek-V3) this is R3's gate,
    ``g_i = I_i exp(s_i) / sum_j I_j exp(s_j)`` with ``I`` the replayed mask and ``s`` the training logits (Ma
    et al. 2025, arXiv:2510.11370, §3): the experts are fixed, the weights and so the router keep their gradient."""
    if router.topk_order == "topk_then_softmax":
        return record.logits_TE.gather(-1, expert_ids_TK).softmax(dim=-1)
    weights_TK = record.probs_TE.gather(-1, expert_ids_TK)
    if router.norm_topk_prob:
        eps = 1e-20 if isinstance(router, DeepSeekRouter) else 0.0  # as each router's own `route`
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + eps)
    return weights_TK * getattr(router, "scaling", 1.0)


@dataclass
class ReplayCounts:
    """Routing decisions (a token's top-k set in one MoE layer) of the tokens that had a recorded routing."""

    decisions: int = 0
    changed: int = 0  # the router's own top-k set differs from the recorded one (what replay overrode)
    mismatched: int = (
        0  # the routing the forward used differs from the recorded one (0 whenever replay is on)
    )


class RoutingReplay:
    """Rollout routing replay (R3; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training
    and Inference Routers", arXiv:2510.11370): the experts each token was routed to while the rollout was
    sampled are recorded, and the training forward over the same tokens routes them to those experts again,
    with the gate weights recomputed from the training forward's logits (`replay_weights`), so the policy whose
    log-probabilities the loss uses routes as the policy that sampled, and the router still learns.

    An option on the routers, from outside them: forward hooks on the given routers (a model's MoE layers; dense
    layers have none), removed by `close`. Three states:
    - `recording`: every forward's ``expert_ids_TK`` and ``dropped_TK`` per layer are kept, in call order (the
      rollout: a prefill, then one call per decoded token);
    - `load`: the next forwards over exactly ``T`` tokens take the routing given per layer (``-1`` rows: no
      recorded routing, the router's own choice stays), until `unload`; each layer's first such forward counts
      the decisions replay changed (`ReplayCounts`; a recomputation under gradient checkpointing does not count
      twice). With ``apply=False`` nothing is replaced, only counted (how far training would drift unreplayed);
    - neither: the routers route as always.
    Token-choice routers only (topk, switch, aux_free, deepseek; not pruned): an expert-choice router's selection
    depends on the whole batch, so a token's experts are not its own to replay.
    """

    def __init__(self, routers, *, apply: bool = True) -> None:
        self.routers = list(routers)
        for i, router in enumerate(self.routers):
            if not isinstance(router, TokenChoiceTopKRouter):
                raise RoutingReplayError(
                    f"routing replay: MoE layer {i} has router {router.registry_name!r}; replay needs a token-choice "
                    "router (topk, switch, aux_free, deepseek), whose experts for a token depend on that token alone"
                )
            if router.pruned_gate_weight is not None:
                raise RoutingReplayError(
                    f"routing replay: MoE layer {i}'s router is pruned; replay a model before pruning"
                )
        self.apply = apply
        self.counts = ReplayCounts()
        self._trace: list[list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._ids_LTK: torch.Tensor | None = None
        self._dropped_LTK: torch.Tensor | None = None
        self._counted: set[int] = set()
        self._handles = [
            router.register_forward_hook(lambda m, args, rec, i=i: self._hook(i, m, rec))
            for i, router in enumerate(self.routers)
        ]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def recording(self):
        """Yields ``trace``: per MoE layer, the ``(expert_ids_TK, dropped_TK)`` of each forward, in call order."""
        if self._ids_LTK is not None:
            raise RoutingReplayError(
                "routing replay: recording while replayed routing is loaded; unload it first"
            )
        trace: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.routers]
        self._trace = trace
        try:
            yield trace
        finally:
            self._trace = None

    def load(self, expert_ids_LTK: torch.Tensor, dropped_LTK: torch.Tensor | None = None) -> None:
        """Route the next forwards' T tokens as ``expert_ids_LTK`` says ([MoE layers, T, K]; ``-1`` rows keep the
        router's own choice), with ``dropped_LTK`` the recorded capacity drops (none when omitted)."""
        if expert_ids_LTK.shape[0] != len(self.routers):
            raise RoutingReplayError(
                f"routing replay: routing for {expert_ids_LTK.shape[0]} MoE layers, the model has {len(self.routers)}"
            )
        self._ids_LTK = expert_ids_LTK
        self._dropped_LTK = (
            dropped_LTK if dropped_LTK is not None else torch.zeros_like(expert_ids_LTK, dtype=torch.bool)
        )
        self._counted = set()

    def unload(self) -> None:
        self._ids_LTK = self._dropped_LTK = None

    def take_counts(self) -> ReplayCounts:
        """The counts since the last call, and a fresh start."""
        counts, self.counts = self.counts, ReplayCounts()
        return counts

    def _hook(self, i: int, router: Router, record: RoutingRecord) -> RoutingRecord | None:
        if self._trace is not None:
            self._trace[i].append((record.expert_ids_TK.detach().clone(), record.dropped_TK.detach().clone()))
            return None
        if self._ids_LTK is None:
            return None
        ids_TK = self._ids_LTK[i].to(record.expert_ids_TK.device, torch.long)
        if ids_TK.shape != record.expert_ids_TK.shape:
            raise RoutingReplayError(
                f"routing replay: MoE layer {i} routes {tuple(record.expert_ids_TK.shape)} [tokens, slots], the "
                f"loaded routing is {tuple(ids_TK.shape)}; load the routing of this very batch"
            )
        kept_T = ids_TK[:, 0] >= 0  # tokens with a recorded routing
        own_TK = record.expert_ids_TK
        if self.apply:
            use_TK = torch.where(kept_T[:, None], ids_TK, own_TK)
            dropped_TK = torch.where(
                kept_T[:, None], self._dropped_LTK[i].to(own_TK.device), record.dropped_TK
            )
            weights_TK = torch.where(
                kept_T[:, None], replay_weights(router, record, use_TK), record.weights_TK
            )
            record = router.record(
                record.logits_TE, record.probs_TE, use_TK, weights_TK, dropped_TK, record.capacity
            )
        if i not in self._counted:
            self._counted.add(i)
            recorded_TK = ids_TK.sort(dim=-1).values
            changed_T = (own_TK.sort(dim=-1).values != recorded_TK).any(dim=-1) & kept_T
            used_T = (record.expert_ids_TK.sort(dim=-1).values != recorded_TK).any(dim=-1) & kept_T
            self.counts.decisions += int(kept_T.sum())
            self.counts.changed += int(changed_T.sum())
            self.counts.mismatched += int(used_T.sum())
        return record
