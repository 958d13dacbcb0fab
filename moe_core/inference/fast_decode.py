"""A decode-specialized expert path: for a handful of tokens, touch only the chosen experts' weights.

Legend: T = tokens, D = model dim, E = experts, K = slots per token.

Batch-1 decoding is memory-bound: a step costs about the bytes of the weights it reads. The library's
``sorted`` path pays a sort, a host sync and one (mostly empty) matmul per expert, and ``grouped_mm`` reads
its whole stack through one kernel; both are made for many tokens. `DecodeExperts` keeps those for prefill
and, when few slots are routed (``T * K <= max_slots``, no gradient, not tracing), loops over the *distinct*
chosen experts only and runs each on the view ``w[e]`` of its weights (no copy), so a step reads K experts'
bytes, not E. Every other case (training, tracing, export, the ``reference``/``static`` impls) falls through
to `GroupedExperts.forward` unchanged; `tests/test_inference_fast_decode.py` holds the path equal to the
reference loop.

Applied from outside the model file::

    from moe_core.inference import enable_fast_decode
    enable_fast_decode(model)   # swaps each GroupedExperts for a DecodeExperts sharing its parameters
"""

from __future__ import annotations

import torch
from torch import nn

from moe_core.experts import GroupedExperts
from moe_core.routing import RoutingRecord


class DecodeExperts(GroupedExperts):
    """`GroupedExperts` with a fast path for few routed slots (decoding); shares the parameters it wraps."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        impl: str = "auto",
        max_slots: int = 64,
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, activation, impl)
        self.max_slots = max_slots

    @classmethod
    def wrap(cls, experts: GroupedExperts, max_slots: int = 64) -> DecodeExperts:
        """A `DecodeExperts` holding the very same `nn.Parameter` objects as ``experts`` (no copy)."""
        E, F_, D = experts.up_proj.shape
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.num_experts, new.activation, new.impl, new.max_slots = (
            E,
            experts.activation,
            experts.impl,
            max_slots,
        )
        new.gate_proj = experts.gate_proj
        new.up_proj = experts.up_proj
        new.down_proj = experts.down_proj
        return new

    def uses_decode_path(self, x_TD: torch.Tensor, record: RoutingRecord, impl: str) -> bool:
        return (
            impl in ("sorted", "grouped_mm")
            and record.expert_ids_TK.numel() <= self.max_slots
            and not (torch.is_grad_enabled() and x_TD.requires_grad)
        )

    def forward(self, x_TD: torch.Tensor, record: RoutingRecord, impl: str | None = None) -> torch.Tensor:
        impl = impl or self.resolved_impl(x_TD)
        if self.uses_decode_path(x_TD, record, impl):
            return self.forward_decode(x_TD, record)
        return super().forward(x_TD, record, impl)

    def forward_decode(self, x_TD: torch.Tensor, record: RoutingRecord) -> torch.Tensor:
        # one host sync for the whole layer; then a matmul per distinct chosen expert, on a view of its weights
        ids = record.expert_ids_TK.masked_fill(record.dropped_TK, -1).tolist()
        weights_TK = record.weights_TK.to(x_TD.dtype)
        tokens_of: dict[int, tuple[list[int], list[int]]] = {}
        for t, row in enumerate(ids):
            for k, e in enumerate(row):
                if e >= 0:
                    toks, slots = tokens_of.setdefault(e, ([], []))
                    toks.append(t)
                    slots.append(k)
        y_TD = torch.zeros_like(x_TD)
        weights = self.gate_proj, self.up_proj, self.down_proj
        T = x_TD.shape[0]
        for e, (toks, slots) in tokens_of.items():
            if len(toks) == T == 1:  # the batch-1 decode step: no gathers at all
                y_TD = y_TD + self.expert(e, x_TD, weights) * weights_TK[:, slots[0], None]
                continue
            t_N = torch.tensor(toks, device=x_TD.device)
            w_N = weights_TK[t_N, torch.tensor(slots, device=x_TD.device)]
            y_TD = y_TD.index_add(0, t_N, self.expert(e, x_TD.index_select(0, t_N), weights) * w_N[:, None])
        return y_TD


def enable_fast_decode(model: nn.Module, max_slots: int = 64) -> nn.Module:
    """Swap every `GroupedExperts` in ``model`` for a `DecodeExperts` sharing its parameters; returns the model.

    The state dict keeps its names and tensors, so saving and loading are unaffected."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is GroupedExperts:
                setattr(parent, name, DecodeExperts.wrap(child, max_slots))
    return model


def disable_fast_decode(model: nn.Module) -> nn.Module:
    """Undo `enable_fast_decode` (the parameters are shared, so nothing is copied)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DecodeExperts):
                plain = GroupedExperts.__new__(GroupedExperts)
                nn.Module.__init__(plain)
                plain.num_experts, plain.activation, plain.impl = (
                    child.num_experts,
                    child.activation,
                    child.impl,
                )
                plain.gate_proj, plain.up_proj, plain.down_proj = (
                    child.gate_proj,
                    child.up_proj,
                    child.down_proj,
                )
                setattr(parent, name, plain)
    return model
