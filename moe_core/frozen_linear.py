"""Linear layers over frozen weights whose input gradient is fast in bf16/fp16 on CPU, and `share_hooks` for the
modules the lab swaps in for others (sharing their parameters).

Fine-tuning with LoRA (or QLoRA) keeps the base frozen, so backward computes only input gradients, ``dX = dY W``
for every Linear. On AVX2 CPUs (no AVX-512 BF16), oneDNN has no fast low-precision kernel for a product whose
right operand is a row-major ``[O, I]`` weight: 96 ms for [8, 1024] x [1024, 2048] in bf16 (minutes per step
for an LM head), against 9 ms for the same product written ``F.linear(dY, W^T)`` on a transposed copy made in
about a millisecond (benchmarks/README.md, "Expert LoRA"). On CPUs with AVX-512 BF16 and AMX it is the other way
round: autograd's own product is 7-11x faster than making the copy (0.30 against 2.13 ms for [64, 2048] x
[2048, 768]; 62 against 665 ms for a 151,936-row LM head), and the copy had made the lab's fine-tuning step 3x
slower than transformers + PEFT's. Which layout is fast is measured once per process and dtype
(`input_gradient_layout`), and the transposed path is taken only where it wins. `frozen_linear` is that product
with that backward; the expert paths call it for their per-expert slices, and `use_frozen_linears` swaps a
model's plain ``nn.Linear`` layers for `FrozenLinear` (same parameters, hooks and state dict) from outside the
model file. Elsewhere (a weight that trains, CUDA, fp32, no gradient, a CPU whose own product is fast)
everything is exactly ``F.linear``.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

# the layout of the input gradient ``dY W`` per low-precision dtype on this CPU: "transposed" (``F.linear(dY,
# W^T)`` on a transposed copy: AVX2) or "direct" (autograd's ``dY @ W``: AVX-512 BF16 / AMX); filled by
# `input_gradient_layout` on first use, set by tests to exercise either path
INPUT_GRADIENT_LAYOUT: dict[torch.dtype, str] = {}


def input_gradient_layout(dtype: torch.dtype) -> str:
    """ "transposed" where making ``W^T`` and multiplying by it beats oneDNN's ``dY @ W`` for ``dtype`` on this
    CPU, else "direct": timed once per process on a [16, 1024] x [1024, 512] product (the two differ 7-11x
    either way, so the choice does not hinge on the machine's load)."""
    if dtype not in INPUT_GRADIENT_LAYOUT:
        generator = torch.Generator().manual_seed(0)  # its own: the caller's random stream stays untouched
        w_OI = torch.randn(1024, 512, generator=generator).to(dtype)
        grad_NO = torch.randn(16, 1024, generator=generator).to(dtype)

        def fastest(product) -> float:
            product()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                product()
                times.append(time.perf_counter() - start)
            return min(times)

        direct = fastest(lambda: grad_NO @ w_OI)
        transposed = fastest(lambda: F.linear(grad_NO, w_OI.t().contiguous()))
        INPUT_GRADIENT_LAYOUT[dtype] = "transposed" if transposed < direct else "direct"
    return INPUT_GRADIENT_LAYOUT[dtype]


def _low_precision_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def share_hooks(module: nn.Module, replacement: nn.Module) -> nn.Module:
    """Give ``replacement`` (a module swapped in for ``module``, sharing its parameters) the very hook
    dictionaries of ``module``: the forward, backward and state-dict hooks a user registered keep firing,
    and their handles still remove them. Returns ``replacement``."""
    for name, value in vars(module).items():
        if "hook" in name and name.startswith("_"):
            setattr(replacement, name, value)
    return replacement


class _FrozenLinearLowPrecisionCPU(torch.autograd.Function):
    """``y = x W^T`` for a weight that takes no gradient (a frozen expert under LoRA, a dequantized 4-bit one), in
    bf16/fp16 on CPU. Autograd's input gradient ``dY W`` multiplies by a row-major right operand, for which
    oneDNN on AVX2 CPUs has no fast low-precision kernel: 96 ms for [8, 1024] x [1024, 2048] in bf16, against 9 ms
    for the same product as ``F.linear(dY, W^T)`` on a transposed copy (1 ms to make; benchmarks/README.md, "Expert
    LoRA"). The result is the same product; `tests/test_expert_lora.py` holds it to autograd's."""

    @staticmethod
    def forward(ctx, x_NI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w_OI)
        return F.linear(x_NI, w_OI)

    @staticmethod
    def backward(ctx, grad_NO: torch.Tensor):
        (w_OI,) = ctx.saved_tensors
        return _input_gradient(grad_NO, w_OI), None


# the most bytes of a weight's transposed copy made at once: a larger weight (an LM head, 50304 x 2048 in bf16 =
# 196 MiB) is copied a block of rows at a time, so that a frozen base's backward never holds a second copy of it
# (with the base memory-mapped, that copy was what kept the fine-tuning peak above transformers + PEFT's)
TRANSPOSE_BLOCK_BYTES = 32 * 2**20


def _input_gradient(grad_NO: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """``dY W``: on a transposed copy where oneDNN's own path is slow (bf16/fp16 on some CPUs:
    `input_gradient_layout`), else as it is. A weight above `TRANSPOSE_BLOCK_BYTES` goes by blocks of O rows,
    ``sum_b dY[:, b] W[b]``, added up in fp32."""
    if not _low_precision_cpu(grad_NO) or input_gradient_layout(grad_NO.dtype) == "direct":
        return grad_NO @ w_OI.to(grad_NO.dtype)
    O, I = w_OI.shape
    rows = max(1, TRANSPOSE_BLOCK_BYTES // (I * w_OI.element_size()))
    if O <= rows:
        return F.linear(grad_NO, w_OI.t().contiguous())
    grad_NI = torch.zeros((*grad_NO.shape[:-1], I), dtype=torch.float32)
    for start in range(0, O, rows):
        block = slice(start, start + rows)
        grad_NI += F.linear(grad_NO[..., block], w_OI[block].t().contiguous())
    return grad_NI.to(grad_NO.dtype)


class _RecomputedWeightLinear(torch.autograd.Function):
    """``y = x W^T`` for a frozen weight made on demand (``weight_fn``: a 4-bit expert slice dequantized) and made
    again in backward instead of kept: what autograd holds for a layer is its activations, not a dense copy of
    every expert it ran (QLoRA's trade, as bitsandbytes makes it: a second dequantization per step)."""

    @staticmethod
    def forward(ctx, x_NI: torch.Tensor, weight_fn) -> torch.Tensor:
        ctx.weight_fn = weight_fn
        return F.linear(x_NI, weight_fn())

    @staticmethod
    def backward(ctx, grad_NO: torch.Tensor):
        return _input_gradient(grad_NO, ctx.weight_fn()), None


class _RecomputedWeightGroupedMM(torch.autograd.Function):
    """`_RecomputedWeightLinear` for expert-sorted rows and a whole frozen stack: ``y_A = x_A W_{e(A)}^T``
    through `torch._grouped_mm` (``offs_E``: where each expert's rows end), the ``[E, O, I]`` stack made by
    ``weight_fn`` in forward and again in backward (a 4-bit layer dequantized at once on a GPU: one stack
    alive at a time), in the compute dtype (``weight_fn(dtype)``: a 4-bit stack dequantizes straight into
    it)."""

    @staticmethod
    def forward(ctx, x_AI: torch.Tensor, weight_fn, offs_E: torch.Tensor) -> torch.Tensor:
        ctx.weight_fn = weight_fn
        ctx.save_for_backward(offs_E)
        w_EOI = weight_fn(x_AI.dtype)
        return torch._grouped_mm(x_AI, w_EOI.transpose(-2, -1), offs=offs_E)

    @staticmethod
    def backward(ctx, grad_AO: torch.Tensor):
        (offs_E,) = ctx.saved_tensors
        w_EOI = ctx.weight_fn(grad_AO.dtype)
        return torch._grouped_mm(grad_AO.contiguous(), w_EOI, offs=offs_E), None, None


def recomputed_grouped_mm(x_AI: torch.Tensor, weight_fn, offs_E: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, weight_fn(x.dtype).transpose(-2, -1), offs=offs_E)`` whose backward calls
    ``weight_fn`` again rather than keeping the stack (``weight_fn(dtype)``: the stack in ``dtype``)."""
    if x_AI.requires_grad and torch.is_grad_enabled():
        return _RecomputedWeightGroupedMM.apply(x_AI, weight_fn, offs_E)
    return torch._grouped_mm(x_AI, weight_fn(x_AI.dtype).transpose(-2, -1), offs=offs_E)


def recomputed_linear(x_NI: torch.Tensor, weight_fn) -> torch.Tensor:
    """``F.linear(x, weight_fn())`` whose backward calls ``weight_fn`` again rather than keeping the weight."""
    if x_NI.requires_grad and torch.is_grad_enabled():
        return _RecomputedWeightLinear.apply(x_NI, weight_fn)
    return F.linear(x_NI, weight_fn())


def frozen_linear(x_NI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)``, with the fast input gradient of `_FrozenLinearLowPrecisionCPU` where it applies."""
    if (
        x_NI.requires_grad
        and not w_OI.requires_grad
        and _low_precision_cpu(x_NI)
        and torch.is_grad_enabled()
        and input_gradient_layout(x_NI.dtype) == "transposed"
    ):
        return _FrozenLinearLowPrecisionCPU.apply(x_NI, w_OI)
    return F.linear(x_NI, w_OI)


class FrozenLinear(nn.Linear):
    """`nn.Linear` whose input gradient takes `frozen_linear`'s fast path when its weight is frozen
    (bf16/fp16 on CPU: autograd's ``dY W`` has no fast kernel there; the LM head's alone took minutes per step);
    otherwise exactly ``F.linear``. Installed by `use_frozen_linears` with the very parameters and hooks of the
    module it replaces: the state dict, PEFT's wrapping and the outputs are unchanged."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> FrozenLinear:
        with torch.device("meta"):  # the constructor's own weights are replaced at once: allocate nothing
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight, new.bias = linear.weight, linear.bias
        return share_hooks(linear, new)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = frozen_linear(x, self.weight)
        return y if self.bias is None else y + self.bias


def use_frozen_linears(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` for a `FrozenLinear` sharing it, when the model runs in bf16/fp16
    on a CPU where the transposed input gradient is the fast one (elsewhere autograd's own kernels are fast); in
    place, before the weights that train are chosen (a `FrozenLinear` whose weight trains is ``F.linear``).
    Returns how many."""
    weight = next(model.parameters())
    if not _low_precision_cpu(weight) or input_gradient_layout(weight.dtype) == "direct":
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, FrozenLinear.sharing(child))
                swapped += 1
    return swapped
