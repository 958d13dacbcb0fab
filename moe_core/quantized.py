"""The quantized-checkpoint format: what `moe-lab quantize` writes and `moe_core.load` reads.

Legend: E = experts, O = output features, I = input features, G = groups per row (I / group_size).

A quantized checkpoint is a directory holding ``config.json`` (the model's `MoEConfig`), ``model.safetensors``
(the state dict with every expert stack as `QuantizedExperts` buffers) and ``quantization.json`` (the
`QuantConfig` and the `QuantReport`), written together by `save_quantized` into a staging directory that is
renamed into place only when complete (`moe_core.fileio.atomic_directory`); `load_quantized` reads it back.

Codes are symmetric: int8 with one absmax scale per output channel (``bits=8``), or int4 with one scale per
``group_size`` inputs of each output channel, packed two a byte (``bits=4``). With ``codebook="nf4"`` (4 bits) a
code indexes the NormalFloat4 levels (QLoRA, Dettmers et al. 2023: the 16 quantiles of N(0, 1) scaled to
[-1, 1], which suit normally distributed weights better than evenly spaced levels) times the group's absmax. `fake_quantize` (quantize then
dequantize) is the reference the quantized modules are held equal to. How the codes are chosen (round to
nearest, GPTQ, AWQ) and the ``moe-lab quantize`` command live above this module, in
`moe_core.inference.quantize`; the loader reads this format without importing them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from moe_core.config import MoEConfig
from moe_core.convert import check_shape, copy_companion_files, open_streaming, stream_weights
from moe_core.errors import MoELabError, weight_mismatch
from moe_core.experts import (
    PROJECTIONS,
    ExpertLoRA,
    GroupedExperts,
    StackedExperts,
    grouped_mm_supported,
    impl_under_capture,
    replace_experts,
)
from moe_core.fileio import atomic_directory
from moe_core.frozen_linear import recomputed_linear
from moe_core.model import DecoderLayer, FeedForward, MoEForCausalLM, materialize, materialize_unsaved


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
    codebook: str = "int"  # "int": evenly spaced levels; "nf4": NormalFloat4 levels (bits == 4, rtn only)
    # how the absmax scales are stored: codes are chosen with the float32 scale either way; QLoRA's frozen base
    # keeps them in bfloat16 (half their bytes: 0.36 GiB of Qwen1.5-MoE-A2.7B's experts at group 64, a relative
    # error of at most 2^-9 on each group's scale, as bitsandbytes' double quantization trades precision there)
    scale_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise QuantizationError(f"QuantConfig.bits={self.bits!r}: choose 8 or 4")
        if self.scale_dtype not in ("float32", "bfloat16"):
            raise QuantizationError(
                f"QuantConfig.scale_dtype={self.scale_dtype!r}: choose float32 or bfloat16"
            )
        if self.codebook not in ("int", "nf4"):
            raise QuantizationError(f"QuantConfig.codebook={self.codebook!r}: choose 'int' or 'nf4'")
        if self.codebook == "nf4" and (self.bits != 4 or self.method != "rtn"):
            raise QuantizationError(
                "QuantConfig.codebook='nf4' is a 4-bit round-to-nearest format: set bits=4 and method='rtn'"
            )
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
    def qmax(self) -> float:
        """What the absmax of a group maps to: the largest code (int), or the largest level (nf4)."""
        if self.codebook == "nf4":
            return 1.0
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


# QLoRA (Dettmers et al. 2023), appendix E: the NormalFloat4 levels, as bitsandbytes' and torchao's NF4 use them
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def nf4_midpoints(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 15 fp32 midpoints between consecutive NF4 levels: the nearest level is how many lie below."""
    levels = torch.tensor(NF4_LEVELS, device=device)
    return (levels[1:] + levels[:-1]) / 2


def nf4_codes_reference(y: torch.Tensor) -> torch.Tensor:
    """The reference for `nf4_codes`: the index of the nearest NF4 level of each ``y`` in [-1, 1] (ties to the
    lower level), by binary search over the midpoints (int64)."""
    return torch.bucketize(y, nf4_midpoints(y.device))


NF4_CELLS = 512  # `nf4_codes`' table: [-1, 1] in 512 cells, each holding at most one midpoint


def _nf4_cell(y: torch.Tensor) -> torch.Tensor:
    """Each ``y`` in [-1, 1]'s cell (int32): non-decreasing in ``y``, as every step of it is in fp32 (a NaN, from a
    corrupt weight, gets a cell too rather than an out-of-range index)."""
    return ((y + 1) * (NF4_CELLS / 2)).to(torch.int32).clamp_(0, NF4_CELLS - 1)


@functools.cache
def _nf4_cell_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per cell: how many midpoints lie in cells below it (int8), and the midpoint inside it (+inf if none)."""
    midpoints = nf4_midpoints(device)
    cells = _nf4_cell(midpoints)
    if len(set(cells.tolist())) != len(cells):
        raise RuntimeError(f"NF4_CELLS={NF4_CELLS}: two NF4 midpoints share a cell")
    below = torch.searchsorted(cells, torch.arange(NF4_CELLS, dtype=torch.int32, device=device))
    inside = torch.full((NF4_CELLS,), float("inf"), device=device)
    inside[cells.long()] = midpoints
    return below.to(torch.int8), inside


def nf4_codes(y: torch.Tensor) -> torch.Tensor:
    """`nf4_codes_reference` (int8), exactly, 5x faster on a CPU: ``y``'s cell tells how many midpoints lie in
    the cells below (all below ``y``, since the cell is non-decreasing in ``y``) and the one midpoint that may
    share its cell, compared directly; two table lookups and a comparison instead of a binary search per
    value, the bulk of quantizing a checkpoint to NF4 while it loads (35 of 37 ms for a 1024 x 2048 slice)."""
    below, inside = _nf4_cell_tables(torch.device(y.device))
    y_N = y.reshape(-1)
    cell_N = _nf4_cell(y_N)
    q_N = torch.index_select(below, 0, cell_N)
    q_N += y_N > torch.index_select(inside, 0, cell_N)
    return q_N.view(y.shape)


def quantize_rtn(w_OI: torch.Tensor, scale_OG: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """Codes of ``w`` [..., O, I] at the given scales, as int8: integers in [-qmax-1, qmax], or (nf4) the index
    of the nearest NF4 level minus 8, so that int4 packing stores both alike."""
    G = scale_OG.shape[-1]
    w_OGg = w_OI.float().reshape(*w_OI.shape[:-1], G, -1) / scale_OG[..., None]
    if config.codebook == "nf4":
        q = nf4_codes(w_OGg.clamp(-1, 1)) - 8
    else:
        q = torch.round(w_OGg).clamp(-config.qmax - 1, config.qmax)
    return q.reshape(w_OI.shape).to(torch.int8)


def dequantize(q_OI: torch.Tensor, scale_OG: torch.Tensor, codebook: str = "int") -> torch.Tensor:
    G = scale_OG.shape[-1]
    values = (
        q_OI.float() if codebook == "int" else torch.tensor(NF4_LEVELS, device=q_OI.device)[q_OI.long() + 8]
    )
    return (values.reshape(*q_OI.shape[:-1], G, -1) * scale_OG[..., None]).reshape(q_OI.shape)


def dequantize_int4(
    packed_OH: torch.Tensor, scale_OG: torch.Tensor, codebook: str = "int", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``dequantize(unpack_int4(packed), scale, codebook).to(dtype)``, bitwise, by one table lookup per byte:
    each of the 256 byte values stands for two values (low nibble first), so a byte's pair comes out of a
    256-entry table (`_int4_pairs`) and no int64 code tensor is made. The temporaries are an int32 index and
    the values, which is what the per-expert dequantization of QLoRA runs at every forward and backward (a
    layer's stacks at once on a GPU): fewer and smaller blocks, less allocator growth. In a compute ``dtype``,
    integer codes come out of the table in it (exact: ``nibble - 8`` is in every float dtype) and NF4's fp32
    values are scaled into it (`_scaled_into`): no fp32 stack cast after (a stack of 8 Qwen1.5-MoE experts on
    2 CPU cores, int codes into bf16: 70 against 109 ms)."""
    *lead, O, H = packed_OH.shape
    G = scale_OG.shape[-1]
    index = packed_OH.int().flatten()
    if dtype == torch.float32 or (codebook == "int" and 2 * dtype.itemsize in WORDS):  # pairs in ``dtype``
        pairs_B = _int4_pairs(codebook, packed_OH.device, dtype)
        values = torch.index_select(pairs_B, 0, index).view(dtype).view(*lead, O, G, 2 * H // G)
        values.mul_(scale_OG[..., None])  # in the common dtype of the two, then rounded to ``dtype``
        return values.view(*lead, O, 2 * H)
    values = torch.index_select(_int4_pairs(codebook, packed_OH.device), 0, index).view(torch.float32)
    return _scaled_into(values.view(*lead, O, G, 2 * H // G), scale_OG, dtype).view(*lead, O, 2 * H)


def _scaled_into(
    values_OGk: torch.Tensor, scale_OG: torch.Tensor, dtype: torch.dtype, one_pass: bool | None = None
) -> torch.Tensor:
    """``(values * scale).to(dtype)``, bit for bit: the product is computed in the common dtype of the two
    (fp32 for NF4's levels) and rounded to it, then to ``dtype``. On a GPU in one pass, stored in ``dtype`` as
    it is computed (a layer's fp32 stack neither written back nor read again); on the CPU in place and then
    cast, which measured faster there than the mixed-dtype product (a 1408 x 2048 bf16 slice: 2.10 against
    2.25 ms). ``one_pass``: which of the two (default: one pass on a GPU), for the tests."""
    if not (values_OGk.is_cuda if one_pass is None else one_pass):
        return values_OGk.mul_(scale_OG[..., None]).to(dtype)
    out = torch.empty(values_OGk.shape, dtype=dtype, device=values_OGk.device)
    return torch.mul(values_OGk, scale_OG[..., None], out=out)


# Reused buffers for the dequantization QLoRA runs at every forward and backward (`QuantizedExperts.project`):
# one per (shape, dtype, device), a few per model. Allocating the slices instead (an int32 index, the fp32 values,
# their copy in the compute dtype: ~30 MiB for a Qwen1.5-MoE expert, ~13k times a step) left glibc's heap holding
# freed blocks it never returned: +1.8 GiB of resident memory after 3 steps of a 2-layer Qwen1.5-MoE-A2.7B, more
# than the 4-bit weights of its experts. Only a caller that is done with the slice before asking for the next
# may use them (`recomputed_linear` is: its forward and backward each consume the weight at once).
_SCRATCH: dict[tuple, torch.Tensor] = {}


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The reused buffer of this shape, dtype and device (contents undefined)."""
    key = (tuple(shape), dtype, torch.device(device))
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(shape, dtype=dtype, device=device)
    return _SCRATCH[key]


def _int4_table(codebook: str, device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the two values (low nibble first) each byte of packed int4 codes stands for."""
    key = ("int4-table", codebook, torch.device(device))
    if key not in _SCRATCH:
        u = torch.arange(256, device=device)
        codes_B2 = torch.stack(((u & 0x0F) - 8, (u >> 4) - 8), dim=-1)
        levels = torch.tensor(NF4_LEVELS, device=device)
        _SCRATCH[key] = levels[codes_B2 + 8] if codebook == "nf4" else codes_B2.float()
    return _SCRATCH[key]


WORDS = {4: torch.int32, 8: torch.int64}  # an integer dtype of each word size `_int4_pairs` makes


def _int4_pairs(codebook: str, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[256] words: `_int4_table`'s two values of each byte in ``dtype`` as one word of twice its size, so that a
    lookup moves the pair at once (a 1-D ``index_select`` is 2.4x faster on a CPU than one over [256, 2] rows:
    0.94 against 2.25 ms for a 1408 x 2048 slice in fp32), the result read back as ``dtype`` bit for bit. NF4's
    levels are fp32 (``dtype`` another would round them before the scale does); the integer codes are exact in
    every float dtype."""
    if codebook == "nf4" and dtype != torch.float32:
        raise ValueError(
            f"NF4's levels are looked up in fp32, not {dtype}: the scale's product is rounded once"
        )
    key = ("int4-pairs", codebook, torch.device(device), dtype)
    if key not in _SCRATCH:
        table_B2 = _int4_table(codebook, device).to(dtype)
        _SCRATCH[key] = table_B2.view(WORDS[2 * dtype.itemsize]).view(256)
    return _SCRATCH[key]


def _int4_quads(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[65536] int64: the four ``nibble - 8`` (two bytes' codes, the first byte's low nibble first) in a
    16-bit ``dtype``, one word each, indexed by the two bytes read as one little-endian uint16 (512 KiB; half
    as many lookups as a byte at a time, of words twice as wide: 1.2x faster on a CPU)."""
    key = ("int4-quads", torch.device(device), dtype)
    if key not in _SCRATCH:
        u = torch.arange(65536, device=device)
        first, second = u & 0xFF, u >> 8
        codes_U4 = torch.stack((first & 0x0F, first >> 4, second & 0x0F, second >> 4), dim=-1) - 8
        _SCRATCH[key] = codes_U4.to(dtype).view(torch.int64).view(65536)
    return _SCRATCH[key]


def _quads_apply(packed_OH: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `_int4_quads` can read ``packed_OH``: a 16-bit ``dtype``, rows of whole byte pairs at even
    addresses, on a little-endian CPU (measured there; a GPU takes a layer's stack at once,
    `dequantize_int4`)."""
    return (
        dtype.itemsize == 2
        and dtype.is_floating_point
        and packed_OH.device.type == "cpu"
        and sys.byteorder == "little"
        and packed_OH.is_contiguous()
        and packed_OH.shape[-1] % 2 == 0
        and packed_OH.data_ptr() % 2 == 0
    )


def dequantize_int4_scratch(
    packed_OH: torch.Tensor, scale_OG: torch.Tensor, codebook: str = "int", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``dequantize_int4(packed, scale, codebook).to(dtype)`` of one expert slice [O, I/2], bitwise, in reused
    buffers (`scratch`: nothing is allocated per slice). NF4: `dequantize_int4`'s table lookup, written with
    ``out=``, then the cast. Integer codes: the byte's pair of ``nibble - 8`` looked up straight in ``dtype``
    (less memory traffic than fp32 values and a cast), then the scale. Bitwise the same: ``nibble - 8`` is
    exact in every float dtype, and the in-place product is computed in the common dtype (fp32 against an fp32
    scale, rounded to fp32 and then to ``dtype`` as the reference's; exact against a bf16 scale, QLoRA's, then
    rounded once). In a 16-bit ``dtype`` on the CPU, integer codes are looked up two bytes at a time
    (`_int4_quads`). A 1408 x 2048 bf16 slice on 2 cores: NF4 1.88 ms (2.21 before the word lookups); int
    1.32-1.38 ms against 1.61-1.69 a byte at a time in the same run (1.73 before the word lookups)."""
    O, H = packed_OH.shape
    G = scale_OG.shape[-1]
    device = packed_OH.device
    if codebook == "int":  # the pairs straight in ``dtype`` (1.2x faster than unpacking the nibbles there)
        out_OH2 = scratch((O, H, 2), dtype, device)
        if _quads_apply(packed_OH, dtype):  # two bytes, four codes, at a time
            index_OQ = scratch((O, H // 2), torch.int32, device)
            index_OQ.copy_(packed_OH.view(torch.uint16))
            table = _int4_quads(device, dtype)
            torch.index_select(table, 0, index_OQ.view(-1), out=out_OH2.view(-1).view(table.dtype))
        else:
            index_OH = scratch((O, H), torch.int32, device)
            index_OH.copy_(packed_OH)
            pairs_B = _int4_pairs(codebook, device, dtype)
            torch.index_select(pairs_B, 0, index_OH.view(-1), out=out_OH2.view(pairs_B.dtype).view(-1))
        # in place, in the common dtype of the two (fp32 for an fp32 scale), then rounded to ``dtype``
        out_OH2.view(O, G, 2 * H // G).mul_(scale_OG[..., None])
        return out_OH2.view(O, 2 * H)
    index_OH = scratch((O, H), torch.int32, device)  # int32: half int64's traffic, 1.15-1.5x faster
    index_OH.copy_(packed_OH)
    values_OH2 = scratch((O, H, 2), torch.float32, packed_OH.device)
    pairs_B = _int4_pairs(codebook, packed_OH.device)
    torch.index_select(pairs_B, 0, index_OH.view(-1), out=values_OH2.view(torch.int64).view(-1))
    values_OGk = values_OH2.view(O, G, 2 * H // G)
    values_OGk.mul_(scale_OG[..., None])
    return scratch_in_dtype(values_OH2.view(O, 2 * H), dtype)


def scratch_in_dtype(w_OI: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A dequantized fp32 scratch slice as ``dtype``: itself, or its copy in that dtype's reused buffer."""
    return w_OI if dtype == w_OI.dtype else scratch(w_OI.shape, dtype, w_OI.device).copy_(w_OI)


def rtn_codes(w_OI: torch.Tensor, config: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest codes of one weight (int4 packed two a byte, or int8) and its absmax scales."""
    scale_OG = compute_scales(w_OI, config)
    q_OI = quantize_rtn(w_OI, scale_OG, config)
    return (pack_int4(q_OI) if config.bits == 4 else q_OI), scale_OG


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
    return dequantize(quantize_rtn(w, scale, config), scale, config.codebook).to(w.dtype)


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

    def summary(self) -> str:
        """One line for people (the whole report is ``quantization.json``)."""
        smaller = self.bytes_before / self.bytes_after if self.bytes_after else float("nan")
        line = (
            f"{self.method} int{self.bits}: {self.experts_quantized} expert stacks, "
            f"{self.fraction_quantized:.0%} of the parameters quantized, "
            f"{self.bytes_before / 2**20:,.1f} -> {self.bytes_after / 2**20:,.1f} MiB ({smaller:.2f}x smaller)"
        )
        if self.experts_rtn_fallback:
            line += (
                f"; {len(self.experts_rtn_fallback)} experts fell back to RTN (too few calibration tokens)"
            )
        return line


# ---------------------------------------------------------------------------------------------- the module
class QuantizedExperts(StackedExperts):
    """A `StackedExperts` of weight-only int8/int4 weights, dequantized per expert as it runs.

    Buffers per projection ``p``: ``p_q`` (int8 codes, or uint8 with two int4 codes a byte), ``p_scale``
    ([E, O, G], `QuantConfig.scale_dtype`: fp32 unless QLoRA's bf16) and, for AWQ only, ``p_in_scale`` (fp32 [E, I], the activation-aware scale that divides
    the dequantized weight's columns). ``grouped_mm`` (``auto`` on a GPU) dequantizes a layer's stack per projection
    in forward and again in backward (`moe_core.frozen_linear.recomputed_grouped_mm`); the CPU runs ``sorted``.
    gpt-oss's experts keep their biases unquantized (frozen ``{p}_bias`` [E, O] parameters in the model's dtype)
    and their clamped SwiGLU (``bias``, ``swiglu_limit``, ``swiglu_alpha``: `StackedExperts.ffn_options`)."""

    def __init__(
        self,
        num_experts: int,
        activation: str,
        shapes: dict[str, tuple[int, int]],
        config: QuantConfig,
        impl: str = "auto",
        max_slots: int = 64,
        *,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = 1.702,
        bias_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_experts, activation, impl, max_slots)
        self.quant_config = config
        self.projections = tuple(shapes)
        self.shapes = dict(shapes)  # projection -> (O, I) of one expert's dense weight
        for name, (O, I) in shapes.items():
            width = I if config.bits == 8 else I // 2
            dtype = torch.int8 if config.bits == 8 else torch.uint8
            self.register_buffer(f"{name}_q", torch.zeros(num_experts, O, width, dtype=dtype))
            self.register_buffer(
                f"{name}_scale",
                torch.ones(num_experts, O, config.groups(I), dtype=getattr(torch, config.scale_dtype)),
            )
            if config.method == "awq":
                self.register_buffer(f"{name}_in_scale", torch.ones(num_experts, I))
        self.init_frozen_biases(shapes, bias, bias_dtype)
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha

    @classmethod
    def shaped_like(cls, dense: StackedExperts, config: QuantConfig) -> QuantizedExperts:
        """Codes and scales of ``dense``'s shapes under ``config``, not yet filled (built on the meta device by the
        loaders, before any storage exists). ``dense``: stacked or memory-mapped (`moe_core.mapped.MappedExperts`,
        whose weights are per-expert tensors); its biases, if any, keep its weights' dtype."""
        return cls(
            dense.num_experts,
            dense.activation,
            dense.projection_shapes(),
            config,
            dense.impl,
            **dense.ffn_options(),
            bias_dtype=dense.unbound()[1][0].dtype,  # (the up projection's first expert)
        )

    @classmethod
    @torch.no_grad()
    def to_fill(cls, experts: StackedExperts, config: QuantConfig) -> QuantizedExperts:
        """`shaped_like` ``experts`` with its biases copied (gpt-oss: kept as they are) and the decode path on (as
        `from_experts`), for its codes to be written expert by expert (`quantize_into`, `set_codes`)."""
        quantized = cls.shaped_like(experts, config)
        quantized.max_slots = experts.max_slots or 64
        for p in PROJECTIONS:
            if experts.bias_stack(p) is not None:
                getattr(quantized, f"{p}_bias").copy_(experts.bias_stack(p))
        return quantized

    @classmethod
    def from_experts(cls, experts: GroupedExperts, config: QuantConfig) -> QuantizedExperts:
        """Quantize ``experts``' stacks, round to nearest (calibrated codes are set expert by expert: `set_codes`).
        The decode path is on (``max_slots`` 64 unless ``experts`` has its own): dequantizing only the chosen
        experts is what makes a decode step cheap."""
        shapes = experts.projection_shapes()
        new = cls(
            experts.num_experts,
            experts.activation,
            shapes,
            config,
            experts.impl,
            experts.max_slots or 64,
            **experts.ffn_options(),
            bias_dtype=experts.up_proj.dtype,
        )
        for p in shapes:
            if experts.bias_stack(p) is not None:  # gpt-oss: kept as they are
                getattr(new, f"{p}_bias").copy_(experts.bias_stack(p).detach())
            w = getattr(experts, p).detach()
            scale = compute_scales(w, config)
            q = quantize_rtn(w, scale, config)
            getattr(new, f"{p}_q").copy_(pack_int4(q) if config.bits == 4 else q)
            getattr(new, f"{p}_scale").copy_(scale)
        return new.to(experts.up_proj.device)

    @torch.no_grad()
    def quantize_into(self, name: str, e: int, w_OI: torch.Tensor) -> None:
        """Expert ``e``'s ``name`` weight, round to nearest: for a model quantized while it streams in, one
        expert slice at a time (the dense stack never exists)."""
        getattr(self, f"{name}_q")[e], getattr(self, f"{name}_scale")[e] = rtn_codes(w_OI, self.quant_config)

    @torch.no_grad()
    def set_codes(
        self,
        name: str,
        e: int,
        q_OI: torch.Tensor,
        scale_OG: torch.Tensor,
        in_scale_I: torch.Tensor | None = None,
    ) -> None:
        """Expert ``e``'s ``name`` codes (int8 values, packed here for int4), their scales and AWQ's input scale:
        codes chosen elsewhere (GPTQ, AWQ: `moe_core.inference.quantize.calibrated`), one expert at a time."""
        getattr(self, f"{name}_q")[e] = pack_int4(q_OI) if self.quant_config.bits == 4 else q_OI
        getattr(self, f"{name}_scale")[e] = scale_OG
        if in_scale_I is not None:
            getattr(self, f"{name}_in_scale")[e] = in_scale_I

    def stack_shape(self, name: str) -> tuple[int, int, int]:
        """``(E, O, I)``: the shape of the dense ``name`` stack these codes stand for."""
        return (self.num_experts, *self.shapes[name])

    def codes(self, name: str, e: int | slice = slice(None)) -> torch.Tensor:
        q = getattr(self, f"{name}_q")[e]
        return unpack_int4(q) if self.quant_config.bits == 4 else q

    def weight(self, name: str, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """Expert ``e``'s dequantized ``name`` weight [O, I]."""
        if name not in self.projections:
            return None
        w = self._dequantized(name, e)
        if self.quant_config.method == "awq":
            w = w / getattr(self, f"{name}_in_scale")[e]
        return w.to(dtype)

    def _dequantized(self, name: str, e: int | slice, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q, scale = getattr(self, f"{name}_q")[e], getattr(self, f"{name}_scale")[e]
        if self.quant_config.bits == 4:
            return dequantize_int4(q, scale, self.quant_config.codebook, dtype)
        return dequantize(q, scale, self.quant_config.codebook).to(dtype)

    def dequantized_stack(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The dense ``[E, O, I]`` stack of ``name`` in ``dtype`` (the fp32 values' cast, bit for bit: AWQ's
        division in fp32 first)."""
        if name not in self.projections:
            return None
        if self.quant_config.method == "awq":
            w = self._dequantized(name, slice(None)) / getattr(self, f"{name}_in_scale")[:, None, :]
            return w.to(dtype)
        return self._dequantized(name, slice(None), dtype)

    def resolved_impl(self, x_TD: torch.Tensor) -> str:
        # on a GPU, a layer's stacks dequantized at once and one grouped matmul per projection (forward and again
        # in backward: one dense stack alive at a time); on the CPU slice by slice, each dequantized slice
        # cache-sized (`project`)
        if self.impl not in ("auto", "grouped_mm"):
            return self.impl
        traced = impl_under_capture(x_TD, lambda: self.grouped_mm_ok(x_TD))
        if traced is not None:
            return traced
        if self.impl == "grouped_mm" or x_TD.is_cuda:
            return "grouped_mm"
        return "sorted"

    def grouped_mm_ok(self, x_TD: torch.Tensor, lora: ExpertLoRA | None = None) -> bool:
        F_, D = self.shapes["up_proj"]
        return grouped_mm_supported(x_TD, F_, D, *(lora.ranks() if lora is not None else ()))

    def grouped_project(self, p: str, x_AI: torch.Tensor, gmm) -> torch.Tensor:
        return gmm(x_AI, lambda dtype: self.dequantized_stack(p, dtype))

    def unbound(self) -> tuple:
        return None, None, None  # `expert` dequantizes its own slices

    def stacks(self, dtype: torch.dtype | None = None) -> tuple:
        stacks = (self.dequantized_stack(p) for p in PROJECTIONS)
        return tuple(w.to(dtype) if w is not None and dtype is not None else w for w in stacks)

    def project(self, p: str, e: int, x_NI: torch.Tensor, weights: tuple) -> torch.Tensor:
        # the dequantized slice is made again in backward, not kept: a layer's backward would otherwise hold a
        # dense copy of every expert it ran (768 MiB for an OLMoE-1B-7B layer); in reused buffers (`scratch`)
        return recomputed_linear(x_NI, lambda: self.scratch_weight(p, e, x_NI.dtype))

    def scratch_weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """`weight` (bitwise) in reused buffers: valid until the next call; for a caller that consumes it at once."""
        if self.quant_config.bits != 4:
            return self.weight(name, e, dtype)
        q, scale = getattr(self, f"{name}_q")[e], getattr(self, f"{name}_scale")[e]
        if self.quant_config.method != "awq":
            return dequantize_int4_scratch(q, scale, self.quant_config.codebook, dtype)
        w_OI = dequantize_int4_scratch(q, scale, self.quant_config.codebook)  # fp32, divided, then cast
        w_OI.div_(getattr(self, f"{name}_in_scale")[e])
        return scratch_in_dtype(w_OI, dtype)


def expert_modules(model: nn.Module) -> list[tuple[str, StackedExperts]]:
    """Every stacked expert module of ``model``, dense or already quantized."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, StackedExperts)]


def check_experts_quantized(model: nn.Module) -> None:
    """Raise `QuantizationError` when any expert stack of ``model`` is still in full precision."""
    skipped = [name for name, m in expert_modules(model) if not isinstance(m, QuantizedExperts)]
    if skipped:
        raise QuantizationError(
            f"expert weights left unquantized in {skipped}; run quantize_experts on the model"
        )


QUANT_FILE = "quantization.json"


def save_quantized(
    model,
    out_dir: str | os.PathLike,
    config: QuantConfig,
    report: QuantReport | None = None,
    *,
    companions_from: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write config.json, the quantized state dict (safetensors), the tokenizer and generation files found in
    ``companions_from`` and quantization.json, staged: ``out_dir`` appears complete or not at all, and a
    non-empty ``out_dir`` is replaced (only once the new one is complete) only with ``overwrite``."""
    with atomic_directory(out_dir, overwrite, QuantizationError) as tmp:
        model.config.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if companions_from is not None:
            copy_companion_files(companions_from, tmp)
        meta = {"quant_config": asdict(config), "report": report.to_dict() if report else None}
        (tmp / QUANT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return Path(out_dir)


def load_quantized(directory: str | os.PathLike) -> MoEForCausalLM:
    """Load what `save_quantized` wrote: an `MoEForCausalLM` with `QuantizedExperts`."""
    directory = Path(directory)
    meta = _read_quant_file(directory)
    try:
        config = QuantConfig(**meta["quant_config"])
    except (KeyError, TypeError) as err:
        raise QuantizationError(
            f"{directory / QUANT_FILE}: no valid quant_config ({err}); quantize the model again "
            "(moe-lab quantize --overwrite)"
        ) from None
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise QuantizationError(
            f"{directory}: {QUANT_FILE} without model.safetensors; quantize the model again "
            "(moe-lab quantize --overwrite)"
        )
    # built on the meta device and given the file's tensors (views of its mapping) in the dtype they are stored
    # in: the model built in float32 first (random weights, random experts quantized, then replaced) took 25.8 GiB
    # for a 4.7 GiB quantized OLMoE-1B-7B, more than the machine that wrote it holds
    with torch.device("meta"):
        model = MoEForCausalLM(MoEConfig.from_pretrained(directory)).eval()
        # the structure (and AWQ's input scales) for the state dict
        replace_experts(model, lambda dense: QuantizedExperts.shaped_like(dense, config))
    with safe_open(str(weights), framework="pt") as file:
        state = {key: file.get_tensor(key) for key in file.keys()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise QuantizationError(
            f"{weights}: the weights do not cover the model its config.json describes ("
            + weight_mismatch(missing, unexpected)
            + "); quantize the model again (moe-lab quantize --overwrite)"
        )
    if model.config.tie_word_embeddings:
        model.tie_weights()
    materialize_unsaved(model)
    return model


def _read_quant_file(directory: Path) -> dict:
    """quantization.json as a dict; a missing, empty or damaged one is one clear `QuantizationError`."""
    path = directory / QUANT_FILE
    if not path.is_file():
        raise QuantizationError(
            f"{directory}: no {QUANT_FILE}; write one with `moe-lab quantize` or save_quantized"
        )
    try:
        meta = json.loads(path.read_text())
    except ValueError as err:
        meta = err
    if not isinstance(meta, dict):
        reason = f"not valid JSON ({meta})" if isinstance(meta, ValueError) else "not a JSON object"
        raise QuantizationError(
            f"{path}: {reason}, a damaged quantized checkpoint; quantize the model again "
            "(moe-lab quantize --overwrite)"
        )
    return meta


# ---------------------------------------------------------------------------------------------- dense projections
class QuantizedLinear(nn.Module):
    """A frozen ``nn.Linear`` [O, I] held as codes (``weight_q``: int4 packed two a byte, or int8) and absmax
    scales (``weight_scale`` [O, G]), its bias (if any) kept as it was (a ``bias`` buffer, the model's dtype):
    under QLoRA, the shared experts' projections (Qwen2-MoE's 5632-wide shared expert: 1.6 GiB of bf16 over
    Qwen1.5-MoE-A2.7B's 24 layers, 0.45 GiB in 4 bits) and the attention projections (``quantize.attention``,
    on by default under QLoRA). Dequantized into reused buffers at each use and again in backward
    (`recomputed_linear`), as the routed experts' slices are. LoRA on it is `moe_core.finetune.expert_lora.QuantizedLinearLoRA`, whose adapter
    has the keys of LoRA on the ``nn.Linear`` it stands for."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        config: QuantConfig,
        bias: bool = False,
        bias_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.quant_config = in_features, out_features, config
        width = in_features if config.bits == 8 else in_features // 2
        dtype = torch.int8 if config.bits == 8 else torch.uint8
        self.register_buffer("weight_q", torch.zeros(out_features, width, dtype=dtype))
        scale_dtype = getattr(torch, config.scale_dtype)
        self.register_buffer(
            "weight_scale", torch.ones(out_features, config.groups(in_features), dtype=scale_dtype)
        )
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype) if bias else None)

    @property
    def qweight(self) -> torch.Tensor:
        """The codes under the name quantized linears give them (GPTQ's, AWQ's): where PEFT looks for a layer's
        device when it wraps one with LoRA (it has no ``weight``)."""
        return self.weight_q

    @torch.no_grad()
    def quantize_from(self, w_OI: torch.Tensor) -> None:
        """Round to nearest, as `QuantizedExperts.quantize_into` does for one expert slice."""
        codes, scale_OG = rtn_codes(w_OI, self.quant_config)
        self.weight_q.copy_(codes)
        self.weight_scale.copy_(scale_OG)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: the dense [O, I] weight these codes stand for, newly allocated."""
        codebook = self.quant_config.codebook
        if self.quant_config.bits == 4:
            return dequantize_int4(self.weight_q, self.weight_scale, codebook).to(dtype)
        return dequantize(self.weight_q, self.weight_scale, codebook).to(dtype)

    def _scratch_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.quant_config.bits != 4:
            return self.dequantized(dtype)
        return dequantize_int4_scratch(self.weight_q, self.weight_scale, self.quant_config.codebook, dtype)

    def forward(self, x_NI: torch.Tensor) -> torch.Tensor:
        y_NO = recomputed_linear(x_NI, lambda: self._scratch_weight(x_NI.dtype))
        return y_NO if self.bias is None else y_NO + self.bias.to(y_NO.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.quant_config.bits}, "
            f"bias={self.bias is not None}"
        )


def _quantize_linears(config: QuantConfig, owners: list[tuple[str, nn.Module]]) -> dict[str, QuantizedLinear]:
    """Every ``nn.Linear`` child of the ``owners`` (name, module) replaced by `QuantizedLinear`, in place:
    quantized from its weight (its bias copied), or, on the meta device (a model about to stream in), empty
    codes to fill with `QuantizedLinear.quantize_from`. Returns the new modules by name."""
    replaced: dict[str, QuantizedLinear] = {}
    for name, owner in owners:
        for child, linear in list(owner.named_children()):
            if not isinstance(linear, nn.Linear):
                continue
            bias = linear.bias
            quantized = QuantizedLinear(
                linear.in_features,
                linear.out_features,
                config,
                bias is not None,
                None if bias is None else bias.dtype,
            )
            if linear.weight.device.type != "meta":
                quantized = quantized.to(linear.weight.device)
                quantized.quantize_from(linear.weight.detach())
                if bias is not None:
                    quantized.bias.copy_(bias.detach())
            setattr(owner, child, quantized)
            replaced[f"{name}.{child}"] = quantized
    return replaced


def quantize_shared_experts(model: nn.Module, config: QuantConfig) -> dict[str, QuantizedLinear]:
    """Replace every shared expert's projections (``...mlp.shared_expert.{gate,up,down}_proj``, the always-on
    `FeedForward` of Qwen2-MoE / DeepSeekMoE) by `QuantizedLinear` (`_quantize_linears`). Returns the new
    modules by their names (``...shared_expert.up_proj``)."""
    owners = [
        (name, module)
        for name, module in model.named_modules()
        if name.endswith(".mlp.shared_expert") and isinstance(module, FeedForward)
    ]
    return _quantize_linears(config, owners)


def quantize_attention(model: nn.Module, config: QuantConfig) -> dict[str, QuantizedLinear]:
    """Replace every attention projection (``...self_attn.{q,k,v,o}_proj``; multi-head latent attention's
    ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``) by `QuantizedLinear`, biases
    kept (Qwen2-MoE's q/k/v). Returns the new modules by name (``...self_attn.q_proj``)."""
    owners = [(name, module) for name, module in model.named_modules() if name.endswith(".self_attn")]
    return _quantize_linears(config, owners)


def attention_input_widths(config: MoEConfig) -> dict[str, int]:
    """The input width of each attention projection of ``config``'s model (read off one layer built on the
    meta device): a 4-bit group size must divide each before the attention can be quantized."""
    with torch.device("meta"):
        attention = DecoderLayer(config, 0).self_attn
    return {name: m.in_features for name, m in attention.named_children() if isinstance(m, nn.Linear)}


# ---------------------------------------------------------------------------------------------- quantized loading
def load_quantizing_experts(
    path: str | os.PathLike,
    config: QuantConfig,
    dtype: torch.dtype | str | None = None,
    *,
    shared_experts: bool = False,
    attention: bool = False,
) -> MoEForCausalLM:
    """A full-precision checkpoint (a Hugging Face one `convert` reads, or ours) with its expert stacks
    quantized while they stream in, one expert slice at a time (round to nearest), for QLoRA: the model is built
    on the meta device, every expert stack replaced by `QuantizedExperts` before any storage exists, and only
    the quantized codes, the other weights (in ``dtype``, default the checkpoint's) and one source tensor at a
    time are ever in memory; the full-precision model never has to fit. ``shared_experts``: the shared experts'
    projections too (`quantize_shared_experts`); ``attention``: the attention projections too
    (`quantize_attention`)."""
    opened = open_streaming(path, dtype, QuantizationError, "quantizing while loading")
    directory, reader, model, plan = opened.directory, opened.reader, opened.model, opened.plan
    with torch.device("meta"):  # before any storage exists
        quantized = replace_experts(
            model,
            lambda dense: QuantizedExperts.shaped_like(dense, config),
        )
        linears = quantize_shared_experts(model, config) if shared_experts else {}
        if attention:
            linears.update(quantize_attention(model, config))
    materialize(model, "cpu")
    model.tie_weights()
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for ours, e, name, source in stream_weights(reader, plan, release=True):
            module, _, projection = ours.rpartition(".")
            if module in linears and projection == "weight":
                linear = linears[module]
                check_shape(directory, name, source, ours, (linear.out_features, linear.in_features))
                linear.quantize_from(source)
                continue
            experts = quantized.get(module)
            # not a quantized stack: copied as it is (gpt-oss's expert biases too, one expert's row at a time)
            if experts is None or projection not in experts.projections:
                target = state[ours] if e is None else state[ours][e]
                check_shape(directory, name, source, ours, target.shape)
                target.copy_(source)
                continue
            E, O, I = experts.stack_shape(projection)
            check_shape(directory, name, source, ours, (O, I) if e is not None else (E, O, I))
            for expert, w_OI in [(e, source)] if e is not None else enumerate(source):
                experts.quantize_into(projection, expert, w_OI)
    return opened.finish()
