"""Expert computation: E feed-forward experts stored as stacked weights, and four ways to run them.

Legend: T = tokens, D = model dim, F = expert hidden dim, E = experts, K = slots per token,
A = kept (token, slot) assignments, sorted by expert.

Weights are stacked like `nn.Linear` weights, one slice per expert: ``gate_proj [E, F, D]``,
``up_proj [E, F, D]``, ``down_proj [E, D, F]`` (SwiGLU: ``down(silu(gate x) * up x)``, Shazeer 2020), or
``up_proj`` and ``down_proj`` alone for GELU experts (Switch Transformer). Slicing ``w[e]`` is a view, so a
per-expert loop costs no copy, and the stack feeds `torch._grouped_mm` directly (torchtitan `GroupedExperts`).

Implementations, all computing ``y_t = sum_k w_tk * expert_{e_tk}(x_t)`` over the kept slots:
- ``reference``: a plain loop over experts with a boolean mask each: slow, obviously right.
- ``sorted``: sort the kept slots by expert, run each expert's matmuls on its contiguous slice and add it
  back while it is still in cache. The default on CPU and wherever grouped_mm is not supported.
- ``grouped_mm``: the same sorted layout through one `torch._grouped_mm` per projection (CPU fp32/bf16 in
  torch 2.13, Hopper GPUs in bf16), with no host sync on the token counts. The default on those GPUs.
- ``static``: every expert on every token, as one wide FFN of E*F hidden units gated by a dense [T, E]
  combine matrix: three matmuls, no data-dependent shapes, for ONNX export and
  ``torch.compile(fullgraph=True)``. E/K times the FLOPs.
- ``gather``: each token gathers its K experts' weights and every projection is written as the reduction
  it is (``h_tkf = sum_d x_td w_{e_tk} fd``). For compiled decoding (few tokens): inductor fuses the gather
  into the reduction loop, so a step streams exactly the chosen experts' bytes, with no copy, no host sync
  and no data-dependent shape. Eager, it materializes [T, K, F, D]: a reference for small T only.
Tests hold all five equal in forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.routing import RoutingRecord


def ffn_act(activation: str, h_gate: torch.Tensor | None, h_up: torch.Tensor) -> torch.Tensor:
    if activation == "swiglu":
        return F.silu(h_gate) * h_up
    return F.gelu(h_up)


def grouped_mm_supported(x: torch.Tensor, *dims: int) -> bool:
    """`torch._grouped_mm` runs on CPU (fp32, bf16) and on Hopper-or-newer GPUs in bf16, with every row
    stride a multiple of 16 bytes (so ``dims``, the matrix widths, must be multiples of 16 / element size)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    if any(d * dtype.itemsize % 16 for d in dims):
        return False
    if x.is_cuda:
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return device == "cpu"


class GroupedExperts(nn.Module):
    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str, impl: str = "auto"
    ):
        super().__init__()
        self.num_experts, self.activation, self.impl = num_experts, activation, impl
        E, D, F_ = num_experts, hidden_size, intermediate_size
        if activation == "swiglu":
            self.gate_proj = nn.Parameter(torch.empty(E, F_, D))
        else:
            self.register_parameter("gate_proj", None)
        self.up_proj = nn.Parameter(torch.empty(E, F_, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, F_))

    def expert(self, e: int, x_ND: torch.Tensor, weights: tuple | None = None) -> torch.Tensor:
        """Expert ``e`` on a batch of tokens, like an ordinary FFN. ``weights`` are the `unbound` weights, so a
        loop over experts builds one gradient per stack instead of one full-size gradient per slice."""
        gate, up, down = weights if weights is not None else self.unbound()
        h_gate = F.linear(x_ND, gate[e]) if gate is not None else None
        return F.linear(ffn_act(self.activation, h_gate, F.linear(x_ND, up[e])), down[e])

    def stacks(self, dtype: torch.dtype | None = None) -> tuple:
        """The whole ``(gate [E, F, D] or None, up [E, F, D], down [E, D, F])`` weight stacks."""
        return self.gate_proj, self.up_proj, self.down_proj

    def unbound(self) -> tuple:
        gate = self.gate_proj.unbind(0) if self.gate_proj is not None else None
        return gate, self.up_proj.unbind(0), self.down_proj.unbind(0)

    def resolved_impl(self, x_TD: torch.Tensor) -> str:
        if self.impl != "auto":
            return self.impl
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
            return "static"
        E, F_, D = self.up_proj.shape
        # on CPU the per-expert loop keeps each slice cache-sized and measures as fast (benchmarks/README.md)
        return "grouped_mm" if x_TD.is_cuda and grouped_mm_supported(x_TD, F_, D) else "sorted"

    def forward(self, x_TD: torch.Tensor, record: RoutingRecord, impl: str | None = None) -> torch.Tensor:
        impl = impl or self.resolved_impl(x_TD)
        if impl == "reference":
            return self.forward_reference(x_TD, record)
        if impl == "static":
            return self.forward_static(x_TD, record)
        if impl == "gather":
            return self.forward_gather(x_TD, record)
        if impl in ("sorted", "grouped_mm"):
            return self.forward_sorted(x_TD, record, grouped=impl == "grouped_mm")
        raise ValueError(
            f"unknown expert implementation {impl!r}; choose reference, sorted, grouped_mm, static or gather"
        )

    # -------------------------------------------------------------------------------- slow reference
    def forward_reference(self, x_TD: torch.Tensor, record: RoutingRecord) -> torch.Tensor:
        y_TD = torch.zeros_like(x_TD)
        weights_TK = record.weights_TK.to(x_TD.dtype)
        for e in range(self.num_experts):
            token_idx, slot_idx = torch.where((record.expert_ids_TK == e) & ~record.dropped_TK)
            if token_idx.numel() == 0:
                continue
            out_ND = self.expert(e, x_TD[token_idx]) * weights_TK[token_idx, slot_idx, None]
            y_TD = y_TD.index_add(0, token_idx, out_ND)
        return y_TD

    # -------------------------------------------------------------------------------- fast paths
    def forward_sorted(
        self, x_TD: torch.Tensor, record: RoutingRecord, grouped: bool = False
    ) -> torch.Tensor:
        T, K = record.expert_ids_TK.shape
        kept_A = (~record.dropped_TK).flatten().nonzero().squeeze(-1)
        expert_ids_A = record.expert_ids_TK.flatten()[kept_A]
        expert_ids_A, order_A = expert_ids_A.sort(stable=True)
        slot_A = kept_A[order_A]
        token_idx_A = slot_A // K
        weights_A = record.weights_TK.flatten()[slot_A].to(x_TD.dtype)
        counts_E = torch.bincount(expert_ids_A, minlength=self.num_experts)

        x_AD = x_TD.index_select(0, token_idx_A)
        if grouped:
            offs_E = counts_E.cumsum(0).to(torch.int32)
            out_AD = self._grouped_ffn(x_AD, offs_E)
            return torch.zeros_like(x_TD).index_add(0, token_idx_A, out_AD * weights_A[:, None])
        # expert by expert on its contiguous slice, combined while the slice is still in cache
        y_TD, weights = torch.zeros_like(x_TD), self.unbound()
        counts = counts_E.tolist()
        for e, x_ND, t_N, w_N in zip(
            range(self.num_experts), x_AD.split(counts), token_idx_A.split(counts), weights_A.split(counts)
        ):
            if counts[e]:
                y_TD.index_add_(0, t_N, self.expert(e, x_ND, weights) * w_N[:, None])
        return y_TD

    def _grouped_ffn(self, x_AD: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        device = x_AD.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_AD.dtype

        def gmm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # autocast does not cover _grouped_mm
            out = torch._grouped_mm(a.to(dtype), w.to(dtype).transpose(-2, -1), offs=offs_E)
            if out.requires_grad:  # its CPU backward rejects zero-stride (expanded) gradients
                out.register_hook(lambda g: g.contiguous())
            return out

        h_gate = gmm(x_AD, self.gate_proj) if self.gate_proj is not None else None
        return gmm(ffn_act(self.activation, h_gate, gmm(x_AD, self.up_proj)), self.down_proj)

    # -------------------------------------------------------------------------------- export-friendly
    def forward_static(self, x_TD: torch.Tensor, record: RoutingRecord) -> torch.Tensor:
        # the layer as one wide dense FFN of E*F hidden units, each expert's units scaled by its combine
        # weight before the down projection: sum_e c_te down_e(h_te) = down_cat(c_t (x) h_t). Three
        # matmuls whatever E, every expert in the graph, and each weight a plain 2-D matrix (so ONNX
        # Runtime's int8 quantizer gets one per-channel MatMul per projection, not E small ones)
        gate, up, down = self.stacks(x_TD.dtype)
        E, F_, D = up.shape
        T = x_TD.shape[0]
        weights_TK = record.weights_TK.masked_fill(record.dropped_TK, 0.0).to(x_TD.dtype)
        experts_E = torch.arange(E, device=x_TD.device)
        combine_TE = (weights_TK[:, :, None] * (record.expert_ids_TK[:, :, None] == experts_E)).sum(1)
        h_up_TEF = F.linear(x_TD, up.reshape(E * F_, D)).view(T, E, F_)
        h_gate_TEF = F.linear(x_TD, gate.reshape(E * F_, D)).view(T, E, F_) if gate is not None else None
        h_TEF = ffn_act(self.activation, h_gate_TEF, h_up_TEF) * combine_TE[:, :, None]
        down_DEF = down.transpose(0, 1).reshape(D, E * F_)
        return F.linear(h_TEF.reshape(T, E * F_), down_DEF)

    def forward_gather(self, x_TD: torch.Tensor, record: RoutingRecord) -> torch.Tensor:
        weights_TK = record.weights_TK.masked_fill(record.dropped_TK, 0.0).to(x_TD.dtype)
        gate, up, down = self.stacks(x_TD.dtype)
        ids_TK = record.expert_ids_TK
        gathered = ids_TK.numel() * up[0].numel()
        if gathered > 2**28 and not torch.compiler.is_compiling():
            raise ValueError(
                f"expert_impl='gather' would materialize {gathered:,} weights for {ids_TK.shape[0]} "
                "tokens outside torch.compile; it is for compiled decoding: use 'auto' here"
            )
        x_T11D = x_TD[:, None, None, :]
        h_up_TKF = (x_T11D * up[ids_TK]).sum(-1)
        h_gate_TKF = (x_T11D * gate[ids_TK]).sum(-1) if gate is not None else None
        h_TK1F = ffn_act(self.activation, h_gate_TKF, h_up_TKF)[:, :, None, :]
        y_TKD = (h_TK1F * down[ids_TK]).sum(-1)
        return (weights_TK[:, :, None] * y_TKD).sum(1)
