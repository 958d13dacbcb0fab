"""PyTorch weight-only experts: `quantize_experts` and `quantize_checkpoint` (``moe-lab quantize``).

Each `GroupedExperts` is replaced by a `QuantizedExperts` (`moe_core.quantized`, the format the loader reads)
holding int8 weights (``bits=8``: symmetric, one scale per output channel) or packed int4 weights (``bits=4``:
symmetric, one scale per ``group_size`` inputs of each output channel, two values a byte), and dequantizing
only the experts a token uses, on the fly. Router, attention, norms, embeddings and the LM head stay in full
precision. The integers are chosen by round to nearest (``rtn``, `moe_core.quantized.quantize_rtn`) or
calibrated (``gptq``, ``awq``: `calibrated`). The reference beside the fast path is fake quantization
(`fake_quantize`: quantize, dequantize, run the plain `GroupedExperts`); tests hold the two equal.
`QuantReport` gives the fraction of parameters quantized and the bytes; `check_experts_quantized` raises when
any expert stack was skipped.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from moe_core.experts import PROJECTIONS, StackedExperts
from moe_core.fileio import check_output_dir
from moe_core.finetune.sizing import read_dtype
from moe_core.inference.evaluate import calibration_batches
from moe_core.inference.quantize.calibrated import calibrated_experts, expert_inputs, fallback_note
from moe_core.loading import (
    MAPPABLE,
    adapter_to_merge,
    detect,
    load,
    memory_map_refusal,
    merges_as_written,
    tokenizer_dir,
)
from moe_core.mapped import ExpertDeltas, MappedExperts, MergedSlices, merged_slice, release_pages
from moe_core.model import MoEForCausalLM
from moe_core.quantized import (
    QuantConfig,
    QuantizationError,
    QuantizedExperts,
    QuantReport,
    check_experts_quantized,
    expert_modules,
    load_quantizing_experts,
    save_quantized,
)


def _weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


# ---------------------------------------------------------------------------------------------- entry points
def quantize_experts(
    model: nn.Module,
    config: QuantConfig | None = None,
    calibration: Iterable[torch.Tensor] | None = None,
    *,
    inputs: Mapping[StackedExperts, dict] | None = None,
    deltas: ExpertDeltas | None = None,
) -> QuantReport:
    """Replace every `GroupedExperts` (or memory-mapped `MappedExperts`) of ``model`` by a `QuantizedExperts`, in
    place, one module at a time; returns the report.

    ``calibration``: batches of token ids [B, S], required for ``method="gptq"`` and ``"awq"`` (or their
    ``inputs``, `calibrated.expert_inputs`, collected on another model with the same experts modules: a fine-tune's
    adapter as it trained). ``deltas``: an adapter's, added to each expert slice as it is quantized
    (`moe_core.finetune.export.merged_for_writing`). A memory-mapped expert slice's pages are released once it
    is quantized."""
    config = config or QuantConfig()
    deltas = deltas or {}
    found = expert_modules(model)
    if not found:
        raise QuantizationError("the model has no GroupedExperts to quantize (a dense model?)")
    modules = [(name, m) for name, m in found if not isinstance(m, QuantizedExperts)]
    params_total = sum(p.numel() for p in model.parameters())
    bytes_before = _weight_bytes(model)
    report = QuantReport(config.bits, config.method, params_total, 0, bytes_before, 0, 0)
    if config.method in ("gptq", "awq") and inputs is None:
        if calibration is None:
            raise QuantizationError(
                f"method={config.method!r} needs calibration batches (token ids [B, S]): "
                "from the CLI, --data DIR (a prepared-data directory)"
            )
        inputs = expert_inputs(model, calibration)
    for name, module in modules:
        shapes = module.projection_shapes().values()  # (not biases; a memory-mapped module's never stacked)
        report.params_quantized += module.num_experts * sum(O * I for O, I in shapes)
        report.experts_quantized += module.num_experts
        if config.method in ("gptq", "awq"):
            quantized = calibrated_experts(
                name,
                module,
                inputs.pop(module),  # each module's inputs let go of once it is quantized
                config,
                report,
                MergedSlices(module, deltas.get(module)),
                done=functools.partial(_release_expert, module)
                if isinstance(module, MappedExperts)
                else None,
            )
        elif isinstance(module, MappedExperts) or module in deltas:
            quantized = _quantized_slices(module, config, deltas.get(module, {}))
        else:
            quantized = QuantizedExperts.from_experts(module, config)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quantized)
    fallback_note(report, config)
    report.bytes_after = _weight_bytes(model)
    check_experts_quantized(model)
    total = sum(m.num_experts for _, m in modules)
    if report.experts_quantized != total:  # every expert of every layer (fallbacks are in the report)
        raise QuantizationError(f"quantized {report.experts_quantized} of {total} experts")
    return report


def quantize_checkpoint(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: QuantConfig,
    calibration: Iterable[torch.Tensor] | None = None,
    data_dir: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
) -> QuantReport:
    """`moe-lab quantize`: load a checkpoint, quantize its experts, save (staged: ``out_dir`` is the old result
    or the new one, never a mix; a non-empty ``out_dir`` is replaced only with ``overwrite``). GPTQ and AWQ
    calibrate on ``calibration`` batches, or on the first batches of the prepared-data directory ``data_dir``.

    The full-precision model is never in memory whole where it need not be:
    - round to nearest on a model directory (ours, a pruned one or a Hugging Face one) quantizes while the
      checkpoint streams in (`load_quantizing_experts`, as QLoRA's base): the same codes, and memory for the
      quantized model only;
    - GPTQ and AWQ on a model directory in its stored dtype run their calibration pass on the memory-mapped
      model and read each expert slice from the file as they quantize it;
    - on a fine-tune's output that holds its adapter alone (`merges_as_written`) the adapter is merged into one
      expert slice at a time of its full-precision base, memory-mapped, as that slice is quantized
      (`quantize_merged`); GPTQ and AWQ calibrate on the adapter as it trained (unmerged, over that base: the
      merged model's function, up to rounding). The codes are the merged model's."""
    check_output_dir(out_dir, overwrite, QuantizationError)  # before anything expensive
    if calibration is None and data_dir is not None:
        calibration = calibration_batches(data_dir)
    calibrated = config.method in ("gptq", "awq")
    if calibrated and calibration is None:
        raise QuantizationError(
            f"--method {config.method} calibrates on real text: pass --data DIR (a "
            "prepared-data directory, moe-lab data prepare)"
        )
    dtype = read_dtype(model_dir, "quantize")
    if config.method == "rtn" and detect(model_dir) in MAPPABLE:
        # a model directory, round to nearest: quantized while it streams in, one expert slice at a time; the
        # full-precision experts are never in memory (a model larger than memory quantizes too)
        model = load_quantizing_experts(model_dir, config, dtype)
        report = _streamed_report(model, config)
        companions = Path(model_dir)
    elif merges_as_written(model_dir):
        # a fine-tune's adapter over its base (memory-mapped where its files hold the dtype), merged into each
        # expert slice as it is quantized: a base larger than memory (a fine-tune of Qwen1.5-MoE-A2.7B on a 24
        # GiB machine) quantizes too, where a merge needs it whole
        model, report = quantize_merged(adapter_to_merge(model_dir, dtype), config, calibration)
        companions = tokenizer_dir(model_dir)  # the adapter's: its tokenizer and prompt framing
    else:
        # calibrated, memory-mapped where it can be; or a fine-tune's adapter merged in
        mapped = calibrated and memory_map_refusal(model_dir, dtype) is None
        loaded = load(model_dir, dtype=dtype, memory_map=mapped, merged=True)
        model = loaded.model
        report = quantize_experts(model, config, calibration)
        # the tokenizer and generation defaults travel along (a run's or checkpoint's tokenizer is the data's)
        companions = loaded.tokenizer_dir or loaded.path
    save_quantized(model, out_dir, config, report, companions_from=companions, overwrite=overwrite)
    return report


def quantize_merged(
    peft_model, config: QuantConfig, calibration: Iterable[torch.Tensor] | None = None
) -> tuple[MoEForCausalLM, QuantReport]:
    """``peft_model``'s adapter merged into its base and every expert stack quantized, one expert slice at a time:
    the rest merged by PEFT (`moe_core.finetune.export.merged_for_writing`, as the merged exports do), and each
    memory-mapped expert slice plus its slice of the projection's deltas (PEFT's ``get_delta_weight``, made for
    one layer at a time) quantized into a `QuantizedExperts`. Round to nearest gives the codes of `quantize_experts`
    on ``merge_and_unload``'s model (the same delta, added in the weights' dtype as PEFT adds it), without the
    merged experts ever in memory. GPTQ and AWQ calibrate on ``peft_model`` as it trained, before the merge
    (unmerged: the merged model's function up to rounding)."""
    from moe_core.finetune.export import merged_for_writing  # peft: for adapters only
    from moe_core.finetune.methods import unwrap

    inputs = None
    if config.method in ("gptq", "awq"):
        if calibration is None:
            raise QuantizationError(f"method={config.method!r} needs calibration batches (token ids [B, S])")
        inputs = expert_inputs(unwrap(peft_model), calibration)
    merged, deltas = merged_for_writing(peft_model)
    report = quantize_experts(merged, config, inputs=inputs, deltas=deltas)
    return merged, report


def _release_expert(experts: MappedExperts, e: int) -> None:
    """Expert ``e``'s slices of a memory-mapped module out of the resident set, once quantized (read once)."""
    release_pages(w[e] for w in experts.unbound() if w is not None)


def _quantized_slices(experts: StackedExperts, config: QuantConfig, deltas: Mapping) -> QuantizedExperts:
    """``experts`` (dense or memory-mapped) quantized one expert slice at a time, round to nearest, with the deltas
    of projection ``p`` (``deltas[p]()``: `moe_core.mapped.ExpertDeltas`' functions) added to each slice first, in
    the slice's dtype; a memory-mapped slice's pages are released once it is read."""
    quantized = QuantizedExperts.to_fill(experts, config)
    for p, slices in zip(PROJECTIONS, experts.unbound(), strict=True):
        if slices is None:
            continue
        deltas_EOI = deltas[p]() if p in deltas else []
        for e, w_OI in enumerate(slices):
            quantized.quantize_into(p, e, merged_slice(w_OI, deltas_EOI, e))
        del deltas_EOI
        if isinstance(experts, MappedExperts):  # read once: out of the resident set as it goes
            release_pages(slices)
    return quantized.to(next(experts.parameters()).device)


def _streamed_report(model: nn.Module, config: QuantConfig) -> QuantReport:
    """`quantize_experts`' report for a model whose experts were quantized while loading: the full-precision
    model's counts and bytes from its shapes, in the dtype its other weights were read in (built on the meta
    device: no storage)."""
    with torch.device("meta"):
        dense = MoEForCausalLM._from_config(model.config, dtype=model.get_input_embeddings().weight.dtype)
    stacks = [(m.num_experts, [w for w in m.stacks() if w is not None]) for _, m in expert_modules(dense)]
    report = QuantReport(
        config.bits,
        config.method,
        params_total=sum(p.numel() for p in dense.parameters()),
        params_quantized=sum(w.numel() for _, ws in stacks for w in ws),
        bytes_before=_weight_bytes(dense),
        bytes_after=_weight_bytes(model),
        experts_quantized=sum(E for E, _ in stacks),
    )
    check_experts_quantized(model)
    return report
