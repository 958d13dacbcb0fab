"""Continued pretraining: the trainer's model started from an MoE checkpoint (``model.init_from=DIR``), a model
directory of ours (a run's exported ``<out>/final``, `moe_core.convert.convert_from_hf`'s output), a step
checkpoint of a training run (``<out>/checkpoints/step_N``: its weights, not its optimizer or data position; that
is ``--resume``) or a Hugging Face one of any architecture `moe_core.convert` reads (named and mapped as it maps
them).

    config = initial_config("dir", {"router_aux_loss_coef": 0.02})   # the checkpoint's architecture
    load_initial(rank_model, "dir")                                  # this rank's tensors only

The checkpoint's config.json is the model: ``model.preset`` is not used, and ``model.overrides`` may set only
the fields that change how it trains, not what its parameters are (`TRAINING_FIELDS`); another override that
differs from the checkpoint is refused, naming the field, before any weight is read. Each rank reads its own
experts (a Hugging Face checkpoint stores one tensor per expert; ours a stack, read as rows) and, under FSDP2, its
rows of the dense weights, one tensor at a time (`moe_core.train.build.copy_owned`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from moe_core.config import MoEConfig
from moe_core.convert import ARCHITECTURES, config_from_hf, open_streaming, read_hf_config
from moe_core.errors import MoELabError
from moe_core.model import MoEForCausalLM
from moe_core.train import parallel as par
from moe_core.train.build import copy_owned, expert_offsets
from moe_core.train.checkpoint import CheckpointError, load_model_state


class InitFromError(MoELabError):
    """A checkpoint, or model overrides, that cannot start a run; the message names the field."""


# what continued pretraining may change: routing and its losses, not the parameters
TRAINING_FIELDS = frozenset(
    {
        "router_aux_loss_coef",
        "router_z_loss_coef",
        "router_jitter",
        "router_bias_update_rate",
        "router_loss_reduction",
        "capacity_factor",
        "eval_capacity_factor",
        "expert_impl",
        "attention_dropout",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "max_position_embeddings",
    }
)


def initial_config(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> MoEConfig:
    """The checkpoint's `MoEConfig` with ``overrides`` of `TRAINING_FIELDS` applied; reads config.json only."""
    directory = Path(path).expanduser()
    try:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as err:
        raise InitFromError(f"model.init_from={path}: no readable config.json ({err})") from None
    if model_type == MoEConfig.model_type:
        config = MoEConfig.from_pretrained(directory)
    elif model_type in ARCHITECTURES:
        config = config_from_hf(*read_hf_config(directory))
    else:
        raise InitFromError(
            f"model.init_from={path}: model_type {model_type!r} is neither ours ({MoEConfig.model_type}) nor a "
            f"Hugging Face MoE the lab converts ({', '.join(ARCHITECTURES)}); a dense model is upcycled with "
            "model.upcycle_from"
        )
    refused = [
        f"model.overrides.{key}={value!r} (the checkpoint has {getattr(config, key, None)!r})"
        for key, value in (overrides or {}).items()
        if key not in TRAINING_FIELDS and value != getattr(config, key, None)
    ]
    if refused:
        raise InitFromError(
            f"model.init_from={path} fixes the architecture; these overrides change it: {'; '.join(refused)}. "
            f"Drop them (overridable: {', '.join(sorted(TRAINING_FIELDS))})"
        )
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def is_training_checkpoint(path: str | os.PathLike) -> bool:
    """A step checkpoint a training run wrote (weights whole and in expert shards, `moe_core.train.checkpoint`)."""
    return (Path(path).expanduser() / "train_config.json").is_file()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def checkpoint_tokenizer(path: str | os.PathLike, field: str) -> str:
    """The tokenizer directory of the checkpoint a run starts from (``model.init_from`` or ``model.upcycle_from``,
    named by ``field``): text data must be tokenized with it, since the embedding rows are its tokens."""
    directory = Path(path).expanduser()
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise InitFromError(
            f"model.{field}={path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); the data must be "
            "tokenized with the checkpoint's tokenizer: copy it there, or set data.path to data prepared with "
            "`moe-lab data prepare --tokenizer` of it"
        )
    return str(directory)


@torch.no_grad()
def load_initial(model: MoEForCausalLM, path: str | os.PathLike) -> MoEForCausalLM:
    """Copy the checkpoint at ``path`` into ``model`` (built from `initial_config`, materialized, possibly laid
    out): each rank reads and writes only what it holds."""
    if is_training_checkpoint(
        path
    ):  # ``<out>/checkpoints/step_N``: the resharding loader reads this rank's part
        try:
            load_model_state(model, Path(path))
        except CheckpointError as err:
            raise InitFromError(f"model.init_from: {err}") from None
        return model
    opened = open_streaming(path, torch.float32, InitFromError, "model.init_from")  # checks names, reads none
    plan, reader = dict(opened.plan), opened.reader
    offsets = expert_offsets(model)
    for name, param in model.named_parameters():
        whole = par.full_model_name(name)
        names = plan[whole]
        first, count = offsets(name), par.local(param).shape[0]
        if len(names) > 1:  # a Hugging Face checkpoint: one tensor per expert, this rank's only
            value = torch.stack([reader.get(n) for n in names[first : first + count]])
        elif par.is_expert_param(name):  # ours: the whole stack, this rank's rows
            value = reader.get(names[0])[first : first + count]
        else:
            value = reader.get(names[0])
        _copy(param, value, path, names[0])
    for name, buffer in model.named_buffers():  # persistent ones a checkpoint of ours holds (router biases)
        whole = par.full_model_name(name)
        if whole in plan:
            _copy(buffer, reader.get(plan[whole][0]), path, whole)
    return model


def _copy(target: torch.Tensor, value: torch.Tensor, path, source: str) -> None:
    try:
        copy_owned(target, value, f"{path}: {source}")
    except ValueError as err:
        raise InitFromError(f"{err}; is its config.json the one its weights were written with?") from None
