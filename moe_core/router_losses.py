"""The router losses, in one place: computed from the routing records, weighed once, for every trainer.

Legend: T = tokens, E = experts, K = expert slots per token, L = MoE layers.

A router returns a `RoutingRecord` (`moe_core.routing`): a fact about one forward, with no loss in it. This
module turns a forward's records into its router losses, and every trainer (pretraining, SFT, DPO, and any
objective added later) gets them the same way:

- `layer_losses(records, balancing, token_mask_T, balance)` -> `RouterLosses`: per layer,
  - the load-balancing loss ``E * sum_e f_e * P_e`` (Switch Transformer eq. 4; GShard), ``f_e`` the fraction
    of the routed slots sent to expert e (no gradient; counted before capacity drops), ``P_e`` the mean
    router probability of e (the gradient path). 1.0 under perfectly uniform routing for any K (Megatron-LM's
    normalization; transformers' ``load_balancing_loss_func`` is K times this);
  - the router z-loss ``mean_t logsumexp(logits_t)^2`` (Zoph et al. 2022, ST-MoE eq. 5).
  Tokens outside ``token_mask_T`` (padding) are neither counted in ``f_e`` nor averaged into ``P_e`` or the
  z-loss, as transformers' ``load_balancing_loss_func`` masks them.
- `LoadBalance` sets the scope of ``f_e`` (and ``P_e``), one setting for every trainer:
  ``micro_batch`` (this forward's tokens), ``data_parallel`` (f_e and P_e all-reduced over the data-parallel
  ranks' micro-batches, Megatron-LM's ``global_aux_loss``) or ``global_batch`` (f_e over every micro-batch of
  the optimizer step and every rank, P_e this micro-batch's: Qiu et al. 2025, "Demons in the Detail").
- `router_loss(config, losses)`: ``router_aux_loss_coef * aux + router_z_loss_coef * z``, reduced over layers
  by the config's ``router_loss_reduction`` (``mean``; ``sum``: Switch weighs every layer fully). The one
  place the coefficients and the layer reduction are applied.

How a router's layer is balanced is the router's class attribute ``balancing``: ``"loss"`` (the loss above,
with its gradient), ``"bias"`` (aux-loss-free: the loss is reported detached, a bias balances) or ``"none"``
(expert choice: balanced by construction; the loss is 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

BALANCE_SCOPES = ("micro_batch", "data_parallel", "global_batch")
BalanceScope = Literal["micro_batch", "data_parallel", "global_batch"]
BALANCING = ("loss", "bias", "none")


# ------------------------------------------------------------------------------------------------ the two losses
def slot_counts(
    expert_ids_TK: torch.Tensor, num_experts: int, token_mask_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Routed slots per expert, counted from the token-choice assignment BEFORE capacity drops (Switch eq. 4:
    f_e counts what the router chose, not what an expert had room for); only the tokens in ``token_mask_T``.
    A scatter-add, not ``bincount``: on CUDA that reads the largest id back to the host, a wait per layer."""
    if token_mask_T is None:
        token_mask_T = torch.ones(expert_ids_TK.shape[0], dtype=torch.bool, device=expert_ids_TK.device)
    weights_TK = token_mask_T[:, None].expand_as(expert_ids_TK).long()
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=expert_ids_TK.device)
    return counts_E.scatter_add_(0, expert_ids_TK.flatten(), weights_TK.flatten())


def _token_mean(values_T: torch.Tensor, token_mask_T: torch.Tensor | None) -> torch.Tensor:
    if token_mask_T is None:
        return values_T.mean(0)
    mask = token_mask_T.to(values_T.dtype).reshape(-1, *([1] * (values_T.dim() - 1)))
    return (values_T * mask).sum(0) / mask.sum().clamp_min(1.0)


def normalized_probs(probs_TE: torch.Tensor) -> torch.Tensor:
    """Router scores as a distribution per token (sigmoid scores are normalized first; softmax is already)."""
    return probs_TE / probs_TE.sum(-1, keepdim=True)


def load_balancing_loss(
    probs_TE: torch.Tensor,
    expert_ids_TK: torch.Tensor,
    slot_fraction_E: torch.Tensor | None = None,
    token_mask_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch Transformer eq. 4, ``E * sum_e f_e * P_e``; 1.0 under perfectly uniform routing.

    ``f_e`` (no gradient) is the fraction of this batch's slots routed to e, or ``slot_fraction_E`` when given
    (a wider scope's, `LoadBalance`); ``P_e`` (the gradient path) is this batch's. Both over the tokens in
    ``token_mask_T`` when given.
    """
    T, E = probs_TE.shape
    if slot_fraction_E is None:
        counts_E = slot_counts(expert_ids_TK, E, token_mask_T).to(probs_TE.dtype)
        slot_fraction_E = counts_E / counts_E.sum().clamp_min(1.0)
    P_E = _token_mean(normalized_probs(probs_TE), token_mask_T)
    return E * torch.sum(slot_fraction_E.to(P_E.dtype) * P_E)


def router_z_loss(logits_TE: torch.Tensor, token_mask_T: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE eq. 5: mean squared log-partition function; keeps router logits small and stable."""
    return _token_mean(torch.logsumexp(logits_TE, dim=-1).square(), token_mask_T)


# ------------------------------------------------------------------------------------------------ scope
class LoadBalance:
    """The scope of the load-balancing loss's statistics for a training run (module docstring).

    ``group``: the data-parallel process group whose ranks' statistics are summed (``data_parallel`` and
    ``global_batch``; every rank runs the same number of micro-batches, as data parallelism does anyway);
    None on one process. ``global_batch`` keeps the step's running slot counts: the trainer calls `reset` at
    the start of each optimizer step; like Megatron-LM's ``global_aux_loss``, ``f_e`` is the running count over
    the micro-batches seen so far in the step (the last one uses the exact global ``f``), so nothing waits for
    the step's end.
    """

    def __init__(self, scope: BalanceScope = "micro_batch", group=None) -> None:
        if scope not in BALANCE_SCOPES:
            raise ValueError(f"balance scope {scope!r}: choose one of {BALANCE_SCOPES}")
        self.scope = scope
        self.group = group
        self.counts_LE: torch.Tensor | None = (
            None  # global_batch: routed slots per layer and expert, this step
        )

    def reset(self) -> None:
        self.counts_LE = None

    @torch.no_grad()
    def slot_fractions(self, counts_LE: torch.Tensor) -> torch.Tensor:
        """f_LE over this scope, given this micro-batch's slot counts (all-reduced and, for the global batch,
        accumulated over the step)."""
        counts_LE = counts_LE.double()
        if self.scope != "micro_batch" and self.group is not None:
            dist.all_reduce(counts_LE, group=self.group)
        if self.scope == "global_batch":
            self.counts_LE = counts_LE if self.counts_LE is None else self.counts_LE + counts_LE
            counts_LE = self.counts_LE
        return counts_LE / counts_LE.sum(-1, keepdim=True).clamp_min(1.0)

    def mean_probs(self, p_sum_LE: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """P_LE: this micro-batch's mean probabilities, or with ``data_parallel`` the mean over every rank's
        tokens. The all-reduce is differentiable: its backward sums every rank's upstream gradient, and the
        data-parallel gradient average then divides by the world size, leaving exactly d(aux)/d(theta)."""
        if self.scope == "data_parallel" and self.group is not None:
            p_sum_LE = _AllReduceSum.apply(p_sum_LE, self.group)
            tokens = tokens.detach().clone()
            dist.all_reduce(tokens, group=self.group)
        return p_sum_LE / tokens.clamp_min(1.0)


class _AllReduceSum(torch.autograd.Function):
    """A sum over ``group`` that gradients flow through: forward all-reduces the tensor, backward all-reduces
    the upstream gradient (every rank's loss reads the sum, so each rank's share gets every rank's gradient).
    What ``torch.distributed.nn.functional.all_reduce`` did, which torch 2.13 deprecates for a private module;
    written on the public collective instead."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


MICRO_BATCH = LoadBalance()  # the default scope: this forward's tokens, no state


# ------------------------------------------------------------------------------------------------ per forward
@dataclass(frozen=True)
class RouterLosses:
    """One forward's router losses per MoE layer; ``aux`` and ``z`` are the layer means (what is logged)."""

    aux_L: torch.Tensor
    z_L: torch.Tensor

    @property
    def aux(self) -> torch.Tensor:
        return self.aux_L.mean()

    @property
    def z(self) -> torch.Tensor:
        return self.z_L.mean()


# a model output carries it: tracing (torch.export, compile) must see its tensors
torch.export.register_dataclass(RouterLosses, serialized_type_name="moe_core.router_losses.RouterLosses")


def layer_losses(
    records: Sequence,
    balancing: Sequence[str],
    token_mask_T: torch.Tensor | None = None,
    balance: LoadBalance | None = None,
) -> RouterLosses:
    """The load-balancing and z losses of each MoE layer's `RoutingRecord` (module docstring).

    ``balancing[i]``: how layer i's router is balanced (``loss``, ``bias`` or ``none``). ``token_mask_T``: the
    tokens that count (False for padding), None for all. ``balance``: the scope; None is the micro-batch.
    """
    balance = balance or MICRO_BATCH
    if token_mask_T is not None:
        token_mask_T = token_mask_T.reshape(-1).bool()
    E = records[0].num_experts
    probs_LTE = [normalized_probs(r.probs_TE) for r in records]
    counts_LE = torch.stack([slot_counts(r.expert_ids_TK, E, token_mask_T) for r in records])
    f_LE = balance.slot_fractions(counts_LE)
    if token_mask_T is None:
        # made on the device (a copy from the host would wait for it)
        tokens = torch.full((), float(records[0].probs_TE.shape[0]), device=counts_LE.device)
        p_sum_LE = torch.stack([p_TE.sum(0) for p_TE in probs_LTE])
    else:
        mask_T1 = token_mask_T[:, None].to(probs_LTE[0].dtype)
        tokens = mask_T1.sum()
        p_sum_LE = torch.stack([(p_TE * mask_T1).sum(0) for p_TE in probs_LTE])
    P_LE = balance.mean_probs(p_sum_LE, tokens)
    aux_L = E * (f_LE.to(P_LE.dtype) * P_LE).sum(-1)
    aux_L = torch.stack(
        [_as_balanced(aux, kind) for aux, kind in zip(aux_L.unbind(), balancing, strict=True)]
    )
    z_L = torch.stack([router_z_loss(r.logits_TE, token_mask_T) for r in records])
    return RouterLosses(aux_L=aux_L, z_L=z_L)


def _as_balanced(aux: torch.Tensor, balancing: str) -> torch.Tensor:
    if balancing == "loss":
        return aux
    if (
        balancing == "bias"
    ):  # the balance is kept by the bias, not by a gradient: report it, do not train on it
        return aux.detach()
    if balancing == "none":  # balanced by construction (expert choice)
        return torch.zeros_like(aux)
    raise ValueError(f"router balancing {balancing!r}: choose one of {BALANCING}")


def router_loss(config, losses: RouterLosses) -> torch.Tensor | None:
    """``router_aux_loss_coef * aux + router_z_loss_coef * z`` reduced over layers by
    ``config.router_loss_reduction`` (``mean``, or ``sum``: Switch); None when both coefficients are 0."""
    reduce = torch.sum if getattr(config, "router_loss_reduction", "mean") == "sum" else torch.mean
    term = None
    if config.router_aux_loss_coef > 0:
        term = config.router_aux_loss_coef * reduce(losses.aux_L)
    if config.router_z_loss_coef > 0:
        z = config.router_z_loss_coef * reduce(losses.z_L)
        term = z if term is None else term + z
    return term
