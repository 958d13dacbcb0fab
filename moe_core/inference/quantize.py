"""Quantization of a trained model, applied from outside the model file.

Legend: E = experts, O = output features, I = input features, G = groups per row (I / group_size), N =
calibration tokens of one expert.

PyTorch weight-only experts (`quantize_experts`): each `GroupedExperts` is replaced by a `QuantizedExperts`
holding int8 weights (``bits=8``: symmetric, one scale per output channel) or packed int4 weights
(``bits=4``: symmetric, one scale per ``group_size`` inputs of each output channel, two values a byte), and
dequantizing only the experts a token uses, on the fly. Router, attention, norms, embeddings and the LM head
stay in full precision. Two ways to choose the integers:
- ``rtn``: round to nearest.
- ``gptq``: GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
  Pre-trained Transformers", Algorithm 1 with lazy batch updates): quantize columns in order, each error
  compensated on the not-yet-quantized columns through the inverse Hessian ``H = X^T X`` of the expert's
  own inputs, collected from calibration batches routed by the real router. An expert the router rarely
  picks gets its ``min_tokens`` from the calibration tokens with the highest router probability for it
  (force-routed); with fewer calibration tokens than that in all, it falls back to round-to-nearest and the
  report says so. Simplification: all layers are calibrated in one pass on unquantized inputs.
- ``awq``: AWQ (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and
  Acceleration", Sec. 3.2): per expert, a per-input-channel scale ``s = mean|x|^alpha`` (normalized as
  upstream llm-awq, ``s / sqrt(max s * min s)``) chosen on the grid ``alpha in {0, 1/(n-1), ..., 1}`` to
  minimize ``|| Q(W diag(s)) diag(s)^-1 x - W x ||^2`` on the expert's own calibration inputs (Eq. 5), then
  round-to-nearest with groups of ``W diag(s)``. gate_proj and up_proj share their input and one scale
  (searched on their joint output, as upstream scales a block's inputs together); down_proj is searched on
  the hidden activation. Upstream folds ``1/s`` into the preceding op; an expert's input is the normed hidden
  state every expert shares, so ``1/s`` is kept per expert as ``p_in_scale`` and divides the dequantized
  weight's columns instead (the same product). ``alpha = 0`` is plain RTN, so AWQ's output error on the
  calibration inputs is never above RTN's. Calibration coverage, force-routing and the RTN fallback are
  GPTQ's. Not done: upstream's second search (per-group weight clipping).
The reference beside the fast path is fake quantization (`fake_quantize`: quantize, dequantize, run the
plain `GroupedExperts`); tests hold the two equal. `QuantReport` gives the fraction of parameters quantized
and the bytes; `check_experts_quantized` raises when any expert stack was skipped.

ONNX Runtime (`quantize_onnx_dynamic`): dynamic int8 through optimum's `ORTQuantizer` on an exported
directory. The static expert path runs each projection of a layer as one wide MatMul over all E experts
([D, E*F] or [E*F, D]), so per-channel scales are per expert row and ONNX Runtime runs three int8 MatMuls a
layer instead of 3E small ones. ONNX Runtime's quantizer only quantizes MatMuls whose weight is an
initializer, and a weight may sit behind a Reshape/Transpose of its stack, so the graph is first
constant-folded by ONNX Runtime (basic level: standard ONNX ops only).
Router MatMuls stay in float; weight-times-activation MatMuls only (no activation-times-activation).

optimum's own GPTQ route (`quantize_optimum_gptq`, ``optimum.gptq.GPTQQuantizer``) runs on the model's
Hugging Face architecture and needs a CUDA GPU with ``gptqmodel``/``auto-gptq``; `optimum_gptq_available`
says whether this machine has them. Not exercised here: no GPU was lent to this project's sessions.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.errors import MoELabError
from moe_core.experts import GroupedExperts, ffn_act
from moe_core.inference.evaluate import calibration_pass
from moe_core.inference.fast_decode import DecodeExperts

logger = logging.getLogger(__name__)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class QuantizationError(MoELabError):
    """A quantization that cannot be done or did not cover what it should; says what and what to do."""


@dataclass(frozen=True)
class QuantConfig:
    bits: int = 8  # 8: per output channel; 4: group-wise, packed two a byte
    group_size: int = 32  # inputs sharing one scale when bits == 4
    method: str = "rtn"  # "rtn", "gptq" or "awq"
    min_tokens: int = 32  # gptq/awq: calibration tokens each expert must see (force-routed if rarely hit)
    damp: float = 0.01  # gptq: dampening, a fraction of the mean Hessian diagonal
    block_size: int = 128  # gptq: lazy-batch width (a multiple of group_size when bits == 4)
    awq_grid: int = 20  # awq: points of the alpha grid on [0, 1]

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise QuantizationError(f"QuantConfig.bits={self.bits!r}: choose 8 or 4")
        if self.method not in ("rtn", "gptq", "awq"):
            raise QuantizationError(f"QuantConfig.method={self.method!r}: choose 'rtn', 'gptq' or 'awq'")
        if self.awq_grid < 2:
            raise QuantizationError(f"QuantConfig.awq_grid={self.awq_grid!r}: must be >= 2")
        if self.bits == 4 and (self.group_size <= 0 or self.group_size % 2):
            raise QuantizationError(
                f"QuantConfig.group_size={self.group_size!r}: must be a positive even number"
            )
        if self.bits == 4 and self.block_size % self.group_size:
            raise QuantizationError(
                f"QuantConfig.block_size={self.block_size} must be a multiple of group_size={self.group_size}"
            )
        if self.min_tokens < 1 or not 0 <= self.damp < 1:
            raise QuantizationError("QuantConfig: min_tokens must be >= 1 and damp in [0, 1)")

    @property
    def qmax(self) -> int:
        return 127 if self.bits == 8 else 7

    def groups(self, in_features: int) -> int:
        if self.bits == 8:
            return 1
        if in_features % self.group_size:
            raise QuantizationError(
                f"input width {in_features} is not a multiple of group_size={self.group_size}; "
                "pick a group_size that divides hidden_size and expert_intermediate_size"
            )
        return in_features // self.group_size


# ---------------------------------------------------------------------------------------------- integer codes
def compute_scales(w_OI: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """Symmetric absmax scales [..., O, G]."""
    G = config.groups(w_OI.shape[-1])
    w_OGg = w_OI.float().reshape(*w_OI.shape[:-1], G, -1)
    return (w_OGg.abs().amax(-1) / config.qmax).clamp_min(1e-12)


def quantize_rtn(w_OI: torch.Tensor, scale_OG: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """Integer codes (int8 holding values in [-qmax-1, qmax]) of ``w`` [..., O, I] at the given scales."""
    G = scale_OG.shape[-1]
    w_OGg = w_OI.float().reshape(*w_OI.shape[:-1], G, -1)
    q = torch.round(w_OGg / scale_OG[..., None]).clamp(-config.qmax - 1, config.qmax)
    return q.reshape(w_OI.shape).to(torch.int8)


def dequantize(q_OI: torch.Tensor, scale_OG: torch.Tensor) -> torch.Tensor:
    G = scale_OG.shape[-1]
    return (q_OI.float().reshape(*q_OI.shape[:-1], G, -1) * scale_OG[..., None]).reshape(q_OI.shape)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two signed 4-bit codes a byte along the last dim: low nibble = even index."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    lo = (packed & 0x0F).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def fake_quantize(w: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """The reference: round-to-nearest quantize then dequantize, in the weight's dtype."""
    scale = compute_scales(w, config)
    return dequantize(quantize_rtn(w, scale, config), scale).to(w.dtype)


# ---------------------------------------------------------------------------------------------- GPTQ
@torch.no_grad()
def gptq_quantize(
    w_OI: torch.Tensor, H_II: torch.Tensor, config: QuantConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ codes and scales of one weight matrix given its input Hessian (Frantar et al. 2022, Alg. 1).

    Scales are absmax of the error-updated weights at the moment their group starts (per row for int8)."""
    W = w_OI.detach().float().clone()
    O, I = W.shape
    H = H_II.detach().float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += config.damp * torch.mean(torch.diag(H)) * torch.eye(I)
    try:
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except torch.linalg.LinAlgError:  # numerically singular even after dampening: no error feedback possible
        scale = compute_scales(W, config)
        return quantize_rtn(W, scale, config), scale
    G = config.groups(I)
    g = I // G
    scale = compute_scales(W, config) if config.bits == 8 else torch.empty(O, G)
    Q = torch.empty(O, I, dtype=torch.int8)
    for i1 in range(0, I, config.block_size):
        i2 = min(i1 + config.block_size, I)
        W1, Err1, Hinv1 = W[:, i1:i2].clone(), torch.zeros(O, i2 - i1), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if config.bits == 4 and col % g == 0:  # the group lies inside this block (block_size % g == 0)
                scale[:, col // g] = (W1[:, i : i + g].abs().amax(-1) / config.qmax).clamp_min(1e-12)
            s = scale[:, col // g]
            q = torch.round(W1[:, i] / s).clamp(-config.qmax - 1, config.qmax)
            Q[:, col] = q.to(torch.int8)
            err = (W1[:, i] - q * s) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q, scale


# ---------------------------------------------------------------------------------------------- AWQ
def awq_output_error(w_OI: torch.Tensor, x_NI: torch.Tensor, s_I: torch.Tensor, config: QuantConfig) -> float:
    """AWQ's objective (Lin et al. 2024, Eq. 5): mean squared error of ``Q(W diag(s)) diag(s)^-1 x`` against
    ``W x`` over the rows of ``x``."""
    w = w_OI.float()
    w_hat = fake_quantize(w * s_I, config) / s_I
    return float(((x_NI @ (w_hat - w).T) ** 2).mean())


def awq_alphas(config: QuantConfig) -> list[float]:
    return [i / (config.awq_grid - 1) for i in range(config.awq_grid)]


@torch.no_grad()
def awq_search_scale(
    w_OI: torch.Tensor, x_NI: torch.Tensor, config: QuantConfig
) -> tuple[torch.Tensor, float, list[float]]:
    """The per-input-channel scale [I] minimizing `awq_output_error` over the alpha grid; returns
    (scale, the chosen alpha, the error at each alpha). ``w`` may stack several weights that share ``x``."""
    x = x_NI.float()
    mean_abs_I = x.abs().mean(0)
    errors, best = [], (float("inf"), 0.0, torch.ones_like(mean_abs_I))
    for alpha in awq_alphas(config):
        s_I = mean_abs_I.pow(alpha).clamp_min(1e-4)
        s_I = (
            s_I / (s_I.max() * s_I.min()).sqrt()
        )  # llm-awq's normalization: keeps the weights' range centred
        err = awq_output_error(w_OI, x, s_I, config)
        errors.append(err)
        if err < best[0]:
            best = (err, alpha, s_I)
    return best[2], best[1], errors


def awq_quantize(
    w_OI: torch.Tensor, s_I: torch.Tensor, config: QuantConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes and group scales of ``W diag(s)``, and ``s``: the weight is ``dequantize(q, scale) / s``."""
    w_s = w_OI.detach().float() * s_I
    scale = compute_scales(w_s, config)
    return quantize_rtn(w_s, scale, config), scale, s_I


# ---------------------------------------------------------------------------------------------- the module
class QuantizedExperts(DecodeExperts):
    """`GroupedExperts` with weight-only int8/int4 weights, dequantized per expert as it runs.

    Buffers per projection ``p``: ``p_q`` (int8 codes, or uint8 with two int4 codes a byte), ``p_scale``
    (fp32 [E, O, G]) and, for AWQ only, ``p_in_scale`` (fp32 [E, I], the activation-aware scale that divides
    the dequantized weight's columns). ``grouped_mm`` needs the whole dense stack, so it runs as ``sorted``."""

    def __init__(
        self,
        num_experts: int,
        activation: str,
        shapes: dict[str, tuple[int, int]],
        config: QuantConfig,
        impl: str = "auto",
        max_slots: int = 64,
    ) -> None:
        nn.Module.__init__(self)
        self.num_experts, self.activation, self.impl, self.max_slots = (
            num_experts,
            activation,
            impl,
            max_slots,
        )
        self.quant_config = config
        self.projections = tuple(shapes)
        for name, (O, I) in shapes.items():
            width = I if config.bits == 8 else I // 2
            dtype = torch.int8 if config.bits == 8 else torch.uint8
            self.register_buffer(f"{name}_q", torch.zeros(num_experts, O, width, dtype=dtype))
            self.register_buffer(f"{name}_scale", torch.ones(num_experts, O, config.groups(I)))
            if config.method == "awq":
                self.register_buffer(f"{name}_in_scale", torch.ones(num_experts, I))
        # the parent's attributes: no dense weights here
        self.gate_proj = self.up_proj = self.down_proj = None

    @classmethod
    def from_experts(
        cls,
        experts: GroupedExperts,
        config: QuantConfig,
        codes: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> QuantizedExperts:
        """Quantize ``experts`` (round to nearest unless ``codes`` gives ``{proj: (q [E,O,I] int8, scale)}``,
        or ``(q, scale, in_scale [E, I])`` for AWQ)."""
        shapes = {
            p: tuple(getattr(experts, p).shape[1:]) for p in PROJECTIONS if getattr(experts, p) is not None
        }
        new = cls(
            experts.num_experts,
            experts.activation,
            shapes,
            config,
            experts.impl,
            getattr(experts, "max_slots", 64),
        )
        for p in shapes:
            w = getattr(experts, p).detach()
            in_scale = None
            if codes is not None and p in codes:
                q, scale, *rest = codes[p]
                in_scale = rest[0] if rest else None
            else:
                scale = compute_scales(w, config)
                q = quantize_rtn(w, scale, config)
            getattr(new, f"{p}_q").copy_(pack_int4(q) if config.bits == 4 else q)
            getattr(new, f"{p}_scale").copy_(scale)
            if in_scale is not None:
                getattr(new, f"{p}_in_scale").copy_(in_scale)
        return new.to(experts.up_proj.device)

    def codes(self, name: str, e: int | slice = slice(None)) -> torch.Tensor:
        q = getattr(self, f"{name}_q")[e]
        return unpack_int4(q) if self.quant_config.bits == 4 else q

    def weight(self, name: str, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """Expert ``e``'s dequantized ``name`` weight [O, I]."""
        if name not in self.projections:
            return None
        w = dequantize(self.codes(name, e), getattr(self, f"{name}_scale")[e])
        if self.quant_config.method == "awq":
            w = w / getattr(self, f"{name}_in_scale")[e]
        return w.to(dtype)

    def dequantized_stack(self, name: str) -> torch.Tensor | None:
        if name not in self.projections:
            return None
        w = dequantize(self.codes(name), getattr(self, f"{name}_scale"))
        if self.quant_config.method == "awq":
            w = w / getattr(self, f"{name}_in_scale")[:, None, :]
        return w

    def resolved_impl(self, x_TD: torch.Tensor) -> str:
        if self.impl not in ("auto", "grouped_mm"):
            return self.impl
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
            return "static"
        return "sorted"

    def unbound(self) -> tuple:
        return None, None, None  # `expert` dequantizes its own slices

    def stacks(self, dtype: torch.dtype | None = None) -> tuple:
        stacks = (self.dequantized_stack(p) for p in PROJECTIONS)
        return tuple(w.to(dtype) if w is not None and dtype is not None else w for w in stacks)

    def expert(self, e: int, x_ND: torch.Tensor, weights: tuple | None = None) -> torch.Tensor:
        gate = self.weight("gate_proj", e, x_ND.dtype)
        h_gate = F.linear(x_ND, gate) if gate is not None else None
        h_up = F.linear(x_ND, self.weight("up_proj", e, x_ND.dtype))
        return F.linear(ffn_act(self.activation, h_gate, h_up), self.weight("down_proj", e, x_ND.dtype))


# ---------------------------------------------------------------------------------------------- report
@dataclass
class QuantReport:
    bits: int
    method: str
    params_total: int
    params_quantized: int
    bytes_before: int
    bytes_after: int
    experts_quantized: int
    experts_rtn_fallback: list[str] = field(default_factory=list)  # "layer:expert" that gptq left to RTN
    calibration_tokens: dict[str, list[int]] = field(default_factory=dict)  # per layer, per expert (gptq)
    forced_tokens: dict[str, list[int]] = field(default_factory=dict)  # force-routed extra tokens (gptq)
    awq_alpha: dict[str, list[list[float]]] = field(
        default_factory=dict
    )  # per expert: [alpha_in, alpha_hidden]
    notes: list[str] = field(default_factory=list)
    perplexity: dict[str, float] = field(default_factory=dict)

    @property
    def fraction_quantized(self) -> float:
        return self.params_quantized / self.params_total if self.params_total else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "fraction_quantized": self.fraction_quantized}


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, GroupedExperts)]


def check_experts_quantized(model: nn.Module) -> None:
    """Raise `QuantizationError` when any expert stack of ``model`` is still in full precision."""
    skipped = [name for name, m in expert_modules(model) if not isinstance(m, QuantizedExperts)]
    if skipped:
        raise QuantizationError(
            f"expert weights left unquantized in {skipped}; run quantize_experts on the model"
        )


def _weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


# ---------------------------------------------------------------------------------------------- entry points
def quantize_experts(
    model: nn.Module, config: QuantConfig | None = None, calibration: Iterable[torch.Tensor] | None = None
) -> QuantReport:
    """Replace every `GroupedExperts` of ``model`` by a `QuantizedExperts`, in place; returns the report.

    ``calibration``: batches of token ids [B, S], required for ``method="gptq"`` and ``"awq"``."""
    config = config or QuantConfig()
    modules = expert_modules(model)
    if not modules:
        raise QuantizationError("the model has no GroupedExperts to quantize (a dense model?)")
    params_total = sum(p.numel() for p in model.parameters())
    bytes_before = _weight_bytes(model)
    report = QuantReport(config.bits, config.method, params_total, 0, bytes_before, 0, 0)
    all_codes: dict[str, dict] = {}
    if config.method in ("gptq", "awq"):
        if calibration is None:
            raise QuantizationError(
                f"method={config.method!r} needs calibration batches (token ids [B, S]): "
                "from the CLI, --data DIR (a prepared-data directory)"
            )
        all_codes = _calibrated_codes(model, modules, config, calibration, report)
    for name, module in modules:
        if isinstance(module, QuantizedExperts):
            continue
        report.params_quantized += sum(p.numel() for p in module.parameters(recurse=False))
        report.experts_quantized += module.num_experts
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedExperts.from_experts(module, config, all_codes.get(name)))
    report.bytes_after = _weight_bytes(model)
    check_experts_quantized(model)
    total = sum(m.num_experts for _, m in modules if not isinstance(m, QuantizedExperts))
    if (
        report.experts_quantized != total
    ):  # every expert of every layer, counted (fallbacks are in the report)
        raise QuantizationError(f"quantized {report.experts_quantized} of {total} experts")
    return report


@torch.no_grad()
def _collect_expert_inputs(model, modules, calibration) -> dict[str, dict[str, torch.Tensor]]:
    """One calibration pass: per expert module, its inputs x [N, D], router probabilities [N, E] and which
    expert each token was routed to (hit [N, E])."""
    seen: dict[str, dict[str, list[torch.Tensor]]] = {
        name: {"x": [], "probs": [], "hit": []} for name, _ in modules
    }
    hooks = []
    for name, module in modules:

        def hook(mod, args, _out, name=name):
            x_TD, record = args[0], args[1]
            seen[name]["x"].append(x_TD.detach().float())
            seen[name]["probs"].append(record.probs_TE.detach().float())
            hit_TE = torch.zeros_like(record.probs_TE, dtype=torch.bool)
            hit_TE.scatter_(1, record.expert_ids_TK.masked_fill(record.dropped_TK, 0), ~record.dropped_TK)
            seen[name]["hit"].append(hit_TE)

        hooks.append((module, hook))
    calibration_pass(model, calibration, hooks)
    for name in seen:
        if not seen[name]["x"]:
            raise QuantizationError("the calibration batches were empty; give token ids [B, S]")
    return {name: {k: torch.cat(v) for k, v in parts.items()} for name, parts in seen.items()}


def _gptq_expert(module, e: int, x_ND: torch.Tensor, config: QuantConfig, _alphas: list) -> dict[str, tuple]:
    h_up = F.linear(x_ND, module.up_proj[e].float())
    h_gate = F.linear(x_ND, module.gate_proj[e].float()) if module.gate_proj is not None else None
    a_NF = ffn_act(module.activation, h_gate, h_up)
    H_in, H_hidden = x_ND.T @ x_ND, a_NF.T @ a_NF
    return {
        p: gptq_quantize(getattr(module, p)[e], H_hidden if p == "down_proj" else H_in, config)
        for p in PROJECTIONS
        if getattr(module, p) is not None
    }


def _awq_expert(module, e: int, x_ND: torch.Tensor, config: QuantConfig, alphas: list) -> dict[str, tuple]:
    """AWQ of one expert: one scale for the projections reading x (searched on their joint output), one for
    down_proj on the hidden activation computed in full precision."""
    inputs = [p for p in ("gate_proj", "up_proj") if getattr(module, p) is not None]
    w_in = torch.cat([getattr(module, p)[e].float() for p in inputs])
    s_in, alpha_in, _ = awq_search_scale(w_in, x_ND, config)
    h_up = F.linear(x_ND, module.up_proj[e].float())
    h_gate = F.linear(x_ND, module.gate_proj[e].float()) if module.gate_proj is not None else None
    a_NF = ffn_act(module.activation, h_gate, h_up)
    s_hidden, alpha_hidden, _ = awq_search_scale(module.down_proj[e], a_NF, config)
    alphas.append([alpha_in, alpha_hidden])
    codes = {p: awq_quantize(getattr(module, p)[e], s_in, config) for p in inputs}
    codes["down_proj"] = awq_quantize(module.down_proj[e], s_hidden, config)
    return codes


def _rtn_expert(module, e: int, config: QuantConfig) -> dict[str, tuple]:
    codes = {}
    for p in PROJECTIONS:
        if getattr(module, p) is None:
            continue
        w = getattr(module, p)[e].detach().float()
        scale = compute_scales(w, config)
        codes[p] = (quantize_rtn(w, scale, config), scale)
        if config.method == "awq":  # the identity scale: this expert is plain RTN inside an AWQ module
            codes[p] += (torch.ones(w.shape[-1]),)
    return codes


@torch.no_grad()
def _calibrated_codes(
    model, modules, config: QuantConfig, calibration, report: QuantReport
) -> dict[str, dict]:
    """GPTQ or AWQ codes of every expert from its own calibration inputs (force-routed up to min_tokens)."""
    seen = _collect_expert_inputs(model, modules, calibration)
    quantize_expert = _gptq_expert if config.method == "gptq" else _awq_expert
    codes: dict[str, dict] = {}
    from moe_core.progress import Progress

    bar = Progress(sum(m.num_experts for _, m in modules), f"quantize ({config.method})", unit="expert")
    for name, module in modules:
        x_ND, probs_NE, hit_NE = seen[name]["x"], seen[name]["probs"], seen[name]["hit"]
        counts, forced, alphas, per_expert = [], [], [], []
        for e in range(module.num_experts):
            bar.update(1, layer=name.split(".experts")[0].removeprefix("model."))
            idx = hit_NE[:, e].nonzero().flatten()
            extra = 0
            if idx.numel() < config.min_tokens:  # force-route the tokens the router likes best for e
                order = probs_NE[:, e].masked_fill(hit_NE[:, e], -1.0).argsort(descending=True)
                extra = min(config.min_tokens - idx.numel(), int((~hit_NE[:, e]).sum()))
                idx = torch.cat([idx, order[:extra]])
            counts.append(int(hit_NE[:, e].sum()))
            forced.append(extra)
            if idx.numel() < config.min_tokens:
                report.experts_rtn_fallback.append(f"{name}:{e}")
                per_expert.append(_rtn_expert(module, e, config))
                if config.method == "awq":
                    alphas.append([0.0, 0.0])
                continue
            per_expert.append(quantize_expert(module, e, x_ND[idx], config, alphas))
        report.calibration_tokens[name] = counts
        report.forced_tokens[name] = forced
        if alphas:
            report.awq_alpha[name] = alphas
        codes[name] = {
            p: tuple(torch.stack(parts) for parts in zip(*(c[p] for c in per_expert))) for p in per_expert[0]
        }
    bar.close()
    if report.experts_rtn_fallback:
        report.notes.append(
            f"{len(report.experts_rtn_fallback)} experts had fewer than min_tokens="
            f"{config.min_tokens} calibration tokens even with force-routing and were rounded "
            "to nearest; give more calibration data"
        )
    return codes


QUANT_FILE = "quantization.json"


def save_quantized(
    model, out_dir: str | os.PathLike, config: QuantConfig, report: QuantReport | None = None
) -> Path:
    """Write config.json, the quantized state dict (safetensors) and quantization.json."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    meta = {"quant_config": asdict(config), "report": report.to_dict() if report else None}
    (out_dir / QUANT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


def load_quantized(directory: str | os.PathLike):
    """Load what `save_quantized` wrote: an `MoEForCausalLM` with `QuantizedExperts`."""
    from safetensors.torch import load_file

    from moe_core.config import MoEConfig
    from moe_core.model import MoEForCausalLM

    directory = Path(directory)
    if not (directory / QUANT_FILE).is_file():
        raise QuantizationError(
            f"{directory}: no {QUANT_FILE}; write one with `moe-lab quantize` or save_quantized"
        )
    meta = json.loads((directory / QUANT_FILE).read_text())
    config = QuantConfig(**meta["quant_config"])
    model = MoEForCausalLM(MoEConfig.from_pretrained(directory)).eval()
    for name, module in expert_modules(model):  # the structure (and AWQ's input scales) for the state dict
        parent_name, _, child = name.rpartition(".")
        setattr(
            model.get_submodule(parent_name) if parent_name else model,
            child,
            QuantizedExperts.from_experts(module, config),
        )
    missing, unexpected = model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise QuantizationError(
            f"{directory}: checkpoint does not match its config (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def quantize_checkpoint(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: QuantConfig,
    calibration: Iterable[torch.Tensor] | None = None,
    data_dir: str | os.PathLike | None = None,
) -> QuantReport:
    """`moe-lab quantize`: load a checkpoint, quantize its experts, save. GPTQ and AWQ calibrate on
    ``calibration`` batches, or on the first batches of the prepared-data directory ``data_dir``."""
    from moe_core.loading import load

    if calibration is None and data_dir is not None:
        from moe_core.inference.evaluate import calibration_batches

        calibration = calibration_batches(data_dir)
    if config.method in ("gptq", "awq") and calibration is None:
        raise QuantizationError(
            f"--method {config.method} calibrates on real text: pass --data DIR (a "
            "prepared-data directory, moe-lab data prepare)"
        )
    model = load(model_dir, dtype=torch.float32).model
    report = quantize_experts(model, config, calibration)
    save_quantized(model, out_dir, config, report)
    from moe_core.convert import copy_companion_files

    copy_companion_files(model_dir, Path(out_dir))  # tokenizer and generation defaults travel along
    return report


# ---------------------------------------------------------------------------------------------- ONNX Runtime
def fold_onnx_constants(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Constant-fold an ONNX file with ONNX Runtime's basic optimizations (standard ONNX ops only), so that
    every expert's weight becomes a MatMul initializer the quantizer can see."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
    return Path(dst)


def weight_matmuls(onnx_path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(MatMul nodes whose weight is an initializer, outside the router; router MatMul nodes)."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    weights, routers = [], []
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits:
            (routers if "/router/" in node.name or ".router." in node.input[1] else weights).append(node.name)
    return weights, routers


def quantize_onnx_dynamic(
    onnx_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    per_channel: bool = True,
    keep_router_float: bool = True,
) -> Path:
    """Dynamic int8 (weights int8 per channel, activations quantized at run time) through optimum's
    `ORTQuantizer`; writes ``model_quantized.onnx`` and the configs into ``out_dir``."""
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    from moe_core.inference.onnx_export import ONNX_FILES

    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    src = next((onnx_dir / f for f in ONNX_FILES if (onnx_dir / f).is_file()), None)
    if src is None:
        raise QuantizationError(
            f"{onnx_dir}: no exported ONNX model ({', '.join(ONNX_FILES)}); run `moe-lab export onnx` first"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    folded_dir = out_dir / "_folded"
    folded_dir.mkdir(exist_ok=True)
    try:
        folded = fold_onnx_constants(src, folded_dir / "model.onnx")
        for companion in ("config.json", "generation_config.json"):
            if (onnx_dir / companion).is_file():
                shutil.copy(onnx_dir / companion, folded_dir / companion)
                shutil.copy(onnx_dir / companion, out_dir / companion)
        weights, routers = weight_matmuls(folded)
        nodes = weights if keep_router_float else weights + routers
        qconfig = AutoQuantizationConfig.avx2(
            is_static=False,
            per_channel=per_channel,
            nodes_to_quantize=nodes,
            operators_to_quantize=["MatMul"],
        )
        quantizer = ORTQuantizer.from_pretrained(folded_dir, file_name="model.onnx")
        quantizer.quantize(save_dir=out_dir, quantization_config=qconfig)
    finally:
        shutil.rmtree(folded_dir, ignore_errors=True)
    return out_dir


def optimum_gptq_available() -> bool:
    """optimum's GPTQ route needs a CUDA GPU and the gptqmodel (or auto-gptq) backend."""
    import importlib.util

    return torch.cuda.is_available() and any(
        importlib.util.find_spec(name) is not None for name in ("gptqmodel", "auto_gptq")
    )


def quantize_optimum_gptq(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    calibration: list[torch.Tensor] | None,
    *,
    bits: int = 4,
    group_size: int = 128,
    architecture: str | None = None,
) -> Path:
    """optimum's GPTQ (``optimum.gptq.GPTQQuantizer``) on a GPU, written as a Hugging Face GPTQ checkpoint.

    optimum quantizes ``nn.Linear`` modules; our experts are stacked parameters, so the model goes through
    its Hugging Face architecture first (`moe_core.convert.to_hf`: Mixtral / OLMoE / Qwen2-MoE, one
    ``nn.Linear`` per expert projection), is quantized there block by block on ``calibration`` (token-id
    batches [B, S]), and is refused if any expert projection stayed in float. The result loads with
    ``AutoModelForCausalLM.from_pretrained`` on a machine with the same backend. Rarely routed experts get
    few calibration rows here (GPTQ's dampening keeps them well-posed); our own ``method="gptq"`` force-routes
    them instead and runs on a CPU."""
    if not optimum_gptq_available():
        raise QuantizationError(
            "optimum's GPTQ route needs a CUDA GPU and the gptqmodel backend (pip install gptqmodel); "
            f"this machine has cuda={torch.cuda.is_available()}. Use --method gptq (ours, runs on a CPU)."
        )
    import tempfile

    from optimum.gptq import GPTQQuantizer
    from transformers import AutoModelForCausalLM

    from moe_core.convert import copy_companion_files, to_hf
    from moe_core.fileio import atomic_directory
    from moe_core.loading import load

    if not calibration:
        raise QuantizationError(
            "optimum GPTQ calibrates on real text: pass --data DIR (a prepared-data directory)"
        )
    model = load(model_dir, dtype=torch.float32).model
    with (
        tempfile.TemporaryDirectory(prefix="moe_gptq_") as tmp,
        atomic_directory(out_dir, error_cls=QuantizationError) as staging,
    ):
        to_hf(model, Path(tmp) / "hf", architecture)
        del model
        hf = AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float16, device_map="cuda")
        dataset = [
            {"input_ids": row[None], "attention_mask": torch.ones_like(row)[None]}
            for batch in calibration
            for row in batch
        ]
        quantizer = GPTQQuantizer(
            bits=bits,
            dataset=dataset,
            group_size=group_size,
            block_name_to_quantize="model.layers",
            model_seqlen=calibration[0].shape[-1],
        )
        hf = quantizer.quantize_model(hf, tokenizer=None)
        left = [
            name for name, module in hf.named_modules() if type(module) is nn.Linear and ".experts." in name
        ]
        if left:
            raise QuantizationError(
                f"optimum GPTQ left {len(left)} expert projections in float "
                f"(e.g. {left[:3]}); refusing a partly quantized checkpoint"
            )
        quantizer.save(hf, str(staging))
        copy_companion_files(model_dir, staging)
    return Path(out_dir)
