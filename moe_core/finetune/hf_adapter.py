"""LoRA adapters in a Hugging Face architecture's own module names, both ways (transformers 5, PEFT 0.21).

    from moe_core.finetune.hf_adapter import save_hf_adapter, apply_hf_adapter
    save_hf_adapter(peft_model, "out/adapter")   # our PeftModel of a model converted from HF: HF names
    PeftModel.from_pretrained(OlmoeForCausalLM.from_pretrained(src), "out/adapter")  # stock PEFT, our logits
    peft_model = apply_hf_adapter(from_hf(src), "stock_adapter")   # a stock PEFT adapter of the HF model, on ours

`moe_core.finetune.export.save_adapter` writes this format for every model with ``config.hf_origin``, and
`moe_core.load` reads it (`is_hf_adapter` tells the formats apart). Only the module names and the expert
layout change; r, lora_alpha, use_rslora and so the scaling are the same on both sides, so the logits are too.

Module names (layer i, expert e)::

    ours                                              HF, transformers 5 (what is written)
    model.layers.i.mlp.experts.{gate,up}_proj         model.layers.i.mlp.experts.gate_up_proj [E, 2F, D]
    model.layers.i.mlp.experts.down_proj              model.layers.i.mlp.experts.down_proj [E, D, F]
      stacked [E, O, I] parameters, LoRA through        fused parameters, LoRA through PEFT's ParamWrapper
      PEFT's ParamWrapper (target_parameters)           too (see "transformers 5" below for the fusion)
    model.layers.i.mlp.router.gate                    model.layers.i.mlp.gate (modules_to_save)
    model.layers.i.mlp.router.expert_bias (buffer)    model.layers.i.mlp.gate.e_score_correction_bias, saved
                                                        with the router's copy (DeepSeek-V3, GLM-4.5: the copy
                                                        stock PEFT restores must select as ours does)
    model.layers.i.mlp.shared_expert.*_proj           model.layers.i.mlp.shared_experts.*_proj (DeepSeek, GLM)
    attention (MLA's q_a_proj ... kv_b_proj too), dense FFN, norms, embeddings: the same names on both sides

Adapters in transformers 4's per-expert names (one nn.Linear per expert, ``{moe}.experts.e.{gate,up,down}_proj``,
Mixtral ``block_sparse_moe.experts.e.w1 / w3 / w2``, router ``{moe}.gate``; the hub's adapters trained before
5.x) are read too (`weight_plan`'s names). Expert factors in ParamWrapper's layout (peft 0.21)::

    ours  lora_A [E*R, I]: A_ERI = lora_A.view(E, R, I)          HF 4.x expert e  lora_A [R, I] = A_ERI[e]
          lora_B [O, R*E]: B_ORE = lora_B.view(O, R, E)                           lora_B [O, R] = B_ORE[:, :, e]
          delta_e = scaling * B_ORE[:, :, e] @ A_ERI[e]                           delta = scaling * lora_B @ lora_A

Legend: E = experts, R = LoRA rank r, I = input features, O = output features of a projection, F = an expert's
intermediate size, D = model dim.

Experts whose two factors are both all zero (the experts an expert list or ESFT did not select: `ExpertLoraMask`
keeps them at exactly zero) stay zero in the fused HF factors, and experts an HF adapter does not cover get zero
factors on our side: their delta is zero either way. The task router bias has no HF form and stays a separate
file (`moe_core.task_bias`). What our model cannot represent exactly is refused, with the file and field or key:
DoRA, LoRA or base-layer biases, per-module ranks or alphas (other than the fused gate_up_proj's this module
writes), LoRA on a router's weight, and modules our converted model does not have; ``lora_dropout`` is accepted
(it does nothing at inference).

This module is the one place that knows PEFT's adapter file layout (``base_model.model.<module>.lora_A.weight``;
a module in ``modules_to_save`` as ``base_model.model.<module>.weight``) and ParamWrapper's factor layout; the
nesting of ParamWrappers on the HF side is taken from stock PEFT itself on a meta-device HF model (`hf_layout`).
tests/test_hf_adapter.py holds both against stock PEFT on the HF models, so a PEFT upgrade that changes them fails
there.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora.layer import ParamWrapper
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from moe_core.config import MoEConfig
from moe_core.convert import ARCHITECTURES, HFArchitecture, config_to_hf, get_architecture, weight_plan
from moe_core.errors import MoELabError
from moe_core.finetune.selection_bias import BUFFER as BIAS_BUFFER
from moe_core.finetune.selection_bias import saved_router_biases
from moe_core.task_bias import unwrap
from moe_core.transformers_seam import old_checkpointing_names_quiet

PREFIX = "base_model.model."  # PEFT's prefix of every key in adapter_model.safetensors
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LORA_FACTORS = ("lora_A.weight", "lora_B.weight")
# the selection bias of DeepSeek-V3 / GLM-4.5 routers: ours `mlp.router.expert_bias`, HF's
# `mlp.gate.e_score_correction_bias` (`moe_core.convert.weight_plan`): a buffer beside the router's weight, which PEFT
# saves with a router in modules_to_save (its state_dict), and which moves when the router trains (aux-loss-free)
ROUTER_BIAS_OURS, ROUTER_BIAS_HF = f"router.{BIAS_BUFFER}", "e_score_correction_bias"


class AdapterConversionError(MoELabError):
    """An adapter that cannot be written in, or read from, a Hugging Face architecture's names exactly."""


# ================================================================================================ names
@dataclass(frozen=True)
class NameMap:
    """Module names of our converted model and of the HF architecture it came from (`moe_core.convert`)."""

    arch: HFArchitecture
    modules: dict[str, str]  # our module -> HF module, one to one (router, attention, shared expert, ...)
    experts: dict[str, tuple[str, ...]]  # our stacked expert parameter -> the HF module of each expert
    # DeepSeek-V3 / GLM-4.5: our router module (its buffer ``expert_bias``) -> the HF router module holding that
    # bias as ``e_score_correction_bias`` (the module our router's gate maps to)
    router_biases: dict[str, str] = field(default_factory=dict)

    @property
    def hf_modules(self) -> dict[str, str]:
        """HF module -> our module, for the one-to-one modules."""
        return {hf: ours for ours, hf in self.modules.items()}

    @property
    def hf_experts(self) -> dict[str, tuple[str, int]]:
        """HF per-expert module -> (our stacked parameter, expert index)."""
        return {hf: (stack, e) for stack, names in self.experts.items() for e, hf in enumerate(names)}

    @property
    def hf_router_biases(self) -> dict[str, str]:
        """HF router module -> our router module, for the routers with a selection bias."""
        return {hf: ours for ours, hf in self.router_biases.items()}

    @property
    def hf_only(self) -> set[str]:
        """HF module names our model does not also use: the per-expert modules and the renamed router."""
        return {hf for ours, hf in self.modules.items() if hf != ours} | set(self.hf_experts)


def _module_of(weight_name: str) -> str:
    return weight_name.rsplit(".", 1)[0]  # "model.layers.0.self_attn.q_proj.weight" -> "...q_proj"


def hf_architecture(config: MoEConfig) -> HFArchitecture:
    origin = config.hf_origin or {}
    if not origin.get("model_type"):
        raise AdapterConversionError(
            "the model did not come from a Hugging Face architecture (config.hf_origin is empty), so its "
            "adapter has no HF module names; save it with our names (PeftModel.save_pretrained)"
        )
    return get_architecture(origin["model_type"])


def name_map(config: MoEConfig, arch: HFArchitecture | None = None) -> NameMap:
    """Our module names and the HF ones for ``config`` (default architecture: the one it was converted from)."""
    arch = arch or hf_architecture(config)
    modules: dict[str, str] = {}
    experts: dict[str, tuple[str, ...]] = {}
    router_biases: dict[str, str] = {}
    for ours, theirs in weight_plan(config, arch):
        if ours.endswith(ROUTER_BIAS_OURS):  # a buffer of our router and of HF's router module, not a module
            if arch.router_bias == "stored":  # (DeepSeek-V2's router has none)
                router_biases[_module_of(ours)] = _module_of(theirs[0])
        elif len(theirs) == 1:
            modules[_module_of(ours)] = _module_of(theirs[0])
        else:  # a stacked expert parameter is named without ".weight": it is the parameter, not a module
            experts[ours] = tuple(_module_of(name) for name in theirs)
    if config.tie_word_embeddings:  # lm_head is no weight of its own, but a module PEFT can target
        modules["lm_head"] = "lm_head"
    return NameMap(arch, modules, experts, router_biases)


def split_key(key: str) -> tuple[str, str]:
    """``(module, rest)`` of a key of adapter_model.safetensors: ``rest`` is ``lora_A.weight`` and the like for
    LoRA factors, the module's own parameter name (``weight``) for a module in modules_to_save."""
    body = key.removeprefix(PREFIX)
    if ".lora_" in body:
        module, rest = body.split(".lora_", 1)
        return module, "lora_" + rest
    module, _, rest = body.rpartition(".")
    return module, rest


def target_regex(targets: set[str], candidates: Iterable[str]) -> str | list[str]:
    """A ``target_modules`` regex for PEFT that matches exactly ``targets`` among ``candidates`` (every module
    name of the HF model), grouped by layer and expert so that it stays short at 64 experts x 48 layers; the
    explicit list when the regex would match anything else (it never should)."""

    def alternatives(items: Iterable[str]) -> str:
        items = list(items)
        return items[0] if len(items) == 1 else "(?:" + "|".join(items) + ")"

    per_layer: dict[int, set[str]] = defaultdict(set)
    other: list[str] = []
    for name in targets:
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match:
            per_layer[int(match.group(1))].add(match.group(2))
        else:
            other.append(re.escape(name))
    layers_of: dict[str, list[int]] = defaultdict(list)
    for layer, rests in sorted(per_layer.items()):
        experts: dict[tuple[str, int], set[str]] = defaultdict(set)
        literals = []
        for rest in rests:
            match = re.fullmatch(r"(.+\.experts)\.(\d+)\.([^.]+)", rest)
            if match:
                experts[(match.group(1), int(match.group(2)))].add(match.group(3))
            else:
                literals.append(re.escape(rest))
        groups: dict[tuple[str, tuple[str, ...]], list[int]] = defaultdict(list)
        for (prefix, e), projs in sorted(experts.items()):
            groups[(prefix, tuple(sorted(projs)))].append(e)
        parts = sorted(literals) + [
            rf"{re.escape(prefix)}\.{alternatives(map(str, ids))}\.{alternatives(map(re.escape, projs))}"
            for (prefix, projs), ids in groups.items()
        ]
        layers_of[alternatives(parts)].append(layer)
    patterns = [
        rf"model\.layers\.{alternatives(map(str, layers))}\.{rest}" for rest, layers in layers_of.items()
    ] + sorted(other)
    regex = "|".join(f"(?:{p})" for p in patterns)
    if {name for name in candidates if re.fullmatch(regex, name)} != set(targets):
        return sorted(targets)
    return regex


# ================================================================================================ refusals
def _fused_patterns_ok(raw: dict[str, Any]) -> bool:
    """Whether rank_pattern / alpha_pattern say only what `fused_lora_config` writes: the fused gate_up_proj at
    twice the rank, its alpha scaled to keep the LoRA scaling."""
    r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    rank, alphas = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
    want_alpha = alpha * (math.sqrt(2) if raw.get("use_rslora") else 2)
    return (
        set(rank) == set(alphas) == {GATE_UP_PATTERN}
        and rank[GATE_UP_PATTERN] == 2 * r
        and math.isclose(alphas[GATE_UP_PATTERN], want_alpha, rel_tol=1e-9)
    )


def _refusals(raw: dict[str, Any]) -> list[str]:
    """What an adapter config asks for that the other side cannot represent exactly (empty when nothing)."""
    reasons = []
    if raw.get("peft_type", "LORA") != "LORA":
        reasons.append(f"peft_type={raw.get('peft_type')!r}: only LoRA adapters convert")
    if raw.get("use_dora"):
        reasons.append(
            "use_dora=true: DoRA has no form on our stacked experts (PEFT's ParamWrapper refuses it)"
        )
    if raw.get("bias", "none") != "none":
        reasons.append(f"bias={raw.get('bias')!r}: trained base-layer biases are not converted; only 'none'")
    if raw.get("lora_bias"):
        reasons.append("lora_bias=true: a bias on lora_B has no form on our stacked experts")
    if (raw.get("rank_pattern") or raw.get("alpha_pattern")) and not _fused_patterns_ok(raw):
        for field in ("rank_pattern", "alpha_pattern"):
            if raw.get(field):
                reasons.append(
                    f"{field}={raw[field]!r}: per-module ranks or alphas are not converted (only the fused "
                    f"gate_up_proj at 2r that this module writes)"
                )

    for field in ("layer_replication", "trainable_token_indices"):
        if raw.get(field):
            reasons.append(f"{field}={raw[field]!r}: not convertible")
    if raw.get("fan_in_fan_out"):
        reasons.append("fan_in_fan_out=true: the HF MoE models have no Conv1D layers")
    return reasons


# ================================================================================================ transformers 5
# transformers 5 holds an MoE layer's experts as two fused parameters, ``model.layers.i.mlp.experts.gate_up_proj``
# [E, 2F, D] (gate rows, then up) and ``...down_proj`` [E, D, F], and calls every router ``mlp.gate`` (Mixtral's
# block_sparse_moe is gone); stock PEFT adapts them with ParamWrapper (target_parameters), in the same factor layout
# as ours. Our gate_proj and up_proj LoRA (rank r each) is exactly one rank-2r LoRA of gate_up_proj: A = [A_gate;
# A_up], B = [[B_gate, 0], [0, B_up]], alpha doubled (rsLoRA: times sqrt 2) so the scaling stays; one of them alone
# is rank r with the other's rows of B zero. Read back, a rank-R LoRA of gate_up_proj is gate_proj (A, B[:F]) and
# up_proj (A, B[F:]) at rank R, or at rank R/2 when B is that block diagonal.
FUSED_PARAMS = ("gate_up_proj", "down_proj")
GATE_UP_PATTERN = r".*\.gate_up_proj"  # rank_pattern / alpha_pattern key of the fused projection
# PEFT 0.21.2 warns that "rank_pattern keys did not match any targeted module and were ignored" for this key,
# though it applies it (``BaseTuner.inject_adapter`` in peft/tuners/tuners_utils.py compares the patterns with
# target_modules' matches only, not target_parameters'; the fused lora_A has E * 2r rows all the same). Silenced in
# our own PEFT calls (`fused_rank_pattern_quiet`); a stock load prints it, README says it is false, and
# tests/test_hf_adapter.py fails when PEFT stops printing it
FALSE_PATTERN_WARNING = (
    r"The following (rank|alpha)_pattern keys did not match any targeted module and were ignored: "
    + re.escape(repr([GATE_UP_PATTERN]))
)


@contextlib.contextmanager
def fused_rank_pattern_quiet():
    """PEFT's false warning that the fused gate_up_proj's rank and alpha patterns were ignored (above), only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FALSE_PATTERN_WARNING, category=RuntimeWarning)
        yield


# stock PEFT 0.21 on transformers 5 (peft/utils/transformers_weight_conversion.py, ``_convert_peft_config_moe``)
# rewrites every target_modules entry whose last name is an expert projection's or a router's of transformers 4
# (``gate_proj``, ``up_proj``, ``down_proj``, ``gate``; Mixtral's ``w1`` / ``w2`` / ``w3``) into the fused experts'
# target_parameters, for the MoE model types it converts (OLMoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5, Mixtral): a
# dense layer's or a shared expert's FFN named there would silently become LoRA on every layer's experts. Those
# Linears are written as target_parameters ``<module>.weight`` instead: PEFT's ParamWrapper on a Linear's weight has
# LoRA's keys, shapes and delta (held equal to a LoRA Linear's in tests/test_hf_adapter_deepseek.py)
STOCK_PEFT_RENAMED_LEAVES = ("gate_proj", "up_proj", "down_proj", "gate", "w1", "w2", "w3")


def renamed_by_stock_peft(hf_module: str) -> bool:
    """Whether stock PEFT would read a target_modules entry ``hf_module`` as the fused experts (see above)."""
    return hf_module.rsplit(".", 1)[-1] in STOCK_PEFT_RENAMED_LEAVES


def v5_module(hf_module: str, arch: HFArchitecture) -> str:
    """An HF module's name in transformers 5 from its checkpoint (4.x) name: Mixtral's MoE block is ``mlp``."""
    return hf_module.replace(f".{arch.moe_module}.", ".mlp.")


def gate_up_rows(F: int, interleaved: bool) -> tuple[slice, slice]:
    """The gate and up rows of a fused gate_up_proj's output features: halves (gate first, as transformers 5's
    OlmoeExperts / MixtralExperts chunk them) or interleaved (gpt-oss's GptOssExperts: gate at even features, up
    at odd, ``gate_up[..., ::2]`` / ``[..., 1::2]``; its [E, D, 2F] parameter is transposed against nn.Linear,
    which PEFT's ParamWrapper reads from the experts' ``is_transposed``, so the factors keep our shapes)."""
    if interleaved:
        return slice(0, 2 * F, 2), slice(1, 2 * F, 2)
    return slice(0, F), slice(F, 2 * F)


def fuse_expert_factors(
    projs: dict[str, tuple[torch.Tensor, torch.Tensor]], r: int, interleaved: bool = False
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One layer's LoRA factors of our gate_proj / up_proj / down_proj stacks (``(A_ERI, B_ORE)`` each, those
    present) as transformers 5's ``gate_up_proj`` / ``down_proj`` factors (module comment above): rank 2r, A the
    two A's stacked, B block-diagonal with its rows in the fused parameter's order (`gate_up_rows`)."""
    out = {}
    if "down_proj" in projs:
        out["down_proj"] = projs["down_proj"]
    halves = [projs.get("gate_proj"), projs.get("up_proj")]
    present = [h for h in halves if h is not None]
    if present:
        A_ERI = torch.cat([A for A, _ in present], dim=1)
        F, E = present[0][1].shape[0], A_ERI.shape[0]
        B_ORE = torch.zeros(2 * F, A_ERI.shape[1], E, dtype=A_ERI.dtype)
        column = 0
        for rows, pair in zip(gate_up_rows(F, interleaved), halves):
            if pair is not None:
                B_ORE[rows, column : column + r] = pair[1]
                column += r
        out["gate_up_proj"] = (A_ERI, B_ORE)
    return out


def split_gate_up(
    A_ERI: torch.Tensor, B_ORE: torch.Tensor, r: int, interleaved: bool = False
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A transformers 5 gate_up_proj LoRA as our gate_proj and up_proj factors, exactly (module comment); rank
    r when it is rank 2r in the block form `fuse_expert_factors` writes, else its own rank."""
    F, R = B_ORE.shape[0] // 2, A_ERI.shape[1]
    gate, up = gate_up_rows(F, interleaved)
    B_gate, B_up = B_ORE[gate], B_ORE[up]
    if R == 2 * r and not B_gate[:, r:].any() and not B_up[:, :r].any():
        return {"gate_proj": (A_ERI[:, :r], B_gate[:, :r]), "up_proj": (A_ERI[:, r:], B_up[:, r:])}
    return {"gate_proj": (A_ERI, B_gate), "up_proj": (A_ERI, B_up)}


def hf_layout(config: MoEConfig, arch: HFArchitecture, lora_config: LoraConfig):
    """Stock PEFT's own layout of ``lora_config`` on the transformers 5 model of ``config`` (built on the meta
    device: no memory): ``({ParamWrapper key prefix: the parameter it adapts}, {adapter key: shape})``."""
    probe = copy.deepcopy(lora_config)
    # a from-config model has no name: PEFT would warn that it "renamed" the base (only in this probe's copy)
    probe.base_model_name_or_path = None
    with torch.device("meta"), old_checkpointing_names_quiet(), fused_rank_pattern_quiet():
        hf_model = AutoModelForCausalLM.from_config(config_to_hf(config, arch))
        peft_model = get_peft_model(hf_model, probe)
    wrappers = {name: _stack_name(name, wrapper) for name, wrapper in _param_wrappers(peft_model).items()}
    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    return wrappers, {key: tuple(t.shape) for key, t in state.items()}


def _check_layout(tensors: dict[str, torch.Tensor], expected: dict[str, tuple], target: str) -> None:
    unplaced = sorted(set(tensors) ^ set(expected))
    wrong = [k for k in tensors if k in expected and tuple(tensors[k].shape) != expected[k]]
    if unplaced or wrong:
        raise AdapterConversionError(
            f"internal: the converted adapter does not fit stock PEFT's layout on {target} (keys "
            f"{unplaced[:3]}, shapes {wrong[:3]}); moe_core/finetune/hf_adapter.py needs updating"
        )


# ================================================================================================ ours -> HF
def _stack_name(wrapper_name: str, wrapper: ParamWrapper) -> str:
    """Our stacked parameter adapted by a (possibly nested) ParamWrapper, e.g. ``model.layers.0.mlp.experts.up_proj``."""
    module = wrapper_name.removeprefix(PREFIX).replace(".base_layer", "")
    return f"{module}.{wrapper.parameter_name}"


def _param_wrappers(model) -> dict[str, ParamWrapper]:
    """Every ParamWrapper of a PEFT model (nested ones included) by module name (the key prefix of its factors)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, ParamWrapper)}


def _router_bias_tensors(peft_model, names: NameMap) -> dict[str, torch.Tensor]:
    """The selection bias of each router whose trained copy the adapter saves (`selection_bias.saved_router_biases`),
    as the HF router module's ``e_score_correction_bias``: stock PEFT builds a saved module from the adapter's copy,
    so the copy must carry the bias our router selects with now (moved by aux-loss-free balancing while the router
    trained, `MoEStepCallback`), not the base checkpoint's. A router with no bias on the HF side (DeepSeek-V2) is
    refused unless ours is still zero."""
    out: dict[str, torch.Tensor] = {}
    for key, bias in saved_router_biases(peft_model).items():
        ours = key.removeprefix(PREFIX).removesuffix(f".{BIAS_BUFFER}")
        hf = names.router_biases.get(ours)
        if hf is not None:
            out[f"{PREFIX}{v5_module(hf, names.arch)}.{ROUTER_BIAS_HF}"] = bias
        elif bool(bias.any()):
            raise AdapterConversionError(
                f"the router {ours} has a nonzero selection bias (expert_bias), which "
                f"{names.arch.class_name}'s router has no place for; write this model as deepseek_v3, or keep "
                "router_bias_update_rate at 0 when training its router"
            )
    return out


def hf_adapter_state(peft_model, adapter_name: str = "default") -> tuple[dict[str, torch.Tensor], LoraConfig]:
    """The tensors of adapter_model.safetensors and the LoraConfig, in the HF architecture's names, for our
    PeftModel of a model converted from Hugging Face (``config.hf_origin``)."""
    base = unwrap(peft_model)
    names = name_map(base.config)
    config = peft_model.peft_config[adapter_name]
    reasons = _refusals(config.to_dict())
    if reasons:
        raise AdapterConversionError(
            "this adapter cannot be written in HF module names:\n  - " + "\n  - ".join(reasons)
        )
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name, save_embedding_layers=False)
    stack_of = {
        f"{name}.{factor}": (_stack_name(name, wrapper), factor)
        for name, wrapper in _param_wrappers(peft_model).items()
        for factor in LORA_FACTORS
    }
    tensors: dict[str, torch.Tensor] = {}
    factors: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    lora_targets: set[str] = set()
    saved_modules: set[str] = set()
    for key, tensor in state.items():
        if key in stack_of:
            stack, factor = stack_of[key]
            factors[stack][factor] = tensor
            continue
        module, rest = split_key(key)
        if module not in names.modules:
            raise AdapterConversionError(
                f"internal: adapter key {key} names module {module}, which moe_core.convert.weight_plan does "
                f"not map to {names.arch.class_name}; moe_core/finetune/hf_adapter.py needs updating"
            )
        hf = names.modules[module]
        tensors[f"{PREFIX}{v5_module(hf, names.arch)}.{rest}"] = tensor.detach().clone()
        (lora_targets if rest.startswith("lora_") else saved_modules).add(hf)
    tensors.update(_router_bias_tensors(peft_model, names))
    experts: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)
    for stack, pair in factors.items():  # ParamWrapper's layout, per our stacked [E, O, I] parameter
        E = len(names.experts[stack])
        A, B = pair["lora_A.weight"].detach(), pair["lora_B.weight"].detach()
        prefix, proj = stack.rsplit(".", 1)  # "model.layers.i.mlp.experts", "gate_proj"
        experts[prefix][proj] = (A.view(E, -1, A.shape[-1]), B.view(B.shape[0], -1, E))
    interleaved = names.arch.model_type == "gpt_oss"
    fused = {name: fuse_expert_factors(projs, config.r, interleaved) for name, projs in experts.items()}
    hf_params = {
        f"{prefix}.{param}": pair for prefix, params in fused.items() for param, pair in params.items()
    }
    gate_up_ranks = {A.shape[1] for name, (A, _) in hf_params.items() if name.endswith(".gate_up_proj")}
    hf_targets = [v5_module(hf, names.arch) for hf in lora_targets]
    if not lora_targets and not any(A.any() for A, _ in hf_params.values()):
        raise AdapterConversionError("the adapter has no non-zero LoRA factors to save")
    hf_config = LoraConfig(
        r=config.r,
        lora_alpha=config.lora_alpha,
        use_rslora=config.use_rslora,
        lora_dropout=config.lora_dropout,
        bias="none",
        # a list, not a regex: PEFT 0.21 resolves a regex to leaf names on Mixtral and OLMoE (its transformers 4
        # -> 5 adapter conversion), which would widen it to every layer
        target_modules=sorted(m for m in hf_targets if not renamed_by_stock_peft(m)) or None,
        # (FFN Linears stock PEFT would take for the experts: their weights, `renamed_by_stock_peft`)
        target_parameters=sorted(hf_params)
        + sorted(f"{m}.weight" for m in hf_targets if renamed_by_stock_peft(m))
        or None,
        modules_to_save=sorted(v5_module(hf, names.arch) for hf in saved_modules) or None,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base.name_or_path or config.base_model_name_or_path,
        inference_mode=True,
    )
    if gate_up_ranks - {config.r}:
        if len(gate_up_ranks) != 1 or gate_up_ranks != {2 * config.r}:
            raise AdapterConversionError(
                f"LoRA on gate_proj in some layers and on up_proj in others (fused ranks {sorted(gate_up_ranks)})"
                ": transformers 5 fuses them, and one rank_pattern cannot say that; target both or neither"
            )
        scale = math.sqrt(2) if config.use_rslora else 2  # alpha / r (or / sqrt(r)) unchanged at rank 2r
        hf_config.rank_pattern = {GATE_UP_PATTERN: 2 * config.r}
        hf_config.alpha_pattern = {GATE_UP_PATTERN: config.lora_alpha * scale}
    wrappers, expected = hf_layout(base.config, names.arch, hf_config)
    for wrapper, param in wrappers.items():
        if param not in hf_params:  # an FFN Linear's weight (`renamed_by_stock_peft`): its factors are placed
            continue
        A_ERI, B_ORE = hf_params[param]
        E, R, I = A_ERI.shape
        tensors[f"{wrapper}.lora_A.weight"] = A_ERI.reshape(E * R, I).contiguous()
        tensors[f"{wrapper}.lora_B.weight"] = B_ORE.reshape(B_ORE.shape[0], R * E).contiguous()
    _check_layout(tensors, expected, f"{names.arch.class_name} (transformers 5)")
    return tensors, hf_config


def save_hf_adapter(peft_model, out_dir: str | Path, adapter_name: str = "default") -> Path:
    """Write adapter_config.json and adapter_model.safetensors in the HF architecture's names into ``out_dir``
    (created when missing; `moe_core.finetune.export.save_adapter` writes it staged, with the tokenizer), loadable
    by stock ``PeftModel.from_pretrained`` onto the HF model (`hf_adapter_state`)."""
    tensors, hf_config = hf_adapter_state(peft_model, adapter_name)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    hf_config.save_pretrained(str(out_dir))
    return out_dir


# ================================================================================================ HF -> ours
def read_adapter_config(directory: Path) -> dict[str, Any]:
    file = directory / CONFIG_FILE
    try:
        return json.loads(file.read_text())
    except ValueError as err:
        raise AdapterConversionError(f"{file}: not valid JSON ({err})") from None


def _saved_modules(directory: Path) -> list[str]:
    with safe_open(str(directory / WEIGHTS_FILE), "pt") as f:
        return [split_key(key)[0] for key in f.keys()]


# a module only an HF architecture has: one expert's projection, or the router under the MoE block's name
_HF_ONLY_MODULE = re.compile(
    "|".join(
        rf"\.{re.escape(arch.moe_module)}\.(?:experts\.\d+\.[^.]+|gate)$" for arch in ARCHITECTURES.values()
    )
)


def hf_named_key(directory: str | Path) -> str | None:
    """The first key of the adapter in ``directory`` that names a module only a HF architecture has (a
    per-expert projection, or ``mlp.gate`` / ``block_sparse_moe.gate``); None when there is none. Needs no
    base model, so what cannot convert is refused before one loads (`check_convertible`)."""
    fused = any(
        t.endswith("gate_up_proj")
        for t in read_adapter_config(Path(directory)).get("target_parameters") or []
    )
    with safe_open(str(Path(directory) / WEIGHTS_FILE), "pt") as f:
        return next(
            (
                key
                for key in sorted(f.keys())
                if _HF_ONLY_MODULE.search(split_key(key)[0]) or (fused and ".mlp.experts." in key)
            ),
            None,
        )


def check_convertible(directory: str | Path) -> None:
    """Refuse, from adapter_config.json alone, an adapter in HF names that asks for what our model cannot
    represent (DoRA, biases, ...): one error, before the base model loads."""
    directory = Path(directory)
    raw = read_adapter_config(directory)
    if raw.get("target_parameters") and not is_v5_hf_adapter(directory, raw):
        return
    reasons = _refusals(raw)
    if reasons and hf_named_key(directory) is not None:
        raise AdapterConversionError(
            f"{directory / CONFIG_FILE}: cannot apply this adapter to our model exactly:\n  - "
            + "\n  - ".join(reasons)
        )


def is_v5_hf_adapter(directory: Path, raw: dict[str, Any]) -> bool:
    """Whether an adapter with ``target_parameters`` is in transformers 5's HF names (the fused gate_up_proj, or
    the router as ``mlp.gate``) rather than ours (``gate_proj`` / ``up_proj`` / ``down_proj`` stacks and
    ``mlp.router.gate``). An adapter of down_proj alone reads the same either way."""
    return (
        any(t.endswith("gate_up_proj") for t in raw["target_parameters"])
        or hf_named_key(directory) is not None
    )


def is_hf_adapter(directory: str | Path, config: MoEConfig) -> bool:
    """Whether the adapter in ``directory`` names the HF architecture's modules (ours written by
    `save_hf_adapter`, or one stock PEFT trained on the HF model) rather than ours. Attention-only adapters read
    the same either way; an adapter with ``target_parameters`` is ours."""
    directory = Path(directory)
    raw = read_adapter_config(directory)
    if not config.hf_origin:
        return False
    if raw.get("target_parameters"):
        return is_v5_hf_adapter(directory, raw)
    hf_only = name_map(config).hf_only
    return any(module in hf_only for module in _saved_modules(directory))


def _router_bias_of(key: str, names: NameMap) -> str | None:
    """Our router module when ``key`` is a saved HF router's selection bias (``mlp.gate.e_score_correction_bias``:
    stock PEFT saves it with a router in modules_to_save), else None."""
    module, rest = split_key(key)
    if not key.startswith(PREFIX) or rest != ROUTER_BIAS_HF:
        return None
    return {v5_module(hf, names.arch): ours for hf, ours in names.hf_router_biases.items()}.get(module)


def stack_shapes(model) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter, and of every expert stack held in another form (`QuantizedExperts`' codes,
    `MappedExperts`' per-expert tensors: ``stack_shape``) as the dense ``[E, O, I]`` stack it stands for."""
    unwrapped = lambda name: name.replace(".base_layer", "")  # noqa: E731  (under PEFT's wrappers too)
    shapes = {unwrapped(name): tuple(p.shape) for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if hasattr(module, "stack_shape") and hasattr(module, "projections"):
            shapes.update(
                {unwrapped(f"{name}.{proj}"): module.stack_shape(proj) for proj in module.projections}
            )
    return shapes


def _read_v5(
    model, directory, names, r, tensors, source_of, expert_factors, lora_targets, saved_modules, router_biases
):
    """Fill `apply_hf_adapter`'s tables from an adapter in transformers 5's names: the fused experts' factors
    split per expert into our gate_proj / up_proj / down_proj stacks (`split_gate_up`; experts whose factors
    are zero left out, as a 4.x adapter leaves them out), the routers' selection biases by our router module,
    the other modules renamed."""
    weights_file = directory / WEIGHTS_FILE
    wrappers, _ = hf_layout(model.config, names.arch, LoraConfig.from_pretrained(str(directory)))
    # the fused experts; a Linear's weight in target_parameters (`renamed_by_stock_peft`) is read as its module's LoRA
    wrappers = {w: param for w, param in wrappers.items() if param.endswith(FUSED_PARAMS)}
    wrapper_factor = {
        f"{w}.{factor}": (param, factor) for w, param in wrappers.items() for factor in LORA_FACTORS
    }
    modules = {v5_module(hf, names.arch): ours for hf, ours in names.hf_modules.items()}
    fused: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    with safe_open(str(weights_file), "pt") as f:
        for key in f.keys():
            if key in wrapper_factor:
                param, factor = wrapper_factor[key]
                fused[param][factor] = f.get_tensor(key)
                continue
            if _router_bias_of(key, names) is not None:
                router_biases[_router_bias_of(key, names)] = (f.get_tensor(key), key)
                continue
            module, rest = split_key(key)
            if not key.startswith(PREFIX) or module not in modules:
                raise AdapterConversionError(
                    f"{weights_file}: key {key} names module {module}, which {names.arch.class_name} (transformers "
                    "5) as converted for this base model does not have; is this the adapter of this base model?"
                )
            ours = modules[module]
            our_key = f"{PREFIX}{ours}.{rest}"
            tensors[our_key], source_of[our_key] = f.get_tensor(key), key
            (lora_targets if rest.startswith("lora_") else saved_modules).add(ours)
    stacks = stack_shapes(model)
    for param, pair in fused.items():
        if set(pair) != set(LORA_FACTORS):
            raise AdapterConversionError(
                f"{weights_file}: {param} has {sorted(pair)} but not both LoRA factors"
            )
        prefix, kind = param.rsplit(".", 1)
        E = stacks[f"{prefix}.down_proj"][0]
        A, B = pair["lora_A.weight"], pair["lora_B.weight"]
        A_ERI, B_ORE = A.view(E, -1, A.shape[-1]), B.view(B.shape[0], -1, E)
        interleaved = names.arch.model_type == "gpt_oss"
        projs = (
            split_gate_up(A_ERI, B_ORE, r, interleaved) if kind == "gate_up_proj" else {kind: (A_ERI, B_ORE)}
        )
        for proj, (A_ERI, B_ORE) in projs.items():
            rows, cols = stacks[f"{prefix}.{proj}"][1:]  # our stack is [E, O, I]
            if (B_ORE.shape[0], A_ERI.shape[2]) != (rows, cols):
                key = next(k for k, (p, _) in wrapper_factor.items() if p == param)
                raise AdapterConversionError(
                    f"{weights_file}: key {key}: its {proj} part is [{B_ORE.shape[0]}, {A_ERI.shape[2]}] (out, in); "
                    f"the base model's experts need [{rows}, {cols}]: is this the adapter of this base model? (shape)"
                )
            for e in range(E):
                if A_ERI[e].any() or B_ORE[:, :, e].any():
                    expert_factors[f"{prefix}.{proj}"][e] = {"A": A_ERI[e], "B": B_ORE[:, :, e]}


def apply_hf_adapter(model, directory: str | Path, adapter_name: str = "default", *, into=None):
    """Our PeftModel: ``model`` (our `MoEForCausalLM` converted from the HF architecture) with the HF-named LoRA
    adapter in ``directory`` applied exactly (per-expert factors stacked into ParamWrapper's layout, zeros for
    experts it does not cover). Refuses, naming the file and field or key, what our model cannot represent.
    ``into``: a PeftModel of ``model`` already holding the adapter's wrappers (a QLoRA model rebuilt the way it
    trained, `moe_core.finetune.qlora`): the factors are placed there, and its keys must be the file's."""
    directory = Path(directory)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    raw = read_adapter_config(directory)
    reasons = _refusals(raw)
    v5 = bool(raw.get("target_parameters")) and is_v5_hf_adapter(directory, raw)
    if raw.get("target_parameters") and not v5:
        reasons.append("target_parameters is set: this adapter is in our names, not the HF architecture's")
    for target in raw.get("target_parameters") or [] if v5 else []:
        linear = target.endswith(".weight") and not target.endswith((".gate.weight", ".router.weight"))
        if not (target.endswith(FUSED_PARAMS) or linear):
            reasons.append(
                f"target_parameters has {target!r}: only the experts' {' and '.join(FUSED_PARAMS)} and the "
                "weights of Linear modules convert (a router converts as modules_to_save)"
            )
    if reasons:
        raise AdapterConversionError(
            f"{config_file}: cannot apply this adapter to our model exactly:\n  - " + "\n  - ".join(reasons)
        )
    names = name_map(model.config)
    hf_modules, hf_experts = names.hf_modules, names.hf_experts
    stacks = stack_shapes(model)
    r = int(raw.get("r", 8))  # LoraConfig's default

    tensors: dict[str, torch.Tensor] = {}  # our keys, as get_peft_model_state_dict names them
    source_of: dict[str, str] = {}  # our key -> the file's key, for error messages
    expert_factors: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    lora_targets: set[str] = set()
    saved_modules: set[str] = set()
    router_biases: dict[
        str, tuple[torch.Tensor, str]
    ] = {}  # our router -> (its selection bias, the file's key)
    if v5:
        _read_v5(
            model,
            directory,
            names,
            r,
            tensors,
            source_of,
            expert_factors,
            lora_targets,
            saved_modules,
            router_biases,
        )
    with safe_open(str(weights_file), "pt") as f:
        for key in f.keys() if not v5 else ():
            if _router_bias_of(key, names) is not None:
                router_biases[_router_bias_of(key, names)] = (f.get_tensor(key), key)
                continue
            module, rest = split_key(key)
            if not key.startswith(PREFIX) or (module not in hf_modules and module not in hf_experts):
                raise AdapterConversionError(
                    f"{weights_file}: key {key} names module {module}, which {names.arch.class_name} as converted "
                    f"for this base model does not have; is this the adapter of this base model?"
                )
            if module in hf_experts:
                if rest not in LORA_FACTORS:
                    raise AdapterConversionError(
                        f"{weights_file}: key {key}: only the LoRA factors (lora_A / lora_B weights) of an expert "
                        f"convert; a trained copy of one expert (modules_to_save) or a bias has no form on our "
                        f"stacked experts"
                    )
                stack, e = hf_experts[module]
                tensor = f.get_tensor(key)
                A_or_B = "A" if rest == "lora_A.weight" else "B"
                rows, cols = stacks[stack][1:]  # our stack is [E, O, I]
                expected = (r, cols) if A_or_B == "A" else (rows, r)
                if tuple(tensor.shape) != expected:
                    raise AdapterConversionError(
                        f"{weights_file}: key {key} has shape {tuple(tensor.shape)}; r={r} in {CONFIG_FILE} "
                        f"and the base model's expert imply {expected}"
                    )
                expert_factors[stack][e][A_or_B] = tensor
                continue
            ours = hf_modules[module]
            our_key = f"{PREFIX}{ours}.{rest}"
            tensors[our_key], source_of[our_key] = f.get_tensor(key), key
            (lora_targets if rest.startswith("lora_") else saved_modules).add(ours)
    for stack, per_expert in expert_factors.items():
        for e, pair in per_expert.items():
            if set(pair) != {"A", "B"}:
                raise AdapterConversionError(
                    f"{weights_file}: {names.experts[stack][e]} has lora_{next(iter(pair))} but not its other factor"
                )
    if not lora_targets and not expert_factors:
        raise AdapterConversionError(f"{weights_file}: no LoRA factors in the adapter")
    for router, (bias, key) in router_biases.items():
        if tuple(bias.shape) != tuple(model.get_submodule(router).expert_bias.shape):
            raise AdapterConversionError(
                f"{weights_file}: key {key} has shape {tuple(bias.shape)}, the base model's router "
                f"{router} has {model.get_submodule(router).expert_bias.numel()} experts; is this the adapter of "
                "this base model?"
            )

    lora_config = LoraConfig(
        r=r,
        lora_alpha=raw.get("lora_alpha", 8),
        use_rslora=bool(raw.get("use_rslora", False)),
        lora_dropout=0.0,  # dropout does nothing at inference, and ParamWrapper refuses it
        bias="none",
        target_modules=sorted(lora_targets),
        target_parameters=sorted(expert_factors) or None,
        modules_to_save=sorted(saved_modules) or None,
        base_model_name_or_path=raw.get("base_model_name_or_path"),
    )
    if into is None:
        with old_checkpointing_names_quiet():
            into = get_peft_model(model, lora_config, adapter_name=adapter_name)
    peft_model = into
    for name, wrapper in _param_wrappers(peft_model).items():
        stack = _stack_name(name, wrapper)
        if stack not in expert_factors:
            continue
        E, O, I = stacks[stack]
        A_ERI = torch.zeros(E, r, I, dtype=torch.float32)
        B_ORE = torch.zeros(O, r, E, dtype=torch.float32)
        for e, pair in expert_factors[stack].items():
            A_ERI[e] = pair["A"]
            B_ORE[:, :, e] = pair["B"]
        tensors[f"{name}.lora_A.weight"] = A_ERI.reshape(E * r, I)
        tensors[f"{name}.lora_B.weight"] = B_ORE.reshape(O, r * E)
        for factor in LORA_FACTORS:
            source_of[f"{name}.{factor}"] = f"(the experts of {stack})"
    expected = get_peft_model_state_dict(peft_model, adapter_name=adapter_name, save_embedding_layers=False)
    unplaced = sorted(set(tensors) - set(expected)) + sorted(set(expected) - set(tensors))
    if unplaced:
        raise AdapterConversionError(
            f"internal: converting {weights_file} left {unplaced[:3]} without a place in our PeftModel; "
            "moe_core/finetune/hf_adapter.py needs updating"
        )
    for key, tensor in tensors.items():
        if tensor.shape != expected[key].shape:
            raise AdapterConversionError(
                f"{weights_file}: key {source_of[key]} has shape {tuple(tensor.shape)}, the base model's module "
                f"needs {tuple(expected[key].shape)}; is this the adapter of this base model?"
            )
    set_peft_model_state_dict(peft_model, tensors, adapter_name=adapter_name)
    # a saved router's selection bias: a buffer of our base router (the trained router's copy that PEFT wraps is
    # its gate alone), written there as fine-tuning moves it there (`MoEStepCallback`)
    with torch.no_grad():
        for router, (bias, _) in router_biases.items():
            model.get_submodule(router).expert_bias.copy_(bias)
    return peft_model
