"""A decode-specialized expert path: for a handful of tokens, touch only the chosen experts' weights.

Legend: T = tokens, D = model dim, E = experts, K = slots per token.

Batch-1 decoding is memory-bound: a step costs about the bytes of the weights it reads. The library's
``sorted`` path pays a sort, a host sync and one (mostly empty) matmul per expert, and ``grouped_mm`` reads
its whole stack through one kernel; both are made for many tokens. `DecodeExperts` keeps those for prefill
and, when few slots are routed (``T * K <= max_slots``, no gradient, not tracing), loops over the *distinct*
chosen experts only and runs each on the view ``w[e]`` of its weights (no copy), so a step reads K experts'
bytes, not E (`StackedExperts.forward_decode`, which `QuantizedExperts` uses too). Every other case
(training, tracing, export, the ``reference``/``static`` impls) takes the library's paths unchanged;
`tests/test_inference_fast_decode.py` holds the path equal to the reference loop.

Applied from outside the model file::

    from moe_core.inference import enable_fast_decode
    enable_fast_decode(model)   # swaps each GroupedExperts for a DecodeExperts sharing its parameters
"""

from __future__ import annotations

from torch import nn

from moe_core.experts import GroupedExperts


class DecodeExperts(GroupedExperts):
    """`GroupedExperts` with its decode path on for up to ``max_slots`` routed slots."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        impl: str = "auto",
        max_slots: int = 64,
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, activation, impl, max_slots)

    @classmethod
    def wrap(cls, experts: GroupedExperts, max_slots: int = 64) -> DecodeExperts:
        """A `DecodeExperts` holding the very same `nn.Parameter` objects as ``experts`` (no copy)."""
        return cls.sharing(experts, max_slots=max_slots)


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
                setattr(parent, name, GroupedExperts.sharing(child, max_slots=0))
    return model
