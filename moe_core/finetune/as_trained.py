"""A LoRA fine-tune's adapter on the base it trained on, unmerged: how `moe_core.load` reads a fine-tuning output
that holds its adapter alone (issue 31: "the adapter then generates on the base it was trained on").

Merging an adapter that covers every expert rewrites every expert weight, so it needs the whole base in ordinary
memory, however the base is held: a copy of a 12.9 GiB OLMoE-1B-7B before the first token, and none at all for a
base larger than memory (Qwen1.5-MoE-A2.7B's 26.7 GiB here), which fine-tunes on its memory-mapped files. And a
4-bit base cannot hold a merge (the delta is far below a 4-bit step). Such a fine-tune writes the adapter alone
(`moe_core.finetune.sizing`: above 1 B parameters, and always under QLoRA), and its output is loaded the way it
trained:

    base     the checkpoint ``model.path`` names, as the fine-tune held it: memory-mapped from its files where they
             hold ``model.dtype`` (unless ``model.mmap=false``; `moe_core.mapped`: nothing copied, the kernel pages
             in what runs), else copied; under QLoRA (``quantize.base``) its experts (and shared experts and
             attention, as recorded) quantized while they stream in, round to nearest: training's codes, bit for bit
    wrappers `apply_method` with the recorded config (ESFT's selection from ``moe_expert_selection.json``)
    factors  the adapter's tensors placed into those wrappers (HF-named ones through `hf_adapter`), every key of
             the file placed and every wrapper's factor given, else refused; a trained router's selection bias
             saved with it copied into the base router (`moe_core.finetune.selection_bias`)
    forward  unmerged: attention's LoRA through PEFT's layers, each expert's LoRA on its routed tokens, as in
             training (for QLoRA over the expert's dequantized slice)

Loading so takes seconds and the base's pages, not a copy: the 4-layer OLMoE-1B-7B (3.5 GiB) loads in 0.6 s at 0.4
GiB of anonymous memory where the merge took 17.5 s and 3.9 GiB; `moe-lab generate OUT` of the full OLMoE-1B-7B
(12.9 GiB) took 14.0 s at a 5.7 GiB peak against 52.5 s and 14.8 GiB merged, decoding at 0.8-0.85x the merged
model's speed (LoRA's products at every step), and of the full Qwen1.5-MoE-A2.7B (26.7 GiB: no merge fits a 23.5
GiB machine) 25.8 s at a 9.9 GiB peak (README.md); `tests/test_load_as_trained.py`.

What rewrites weights merges the adapter as it writes, from the base memory-mapped (`merges_as_written`):
`peft_as_trained` gives the adapter's wrappers over the full-precision base, and quantization merges one expert
slice at a time as it quantizes it (`moe_core.inference.quantize.weight_only.quantize_merged`; GPTQ and AWQ
calibrate on the adapter as it trained, unmerged), conversion to Hugging Face and the merged exports one
expert projection at a time as its shard is written (`moe_core.finetune.export.merged_for_writing`), pruning the
kept experts (ranked by the adapter's own routing, or REAP on its own outputs). ``moe-lab quantize`` of the full
OLMoE-1B-7B's LoRA output so peaked at 5.7 GiB where the whole merge took 18.5 GiB, with the same bytes written.
ONNX export and pruning's ``--merge-similar`` (which need the merged experts whole) call ``moe_core.load(path,
merged=True)``, which merges the adapter into the full-precision base (the output's merged/ when it has one), as
``moe_core.load(OUT / "adapter")`` always does: the whole base in memory. Fine-tunes this does not cover load
merged as before: a task router bias (a task id per batch) and a reward model's score head.

A fine-tune can also go on training such an output's adapter (`continued`: ``lora.init_from``, or ``model.path``
naming the output): SFT, then DPO or KTO on the SFT'd adapter, with TRL's reference a frozen copy of it. The run
is built as the output loads (the recorded base, ``lora``, ``freeze`` and ``quantize``, ESFT's experts), its
factors placed by `place_adapter`; its own adapter still records the original base.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from moe_core.configfile import FINETUNE_CONFIG
from moe_core.errors import MoELabError
from moe_core.finetune.config import FinetuneConfig, FinetuneError
from moe_core.finetune.hf_adapter import WEIGHTS_FILE, apply_hf_adapter, is_hf_adapter
from moe_core.finetune.methods import apply_method, unwrap
from moe_core.finetune.qlora import base_quant_config, quantizes_attention, quantizes_shared_experts
from moe_core.finetune.selection_bias import BUFFER as BIAS_BUFFER
from moe_core.finetune.selection_bias import restore_router_biases
from moe_core.model import MoEForCausalLM
from moe_core.quantized import load_quantizing_experts

ADAPTER_DIR = "adapter"


def loads_as_trained(directory: str | os.PathLike) -> bool:
    """Whether `moe_core.load` reads the fine-tuning output ``directory`` unmerged (module docstring): a LoRA
    fine-tune (QLoRA included) that wrote its adapter and no merged/ model. A task router bias or a reward head
    over a full-precision base loads merged, as before; over a quantized one, `load_as_trained` refuses it."""
    directory = Path(directory)
    if (directory / "merged").is_dir() or not (directory / ADAPTER_DIR).is_dir():
        return False
    config = recorded_config(directory)
    if config.method != "lora":
        return False
    if config.quantize.base is not None:
        return True
    return not config.routing.task_bias and config.objective != "reward"


def merges_as_written(directory: str | os.PathLike) -> bool:
    """Whether a writer merges the fine-tuning output ``directory``'s adapter as it writes (quantize, prune,
    conversion to Hugging Face: `peft_as_trained` with ``full_precision``, then one expert slice or projection at
    a time) rather than loading it merged: a LoRA or QLoRA output holding its adapter alone, with no task router
    bias or reward head (those load merged, as `loads_as_trained` says)."""
    if not loads_as_trained(directory):
        return False
    config = recorded_config(Path(directory))
    return not config.routing.task_bias and config.objective != "reward"


def recorded_config(directory: Path) -> FinetuneConfig:
    """The fine-tuning output's config (a missing or invalid file is refused by `FinetuneConfig.load`, naming it)."""
    return FinetuneConfig.load(directory / FINETUNE_CONFIG)


def load_as_trained(
    directory: str | os.PathLike,
    load_base: Callable[[str, torch.dtype | str, bool], MoEForCausalLM],
    *,
    base: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
) -> MoEForCausalLM:
    """Our model with the fine-tune's adapter over its base as it trained, unmerged, in eval mode (module
    docstring). ``load_base(path, dtype, map_it)``: the full-precision base, memory-mapped when ``map_it`` and its
    files hold ``dtype``, else copied (`moe_core.loading` passes its own: this module does not import the loader
    back); ``base``: that checkpoint (default: the recorded ``model.path``); ``dtype``: the weights' (default: the
    recorded ``model.dtype``)."""
    return unwrap(peft_as_trained(directory, load_base, base=base, dtype=dtype)).eval()


def peft_as_trained(
    directory: str | os.PathLike,
    load_base: Callable[[str, torch.dtype | str, bool], MoEForCausalLM],
    *,
    base: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    full_precision: bool = False,
):
    """`load_as_trained`'s PEFT model (``merge_and_unload`` is its own): the adapter's wrappers over the base, the
    factors placed, unmerged. ``full_precision``: a QLoRA fine-tune's adapter over its full-precision base as
    ``load_base`` gives it (memory-mapped where its files allow), not over the 4-bit one it trained on: what a
    writer that merges needs (`moe_core.inference.quantize.weight_only` merges it into one expert slice at a time
    and quantizes that)."""
    directory = Path(directory)
    config = recorded_config(directory)
    adapter = directory / ADAPTER_DIR
    weights = adapter / WEIGHTS_FILE
    if not weights.is_file():
        raise FinetuneError(f"{adapter}: no {WEIGHTS_FILE}; only safetensors adapters are loaded")
    if config.method != "lora":
        raise FinetuneError(f"{directory / FINETUNE_CONFIG}: method={config.method}; expected lora")
    quantized = config.quantize.base is not None and not full_precision
    if quantized and config.routing.task_bias:
        raise FinetuneError(
            f"{directory / FINETUNE_CONFIG}: a task router bias over a quantized base is not loaded yet; merge the "
            "adapter into the full-precision base (moe_core.load(OUT / 'adapter'))"
        )
    source = str(base) if base is not None else config.model.path
    dtype = dtype or config.model.dtype
    try:
        if quantized:
            model = load_quantizing_experts(
                source,
                base_quant_config(config),
                dtype,
                shared_experts=quantizes_shared_experts(config),
                attention=quantizes_attention(config),
            )
        else:
            model = load_base(source, dtype, config.model.mmap is not False)
    except MoELabError as err:  # a base moved or deleted since: say which file named it, and the way out
        named = "base=" if base is not None else f"model.path in {directory / FINETUNE_CONFIG}"
        raise FinetuneError(
            f"{directory}: the base model it was fine-tuned on ({named}: {source}) does not load: {err}; give "
            "where it is now as base= (moe_core.load(OUT, base=DIR); --base DIR for moe-lab generate, eval and analyze)"
        ) from None
    # (the wrappers follow the base's modules: PEFT's Linear LoRA over a full-precision attention, whose adapter
    # keys are QLoRA's `QuantizedLinearLoRA`'s)
    peft_model, _ = apply_method(model, config, expert_selection=recorded_selection(directory, config))
    place_adapter(peft_model, model, adapter, source)
    peft_model.requires_grad_(False)
    return peft_model


def recorded_selection(directory: Path, config: FinetuneConfig) -> dict[int, list[int]] | None:
    """The experts ESFT chose for the fine-tune in ``directory``, recorded beside its adapter; None for the other
    ``lora.experts`` choices, which the config itself gives."""
    if config.lora.experts != "esft":
        return None
    saved = json.loads((directory / ADAPTER_DIR / "moe_expert_selection.json").read_text())["expert_adapters"]
    return {int(layer): ids for layer, ids in saved.items()}


def place_adapter(peft_model, model: MoEForCausalLM, adapter: Path, source: str) -> None:
    """The tensors of ``adapter`` (a fine-tune's adapter/ directory) into the wrappers ``peft_model`` has for it:
    every key of the file placed and every factor given (HF-named ones through `hf_adapter`), else refused; a
    trained router's selection bias copied into the base router."""
    weights = adapter / WEIGHTS_FILE
    if is_hf_adapter(adapter, model.config):
        apply_hf_adapter(model, adapter, into=peft_model)
        return
    tensors = load_file(str(weights))
    # a trained router's selection bias is a buffer of the base, not an adapter tensor (`selection_bias`)
    tensors = {key: t for key, t in tensors.items() if not key.endswith(f".{BIAS_BUFFER}")}
    expected = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    unplaced = sorted(set(tensors) ^ set(expected))
    if unplaced:
        raise FinetuneError(
            f"{weights}: {unplaced[:3]} do not match the adapter the recorded config builds; is this the "
            f"adapter of {source}?"
        )
    set_peft_model_state_dict(peft_model, tensors)
    restore_router_biases(peft_model, weights)


# what gives an adapter its shape and its base its form: a continued run takes them from the run it continues
SHAPING = ("lora", "freeze", "quantize")


def continued(config: FinetuneConfig) -> tuple[FinetuneConfig, str | None]:
    """``config`` as the run it describes: unchanged, unless it continues a LoRA fine-tune's adapter
    (``lora.init_from``, or ``model.path`` naming a fine-tune output that holds its adapter alone, which reads as
    that). Then the base is the one that run recorded (``model.path``, and its ``dtype`` and ``mmap`` where this
    config leaves them at their defaults), the adapter's shape (``lora``, ``freeze``, ``quantize``) is that run's,
    the tokenizer its output's (its chat template with it) and ``data.chat_template`` its own where this one sets
    none; a shaping section set otherwise is refused, naming the field. Returns the config and a line that says
    so (None when nothing continues)."""
    path = config.lora.init_from
    if path is None and config.model.path and _holds_adapter_alone(Path(config.model.path)):
        path = config.model.path
    if path is None:
        return config, None
    directory = Path(path)
    if directory.name == ADAPTER_DIR and (directory.parent / FINETUNE_CONFIG).is_file():
        directory = directory.parent  # its adapter/ directory named: the output it belongs to
    if not ((directory / FINETUNE_CONFIG).is_file() and (directory / ADAPTER_DIR / WEIGHTS_FILE).is_file()):
        raise FinetuneError(
            f"lora.init_from={path}: not a LoRA fine-tune's output (it needs {FINETUNE_CONFIG} and "
            f"{ADAPTER_DIR}/{WEIGHTS_FILE})"
        )
    recorded = recorded_config(directory)
    if recorded.method != "lora" or recorded.routing.task_bias or recorded.objective == "reward":
        raise FinetuneError(
            f"{directory / FINETUNE_CONFIG}: method={recorded.method}, objective={recorded.objective}, "
            f"routing.task_bias={recorded.routing.task_bias}: only a LoRA adapter of a causal LM (no task router "
            "bias) is trained on; fine-tune its merged model instead (model.path=OUT/merged)"
        )
    if config.method != "lora":
        raise FinetuneError(
            f"method={config.method} with the adapter of {directory}: going on training an adapter is "
            "method=lora (or unset method)"
        )
    given, kept, default = (c.model_dump() for c in (config, recorded, FinetuneConfig()))
    for fields in (given, kept, default):  # where each starts is not the adapter's shape
        fields["lora"]["init_from"] = None
    for section in SHAPING:
        mine = given[section]
        differs = sorted(k for k in mine if mine[k] != kept[section][k])
        if mine != default[section] and differs:  # left at the defaults: the recorded ones, said in the note
            field = f"{section}.{differs[0]}"
            raise FinetuneError(
                f"{field}={given[section][differs[0]]!r}: the adapter of {directory} was trained with "
                f"{field}={kept[section][differs[0]]!r}, and going on training it keeps its shape; leave "
                f"{section} unset (or as recorded in {directory / FINETUNE_CONFIG}), or train a new adapter on its "
                "merged model"
            )
    model = dict(given["model"])
    if model["path"] is None or Path(model["path"]) == Path(path):
        model["path"] = recorded.model.path  # the base that run trained on
    for key in ("dtype", "mmap"):
        if model[key] == default["model"][key]:
            model[key] = kept["model"][key]
    if model["tokenizer"] is None and any((directory / ADAPTER_DIR).glob("tokenizer*.json")):
        model["tokenizer"] = str(directory / ADAPTER_DIR)  # its tokenizer and chat template
    data = dict(given["data"])
    if data["chat_template"] is None:
        data["chat_template"] = recorded.data.chat_template
    update = {section: kept[section] for section in SHAPING}
    update["lora"] = {**kept["lora"], "init_from": str(directory)}
    resolved = FinetuneConfig.build({**given, **update, "model": model, "data": data})
    note = (
        f"training on the adapter of {directory} (r={recorded.lora.r}, experts={recorded.lora.experts}"
        f"{', ' + recorded.quantize.base + ' base' if recorded.quantize.base else ''}) over its base "
        f"{model['path']}; its lora, freeze and quantize sections are the recorded ones"
    )
    return resolved, note


def _holds_adapter_alone(directory: Path) -> bool:
    """A fine-tune's output that `moe_core.load` runs as it trained (its adapter alone, `loads_as_trained`)."""
    return (directory / FINETUNE_CONFIG).is_file() and loads_as_trained(directory)
