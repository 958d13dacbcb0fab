"""What every quantization backend here shares: the config, integer codes, the report and the error.

Legend: E = experts, O = output features, I = input features, G = groups per row (I / group_size).

Codes are symmetric: int8 with one absmax scale per output channel (``bits=8``), or int4 with one scale per
``group_size`` inputs of each output channel, packed two a byte (``bits=4``). `fake_quantize` (quantize then
dequantize) is the reference the quantized modules are held equal to.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from moe_core.errors import MoELabError

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
