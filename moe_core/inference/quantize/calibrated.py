"""Calibrated choice of the integer codes for weight-only experts: GPTQ and AWQ.

Legend: E = experts, O = output features, I = input features, G = groups per row (I / group_size), N =
calibration tokens of one expert.

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

`expert_inputs` collects every expert module's calibration inputs in one pass; `calibrated_experts` then
quantizes one module expert by expert, each expert slice read where it lies (a stack in memory, a memory-mapped
file, or a fine-tune's base with its adapter's deltas added as read: `weight_only.quantize_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_core.experts import StackedExperts
from moe_core.inference.evaluate import calibration_pass
from moe_core.mapped import MergedSlices
from moe_core.progress import Progress
from moe_core.quantized import (
    PROJECTIONS,
    QuantConfig,
    QuantizationError,
    QuantizedExperts,
    QuantReport,
    compute_scales,
    expert_modules,
    fake_quantize,
    quantize_rtn,
)


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


@dataclass
class GPTQHessians:
    """B input Hessians prepared for `gptq_quantize_batch` as `gptq_quantize` prepares its one: the dead inputs
    (a zero diagonal entry: their weights are zeroed), the upper Cholesky factor of each dampened inverse, and the
    matrices whose Hessian does not factorize even dampened (rounded to nearest). Made once for the weights that
    read the same inputs (an expert's gate and up projections)."""

    Hinv_BII: torch.Tensor
    dead_BI: torch.Tensor
    singular: list[int]

    @classmethod
    @torch.no_grad()
    def of(cls, H_BII: torch.Tensor, config: QuantConfig) -> GPTQHessians:
        H = H_BII.detach().float().clone()
        B, I, _ = H.shape
        Hinv, dead_BI, singular = torch.empty_like(H), torch.zeros(B, I, dtype=torch.bool), []
        for b in range(B):  # matrix by matrix, as the reference
            dead_BI[b] = torch.diag(H[b]) == 0
            H[b][dead_BI[b], dead_BI[b]] = 1.0
            H[b] += config.damp * torch.mean(torch.diag(H[b])) * torch.eye(I)
            try:
                Hinv[b] = torch.linalg.cholesky(
                    torch.cholesky_inverse(torch.linalg.cholesky(H[b])), upper=True
                )
            except torch.linalg.LinAlgError:
                singular.append(b)
                Hinv[b] = torch.eye(I)  # (any: its codes are round to nearest)
        return cls(Hinv, dead_BI, singular)


@torch.no_grad()
def gptq_quantize_batch(
    w_BOI: torch.Tensor, hessians: GPTQHessians, config: QuantConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gptq_quantize` of B weight matrices of one shape at once, each with its own Hessian (`GPTQHessians`): the
    same codes and scales, bit for bit (`tests/test_inference_quantize.py`), with the column loop's operators run
    once for the B matrices (a layer's experts), where one matrix at a time made GPTQ of a published MoE's
    thousands of expert matrices a matter of the host's dispatching (half an hour for OLMoE-1B-7B's 3,072 on 2
    cores). Elementwise work is batched; each matrix's lazy-batch update is its own matmul (the reference's
    operator, whose result a batched kernel need not reproduce bit for bit)."""
    W = w_BOI.detach().float().clone()
    B, O, I = W.shape
    Hinv = hessians.Hinv_BII
    for b in range(B):
        W[b][:, hessians.dead_BI[b]] = 0.0
    G = config.groups(I)
    g = I // G
    scale = compute_scales(W, config) if config.bits == 8 else torch.empty(B, O, G)
    Q = torch.empty(B, O, I, dtype=torch.int8)
    for i1 in range(0, I, config.block_size):
        i2 = min(i1 + config.block_size, I)
        W1, Err1, Hinv1 = W[:, :, i1:i2].clone(), torch.zeros(B, O, i2 - i1), Hinv[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if config.bits == 4 and col % g == 0:  # the group lies inside this block (block_size % g == 0)
                scale[:, :, col // g] = (W1[:, :, i : i + g].abs().amax(-1) / config.qmax).clamp_min(1e-12)
            s_BO = scale[:, :, col // g]
            q_BO = torch.round(W1[:, :, i] / s_BO).clamp(-config.qmax - 1, config.qmax)
            Q[:, :, col] = q_BO.to(torch.int8)
            err_BO = (W1[:, :, i] - q_BO * s_BO) / Hinv1[:, i, i, None]
            W1[:, :, i:] -= err_BO[:, :, None] * Hinv1[:, None, i, i:]
            Err1[:, :, i] = err_BO
        for b in range(B):
            W[b, :, i2:] -= Err1[b] @ Hinv[b, i1:i2, i2:]
    for b in hessians.singular:  # as the reference: round to nearest, its dead inputs zeroed
        w_OI = w_BOI[b].detach().float().clone()
        w_OI[:, hessians.dead_BI[b]] = 0.0
        scale[b] = compute_scales(w_OI, config)
        Q[b] = quantize_rtn(w_OI, scale[b], config)
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


# ---------------------------------------------------------------------------------------------- calibration
# experts of one module whose GPTQ runs at once (`gptq_quantize_batch`). One 1024 x 1024 int4 matrix on one core:
# 0.56 s alone, 0.18 s each four at a time, 0.25 s each sixteen at a time (their lazy blocks, O x 128 each,
# outgrow the cache)
GPTQ_BATCH = 4
# expert e's weight of projection p ([O, I], in the weights' dtype; None for a projection the experts lack): the
# module's own, or with an adapter's deltas added as it is read (`moe_core.mapped.MergedSlices`)
ExpertWeight = Callable[[str, int], "torch.Tensor | None"]


@torch.no_grad()
def expert_inputs(model, calibration) -> dict[StackedExperts, dict[str, torch.Tensor]]:
    """One calibration pass: per expert module (the module itself is the key, so a model whose experts modules
    are later moved, as out of PEFT's wrappers, still finds them), its inputs x [N, D] in the dtype the model
    runs in (a bf16 model's inputs are kept in bf16: their fp32 cast, made per expert, is exact), router
    probabilities [N, E] and which expert each token was routed to (hit [N, E])."""
    modules = [m for _, m in expert_modules(model)]
    seen: dict[StackedExperts, dict[str, list[torch.Tensor]]] = {
        m: {"x": [], "probs": [], "hit": []} for m in modules
    }
    hooks = []
    for module in modules:

        def hook(mod, args, _out, module=module):
            x_TD, record = args[0], args[1]
            seen[module]["x"].append(x_TD.detach().clone())
            seen[module]["probs"].append(record.probs_TE.detach().float())
            hit_TE = torch.zeros_like(record.probs_TE, dtype=torch.bool)
            hit_TE.scatter_(1, record.expert_ids_TK.masked_fill(record.dropped_TK, 0), ~record.dropped_TK)
            seen[module]["hit"].append(hit_TE)

        hooks.append((module, hook))
    calibration_pass(model, calibration, hooks)
    if any(not parts["x"] for parts in seen.values()):
        raise QuantizationError("the calibration batches were empty; give token ids [B, S]")
    inputs = {}
    for module in modules:  # one module's parts concatenated at a time
        parts = seen.pop(module)
        inputs[module] = {k: torch.cat(v) for k, v in parts.items()}
    return inputs


def _hidden(module, e: int, w: dict, x_ND: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s hidden activation on ``x_ND`` in fp32 (``w``: its weights by projection): what its down
    projection reads (with gpt-oss's biases and clamped SwiGLU, `StackedExperts.activate`)."""

    def proj(p: str) -> torch.Tensor | None:
        if w[p] is None:
            return None
        bias_O = module.expert_bias(p, e)
        return F.linear(x_ND, w[p].float(), None if bias_O is None else bias_O.float())

    return module.activate(proj("gate_proj"), proj("up_proj"))


def _gptq_experts(module, calibrated: dict[int, tuple[dict, torch.Tensor]], config: QuantConfig) -> dict:
    """GPTQ of several experts at once (``calibrated``: expert -> its weights by projection and its inputs x [N,
    I]): each projection's matrices quantized together (`gptq_quantize_batch`), each with its own Hessian (x^T x
    for gate and up, the hidden activation's for down)."""
    experts = list(calibrated)
    H_in = GPTQHessians.of(torch.stack([x_ND.T @ x_ND for _, x_ND in calibrated.values()]), config)
    hidden = [_hidden(module, e, w, x_ND) for e, (w, x_ND) in calibrated.items()]
    H_hidden = GPTQHessians.of(torch.stack([a_NF.T @ a_NF for a_NF in hidden]), config)
    del hidden
    codes: dict[int, dict] = {e: {} for e in experts}
    for p in PROJECTIONS:
        if calibrated[experts[0]][0][p] is None:
            continue
        w_BOI = torch.stack([calibrated[e][0][p] for e in experts])
        Q, scale = gptq_quantize_batch(w_BOI, H_hidden if p == "down_proj" else H_in, config)
        for b, e in enumerate(experts):
            codes[e][p] = (Q[b], scale[b])
    return codes


def _awq_expert(module, e: int, w: dict, x_ND: torch.Tensor, config: QuantConfig) -> tuple[dict, list[float]]:
    """AWQ of one expert: one scale for the projections reading x (searched on their joint output), one for
    down_proj on the hidden activation computed in full precision; returns the codes and the two alphas."""
    inputs = [p for p in ("gate_proj", "up_proj") if w[p] is not None]
    w_in = torch.cat([w[p].float() for p in inputs])
    s_in, alpha_in, _ = awq_search_scale(w_in, x_ND, config)
    a_NF = _hidden(module, e, w, x_ND)
    s_hidden, alpha_hidden, _ = awq_search_scale(w["down_proj"], a_NF, config)
    codes = {p: awq_quantize(w[p], s_in, config) for p in inputs}
    codes["down_proj"] = awq_quantize(w["down_proj"], s_hidden, config)
    return codes, [alpha_in, alpha_hidden]


def _rtn_expert(w: dict, config: QuantConfig) -> dict:
    codes = {}
    for p, w_OI in w.items():
        if w_OI is None:
            continue
        w_OI = w_OI.detach().float()
        scale = compute_scales(w_OI, config)
        codes[p] = (quantize_rtn(w_OI, scale, config), scale)
        if config.method == "awq":  # the identity scale: this expert is plain RTN inside an AWQ module
            codes[p] += (torch.ones(w_OI.shape[-1]),)
    return codes


@torch.no_grad()
def calibrated_experts(
    name: str,
    module: StackedExperts,
    seen: dict[str, torch.Tensor],
    config: QuantConfig,
    report: QuantReport,
    weight: ExpertWeight | None = None,
    done: Callable[[int], None] | None = None,
) -> QuantizedExperts:
    """``module`` quantized by GPTQ or AWQ, expert by expert: each expert's codes chosen from its own calibration
    inputs (``seen``: `expert_inputs`' entry; force-routed up to ``min_tokens``), written into a new
    `QuantizedExperts` at once (a whole module's integer codes never exist apart from it). ``weight``: where each
    expert slice is read from (default: the module's own; `moe_core.mapped.MergedSlices` adds an adapter's deltas);
    ``done(e)``: called once expert ``e`` is quantized (a memory-mapped module releases its pages there)."""
    weight = weight or MergedSlices(module)
    quantized = QuantizedExperts.to_fill(module, config)
    x_ND, probs_NE, hit_NE = seen["x"], seen["probs"], seen["hit"]
    counts, forced, alphas = [], [], {}
    layer = name.split(".experts")[0].removeprefix("model.")
    bar = Progress(module.num_experts, f"quantize ({config.method}) {layer}", unit="expert")
    batch = GPTQ_BATCH if config.method == "gptq" else 1
    for first in range(0, module.num_experts, batch):
        codes, calibrated = {}, {}
        for e in range(first, min(first + batch, module.num_experts)):
            idx = hit_NE[:, e].nonzero().flatten()
            extra = 0
            if idx.numel() < config.min_tokens:  # force-route the tokens the router likes best for e
                order = probs_NE[:, e].masked_fill(hit_NE[:, e], -1.0).argsort(descending=True)
                extra = min(config.min_tokens - idx.numel(), int((~hit_NE[:, e]).sum()))
                idx = torch.cat([idx, order[:extra]])
            counts.append(int(hit_NE[:, e].sum()))
            forced.append(extra)
            w = {p: weight(p, e) for p in PROJECTIONS}  # expert e's weights, read (and merged) once
            if idx.numel() < config.min_tokens:
                report.experts_rtn_fallback.append(f"{name}:{e}")
                codes[e] = _rtn_expert(w, config)
                alphas[e] = [0.0, 0.0]
            elif config.method == "gptq":
                calibrated[e] = (w, x_ND[idx].float())
            else:
                codes[e], alphas[e] = _awq_expert(module, e, w, x_ND[idx].float(), config)
        if calibrated:
            codes.update(_gptq_experts(module, calibrated, config))
        del calibrated
        for e in sorted(codes):
            for p, (q_OI, scale_OG, *in_scale) in codes[e].items():
                quantized.set_codes(p, e, q_OI, scale_OG, *in_scale)
            if done is not None:
                done(e)
            bar.update(1)
    bar.close()
    report.calibration_tokens[name] = counts
    report.forced_tokens[name] = forced
    if config.method == "awq":
        report.awq_alpha[name] = [alphas[e] for e in range(module.num_experts)]
    return quantized.to(next(module.parameters()).device)


def fallback_note(report: QuantReport, config: QuantConfig) -> None:
    """The report's note on the experts left to round to nearest, if any (once every module is quantized)."""
    if report.experts_rtn_fallback:
        report.notes.append(
            f"{len(report.experts_rtn_fallback)} experts had fewer than min_tokens="
            f"{config.min_tokens} calibration tokens even with force-routing and were rounded "
            "to nearest; give more calibration data"
        )
