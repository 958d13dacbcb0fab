"""Expert computation: E feed-forward experts stored as stacked weights, the interface every expert module
shares, and the ways to run them.

Legend: T = tokens, D = model dim, F = expert hidden dim, E = experts, K = slots per token,
A = kept (token, slot) assignments, sorted by expert, N = one expert's assignments, R = LoRA rank,
I / O = a projection's input / output width.

Weights are stacked like `nn.Linear` weights, one slice per expert: ``gate_proj [E, F, D]``,
``up_proj [E, F, D]``, ``down_proj [E, D, F]`` (SwiGLU: ``down(silu(gate x) * up x)``, Shazeer 2020), or
``up_proj`` and ``down_proj`` alone for GELU experts (Switch Transformer). Slicing ``w[e]`` is a view, so a
per-expert loop costs no copy, and the stack feeds `torch._grouped_mm` directly (torchtitan `GroupedExperts`).

Implementations, all computing ``y_t = sum_k w_tk * expert_{e_tk}(x_t)`` over the kept slots:
- ``reference``: a plain loop over experts with a boolean mask each: slow, obviously right.
- ``sorted``: sort the kept slots by expert, run each expert's matmuls on its contiguous slice and add it
  back while it is still in cache. The default on CPU for stacks stored in bf16 and wherever grouped_mm is not
  supported.
- ``grouped_mm``: the same sorted layout through one `torch._grouped_mm` per projection (CPU fp32/bf16 in
  torch 2.13, Hopper GPUs in bf16), with no host sync on the token counts. The default on those GPUs and on a
  CPU for float32 stacks (`StackedExperts.resolved_impl` says why), for every
  module that holds dense stacks (``stack``: `GroupedExperts`; a memory-mapped `MappedExperts` once moved to the
  device) or makes them (4-bit `QuantizedExperts`, dequantized per projection, again in backward).
- ``static``: every expert on every token, as one wide FFN of E*F hidden units gated by a dense [T, E]
  combine matrix: three matmuls, no data-dependent shapes, for ONNX export and
  ``torch.compile(fullgraph=True)``. E/K times the FLOPs. ``auto`` takes it while exporting or tracing, but
  not under torch.compile, where it keeps the routed paths (`impl_under_capture`).
- ``gather``: each token gathers its K experts' weights and every projection is written as the reduction
  it is (``h_tkf = sum_d x_td w_{e_tk} fd``). For compiled decoding (few tokens): inductor fuses the gather
  into the reduction loop, so a step streams exactly the chosen experts' bytes, with no copy, no host sync
  and no data-dependent shape. Eager, it materializes [T, K, F, D]: a reference for small T only.
- ``decode`` (when ``max_slots`` > 0; `moe_core.inference.fast_decode` turns it on): for a handful of routed
  slots without gradient, a loop over the *distinct* chosen experts on views of their weights, so a step reads
  K experts' bytes, not E. Taken instead of ``sorted``/``grouped_mm`` when ``T * K <= max_slots``.
Tests hold each equal to the reference in forward and backward (decode, which takes no gradient, in forward).
Every path also computes gpt-oss's experts (a bias per expert and projection, ``{p}_bias`` [E, O], and the clamped
SwiGLU, `clamped_swiglu`, through the one `StackedExperts.activate`): ``x W_e^T + b_e`` per expert, the grouped
product plus each sorted row's expert's bias, the wide products of ``static`` / ``gather`` plus the stacked biases
(`tests/test_arch_gptoss_fast.py`).

LoRA on the experts (`ExpertLoRA`, given as ``forward(..., lora=)``; `moe_core.finetune.expert_lora` builds it from
PEFT's adapter weights) runs inside every path on the tokens routed to each expert: ``proj_e(x) = x W_e^T +
s (x A_e^T) B_e^T`` (Hu et al. 2021, per expert), so its cost follows the routed tokens (2 R (I + O) FLOPs per
assignment) and no ``[E, O, I]`` delta weight is formed; only ``static`` and ``gather``, which read whole stacks by
design, fold ``s B_e A_e`` into them.

The interface every module at ``MoEBlock.experts`` has is `ExpertModule` (a Protocol: ``num_experts`` and
``forward(x_TD, record, impl)``); `StackedExperts` is the abstract base of those whose weights are E stacked
FFNs, which gives them every path above through four members (``expert``, ``unbound``, ``stacks``,
``resolved_impl``), and ``grouped_mm`` through ``stack`` or ``grouped_project``. `sort_by_expert` /
`ExpertDispatch` is the one sort-by-expert dispatch, shared with expert parallelism (`moe_core.train.parallel`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from moe_core import torch_seam
from moe_core.frozen_linear import frozen_linear, recomputed_grouped_mm, share_hooks
from moe_core.routing import RoutingRecord


def ffn_act(activation: str, h_gate: torch.Tensor | None, h_up: torch.Tensor) -> torch.Tensor:
    if activation == "swiglu":
        return F.silu(h_gate) * h_up
    return F.gelu(h_up)


def clamped_swiglu(h_gate: torch.Tensor, h_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's SwiGLU variant (transformers 5.24 models/gpt_oss/modeling_gpt_oss.py GptOssExperts._apply_gate):
    the gate clamped above at ``limit``, the up projection to [-limit, limit], ``gate * sigmoid(alpha * gate)``
    (alpha 1.702: the sigmoid approximation of GELU) times ``up + 1``."""
    h_gate = h_gate.clamp(max=limit)
    h_up = h_up.clamp(min=-limit, max=limit)
    return (h_up + 1) * (h_gate * torch.sigmoid(h_gate * alpha))


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an expert's weights, in the order `stacks` returns them
# every tensor under a MoE layer's routed experts (`MoEBlock.experts`: the experts, their PEFT wrappers and LoRA
# factors) carries this in its name (an expert-parallel shard's own mark: `moe_core.train.parallel.EXPERT_MARK`)
EXPERTS_MARK = ".mlp.experts."


def experts_first(B_EOR: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a factor stack ``B_EOR`` [E, O, R]. PEFT's layout is a permuted view of its
    ``[O, R*E]`` parameter, E innermost: copied as a 2-D transpose of ``[O*R, E]``, which torch does twice as fast
    as the 3-D permute (2.7 against 5.7 ms for Qwen3-30B-A3B's down projection, 128 experts)."""
    E, O, R = B_EOR.shape
    B_ORE = B_EOR.permute(1, 2, 0)
    if B_ORE.is_contiguous():
        return B_ORE.reshape(O * R, E).t().contiguous().view(E, O, R)
    return B_EOR.contiguous()


class _LowRankDelta(torch.autograd.Function):
    """``s (x A^T) B^T`` for one expert's LoRA factors ``A`` [R, I] and ``B`` [O, R] (fp32 parameters, or views of
    them) on activations ``x`` [N, I], computed in the factors' precision as PEFT's LoRA layer computes it
    (``x`` cast up, the result cast back to ``x``'s dtype): only ``x`` (as given), ``u = x A^T`` [N, R] and the
    factors as given (views of the parameters: no memory of their own) are kept; the up-cast ``x`` is made again
    in backward. Autograd on the same products would keep every expert's fp32 copy of its tokens. Computing in
    bf16 instead (cast factors) ran each expert's LoRA products through oneDNN, whose primitive cache keeps one
    primitive per distinct token count: 0.27 GiB more resident at OLMoE-1B-7B's full size after one step
    (measured with the cache off), and autograd kept the cast factors (150 MiB).

    ``B_read``: the same values as ``B_OR`` in a faster layout for the forward's read (`ExpertLoRA.unbound`'s
    contiguous copy of the layer's stack), never kept: saving it kept every layer's copy from its forward to
    its backward (0.22 GiB at Qwen1.5-MoE-A2.7B's full size). Backward reads ``B_OR`` itself, once per
    expert (the training paths take `_SortedLowRankDelta`, which reads one contiguous copy per layer)."""

    @staticmethod
    def forward(
        ctx,
        x_NI: torch.Tensor,
        A_RI: torch.Tensor,
        B_OR: torch.Tensor,
        scale: float,
        B_read: torch.Tensor | None = None,
    ) -> torch.Tensor:
        u_NR = F.linear(x_NI.to(A_RI.dtype), A_RI)
        ctx.save_for_backward(x_NI, u_NR, A_RI, B_OR)
        ctx.scale = scale
        return (F.linear(u_NR, B_OR if B_read is None else B_read) * scale).to(x_NI.dtype)

    @staticmethod
    def backward(ctx, grad_NO: torch.Tensor):
        x_NI, u_NR, A_RI, B_OR = ctx.saved_tensors
        grad_NO = grad_NO.to(B_OR.dtype) * ctx.scale
        grad_u_NR = grad_NO.mm(B_OR)
        grad_B = grad_NO.t().mm(u_NR) if ctx.needs_input_grad[2] else None
        grad_x = grad_u_NR.mm(A_RI).to(x_NI.dtype) if ctx.needs_input_grad[0] else None
        grad_A = grad_u_NR.t().mm(x_NI.to(A_RI.dtype)) if ctx.needs_input_grad[1] else None
        return grad_x, grad_A, grad_B, None, None


def low_rank_delta(
    x_NI: torch.Tensor,
    A_RI: torch.Tensor,
    B_OR: torch.Tensor,
    scale: float,
    B_read: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scale * (x A^T) B^T`` [N, O] in ``x``'s dtype, computed in the factors' dtype (as PEFT does);
    `_LowRankDelta` when a gradient is wanted, else the plain products. ``B_read``: ``B_OR``'s values in a
    faster layout, read by the forward only (see `_LowRankDelta`)."""
    if (
        torch.is_grad_enabled()
        and x_NI.dim() == 2
        and (x_NI.requires_grad or A_RI.requires_grad or B_OR.requires_grad)
    ):
        return _LowRankDelta.apply(x_NI, A_RI, B_OR, scale, B_read)
    B_OR = B_OR if B_read is None else B_read
    return (F.linear(F.linear(x_NI.to(A_RI.dtype), A_RI), B_OR) * scale).to(x_NI.dtype)


class _SortedLowRankDelta(torch.autograd.Function):
    """`_LowRankDelta` for every expert of a layer at once, on its expert-sorted rows ``x_AI`` (``counts``: rows
    per expert), expert by expert with the same products (bitwise the same values): one autograd node per
    projection, where the per-expert nodes' factor gradients were stacked by autograd, zeros and all (38 ms of a
    1.17 s step of Qwen3-30B-A3B cut to 4 layers), and each expert's backward copied its scattered ``B_e`` (68 ms);
    here each gradient is written into its slice of one ``[E, R, I]`` / ``[E, O, R]`` gradient. Kept for backward: ``x`` as given, ``u = x A^T`` [A, R] and the factors as given
    (views of the parameters); ``B`` is read from a contiguous copy made in each pass and dropped with it."""

    @staticmethod
    def forward(
        ctx, x_AI: torch.Tensor, A_ERI: torch.Tensor, B_EOR: torch.Tensor, scale: float, counts: list[int]
    ) -> torch.Tensor:
        A_ERI_, B_EOR_ = A_ERI.detach(), experts_first(B_EOR.detach())
        u_AR = x_AI.new_empty((x_AI.shape[0], A_ERI.shape[1]), dtype=A_ERI.dtype)
        out_AO = x_AI.new_empty((x_AI.shape[0], B_EOR.shape[1]))
        for e, (x_NI, u_NR, out_NO) in enumerate(
            zip(x_AI.split(counts), u_AR.split(counts), out_AO.split(counts))
        ):
            if counts[e]:
                torch.mm(x_NI.to(A_ERI_.dtype), A_ERI_[e].t(), out=u_NR)
                out_NO.copy_(torch.mm(u_NR, B_EOR_[e].t()).mul_(scale))
        ctx.save_for_backward(x_AI, u_AR, A_ERI, B_EOR)
        ctx.scale, ctx.counts = scale, counts
        return out_AO

    @staticmethod
    def backward(ctx, grad_AO: torch.Tensor):
        x_AI, u_AR, A_ERI, B_EOR = ctx.saved_tensors
        A_ERI_, B_EOR_ = A_ERI.detach(), experts_first(B_EOR.detach())
        need_x, need_A, need_B = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(x_AI)  # every row is some expert's: written whole
        grad_A = torch.zeros_like(A_ERI_) if need_A else None  # experts without rows: zero
        grad_B = torch.zeros_like(B_EOR_) if need_B else None
        splits = (t.split(ctx.counts) for t in (x_AI, u_AR, grad_AO, grad_x))
        for e, (x_NI, u_NR, grad_NO, grad_x_NI) in enumerate(zip(*splits)):
            if not ctx.counts[e]:
                continue
            grad_NO = grad_NO.to(B_EOR_.dtype) * ctx.scale
            grad_u_NR = grad_NO.mm(B_EOR_[e])
            if need_B:
                torch.mm(grad_NO.t(), u_NR, out=grad_B[e])
            if need_x:
                grad_x_NI.copy_(grad_u_NR.mm(A_ERI_[e]))
            if need_A:
                torch.mm(grad_u_NR.t(), x_NI.to(A_ERI_.dtype), out=grad_A[e])
        return grad_x if need_x else None, grad_A, grad_B, None, None


@dataclass(frozen=True)
class ExpertLoRA:
    """Low-rank updates of the expert projections: for projection ``p`` and expert ``e``,
    ``W_pe + sum over adapters a of s_a B_ape A_ape`` (LoRA, Hu et al. 2021; per-expert factors as PEFT's
    ``ParamWrapper`` keeps them for a stacked parameter).

    ``factors[p]`` holds one ``(A_ERI [E, R, I], B_EOR [E, O, R], s)`` per active adapter; a projection without
    an entry is not adapted. Apply it on routed tokens with `delta` (one expert) or `grouped_delta` (the sorted
    assignments of all experts at once); `dense` forms the full ``[E, O, I]`` update for the paths that read
    whole stacks (``static``, ``gather``) and nothing else."""

    factors: dict[str, tuple[tuple[torch.Tensor, torch.Tensor, float], ...]]

    def unbound(self) -> dict[str, tuple[tuple[tuple, tuple, tuple, float], ...]]:
        """Per-expert views of every factor, made once per layer for a loop over experts (one gradient per
        stack, as `StackedExperts.unbound`), and of a contiguous copy of ``B`` for the forward's reads: PEFT's
        ``[O, R*E]`` layout puts an expert's ``B_e`` on every cache line of the parameter, slow to read expert by
        expert. The copy is detached and lives as long as these views (one layer's forward); gradients and
        backward go through the views of the parameter (`_LowRankDelta`)."""
        return {
            p: tuple(
                (A.unbind(0), B.unbind(0), experts_first(B.detach()).unbind(0), s) for A, B, s in per_adapter
            )
            for p, per_adapter in self.factors.items()
        }

    @staticmethod
    def delta(views: dict, p: str, e: int, x_NI: torch.Tensor) -> torch.Tensor | None:
        """``sum_a s_a (x A_ae^T) B_ae^T`` [N, O] for expert ``e`` from `unbound`'s views; None when ``p`` is not
        adapted."""
        out_NO = None
        for A_E, B_E, B_read_E, s in views.get(p, ()):
            term_NO = low_rank_delta(x_NI, A_E[e], B_E[e], s, B_read_E[e])
            out_NO = term_NO if out_NO is None else out_NO + term_NO
        return out_NO

    def sorted_delta(self, p: str, x_AI: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """`delta` of every expert at once, on the expert-sorted rows ``x_AI`` (``counts``: rows per expert), with
        gradients (`_SortedLowRankDelta`); None when ``p`` is not adapted."""
        out_AO = None
        for A_ERI, B_EOR, s in self.factors.get(p, ()):
            term_AO = _SortedLowRankDelta.apply(x_AI, A_ERI, B_EOR, s, counts)
            out_AO = term_AO if out_AO is None else out_AO + term_AO
        return out_AO

    def grouped_delta(self, p: str, x_AI: torch.Tensor, gmm) -> torch.Tensor | None:
        """The same for the expert-sorted assignments ``x_AI`` through ``gmm(a, w [E, out, in])`` (a grouped
        matmul over the same offsets as the base projection)."""
        out_AO = None
        for A_ERI, B_EOR, s in self.factors.get(p, ()):
            term_AO = gmm(gmm(x_AI, A_ERI), B_EOR) * s
            out_AO = term_AO if out_AO is None else out_AO + term_AO
        return out_AO

    def dense(self, p: str, dtype: torch.dtype) -> torch.Tensor | None:
        """``sum_a s_a B_a A_a`` [E, O, I]: the full update, for the paths that read whole stacks."""
        out_EOI = None
        for A_ERI, B_EOR, s in self.factors.get(p, ()):
            term_EOI = torch.bmm(B_EOR.to(dtype), A_ERI.to(dtype)) * s
            out_EOI = term_EOI if out_EOI is None else out_EOI + term_EOI
        return out_EOI

    def ranks(self) -> set[int]:
        return {A.shape[1] for per_adapter in self.factors.values() for A, _, _ in per_adapter}


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


def impl_under_capture(x_TD: torch.Tensor, grouped_mm_ok) -> str | None:
    """The path ``auto`` takes while a graph is being captured, or None when running eagerly.

    - torch.export, ONNX export, jit tracing: ``static``, the one path with no data-dependent shape.
    - torch.compile: ``grouped_mm`` on a GPU where it runs (``grouped_mm_ok()``), as torchtitan compiles its
      experts; otherwise ``sorted``, whose read of the token counts is a graph break: `forward_sorted` runs
      eagerly between the compiled graphs. Not ``grouped_mm`` on the CPU: in torch 2.13 its fake kernel takes
      bf16 only, and inductor's CPU fallback does not keep the strides it needs (a LoRA factor's cast copy
      reached it permuted: "Invalid strides/sizes"). Not ``static`` either: E/K times the FLOPs (compiled fp32
      training steps on 2 CPU cores: olmoe-small 500 ms on it against 351 ms sorted, 360 eager; experts of
      hidden 1024 and width 512, 3.48 s against 1.56, 1.60 eager; only at toy widths in bf16 can its few wide
      matmuls win, benchmarks/README.md). A caller that needs one graph (``fullgraph=True``) names ``static``.
    """
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch_seam.is_exporting():
        return "static"
    if not torch.compiler.is_compiling():
        return None
    return "grouped_mm" if x_TD.is_cuda and grouped_mm_ok() else "sorted"


@runtime_checkable
class ExpertModule(Protocol):
    """What `MoEBlock` calls as ``self.experts``: E experts behind one call. Declared once, here.

    - ``num_experts``: E, the number of experts the router chooses among (for expert parallelism the
      global E, not this rank's share).
    - ``forward(x_TD, record, impl=None) -> y_TD`` (`StackedExperts` also take ``lora=``, an `ExpertLoRA`): ``y_t = sum_k w_tk * expert_{e_tk}(x_t)`` over the
      record's kept slots (dropped slots contribute nothing), same shape and dtype as ``x_TD``. ``impl``
      names a path of `StackedExperts.forward` (``reference``, ``sorted``, ``grouped_mm``, ``static``,
      ``gather``) or None for the module's own choice; a module with one way of computing ignores it.

    Implementations (`tests/test_expert_modules.py` checks each against this and against the reference):
    - `GroupedExperts` (here): dense stacked parameters, the model's own.
    - `moe_core.inference.fast_decode.DecodeExperts`: a `GroupedExperts` with the few-slot decode path on.
    - `moe_core.inference.quantize.QuantizedExperts`: int8/int4 codes, dequantized per expert as it runs.
    - `moe_core.inference.expert_cache.OffloadedExperts`: weights read from disk through an LRU cache.
    - `moe_core.train.parallel.ExpertParallelExperts`: this rank's slice, all-to-all dispatch and return.
    - `moe_core.finetune.expert_lora.ParamWrapper` (PEFT's LoRA wrapper of a stack, our forward): wraps a
      `StackedExperts` and calls it with ``lora=`` (an `ExpertLoRA`), which every path applies on the routed
      tokens; stock PEFT's ``ParamWrapper`` passes the call through with the adapted (dense) weights.
    The first three are `StackedExperts`.
    """

    num_experts: int

    def forward(self, x_TD: torch.Tensor, record: RoutingRecord, impl: str | None = None) -> torch.Tensor: ...


# ------------------------------------------------------------------------------------------------ dispatch
@dataclass
class ExpertSort:
    """Rows sorted by expert, stably (the rows of one expert keep their order)."""

    order_A: torch.Tensor  # sorted position -> original row
    expert_ids_A: torch.Tensor  # expert of each sorted row, ascending
    counts_E: torch.Tensor  # rows per expert

    def inverse(self) -> torch.Tensor:
        """Original row -> sorted position: ``sorted[inverse()]`` is back in the original order."""
        inverse_A = torch.empty_like(self.order_A)
        inverse_A[self.order_A] = torch.arange(self.order_A.numel(), device=self.order_A.device)
        return inverse_A


def sort_by_expert(expert_ids_A: torch.Tensor, num_experts: int) -> ExpertSort:
    """The one sort-by-expert of the lab: the sorted paths here and expert parallelism's regrouping. The counts
    are where each expert's run of the sorted ids begins (`torch.searchsorted`), not ``bincount``: on CUDA
    that reads the largest id back to the host first, a wait for the device in every MoE layer."""
    expert_ids_A, order_A = expert_ids_A.sort(stable=True)
    starts_E1 = torch.searchsorted(expert_ids_A, torch.arange(num_experts + 1, device=expert_ids_A.device))
    return ExpertSort(order_A, expert_ids_A, starts_E1.diff())


@dataclass
class ExpertDispatch:
    """The kept (token, slot) assignments of a `RoutingRecord`, sorted by expert: what a sort-based path
    gathers (`gather`), computes expert by expert on contiguous slices (``counts_E``) and adds back to its
    tokens with their combine weights (`combine`)."""

    token_idx_A: torch.Tensor  # the token of each assignment
    expert_ids_A: torch.Tensor  # its expert, ascending
    weights_A: torch.Tensor  # its combine weight, in the router's dtype
    counts_E: torch.Tensor  # assignments per expert

    @classmethod
    def of(cls, record: RoutingRecord, num_experts: int, every_slot: bool = False) -> ExpertDispatch:
        """The kept slots, sorted by expert. ``every_slot`` (token choice only): every slot, the dropped ones
        with combine weight 0, so they add exactly nothing and get no gradient; selecting the kept ones is a
        ``nonzero``, whose size the host must read back, a wait for the device in every layer (grouped_mm
        takes it: its launches then never wait). Expert choice (K = E slots enumerate the experts) keeps the
        kept ones alone: every slot would be the dense layer."""
        T, K = record.expert_ids_TK.shape
        weights_TK = record.weights_TK
        if every_slot and record.slots_are_choices:
            slot_A = torch.arange(T * K, device=record.expert_ids_TK.device)
            weights_TK = weights_TK.masked_fill(record.dropped_TK, 0.0)  # 0 by the record's contract already
        else:
            slot_A = (~record.dropped_TK).flatten().nonzero().squeeze(-1)
        by_expert = sort_by_expert(record.expert_ids_TK.flatten()[slot_A], num_experts)
        slot_A = slot_A[by_expert.order_A]
        return cls(slot_A // K, by_expert.expert_ids_A, weights_TK.flatten()[slot_A], by_expert.counts_E)

    def gather(self, x_TD: torch.Tensor) -> torch.Tensor:
        return x_TD.index_select(0, self.token_idx_A)

    def combine(self, out_AD: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        """``y_t = sum over t's assignments a of w_a * out_a`` (zero for a token with none)."""
        weights_A = self.weights_A.to(x_TD.dtype)
        return torch.zeros_like(x_TD).index_add(0, self.token_idx_A, out_AD * weights_A[:, None])


# ------------------------------------------------------------------------------------------------ experts
class StackedExperts(nn.Module, ExpertModule, ABC):
    """Abstract base of the `ExpertModule` implementations whose weights are E stacked FFNs: every path of
    this file (reference, sorted, grouped_mm, static, gather, decode), with or without LoRA, runs on top of
    four members; `expert` (one expert's FFN on its tokens) is built from them.

    - ``project(p, e, x_NI, weights) -> y_NO``: projection ``p`` (one of `PROJECTIONS`) of expert ``e`` on a
      batch of its tokens. ``weights`` is what `unbound` (or, without gradients, `decode_weights`) returned,
      handed in by a loop over experts so that the per-expert views are made once per layer.
    - ``unbound() -> (gate, up, down)``: per-expert views of the stacks for `project` in a loop, so that the
      loop builds one gradient per stack instead of one full-size gradient per slice (gate None for GELU
      experts), or Nones for an implementation whose `project` reads its own weights.
    - ``stacks(dtype=None) -> (gate [E, F, D] or None, up [E, F, D], down [E, D, F])``: the whole stacks in
      ``dtype`` (as stored when None), for the paths that run every expert at once (static, gather).
    - ``resolved_impl(x_TD) -> str``: the path ``forward`` takes when called with ``impl=None``.

    Attributes: ``num_experts``, ``activation`` ("swiglu" or "gelu"), ``impl`` (the configured path or
    "auto"), ``max_slots`` (> 0 turns the decode path on for up to that many routed slots).
    Implementations: `GroupedExperts` (dense parameters; `DecodeExperts` is one with ``max_slots`` set),
    `moe_core.inference.quantize.QuantizedExperts` and `moe_core.mapped.MappedExperts` (one memory-mapped tensor
    per expert, as Hugging Face checkpoints store them).
    """

    def __init__(self, num_experts: int, activation: str, impl: str = "auto", max_slots: int = 0) -> None:
        super().__init__()
        self.num_experts, self.activation, self.impl, self.max_slots = (
            num_experts,
            activation,
            impl,
            max_slots,
        )

    # gpt-oss (transformers 5.24 models/gpt_oss/modeling_gpt_oss.py GptOssExperts): a bias per expert and
    # projection, stored by each implementation as ``{p}_bias`` [E, O] (None without), and the clamped SwiGLU
    # (`clamped_swiglu`) when ``swiglu_limit`` is a number. Every path computes both: the per-expert ones (reference,
    # sorted, decode) in `expert`, grouped_mm adds each sorted row's expert's bias after its grouped product, static
    # and gather add the biases to their wide products (the down bias weighted by the combine weights)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def bias_stack(self, p: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """Projection ``p``'s biases [E, O] of every expert (in ``dtype`` when given), or None (no biases)."""
        bias_EO = getattr(self, f"{p}_bias", None)
        return bias_EO if bias_EO is None or dtype is None else bias_EO.to(dtype)

    def expert_bias(self, p: str, e: int) -> torch.Tensor | None:
        """Expert ``e``'s bias of projection ``p`` (gpt-oss), or None."""
        bias_EO = self.bias_stack(p)
        return None if bias_EO is None else bias_EO[e]

    def ffn_options(self) -> dict:
        """What an expert FFN is besides its weights (gpt-oss: biases, the clamped SwiGLU), as the constructors of
        `GroupedExperts`, `moe_core.mapped.MappedExperts` and `moe_core.quantized.QuantizedExperts` take it: a
        module replacing another is built with its ``ffn_options()``."""
        return {
            "bias": self.bias_stack("up_proj") is not None,
            "swiglu_limit": self.swiglu_limit,
            "swiglu_alpha": self.swiglu_alpha,
        }

    def init_frozen_biases(
        self, shapes: dict[str, tuple[int, int]], bias: bool, dtype: torch.dtype | None = None
    ) -> None:
        """Frozen ``{p}_bias`` [E, O] parameters (zeros until a loader fills them) for the projections in
        ``shapes`` when ``bias``, else None: the biases of experts whose weights are held otherwise (memory-mapped,
        quantized), kept in ``dtype`` as they are (a few numbers per expert: never quantized)."""
        for p in PROJECTIONS:
            has = bias and p in shapes
            bias_EO = torch.zeros(self.num_experts, shapes[p][0], dtype=dtype) if has else None
            self.register_parameter(
                f"{p}_bias", nn.Parameter(bias_EO, requires_grad=False) if bias_EO is not None else None
            )

    def activate(self, h_gate: torch.Tensor | None, h_up: torch.Tensor) -> torch.Tensor:
        """The experts' activation, for every path: SwiGLU or GELU (`ffn_act`), or gpt-oss's clamped SwiGLU."""
        if self.swiglu_limit is not None:
            return clamped_swiglu(h_gate, h_up, self.swiglu_limit, self.swiglu_alpha)
        return ffn_act(self.activation, h_gate, h_up)

    @abstractmethod
    def project(self, p: str, e: int, x_NI: torch.Tensor, weights: tuple) -> torch.Tensor: ...

    def expert(
        self, e: int, x_ND: torch.Tensor, weights: tuple | None = None, lora: dict | None = None
    ) -> torch.Tensor:
        """Expert ``e`` on a batch of its tokens, as an ordinary FFN; ``lora``: `ExpertLoRA.unbound` views."""
        weights = weights if weights is not None else self.unbound()

        def proj(p: str, x_NI: torch.Tensor) -> torch.Tensor:
            y_NO = self.project(p, e, x_NI, weights)
            bias_O = self.expert_bias(p, e)
            if bias_O is not None:
                y_NO = y_NO + bias_O
            delta_NO = ExpertLoRA.delta(lora, p, e, x_NI) if lora else None
            return y_NO if delta_NO is None else y_NO + delta_NO

        h_gate = proj("gate_proj", x_ND) if self.activation == "swiglu" else None
        return proj("down_proj", self.activate(h_gate, proj("up_proj", x_ND)))

    @abstractmethod
    def unbound(self) -> tuple: ...

    @abstractmethod
    def stacks(self, dtype: torch.dtype | None = None) -> tuple: ...

    def decode_weights(self) -> tuple:
        """What the decode loop hands to `expert` (it takes no gradient): `unbound` unless cheaper exists."""
        return self.unbound()

    def stack(self, p: str) -> torch.Tensor | None:
        """Projection ``p``'s weights as the dense ``[E, O, I]`` tensor this module already holds (no copy: a
        parameter, or the storage its per-expert tensors are views of), or None: what ``grouped_mm`` multiplies
        by (`grouped_project`)."""
        return None

    def grouped_mm_ok(self, x_TD: torch.Tensor, lora: ExpertLoRA | None = None) -> bool:
        """Whether ``grouped_mm`` can run on ``x_TD`` (and ``lora``'s ranks) here: it needs every projection as
        a dense stack (`stack`) and a device and dtype `torch._grouped_mm` takes."""
        up = self.stack("up_proj")
        if up is None or self.stack("down_proj") is None:
            return False
        if self.activation == "swiglu" and self.stack("gate_proj") is None:
            return False
        E, F_, D = up.shape
        return grouped_mm_supported(x_TD, F_, D, *(lora.ranks() if lora is not None else ()))

    def resolved_impl(self, x_TD: torch.Tensor) -> str:
        if self.impl != "auto":
            return self.impl
        traced = impl_under_capture(x_TD, lambda: self.grouped_mm_ok(x_TD))
        if traced is not None:
            return traced
        if not self.grouped_mm_ok(x_TD):
            return "sorted"
        if x_TD.is_cuda:
            return "grouped_mm"
        # On the CPU, grouped_mm where the stacks are float32 (a trainer's weights, under bf16 autocast too): one
        # call per projection beat the per-expert loop in the fp32 training steps of the five small presets
        # measured (olmoe, qwen3, mixtral, switch, deepseek: 0.71-0.98x), under bf16 autocast (olmoe-small alone:
        # 0.80x) and at OLMoE-1B-7B's width in fp32 (0.92x). Where the stacks are stored in bf16 (a published
        # checkpoint's base) torch's CPU kernel ran the 4-layer OLMoE-1B-7B's steps 1.3-1.9x slower than the loop
        # (full training, and LoRA at 1,024 tokens): benchmarks/README.md, "Expert path and clipping norm on the
        # CPU".
        return "grouped_mm" if self.stack("up_proj").dtype == torch.float32 else "sorted"

    def forward(
        self,
        x_TD: torch.Tensor,
        record: RoutingRecord,
        impl: str | None = None,
        lora: ExpertLoRA | None = None,
    ) -> torch.Tensor:
        impl = impl or self.resolved_impl(x_TD)
        if self.uses_decode_path(x_TD, record, impl):
            return self.forward_decode(x_TD, record, lora)
        if impl == "reference":
            return self.forward_reference(x_TD, record, lora)
        if impl == "static":
            return self.forward_static(x_TD, record, lora)
        if impl == "gather":
            return self.forward_gather(x_TD, record, lora)
        if impl == "sorted":
            return self.forward_sorted(x_TD, record, lora)
        if impl == "grouped_mm":
            return self.forward_grouped_mm(x_TD, record, lora)
        raise ValueError(
            f"unknown expert implementation {impl!r}; choose reference, sorted, grouped_mm, static or gather"
        )

    # -------------------------------------------------------------------------------- slow reference
    def forward_reference(
        self, x_TD: torch.Tensor, record: RoutingRecord, lora: ExpertLoRA | None = None
    ) -> torch.Tensor:
        y_TD = torch.zeros_like(x_TD)
        weights_TK = record.weights_TK.to(x_TD.dtype)
        views = lora.unbound() if lora is not None else None
        for e in range(self.num_experts):
            token_idx, slot_idx = torch.where((record.expert_ids_TK == e) & ~record.dropped_TK)
            if token_idx.numel() == 0:
                continue
            out_ND = self.expert(e, x_TD[token_idx], lora=views) * weights_TK[token_idx, slot_idx, None]
            y_TD = y_TD.index_add(0, token_idx, out_ND)
        return y_TD

    # -------------------------------------------------------------------------------- fast paths
    @torch.compiler.disable  # the host reads the token counts: under torch.compile it runs between graphs
    def forward_sorted(
        self, x_TD: torch.Tensor, record: RoutingRecord, lora: ExpertLoRA | None = None
    ) -> torch.Tensor:
        dispatch = ExpertDispatch.of(record, self.num_experts)
        # training LoRA: a projection at a time (`sorted_ffn`)
        if lora is not None and torch.is_grad_enabled():
            return dispatch.combine(
                self.sorted_ffn(dispatch.gather(x_TD), dispatch.counts_E.tolist(), lora), x_TD
            )
        x_AD, weights_A = dispatch.gather(x_TD), dispatch.weights_A.to(x_TD.dtype)
        # expert by expert on its contiguous slice, combined while the slice is still in cache
        y_TD, weights = torch.zeros_like(x_TD), self.unbound()
        views = lora.unbound() if lora is not None else None
        counts = dispatch.counts_E.tolist()
        for e, x_ND, t_N, w_N in zip(
            range(self.num_experts),
            x_AD.split(counts),
            dispatch.token_idx_A.split(counts),
            weights_A.split(counts),
        ):
            if counts[e]:
                y_TD.index_add_(0, t_N, self.expert(e, x_ND, weights, views) * w_N[:, None])
        return y_TD

    def sorted_ffn(
        self, x_AD: torch.Tensor, counts: list[int], lora: ExpertLoRA | None = None
    ) -> torch.Tensor:
        """Every expert's FFN on its rows of the expert-sorted ``x_AD`` (``counts``: rows per expert), the outputs
        in the same order: `grouped_ffn`'s contract, expert by expert (the sorted path's slices; expert
        parallelism's local experts). Under LoRA with gradients, a projection at a time: the base product expert by
        expert (`project`), the projection's LoRA delta for every expert in one autograd node
        (`ExpertLoRA.sorted_delta`), where one node per expert and projection left autograd to stack their factor
        gradients; the same values as `expert`'s loop. Otherwise (and on no rows at all, which still joins the
        graph) `expert` on each slice."""
        weights = self.unbound()
        if lora is None or not torch.is_grad_enabled() or x_AD.shape[0] == 0:
            views = lora.unbound() if lora is not None else None
            slices = zip(range(self.num_experts), x_AD.split(counts))
            return torch.cat([self.expert(e, x_ND, weights, views) for e, x_ND in slices])

        def proj(p: str, x_AI: torch.Tensor) -> torch.Tensor:
            outs = []
            for e, x_NI in enumerate(x_AI.split(counts)):
                if counts[e]:
                    y_NO = self.project(p, e, x_NI, weights)
                    bias_O = self.expert_bias(p, e)
                    outs.append(y_NO if bias_O is None else y_NO + bias_O)
            y_AO = torch.cat(outs)
            delta_AO = lora.sorted_delta(p, x_AI, counts)
            return y_AO if delta_AO is None else y_AO + delta_AO

        h_gate = proj("gate_proj", x_AD) if self.activation == "swiglu" else None
        return proj("down_proj", self.activate(h_gate, proj("up_proj", x_AD)))

    def forward_grouped_mm(
        self, x_TD: torch.Tensor, record: RoutingRecord, lora: ExpertLoRA | None = None
    ) -> torch.Tensor:
        """The sorted layout through one grouped matmul per projection; where it cannot run (no dense stacks, a
        device or dtype it does not take, a LoRA rank of a width it cannot take), `forward_sorted`."""
        if not self.grouped_mm_ok(x_TD, lora):
            return self.forward_sorted(x_TD, record, lora)
        dispatch = ExpertDispatch.of(record, self.num_experts, every_slot=True)
        offs_E = dispatch.counts_E.cumsum(0).to(torch.int32)
        out_AD = self.grouped_ffn(dispatch.gather(x_TD), offs_E, lora, dispatch.expert_ids_A)
        return dispatch.combine(out_AD, x_TD)

    def grouped_project(self, p: str, x_AI: torch.Tensor, gmm) -> torch.Tensor:
        """Projection ``p`` of the expert-sorted rows ``x_AI`` through ``gmm(a, w)`` (``w``: an ``[E, O, I]``
        stack, or a function of the dtype making it): `stack`'s weights (quantized experts pass their
        dequantization)."""
        return gmm(x_AI, self.stack(p))

    def grouped_ffn(
        self,
        x_AD: torch.Tensor,
        offs_E: torch.Tensor,
        lora: ExpertLoRA | None = None,
        expert_ids_A: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The sorted rows ``x_AD`` through every projection as one grouped matmul each (``offs_E``: where each
        expert's rows end); ``expert_ids_A`` (each row's expert) places gpt-oss's biases."""
        device = x_AD.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_AD.dtype

        def gmm(a: torch.Tensor, w) -> torch.Tensor:  # autocast does not cover _grouped_mm
            # w: an [E, O, I] stack, or a function making one in a dtype (made again in backward, never kept:
            # QLoRA's, dequantized straight into the compute dtype)
            if callable(w):
                out = recomputed_grouped_mm(a.to(dtype), w, offs_E)
            else:
                # contiguous: a LoRA B factor is a permuted view of PEFT's [O, R*E] parameter (a no-op otherwise)
                w_EIO = w.to(dtype).contiguous().transpose(-2, -1)
                out = torch._grouped_mm(a.to(dtype), w_EIO, offs=offs_E)
            if out.requires_grad:  # its CPU backward rejects zero-stride (expanded) gradients
                out.register_hook(lambda g: g.contiguous())
            return out

        def proj(p: str, x_AI: torch.Tensor) -> torch.Tensor:
            y_AO = self.grouped_project(p, x_AI, gmm)
            bias_EO = self.bias_stack(p)
            # the rows are sorted by expert: each gets its expert's bias (a gather: no host sync)
            if bias_EO is not None:
                y_AO = y_AO + bias_EO.to(y_AO.dtype).index_select(0, expert_ids_A)
            delta_AO = lora.grouped_delta(p, x_AI, gmm) if lora is not None else None
            return y_AO if delta_AO is None else y_AO + delta_AO

        h_gate = proj("gate_proj", x_AD) if self.activation == "swiglu" else None
        return proj("down_proj", self.activate(h_gate, proj("up_proj", x_AD)))

    def uses_decode_path(self, x_TD: torch.Tensor, record: RoutingRecord, impl: str) -> bool:
        return (
            self.max_slots > 0
            and impl in ("sorted", "grouped_mm")
            and record.expert_ids_TK.numel() <= self.max_slots
            and not (torch.is_grad_enabled() and x_TD.requires_grad)
        )

    @torch.compiler.disable  # a host loop over the chosen experts: under torch.compile it runs between graphs
    def forward_decode(
        self, x_TD: torch.Tensor, record: RoutingRecord, lora: ExpertLoRA | None = None
    ) -> torch.Tensor:
        # Batch-1 decoding is memory-bound: a step costs about the bytes of the weights it reads. The sorted
        # path pays a sort, a host sync and one (mostly empty) matmul per expert, grouped_mm reads its whole
        # stack; here one host sync for the whole layer, then a matmul per distinct chosen expert, on a view
        # of its weights (no copy), so a step reads K experts' bytes, not E
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
        weights = self.decode_weights()
        views = lora.unbound() if lora is not None else None
        T = x_TD.shape[0]
        for e, (toks, slots) in tokens_of.items():
            if len(toks) == T == 1:  # the batch-1 decode step: no gathers at all
                y_TD = y_TD + self.expert(e, x_TD, weights, views) * weights_TK[:, slots[0], None]
                continue
            t_N = torch.tensor(toks, device=x_TD.device)
            w_N = weights_TK[t_N, torch.tensor(slots, device=x_TD.device)]
            out_ND = self.expert(e, x_TD.index_select(0, t_N), weights, views)
            y_TD = y_TD.index_add(0, t_N, out_ND * w_N[:, None])
        return y_TD

    # -------------------------------------------------------------------------------- export-friendly
    def stacks_with(self, lora: ExpertLoRA | None, dtype: torch.dtype) -> tuple:
        """`stacks` in ``dtype`` with the LoRA update folded in: for the paths that read whole stacks."""
        stacks = self.stacks(dtype)
        if lora is None:
            return stacks
        deltas = (lora.dense(p, dtype) for p in PROJECTIONS)
        return tuple(w if w is None or d is None else w + d for w, d in zip(stacks, deltas))

    def forward_static(
        self, x_TD: torch.Tensor, record: RoutingRecord, lora: ExpertLoRA | None = None
    ) -> torch.Tensor:
        # the layer as one wide dense FFN of E*F hidden units, each expert's units scaled by its combine
        # weight before the down projection: sum_e c_te down_e(h_te) = down_cat(c_t (x) h_t). Three
        # matmuls whatever E, every expert in the graph, and each weight a plain 2-D matrix (so ONNX
        # Runtime's int8 quantizer gets one per-channel MatMul per projection, not E small ones)
        gate, up, down = self.stacks_with(lora, x_TD.dtype)
        gate_b, up_b, down_b = (self.bias_stack(p, x_TD.dtype) for p in PROJECTIONS)  # gpt-oss's, or None
        E, F_, D = up.shape
        T = x_TD.shape[0]
        weights_TK = record.weights_TK.masked_fill(record.dropped_TK, 0.0).to(x_TD.dtype)
        experts_E = torch.arange(E, device=x_TD.device)
        combine_TE = (weights_TK[:, :, None] * (record.expert_ids_TK[:, :, None] == experts_E)).sum(1)

        def wide(w_EFD: torch.Tensor, b_EF: torch.Tensor | None) -> torch.Tensor:
            # the bias added apart: a bias-free product exports as a plain MatMul, which ONNX Runtime's int8 takes
            h_TEF = F.linear(x_TD, w_EFD.reshape(E * F_, D)).view(T, E, F_)
            return h_TEF if b_EF is None else h_TEF + b_EF

        h_up_TEF = wide(up, up_b)
        h_gate_TEF = wide(gate, gate_b) if gate is not None else None
        h_TEF = self.activate(h_gate_TEF, h_up_TEF) * combine_TE[:, :, None]
        down_DEF = down.transpose(0, 1).reshape(D, E * F_)
        y_TD = F.linear(h_TEF.reshape(T, E * F_), down_DEF)
        # sum_e c_te (down_e h_te + b_e): each expert's down bias as much as the token chose it (zero if not)
        return y_TD if down_b is None else y_TD + combine_TE @ down_b

    def forward_gather(
        self, x_TD: torch.Tensor, record: RoutingRecord, lora: ExpertLoRA | None = None
    ) -> torch.Tensor:
        weights_TK = record.weights_TK.masked_fill(record.dropped_TK, 0.0).to(x_TD.dtype)
        gate, up, down = self.stacks_with(lora, x_TD.dtype)
        ids_TK = record.expert_ids_TK
        gathered = ids_TK.numel() * up[0].numel()
        if gathered > 2**28 and not torch.compiler.is_compiling():
            raise ValueError(
                f"expert_impl='gather' would materialize {gathered:,} weights for {ids_TK.shape[0]} "
                "tokens outside torch.compile; it is for compiled decoding: use 'auto' here"
            )
        gate_b, up_b, down_b = (self.bias_stack(p, x_TD.dtype) for p in PROJECTIONS)  # gpt-oss's, or None
        x_T11D = x_TD[:, None, None, :]

        def project(w_EFD: torch.Tensor, b_EF: torch.Tensor | None) -> torch.Tensor:
            h_TKF = (x_T11D * w_EFD[ids_TK]).sum(-1)
            return h_TKF if b_EF is None else h_TKF + b_EF[ids_TK]

        h_up_TKF = project(up, up_b)
        h_gate_TKF = project(gate, gate_b) if gate is not None else None
        # the combine weight scales h before the down projection, and y_td = sum_{k,f} h_tkf w_{e_tk} df is
        # one reduction over K*F per output: one horizontal sum per d (not K), the K experts' rows streamed
        # side by side, no separate combine loop (3-6% off the olmoe-small decode step, benchmarks/README.md)
        h_T1KF = (self.activate(h_gate_TKF, h_up_TKF) * weights_TK[:, :, None])[:, None]
        y_TD = (h_T1KF * down[ids_TK].transpose(1, 2)).sum((-2, -1))
        return y_TD if down_b is None else y_TD + (weights_TK[:, :, None] * down_b[ids_TK]).sum(1)


class GroupedExperts(StackedExperts):
    """E experts as dense stacked parameters: the model's own `StackedExperts` (see the module docstring)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str,
        impl: str = "auto",
        max_slots: int = 0,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
    ):
        super().__init__(num_experts, activation, impl, max_slots)
        E, D, F_ = num_experts, hidden_size, intermediate_size
        if activation == "swiglu":
            self.gate_proj = nn.Parameter(torch.empty(E, F_, D))
        else:
            self.register_parameter("gate_proj", None)
        self.up_proj = nn.Parameter(torch.empty(E, F_, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, F_))
        # gpt-oss: a bias per expert and projection ([E, F] gate and up, [E, D] down), the clamped SwiGLU
        for p, width in (("gate_proj", F_), ("up_proj", F_), ("down_proj", D)):
            has = bias and getattr(self, p) is not None
            self.register_parameter(f"{p}_bias", nn.Parameter(torch.empty(E, width)) if has else None)
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """``{projection: (O, I)}``: one expert's weight shape per projection it has (no gate for GELU)."""
        return {p: tuple(getattr(self, p).shape[1:]) for p in PROJECTIONS if getattr(self, p) is not None}

    @classmethod
    def sharing(cls, experts: GroupedExperts, **overrides) -> GroupedExperts:
        """A ``cls`` holding the very same `nn.Parameter` objects as ``experts`` (no copy, same state dict)
        and hooks, built through its constructor; ``overrides`` replace ``impl`` or ``max_slots``."""
        E, F_, D = experts.up_proj.shape
        options = {"impl": experts.impl, "max_slots": experts.max_slots, **overrides}
        with torch.device("meta"):  # the constructor's own stacks are replaced at once: allocate nothing
            new = cls(E, D, F_, experts.activation, **options)
        new.gate_proj, new.up_proj, new.down_proj = experts.gate_proj, experts.up_proj, experts.down_proj
        for p in PROJECTIONS:  # gpt-oss's biases, the same objects too
            if getattr(experts, f"{p}_bias", None) is not None:
                setattr(new, f"{p}_bias", getattr(experts, f"{p}_bias"))
        new.swiglu_limit, new.swiglu_alpha = experts.swiglu_limit, experts.swiglu_alpha
        return share_hooks(experts, new)

    def project(self, p: str, e: int, x_NI: torch.Tensor, weights: tuple) -> torch.Tensor:
        return frozen_linear(x_NI, weights[PROJECTIONS.index(p)][e])

    def stacks(self, dtype: torch.dtype | None = None) -> tuple:
        stacks = self.gate_proj, self.up_proj, self.down_proj
        return tuple(w.to(dtype) if w is not None and dtype is not None else w for w in stacks)

    def unbound(self) -> tuple:
        gate = self.gate_proj.unbind(0) if self.gate_proj is not None else None
        return gate, self.up_proj.unbind(0), self.down_proj.unbind(0)

    def decode_weights(self) -> tuple:
        return self.gate_proj, self.up_proj, self.down_proj  # indexing a stack is a view: nothing to unbind

    def stack(self, p: str) -> torch.Tensor | None:
        return getattr(self, p)


def replace_experts(model: nn.Module, make) -> dict[str, StackedExperts]:
    """Replace every `GroupedExperts` of ``model`` by ``make(experts)`` (another `StackedExperts`), in place, e.g. on
    a model built on the meta device before any storage exists; returns the new modules by their names."""
    replaced = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, GroupedExperts):
            parent_name, _, child = name.rpartition(".")
            replaced[name] = make(module)
            new = replaced[name]
            if new.ffn_options() != module.ffn_options():  # never drop gpt-oss's biases or clamp silently
                raise ValueError(
                    f"{name}: the replacement {type(new).__name__} was built with {new.ffn_options()}, the experts "
                    f"it replaces have {module.ffn_options()} (gpt-oss: expert_bias, swiglu_limit); build it "
                    "with the replaced module's ffn_options()"
                )
            setattr(model.get_submodule(parent_name) if parent_name else model, child, replaced[name])
    return replaced
