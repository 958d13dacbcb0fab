"""PyTorch weight-only experts: `quantize_experts` and the `QuantizedExperts` module, save and load.

Legend: E = experts, O = output features, I = input features, G = groups per row (I / group_size).

Each `GroupedExperts` is replaced by a `QuantizedExperts` holding int8 weights (``bits=8``: symmetric, one
scale per output channel) or packed int4 weights (``bits=4``: symmetric, one scale per ``group_size`` inputs
of each output channel, two values a byte), and dequantizing only the experts a token uses, on the fly.
Router, attention, norms, embeddings and the LM head stay in full precision. The integers are chosen by
round to nearest (``rtn``, `common.quantize_rtn`) or calibrated (``gptq``, ``awq``: `calibrated`).
The reference beside the fast path is fake quantization (`fake_quantize`: quantize, dequantize, run the
plain `GroupedExperts`); tests hold the two equal. `QuantReport` gives the fraction of parameters quantized
and the bytes; `check_experts_quantized` raises when any expert stack was skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from moe_core.config import MoEConfig
from moe_core.convert import copy_companion_files
from moe_core.experts import GroupedExperts, StackedExperts, ffn_act
from moe_core.inference.evaluate import calibration_batches
from moe_core.inference.quantize.calibrated import calibrated_codes
from moe_core.inference.quantize.common import (
    PROJECTIONS,
    QuantConfig,
    QuantizationError,
    QuantReport,
    compute_scales,
    dequantize,
    pack_int4,
    quantize_rtn,
    unpack_int4,
)
from moe_core.loading import load
from moe_core.model import MoEForCausalLM


# ---------------------------------------------------------------------------------------------- the module
class QuantizedExperts(StackedExperts):
    """A `StackedExperts` of weight-only int8/int4 weights, dequantized per expert as it runs.

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
        super().__init__(num_experts, activation, impl, max_slots)
        self.quant_config = config
        self.projections = tuple(shapes)
        for name, (O, I) in shapes.items():
            width = I if config.bits == 8 else I // 2
            dtype = torch.int8 if config.bits == 8 else torch.uint8
            self.register_buffer(f"{name}_q", torch.zeros(num_experts, O, width, dtype=dtype))
            self.register_buffer(f"{name}_scale", torch.ones(num_experts, O, config.groups(I)))
            if config.method == "awq":
                self.register_buffer(f"{name}_in_scale", torch.ones(num_experts, I))

    @classmethod
    def from_experts(
        cls,
        experts: GroupedExperts,
        config: QuantConfig,
        codes: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> QuantizedExperts:
        """Quantize ``experts`` (round to nearest unless ``codes`` gives ``{proj: (q [E,O,I] int8, scale)}``,
        or ``(q, scale, in_scale [E, I])`` for AWQ). The decode path is on (``max_slots`` 64 unless
        ``experts`` has its own): dequantizing only the chosen experts is what makes a decode step cheap."""
        shapes = {
            p: tuple(getattr(experts, p).shape[1:]) for p in PROJECTIONS if getattr(experts, p) is not None
        }
        new = cls(
            experts.num_experts,
            experts.activation,
            shapes,
            config,
            experts.impl,
            experts.max_slots or 64,
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
        # grouped_mm needs the whole dense stack: asked for it, this module chooses as for "auto"
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
        all_codes = calibrated_codes(model, modules, config, calibration, report)
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


QUANT_FILE = "quantization.json"


def save_quantized(
    model, out_dir: str | os.PathLike, config: QuantConfig, report: QuantReport | None = None
) -> Path:
    """Write config.json, the quantized state dict (safetensors) and quantization.json."""
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
    if calibration is None and data_dir is not None:
        calibration = calibration_batches(data_dir)
    if config.method in ("gptq", "awq") and calibration is None:
        raise QuantizationError(
            f"--method {config.method} calibrates on real text: pass --data DIR (a "
            "prepared-data directory, moe-lab data prepare)"
        )
    loaded = load(model_dir, dtype=torch.float32)
    model = loaded.model
    report = quantize_experts(model, config, calibration)
    save_quantized(model, out_dir, config, report)
    # tokenizer and generation defaults travel along (a training run's or checkpoint's tokenizer is the data's)
    copy_companion_files(loaded.tokenizer_dir or loaded.path, Path(out_dir))
    return report
