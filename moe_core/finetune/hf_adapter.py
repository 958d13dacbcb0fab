"""LoRA adapters in a Hugging Face architecture's own module names, both ways, for transformers 4.57 + PEFT.

    from moe_core.finetune.hf_adapter import save_hf_adapter, apply_hf_adapter
    save_hf_adapter(peft_model, "out/adapter")   # our PeftModel of a model converted from HF: HF names
    PeftModel.from_pretrained(OlmoeForCausalLM.from_pretrained(src), "out/adapter")  # stock PEFT, our logits
    peft_model = apply_hf_adapter(from_hf(src), "stock_adapter")   # a stock PEFT adapter of the HF model, on ours

`moe_core.finetune.export.save_adapter` writes this format for every model with ``config.hf_origin``, and
`moe_core.load` reads it (`is_hf_adapter` tells the two formats apart). Only the module names and the expert
layout change; r, lora_alpha, use_rslora and so the scaling are the same on both sides, so the logits are too.

Module names (`moe_core.convert.weight_plan` is the one name table; layer i, expert e)::

    ours                                              HF (transformers 4.57: one nn.Linear per expert)
    model.layers.i.mlp.experts.{gate,up,down}_proj    model.layers.i.{moe}.experts.e.{gate,up,down}_proj
      a stacked [E, O, I] parameter, LoRA through       (Mixtral: block_sparse_moe.experts.e.w1 / w3 / w2),
      PEFT's ParamWrapper (target_parameters)           one lora.Linear each
    model.layers.i.mlp.router.gate                    model.layers.i.{moe}.gate (modules_to_save, or LoRA)
    attention, shared expert, dense FFN, norms, embeddings: the same names on both sides

Expert factors (`peft.tuners.lora.layer.ParamWrapper.get_delta_weight`, peft 0.21)::

    ours  lora_A [E*R, I]: A_ERI = lora_A.view(E, R, I)          HF expert e  lora_A [R, I] = A_ERI[e]
          lora_B [O, R*E]: B_ORE = lora_B.view(O, R, E)                       lora_B [O, R] = B_ORE[:, :, e]
          delta_e = scaling * B_ORE[:, :, e] @ A_ERI[e]                       delta = scaling * lora_B @ lora_A

Legend: E = experts, R = LoRA rank r, I = input features, O = output features of a projection.

Experts whose two factors are both all zero (the experts an expert list or ESFT did not select: `ExpertLoraMask`
keeps them at exactly zero) are left out of the HF adapter, and experts an HF adapter does not cover get zero
factors on our side: their delta is zero either way. The task router bias has no HF form and stays a separate
file (`moe_core.task_bias`). What our model cannot represent exactly is refused, with the file and field or key:
DoRA, LoRA or base-layer biases, per-module ranks or alphas, and modules our converted model does not have;
``lora_dropout`` is accepted (it does nothing at inference).

This module is the one place that knows PEFT's adapter file layout (``base_model.model.<module>.lora_A.weight``;
a module in ``modules_to_save`` as ``base_model.model.<module>.weight``) and ParamWrapper's factor layout;
tests/test_hf_adapter.py holds both against stock PEFT on the HF models, so a PEFT upgrade that changes them fails
there.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora.layer import ParamWrapper
from safetensors import safe_open
from safetensors.torch import save_file

from moe_core.config import MoEConfig
from moe_core.convert import ARCHITECTURES, HFArchitecture, get_architecture, weight_plan
from moe_core.errors import MoELabError
from moe_core.task_bias import unwrap

PREFIX = "base_model.model."  # PEFT's prefix of every key in adapter_model.safetensors
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LORA_FACTORS = ("lora_A.weight", "lora_B.weight")


class AdapterConversionError(MoELabError):
    """An adapter that cannot be written in, or read from, a Hugging Face architecture's names exactly."""


# ================================================================================================ names
@dataclass(frozen=True)
class NameMap:
    """Module names of our converted model and of the HF architecture it came from (`moe_core.convert`)."""

    arch: HFArchitecture
    modules: dict[str, str]  # our module -> HF module, one to one (router, attention, shared expert, ...)
    experts: dict[str, tuple[str, ...]]  # our stacked expert parameter -> the HF module of each expert

    @property
    def hf_modules(self) -> dict[str, str]:
        """HF module -> our module, for the one-to-one modules."""
        return {hf: ours for ours, hf in self.modules.items()}

    @property
    def hf_experts(self) -> dict[str, tuple[str, int]]:
        """HF per-expert module -> (our stacked parameter, expert index)."""
        return {hf: (stack, e) for stack, names in self.experts.items() for e, hf in enumerate(names)}

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
    for ours, theirs in weight_plan(config, arch):
        if len(theirs) == 1:
            modules[_module_of(ours)] = _module_of(theirs[0])
        else:  # a stacked expert parameter is named without ".weight": it is the parameter, not a module
            experts[ours] = tuple(_module_of(name) for name in theirs)
    if config.tie_word_embeddings:  # lm_head is no weight of its own, but a module PEFT can target
        modules["lm_head"] = "lm_head"
    return NameMap(arch, modules, experts)


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
    for field in ("rank_pattern", "alpha_pattern"):
        if raw.get(field):
            reasons.append(f"{field}={raw[field]!r}: per-module ranks or alphas are not converted")
    for field in ("layer_replication", "trainable_token_indices"):
        if raw.get(field):
            reasons.append(f"{field}={raw[field]!r}: not convertible")
    if raw.get("fan_in_fan_out"):
        reasons.append("fan_in_fan_out=true: the HF MoE models have no Conv1D layers")
    return reasons


# ================================================================================================ ours -> HF
def _stack_name(wrapper_name: str, wrapper: ParamWrapper) -> str:
    """Our stacked parameter adapted by a (possibly nested) ParamWrapper, e.g. ``model.layers.0.mlp.experts.up_proj``."""
    module = wrapper_name.removeprefix(PREFIX).replace(".base_layer", "")
    return f"{module}.{wrapper.parameter_name}"


def _param_wrappers(model) -> dict[str, ParamWrapper]:
    """Every ParamWrapper of a PEFT model (nested ones included) by module name (the key prefix of its factors)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, ParamWrapper)}


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
        tensors[f"{PREFIX}{hf}.{rest}"] = tensor.detach().clone()
        (lora_targets if rest.startswith("lora_") else saved_modules).add(hf)
    for stack, pair in factors.items():
        A, B = pair["lora_A.weight"], pair["lora_B.weight"]
        E = len(names.experts[stack])
        A_ERI = A.detach().view(E, -1, A.shape[-1])
        B_ORE = B.detach().view(B.shape[0], -1, E)
        for e, hf in enumerate(names.experts[stack]):
            A_RI, B_OR = A_ERI[e], B_ORE[:, :, e]
            if not (A_RI.any() or B_OR.any()):
                continue  # an expert the adapter does not train: delta exactly zero
            # copies: B_OR is a strided view, and safetensors refuses tensors that share storage
            tensors[f"{PREFIX}{hf}.lora_A.weight"] = A_RI.clone(memory_format=torch.contiguous_format)
            tensors[f"{PREFIX}{hf}.lora_B.weight"] = B_OR.clone(memory_format=torch.contiguous_format)
            lora_targets.add(hf)
    if not lora_targets:
        raise AdapterConversionError("the adapter has no non-zero LoRA factors to save")
    every_hf_module = list(names.hf_modules) + list(names.hf_experts)
    hf_config = LoraConfig(
        r=config.r,
        lora_alpha=config.lora_alpha,
        use_rslora=config.use_rslora,
        lora_dropout=config.lora_dropout,
        bias="none",
        target_modules=target_regex(lora_targets, every_hf_module),
        modules_to_save=sorted(saved_modules) or None,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base.name_or_path or config.base_model_name_or_path,
        inference_mode=True,
    )
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
    with safe_open(str(Path(directory) / WEIGHTS_FILE), "pt") as f:
        return next((key for key in f.keys() if _HF_ONLY_MODULE.search(split_key(key)[0])), None)


def check_convertible(directory: str | Path) -> None:
    """Refuse, from adapter_config.json alone, an adapter in HF names that asks for what our model cannot
    represent (DoRA, biases, ...): one error, before the base model loads."""
    directory = Path(directory)
    raw = read_adapter_config(directory)
    if raw.get("target_parameters"):
        return
    reasons = _refusals(raw)
    if reasons and hf_named_key(directory) is not None:
        raise AdapterConversionError(
            f"{directory / CONFIG_FILE}: cannot apply this adapter to our model exactly:\n  - "
            + "\n  - ".join(reasons)
        )


def is_hf_adapter(directory: str | Path, config: MoEConfig) -> bool:
    """Whether the adapter in ``directory`` names the HF architecture's modules (ours written by
    `save_hf_adapter`, or one stock PEFT trained on the HF model) rather than ours. Attention-only adapters read
    the same either way; an adapter with ``target_parameters`` is ours."""
    directory = Path(directory)
    if read_adapter_config(directory).get("target_parameters") or not config.hf_origin:
        return False
    hf_only = name_map(config).hf_only
    return any(module in hf_only for module in _saved_modules(directory))


def apply_hf_adapter(model, directory: str | Path, adapter_name: str = "default"):
    """Our PeftModel: ``model`` (our `MoEForCausalLM` converted from the HF architecture) with the HF-named LoRA
    adapter in ``directory`` applied exactly (per-expert factors stacked into ParamWrapper's layout, zeros for
    experts it does not cover). Refuses, naming the file and field or key, what our model cannot represent."""
    directory = Path(directory)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    raw = read_adapter_config(directory)
    reasons = _refusals(raw)
    if raw.get("target_parameters"):
        reasons.append("target_parameters is set: this adapter is in our names, not the HF architecture's")
    if reasons:
        raise AdapterConversionError(
            f"{config_file}: cannot apply this adapter to our model exactly:\n  - " + "\n  - ".join(reasons)
        )
    names = name_map(model.config)
    hf_modules, hf_experts = names.hf_modules, names.hf_experts
    stacks = dict(model.named_parameters())
    r = int(raw.get("r", 8))  # LoraConfig's default

    tensors: dict[str, torch.Tensor] = {}  # our keys, as get_peft_model_state_dict names them
    source_of: dict[str, str] = {}  # our key -> the file's key, for error messages
    expert_factors: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    lora_targets: set[str] = set()
    saved_modules: set[str] = set()
    with safe_open(str(weights_file), "pt") as f:
        for key in f.keys():
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
                rows, cols = tuple(stacks[stack].shape[1:])  # our stack is [E, O, I]
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
    peft_model = get_peft_model(model, lora_config, adapter_name=adapter_name)
    for name, wrapper in _param_wrappers(peft_model).items():
        stack = _stack_name(name, wrapper)
        if stack not in expert_factors:
            continue
        E, O, I = stacks[stack].shape
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
    return peft_model
