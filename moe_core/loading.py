"""One loader for every kind of checkpoint the lab writes or converts: ``moe_core.load(path)``.

    from moe_core import load
    loaded = load("runs/lifecycle-.../pretrain")   # any of the kinds below
    loaded.model, loaded.tokenizer, loaded.kind, loaded.config

The kind is read from the directory's files, never from its name (first match wins):

    quantized    quantization.json            `moe-lab quantize` (moe_core.quantized.save_quantized)
    adapter      adapter_config.json          a PEFT adapter (finetune/export.save_adapter), applied to its base
                                              model (``base=``, else the adapter's base_model_name_or_path) and
                                              merged into it; in our module names, or in a HF architecture's
                                              (ours for a HF-origin model, or stock PEFT's on OlmoeForCausalLM
                                              etc.: finetune/hf_adapter.py converts it exactly or refuses)
    finetuned    finetune_config.json         a fine-tuning output directory: its merged/ model, else adapter/:
                                              a LoRA (or QLoRA) fine-tune's on its base as it trained, unmerged
                                              (memory-mapped, or quantized again: finetune/as_trained.py), or
                                              merged into its base with ``merged=True``
    checkpoint   manifest.json + trainer_state.json   a training checkpoint (format 2, moe_core.train.checkpoint):
                                              replicated weights and expert shards gathered into one model
    run          checkpoints/step_* or final/ a training output directory: its exported final/ model, else its
                                              newest complete checkpoint
    pruned       pruning.json + config.json   `moe-lab prune` (moe_core.inference.prune.prune_checkpoint)
    reward       config.json, model_type "moe_lab", architectures ["MoEForSequenceClassification"]: a reward
                                              model (moe_core.reward_model; a fine-tune with objective=reward)
    model        config.json, model_type "moe_lab"   our save_pretrained / exported model (a fine-tune's merged/
                                              included: its task router bias is attached when saved beside it)
    hf           config.json, model_type mixtral / olmoe / qwen2_moe   converted exactly (moe_core.convert.from_hf)

A path that does not exist is tried as a Hugging Face hub id (`moe_core.convert.resolve_source`). Weights are
read with safetensors only (PEFT adapters: adapter_model.safetensors); nothing is unpickled. Weights that do not
cover the model exactly (a missing or an unexpected tensor) are refused with a `LoadError` naming the file and
the first such tensor: no model with randomly initialized weights is ever returned from a path. The tokenizer is
the directory's own, else the one the checkpoint names (a training checkpoint's prepared-data tokenizer, an
adapter's base model's), else ``tokenizer=`` when given, else None. A model saved without BOS/EOS/PAD ids in its
config (before training recorded them) takes the missing ones from that tokenizer, so `generate` stops at EOS.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moe_core.config import MoEConfig
from moe_core.configfile import FINETUNE_CONFIG
from moe_core.convert import ARCHITECTURES, config_from_hf, from_hf, read_hf_config, resolve_source
from moe_core.data.errors import DataError
from moe_core.data.tokenizer import (
    SPECIAL_TOKEN_FIELDS,
    adopt_special_token_ids,
    load_tokenizer,
    special_token_ids,
)
from moe_core.errors import MoELabError, weight_mismatch
from moe_core.mapped import MappingError, load_mapped, mapping_refusal
from moe_core.model import MoEForCausalLM
from moe_core.quantized import QUANT_FILE, load_quantized
from moe_core.reward_model import REWARD_ARCHITECTURE, MoEForSequenceClassification, reward_model_from
from moe_core.task_bias import TaskRouterBias
from moe_core.train import checkpoint as ckpt_io
from moe_core.transformers_seam import old_checkpointing_names_quiet

logger = logging.getLogger(__name__)

MAPPABLE = ("model", "pruned", "hf")  # the kinds whose weight files are the model's own tensors
_NOT_MAPPED = {
    "quantized": "codes, not the model's tensors",
    "adapter": "merged into its base",
    "checkpoint": "gathered from shards",
    "reward": "a reward model's, loaded whole",
}
KINDS = ("quantized", "adapter", "finetuned", "checkpoint", "run", "pruned", "reward", "model", "hf")
PRUNE_FILE = "pruning.json"  # written by prune_checkpoint beside the pruned model: its PruneReport
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # what save_pretrained writes


class LoadError(MoELabError):
    """A directory that holds no checkpoint of a kind `moe_core.load` knows, or one that does not load."""


@dataclass
class Loaded:
    """What `load` returns: the model (eval mode), which kind of checkpoint it was, the directory the weights
    came from, the model's config, and its tokenizer (read on first use from ``tokenizer_dir``; None when
    the checkpoint names none)."""

    model: MoEForCausalLM
    kind: str
    path: Path
    config: MoEConfig
    tokenizer_dir: Path | None = None

    @cached_property
    def tokenizer(self) -> Any | None:
        return load_tokenizer(self.tokenizer_dir) if self.tokenizer_dir is not None else None


def detect(path: str | os.PathLike) -> str:
    """The kind of checkpoint in directory ``path`` (one of `KINDS`); `LoadError` when it is none of them."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoadError(f"{directory}: not a directory; give a checkpoint directory ({', '.join(KINDS)})")
    has = {p.name for p in directory.iterdir()}
    if QUANT_FILE in has:
        return "quantized"
    if "adapter_config.json" in has:
        return "adapter"
    if FINETUNE_CONFIG in has and ({"merged", "adapter"} & has):
        return "finetuned"
    if ckpt_io.MANIFEST in has and ckpt_io.TRAINER_STATE in has:
        return "checkpoint"
    if (directory / "final" / "config.json").is_file() or ckpt_io.list_checkpoints(directory / "checkpoints"):
        return "run"
    if "config.json" in has:
        model_type = _model_type(directory)
        if model_type == MoEConfig.model_type:
            if PRUNE_FILE in has:
                return "pruned"
            return "reward" if _architectures(directory) == [REWARD_ARCHITECTURE] else "model"
        if model_type in ARCHITECTURES:
            return "hf"
        raise LoadError(
            f"{directory}: config.json has model_type {model_type!r}, neither moe_lab nor one of the "
            f"convertible architectures ({', '.join(ARCHITECTURES)})"
        )
    shown = ", ".join(sorted(has)[:8]) + (f" and {len(has) - 8} more" if len(has) > 8 else "")
    raise LoadError(
        f"{directory}: no checkpoint here (found: {shown or 'nothing'}); give a model directory (config.json), "
        "a training output or checkpoint directory, a fine-tuning output or adapter, or a quantized or pruned "
        "model"
    )


def load(
    path: str | os.PathLike,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    tokenizer: str | os.PathLike | None = None,
    base: str | os.PathLike | None = None,
    memory_map: bool = False,
    merged: bool = False,
) -> Loaded:
    """Model and tokenizer from any checkpoint kind (see the module docstring), in eval mode.

    ``dtype``: None keeps the stored dtype ("auto"); ``device``: where the model goes (default: stays on the
    CPU); ``tokenizer``: a tokenizer (or prepared-data) directory used when the checkpoint names none of its
    own; ``base``: the base model of a PEFT adapter (default: the path the adapter records); ``memory_map``: the
    weights stay memory-mapped from the safetensors files, frozen (`moe_core.mapped`: a model directory, ours
    or a Hugging Face one, in its stored dtype; other kinds are refused). ``merged``: a fine-tuning output's
    adapter merged into its full-precision base rather than run unmerged on the base as it trained
    (`moe_core.finetune.as_trained`): plain weights, what a command that needs the merged experts whole (ONNX
    export, pruning's ``--merge-similar``) reads; the whole base in memory (quantize, prune and conversion merge as
    they write where they can: `merges_as_written`)."""
    directory = _local(path)
    kind = detect(directory)
    if kind == "finetuned" and not merged and _loads_as_trained(directory):
        # the fine-tuning stack (peft, the LoRA wrappers), imported only for a fine-tune's adapter; it does not
        # import this module back
        from moe_core.finetune.as_trained import load_as_trained, recorded_config

        if memory_map and recorded_config(directory).quantize.base is not None:
            raise LoadError(
                f"{directory}: a QLoRA fine-tune loads on its quantized base, not memory-mapped: load without "
                "memory_map (or with merged=True, or give its adapter/ directory, to merge it into the "
                "full-precision base)"
            )
        model = load_as_trained(directory, base_as_trained, base=base, dtype=dtype)
    elif kind in ("run", "finetuned"):
        loaded = load(
            _inner(directory, kind),
            device=device,
            dtype=dtype,
            tokenizer=tokenizer,
            base=base,
            memory_map=memory_map,
        )
        if kind == "finetuned":
            loaded.kind = "finetuned"
        return loaded
    elif memory_map:
        if kind not in MAPPABLE:
            raise LoadError(
                f"{directory}: a {kind} checkpoint is not memory-mapped (its weights are {_NOT_MAPPED[kind]}); "
                f"memory_map reads a model directory ({', '.join(MAPPABLE)}): load without it"
            )
        try:
            model = load_mapped(directory, _torch_dtype(dtype) if dtype is not None else None)
        except MappingError as err:
            raise LoadError(str(err)) from None
        _attach_task_bias(model, directory)
    elif kind == "quantized":
        model = load_quantized(directory)
        if dtype is not None:
            model = model.to(_torch_dtype(dtype))
    elif kind == "checkpoint":
        model = _from_training_checkpoint(directory, dtype)
    elif kind == "adapter":
        model = _from_adapter(directory, base, dtype)
    elif kind == "hf":
        model = from_hf(directory, dtype=_torch_dtype(dtype) if dtype is not None else None)
    elif kind == "reward":
        model = _from_pretrained(
            directory, _torch_dtype(dtype) if dtype is not None else "auto", MoEForSequenceClassification
        )
    else:  # model, pruned
        model = _from_pretrained(directory, _torch_dtype(dtype) if dtype is not None else "auto")
        _attach_task_bias(model, directory)
    if device is not None:
        model = model.to(torch.device(device))
    source = tokenizer_dir(directory, base) or tokenizer
    loaded = Loaded(model.eval(), kind, directory, model.config, Path(source) if source is not None else None)
    if source is not None and any(getattr(model.config, f, None) is None for f in SPECIAL_TOKEN_FIELDS):
        # saved before the training loop recorded the data tokenizer's BOS/EOS/PAD: its tokenizer knows them
        try:
            adopt_special_token_ids(model, special_token_ids(loaded.tokenizer))
        except DataError as err:  # the model loads without them; `loaded.tokenizer` raises it when used
            logger.warning("%s: special-token ids not taken from its tokenizer: %s", directory, err)
    return loaded


def base_as_trained(path: str, dtype: torch.dtype | str, map_it: bool) -> MoEForCausalLM:
    """A fine-tune's full-precision base as it trained (`moe_core.finetune.as_trained`): memory-mapped when
    ``map_it`` (``model.mmap`` not false) and its files hold ``dtype``, else copied."""
    mapped = map_it and memory_map_refusal(path, dtype) is None
    return load(path, dtype=dtype, memory_map=mapped).model


def adapter_to_merge(path: str | os.PathLike, dtype: torch.dtype | str | None = None):
    """The PEFT model of the fine-tuning output at ``path`` for a writer that merges its adapter as it writes
    (`merges_as_written`): the adapter's wrappers over the full-precision base (a QLoRA fine-tune's too), the base
    memory-mapped where its files hold ``dtype`` (None: the dtype they hold, as ``load(path, merged=True)`` reads it:
    a float32 fine-tune of a bf16 checkpoint is written in bf16, its base never copied to float32 for it)."""
    # the fine-tuning stack (peft), imported only for a fine-tune's adapter; it does not import this module back
    from moe_core.finetune.as_trained import peft_as_trained

    def stored(source: str, _trained: torch.dtype | str, map_it: bool) -> MoEForCausalLM:
        return base_as_trained(source, None, map_it)

    load_base = base_as_trained if dtype is not None else stored
    return peft_as_trained(_local(path), load_base, dtype=dtype, full_precision=True)


def _loads_as_trained(directory: Path) -> bool:
    """A LoRA fine-tune's output with its adapter alone (`moe_core.finetune.as_trained.loads_as_trained`); its
    directory layout is looked at first, so that an output with merged/ never imports the fine-tuning stack."""
    if (directory / "merged").is_dir() or not (directory / "adapter").is_dir():
        return False
    # the fine-tuning stack (peft, the LoRA wrappers), imported only for an output holding its adapter alone
    from moe_core.finetune.as_trained import loads_as_trained

    return loads_as_trained(directory)


def merges_as_written(path: str | os.PathLike) -> bool:
    """Whether the writers (quantize, prune, convert to-hf) merge the adapter of the fine-tuning output at ``path``
    as they write, from its memory-mapped base (`moe_core.finetune.as_trained.merges_as_written`); the directory's
    layout is looked at first, so that anything else never imports the fine-tuning stack."""
    directory = _local(path)
    if detect(directory) != "finetuned" or not _loads_as_trained(directory):
        return False
    from moe_core.finetune.as_trained import merges_as_written as adapter_alone  # peft: for adapters only

    return adapter_alone(directory)


def memory_map_refusal(path: str | os.PathLike, dtype: torch.dtype | str | None = None) -> str | None:
    """Why ``load(path, dtype=dtype, memory_map=True)`` would be refused (None when it maps), from the directory's
    files and headers alone, before any weight is read."""
    directory = _local(path)
    kind = detect(directory)
    if kind in ("run", "finetuned"):
        return memory_map_refusal(_inner(directory, kind), dtype)
    if kind not in MAPPABLE:
        return f"it is a checkpoint of kind {kind} (its weights are {_NOT_MAPPED[kind]})"
    try:
        return mapping_refusal(directory, _torch_dtype(dtype) if dtype is not None else None)
    except MappingError as err:
        raise LoadError(str(err)) from None


def tokenizer_dir(path: str | os.PathLike, base: str | os.PathLike | None = None) -> Path | None:
    """The tokenizer `load` gives the checkpoint at ``path``: the directory's own, a training checkpoint's
    prepared-data tokenizer, an adapter's base model's; None when it names none."""
    directory = _local(path)
    kind = detect(directory)
    if kind in ("run", "finetuned"):
        return tokenizer_dir(_inner(directory, kind), base)
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return directory
    if kind == "checkpoint":
        named = ckpt_io.read_trainer_state(directory).get("tokenizer")
        return Path(named) if named and Path(named).is_dir() else None
    if kind == "adapter":
        return tokenizer_dir(base or _adapter_base(directory))
    return None


def model_config(path: str | os.PathLike, base: str | os.PathLike | None = None) -> MoEConfig:
    """The config of the model `load` returns for ``path``, read from its config file alone (no weight is read):
    what a command checks its inputs against (vocabulary, size) before it pays for loading the weights. A
    Hugging Face checkpoint's config is converted (`moe_core.convert.config_from_hf`), refusing what does not
    convert; an adapter's is its base model's (``base``, else the one it records)."""
    directory = _local(path)
    kind = detect(directory)
    if kind in ("run", "finetuned"):
        return model_config(_inner(directory, kind), base)
    if kind == "adapter":
        return model_config(base or _adapter_base(directory))
    if kind == "hf":
        return config_from_hf(*read_hf_config(directory))
    return MoEConfig.from_pretrained(directory)  # model, pruned, quantized, training checkpoint


# ------------------------------------------------------------------------------------------------ kinds
def _from_training_checkpoint(directory: Path, dtype) -> MoEForCausalLM:
    """Replicated weights plus every expert shard (`gather_state_dict`), checked against the config."""
    reason = ckpt_io.incomplete_reason(directory)
    if reason is not None:
        raise LoadError(f"{directory}: incomplete training checkpoint ({reason}); load an earlier step_*")
    try:
        model = ckpt_io.checkpoint_model(directory)
    except ckpt_io.CheckpointError as err:
        raise LoadError(f"{err}; load an earlier step_*") from None
    return model.to(_torch_dtype(dtype)) if dtype is not None else model


def _from_pretrained(directory: Path, dtype, model_class=MoEForCausalLM):
    """Our ``save_pretrained`` directory, refused unless its weights cover the model exactly: transformers would
    initialize whatever the files lack at random with only a warning (a tied lm_head is not missing)."""
    weights = next(
        (directory / n for n in WEIGHT_FILES if (directory / n).is_file()), directory / WEIGHT_FILES[0]
    )
    if not weights.is_file():
        raise LoadError(
            f"{directory}: config.json but no {' or '.join(WEIGHT_FILES)}; the directory is incomplete (left "
            "by a killed writer?): write it again, or load the checkpoint it came from"
        )
    model, info = model_class.from_pretrained(directory, dtype=dtype, output_loading_info=True)
    missing, unexpected = info["missing_keys"], info["unexpected_keys"]  # a shape mismatch raises in there
    if missing or unexpected:
        quantized = any(k.endswith(("_q", "_scale")) for k in unexpected)
        hint = (
            f"it holds quantized experts but no {QUANT_FILE} (a `moe-lab quantize` that was killed?): quantize "
            "again with --overwrite"
            if quantized
            else "write it again from the checkpoint it came from, or load that checkpoint"
        )
        raise LoadError(
            f"{weights}: the weights do not cover the model config.json describes "
            f"({weight_mismatch(missing, unexpected)}); refusing to "
            f"fill them with random values; {hint}"
        )
    return model


def _from_adapter(directory: Path, base: str | os.PathLike | None, dtype) -> MoEForCausalLM:
    """The base model with the PEFT adapter applied and merged (``merge_and_unload``): in our module names
    through PEFT, in the HF architecture's (`moe_core.finetune.hf_adapter`) converted onto our model."""
    # optional heavy dependency (peft), imported only for adapters
    from peft import PeftModel

    from moe_core.finetune.hf_adapter import (
        AdapterConversionError,
        apply_hf_adapter,
        check_convertible,
        hf_named_key,
        is_hf_adapter,
    )
    from moe_core.finetune.selection_bias import restore_router_biases

    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        raise LoadError(
            f"{directory}: adapter_config.json without adapter_model.safetensors; only safetensors adapters "
            "are loaded (nothing is unpickled)"
        )
    try:
        check_convertible(
            directory
        )  # an adapter in HF names our model cannot represent: before the base loads
        base_path = base or _adapter_base(directory)
        try:
            base_loaded = load(base_path, dtype=dtype)
        except MoELabError as err:  # a base moved or deleted since: say which file named it
            named = "base=" if base else f"base_model_name_or_path in {directory / 'adapter_config.json'}"
            raise LoadError(
                f"{directory}: the adapter's base model ({named}: {base_path}) does not load: {err}; give where "
                "it is now as base= (moe_core.load(ADAPTER, base=DIR); --base DIR for moe-lab generate, eval and analyze)"
            ) from None
        if base_loaded.kind == "quantized":
            raise LoadError(
                f"{directory}: base model {base} is quantized; apply adapters to full-precision weights"
            )
        if is_hf_adapter(directory, base_loaded.model.config):
            # HF module names (ours for a HF-origin model, or stock PEFT's): converted, nothing left at init
            peft_model = apply_hf_adapter(base_loaded.model, directory)
        else:
            hf_key = hf_named_key(directory)
            if hf_key is not None:
                raise LoadError(
                    f"{directory / 'adapter_model.safetensors'}: key {hf_key} names a Hugging Face "
                    f"architecture's module, but the base model {base_loaded.path} did not come from one "
                    "(config.hf_origin is empty); give base= the HF checkpoint the adapter was trained on"
                )
            model = base_loaded.model
            if "score" in (_adapter_config(directory).get("modules_to_save") or []):
                # a reward model's adapter (objective=reward): its score head is saved with it, in full
                model = reward_model_from(model)
            with old_checkpointing_names_quiet():
                peft_model = PeftModel.from_pretrained(model, str(directory))
            _check_adapter_covered(peft_model, weights)
            restore_router_biases(
                peft_model, weights
            )  # a trained router's selection bias, saved beside its gate
    except AdapterConversionError as err:
        raise LoadError(str(err)) from None
    model = peft_model.merge_and_unload()
    _attach_task_bias(model, directory)
    return model


def _check_adapter_covered(peft_model, weights: Path) -> None:
    """PEFT leaves an adapter tensor the file lacks at its initial value (lora_A random) with only a warning;
    get_peft_model_state_dict names the tensors save_pretrained writes for this adapter."""
    from peft import get_peft_model_state_dict  # optional heavy dependency, imported only for adapters

    with safe_open(str(weights), "pt") as f:
        saved = set(f.keys())
    # save_embedding_layers=False: "auto" reads the base's config.json again to compare vocabulary sizes
    missing = [
        k for k in get_peft_model_state_dict(peft_model, save_embedding_layers=False) if k not in saved
    ]
    if missing:
        raise LoadError(
            f"{weights}: the adapter does not cover the modules adapter_config.json names "
            f"({weight_mismatch(missing, [])}); refusing to leave them at their initial values; export the "
            "adapter again from its fine-tuning run"
        )


def _attach_task_bias(model: MoEForCausalLM, directory: Path) -> None:
    """A fine-tune's per-task router bias, saved beside its weights (no HF architecture has one)."""
    if (directory / TaskRouterBias.META).is_file():
        TaskRouterBias.load(directory).attach(model)


# ------------------------------------------------------------------------------------------------ helpers
def _local(path: str | os.PathLike) -> Path:
    """``path`` itself, or for a path that does not exist, the hub id's local snapshot (`resolve_source`
    raises a clear error when it is neither)."""
    directory = Path(path).expanduser()
    return directory if directory.exists() else resolve_source(path)


def _inner(directory: Path, kind: str) -> Path:
    """Where a training output ("run") or fine-tuning output ("finetuned") directory keeps its model."""
    if kind == "run":
        final = directory / "final"
        return (
            final
            if (final / "config.json").is_file()
            else ckpt_io.latest_checkpoint(directory / "checkpoints")
        )
    merged = directory / "merged"
    return merged if (merged / "config.json").is_file() else directory / "adapter"


def _adapter_config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "adapter_config.json").read_text())


def _adapter_base(directory: Path) -> str:
    base = _adapter_config(directory).get("base_model_name_or_path")
    if not base:
        raise LoadError(
            f"{directory}: the adapter names no base model (base_model_name_or_path); pass base=DIR"
        )
    return base


def _model_type(directory: Path) -> str | None:
    try:
        return json.loads((directory / "config.json").read_text()).get("model_type")
    except ValueError as err:
        raise LoadError(f"{directory / 'config.json'}: not valid JSON ({err})") from None


def _architectures(directory: Path) -> list[str] | None:
    """config.json's ``architectures`` (read after `_model_type` checked the file is JSON)."""
    return json.loads((directory / "config.json").read_text()).get("architectures")


def _torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise LoadError(f"dtype={dtype!r}; give a torch dtype such as float32 or bfloat16")
    return value
