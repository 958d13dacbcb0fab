"""Checkpoints: everything needed to continue a run exactly, written atomically.

Layout of ``<out>/checkpoints/step_<N>/``::

    train_config.json        the TrainConfig (also model.config below)
    config.json              the MoEConfig (save_pretrained format)
    model.safetensors        replicated parameters and buffers (router biases included); the whole model
                             on one process, so the directory loads with ``from_pretrained`` as is
    experts-ep<k>-of-<n>.safetensors   expert shard k under expert parallelism (n > 1)
    rank<r>.pt               per rank: optimizer, RNG states (python, numpy, torch, cuda)
    trainer_state.json       step, tokens, data position, scheduler, loss scaler, best validation loss,
                             tokenizer reference

A checkpoint is written into ``.tmp-step_<N>`` (every rank writes its own files; a shared filesystem is
assumed across nodes), each file fsync'ed, then renamed to ``step_<N>`` by rank 0: a directory named
``step_*`` is always complete, whatever kills the process. The last ``keep_last`` and the best (lowest
validation loss) are kept. `export_checkpoint` gathers expert shards into one Hugging Face directory.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from moe_core.errors import MoELabError

STEP_PREFIX = "step_"
EXPERT_MARK = ".experts.local."


class CheckpointError(MoELabError):
    """A checkpoint that is missing or does not match the run resuming from it."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)
             and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1] if found else None


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    _fsync_file(path)


# ------------------------------------------------------------------------------------------------ tensors
def split_state_dict(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(replicated, expert shard) tensors of this rank, shared storage (tied weights) written once."""
    from torch.distributed.tensor import DTensor

    replicated, experts, seen = {}, {}, set()
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):  # FSDP2 shard: gather the whole tensor (every rank takes part)
            tensor = tensor.full_tensor()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        target = experts if EXPERT_MARK in name else replicated
        target[name] = tensor.detach().cpu().contiguous()
    return replicated, experts


def load_model_state(model: torch.nn.Module, ckpt: Path, ep_rank: int = 0, ep_size: int = 1) -> None:
    state = load_file(ckpt / "model.safetensors")
    if ep_size > 1 or any(ckpt.glob("experts-ep*.safetensors")):
        shard = ckpt / f"experts-ep{ep_rank}-of-{ep_size}.safetensors"
        if not shard.is_file():
            raise CheckpointError(f"{ckpt}: no expert shard {shard.name}; resume with the same parallel.ep_size "
                                  f"as the run that wrote it")
        state.update(load_file(shard))
    from torch.distributed.tensor import DTensor, distribute_tensor

    current = model.state_dict()
    for name, tensor in state.items():
        target = current.get(name)
        if isinstance(target, DTensor):  # FSDP2: every rank read the whole tensor; keep this rank's shard
            state[name] = distribute_tensor(tensor.to(target.device), target.device_mesh, target.placements)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise CheckpointError(f"{ckpt}: parameters do not match the model (missing {sorted(set(missing) - tied)[:5]}, "
                              f"unexpected {sorted(unexpected)[:5]}); resume with the same model config")


# ------------------------------------------------------------------------------------------------ RNG
def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------ save / load
def begin_checkpoint(ckpt_root: Path, step: int) -> Path:
    """The temporary directory every rank writes into (created by rank 0 before a barrier)."""
    tmp = ckpt_root / f".tmp-{step_dir_name(step)}"
    return tmp


def save_rank_files(tmp: Path, model: torch.nn.Module, optimizer, *, rank: int, ep_rank: int, ep_size: int,
                    dp_rank: int, write_replicated: bool) -> None:
    replicated, experts = split_state_dict(model)
    if write_replicated:
        save_file(replicated, tmp / "model.safetensors", metadata={"format": "pt"})
        _fsync_file(tmp / "model.safetensors")
    if experts and dp_rank == 0:
        path = tmp / f"experts-ep{ep_rank}-of-{ep_size}.safetensors"
        save_file(experts, path, metadata={"format": "pt"})
        _fsync_file(path)
    path = tmp / f"rank{rank}.pt"
    torch.save({"optimizer": _local_optimizer_state(optimizer), "rng": rng_state()}, path)
    _fsync_file(path)


def finish_checkpoint(tmp: Path, final: Path, trainer_state: dict) -> Path:
    """Rank 0, after every rank wrote its files: trainer state last, then the atomic rename."""
    write_json(tmp / "trainer_state.json", trainer_state)
    _fsync_dir(tmp)
    if final.exists():  # a checkpoint of the same step from an earlier attempt
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def _local_optimizer_state(optimizer) -> dict:
    """The optimizer state with FSDP2 DTensors replaced by this rank's shard (plain tensors pickle safely)."""
    from torch.distributed.tensor import DTensor

    state = optimizer.state_dict()  # its per-parameter dicts are the live ones: build new dicts
    state["state"] = {index: {key: value.to_local() if isinstance(value, DTensor) else value
                              for key, value in per_param.items()}
                      for index, per_param in state["state"].items()}
    return state


def load_optimizer_state(optimizer, state: dict) -> None:
    """Inverse of `_local_optimizer_state`: shards become DTensors shaped like their parameters again."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, per_param in state["state"].items():
        param = params[int(index)]
        if not isinstance(param, DTensor):
            continue
        for key, value in per_param.items():
            if torch.is_tensor(value) and value.shape == param.to_local().shape and key != "step":
                per_param[key] = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                                    shape=param.shape, stride=param.stride())
    optimizer.load_state_dict(state)


def load_rank_files(ckpt: Path, rank: int) -> dict:
    path = ckpt / f"rank{rank}.pt"
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: no {path.name}; resume with the same number of processes as the run "
                              f"that wrote it")
    return torch.load(path, map_location="cpu", weights_only=False)


def read_trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())


def prune_checkpoints(ckpt_root: Path, keep_last: int, best: str | None) -> None:
    """Delete all but the last `keep_last` checkpoints and the best one; stale temporary directories too."""
    found = list_checkpoints(ckpt_root)
    keep = {p.name for p in found[-keep_last:]}
    if best:
        keep.add(best)
    for path in found:
        if path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)


def clean_temporary(ckpt_root: Path) -> None:
    if ckpt_root.is_dir():
        for path in ckpt_root.glob(".tmp-*"):
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ export
def gather_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full (Hugging Face) state dict of a checkpoint: expert shards concatenated along the expert dim."""
    state = load_file(ckpt / "model.safetensors")
    shards = sorted(ckpt.glob("experts-ep*-of-*.safetensors"), key=lambda p: int(p.name.split("-")[1][2:]))
    if shards:
        n = int(shards[0].stem.split("-of-")[1])
        if len(shards) != n:
            raise CheckpointError(f"{ckpt}: found {len(shards)} of {n} expert shards; the checkpoint is incomplete")
        parts: dict[str, list[torch.Tensor]] = {}
        for shard in shards:
            for name, tensor in load_file(shard).items():
                parts.setdefault(name.replace(EXPERT_MARK, ".experts."), []).append(tensor)
        state.update({name: torch.cat(tensors, dim=0) for name, tensors in parts.items()})
    return state


def export_checkpoint(ckpt: str | Path, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Write a Hugging Face-loadable directory (config.json, model.safetensors, tokenizer if known)."""
    from moe_core.config import MoEConfig
    from moe_core.model import MoEForCausalLM

    ckpt, out_dir = Path(ckpt), Path(out_dir)
    config = MoEConfig.from_pretrained(ckpt)
    model = MoEForCausalLM(config)
    missing, unexpected = model.load_state_dict(gather_state_dict(ckpt), strict=False)
    if [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)] or unexpected:
        raise CheckpointError(f"{ckpt}: cannot export, parameters do not match its config.json "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.copy2(ckpt / "train_config.json", tmp / "train_config.json")
    if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        for item in Path(tokenizer_dir).iterdir():  # also at the top level, where AutoTokenizer looks
            if item.is_file():
                shutil.copy2(item, tmp / item.name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)
    return out_dir
