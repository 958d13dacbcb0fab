"""Checkpoints: everything needed to continue a run exactly, written atomically, loaded without unpickling code.

This file is the one home of the checkpoint format (format 3). Layout of ``<out>/checkpoints/step_<N>/``::

    train_config.json        the TrainConfig (also model.config below)
    config.json              the MoEConfig (save_pretrained format)
    model.safetensors        replicated parameters and buffers (router biases included), whole tensors (FSDP2
                             shards gathered); the whole model on one process, so the directory loads with
                             ``from_pretrained`` as is
    experts-ep<k>-of-<n>.safetensors   expert shard k under expert parallelism: global experts
                             k*E/n .. (k+1)*E/n - 1 of every stack
    optimizer.safetensors    AdamW's state of the replicated parameters, whole tensors, keyed
                             ``<parameter name>:exp_avg`` / ``:exp_avg_sq`` / ``:step``
    optimizer-experts-ep<k>-of-<n>.safetensors   the same for expert shard k
    rank<r>-state.pt         per rank, loaded with ``torch.load(weights_only=True)`` (tensors and plain
                             containers only; anything else is refused): the optimizer's group settings, the
                             LR scheduler, the data position (epoch and sampler), the fp16 loss scaler, and
                             the RNG states (python, numpy, torch, cuda) as tensors, ints and tuples. Under
                             ``parallel.backend=deepspeed`` the optimizer state is here instead, in DeepSpeed's
                             own per-rank form (such a checkpoint resumes at its own layout only)
    trainer_state.json       step, tokens, skipped steps, best validation loss, world and expert-parallel size,
                             data-parallel mode, tokenizer and data references
    manifest.json            written last: format version, step, and the size and SHA-256 of every other file

A checkpoint is written into ``.tmp-step_<N>`` (every rank writes its own files; a shared filesystem is
assumed across nodes), each file fsync'ed, then rank 0 writes ``trainer_state.json`` and ``manifest.json`` and
renames the directory to ``step_<N>``. A ``step_*`` directory counts as a checkpoint only when its manifest is
there and every file has its recorded size (`list_checkpoints`); before resuming, the checksums are checked too,
and a damaged or incomplete checkpoint is passed over for the newest complete one, with a warning
(`select_resume_checkpoint`). Pruning renames a checkpoint out of sight before deleting it. The last
``keep_last`` and the best (lowest validation loss) are kept. Checkpoints of the earlier pickle format
(``rank<r>.pt`` + ``rank<r>-trainer.pt``, no manifest) are refused, never unpickled.
`export_checkpoint` gathers expert shards into one Hugging Face directory.

Resharding: every tensor is stored whole under its name in the whole model, expert stacks split by global
expert index in the files' names, and so is the optimizer state: a run resumes at another world size,
expert-parallel size or data-parallel mode (DDP or FSDP2), each rank reading only its slice (`TensorIndex`:
``safe_open`` slices, its experts only), with the same weights and AdamW state. At the layout that wrote it a
resume is bitwise exact (each rank also takes back its own RNG state); at another layout the RNG states (which
only jitter and dropout draw from) come from the rank file of the same rank number, or rank 0's.
Format-2 checkpoints (the optimizer state per rank in ``rank<r>-state.pt``) still resume at their own layout.
Writing, rank 0 still gathers the whole replicated state (FSDP2 shards all-gathered, one tensor at a time, kept
until the file is written), as format 2 did for the weights; a writer that streams shard by shard (or
torch.distributed.checkpoint's per-rank shards) would lift that at the largest sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moe_core.data.tokenizer import set_model_input_names
from moe_core.errors import MoELabError
from moe_core.fileio import atomic_directory, disk_full_guard, fsync_directory, fsync_file
from moe_core.train.parallel import expert_modules, full_model_name, is_expert_param, shard_rows

FORMAT = 3
READABLE_FORMATS = (2, 3)  # format 2: optimizer state per rank, for the layout that wrote it only
STEP_PREFIX = "step_"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
OLD_FORMAT_FILES = ("rank0.pt", "rank0-trainer.pt")  # format 1: pickled optimizer/RNG/scheduler files


class CheckpointError(MoELabError):
    """A checkpoint that is missing, damaged or does not match the run resuming from it."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of(path: Path) -> int:
    return int(path.name[len(STEP_PREFIX) :])


def _step_dirs(ckpt_root: str | Path) -> list[Path]:
    """Every ``step_*`` directory, complete or not, oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX) :].isdigit()
    ]
    return sorted(found, key=step_of)


def is_old_format(ckpt: Path) -> bool:
    return not (ckpt / MANIFEST).exists() and any((ckpt / name).exists() for name in OLD_FORMAT_FILES)


def incomplete_reason(ckpt: Path) -> str | None:
    """Why ``ckpt`` is not a complete checkpoint (cheap: sizes only), or None when it is."""
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest.json (the write or a deletion was cut short)"
    except (OSError, ValueError) as err:
        return f"manifest.json is unreadable ({type(err).__name__})"
    if manifest.get("format") not in READABLE_FORMATS:
        return f"format {manifest.get('format')!r}, this version reads formats {READABLE_FORMATS}"
    for name, entry in manifest.get("files", {}).items():
        try:
            size = (ckpt / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, {entry['bytes']} were written"
    return None


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """The complete checkpoints (manifest present, every file at its recorded size), oldest first."""
    return [p for p in _step_dirs(ckpt_root) if incomplete_reason(p) is None]


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1] if found else None


def any_checkpoint_dir(ckpt_root: str | Path) -> Path | None:
    """The newest ``step_*`` directory, complete or not (a run's output directory is taken once it has one)."""
    found = _step_dirs(ckpt_root)
    return found[-1] if found else None


def old_format_error(ckpt: Path) -> CheckpointError:
    return CheckpointError(
        f"{ckpt} was written by an earlier moe-lab in a format that stores optimizer, RNG and scheduler state as "
        f"pickles (rank*.pt, rank*-trainer.pt), which can run code when loaded; this version refuses to load them. "
        f"Its weights (model.safetensors) are safe: continue from them in a new output directory "
        f"(moe_core.train.export_checkpoint(ckpt, dir) then fine-tune, or load with from_pretrained), or resume it "
        f"exactly with the moe-lab version that wrote it, only if you trust where the files came from"
    )


def verify_checkpoint(ckpt: Path) -> None:
    """Raise `CheckpointError` unless every file of ``ckpt`` has the size and SHA-256 its manifest records."""
    if is_old_format(ckpt):
        raise old_format_error(ckpt)
    reason = incomplete_reason(ckpt)
    if reason is None:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        for name, entry in sorted(manifest["files"].items()):
            if _sha256(ckpt / name) != entry["sha256"]:
                reason = f"{name} does not match its checksum"
                break
    if reason is not None:
        raise CheckpointError(f"{ckpt}: incomplete or damaged checkpoint: {reason}")


def select_resume_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The newest checkpoint that passes `verify_checkpoint`; damaged or incomplete newer ones are passed over
    with a warning on stderr. An old-format checkpoint met on the way raises (it is never unpickled)."""
    skipped: list[str] = []
    chosen = None
    for ckpt in reversed(_step_dirs(ckpt_root)):
        if is_old_format(ckpt):
            raise old_format_error(ckpt)
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as err:
            skipped.append(str(err))
            continue
        chosen = ckpt
        break
    for reason in skipped:
        print(
            f"moe-lab train: warning: {reason}; falling back to "
            f"{chosen.name if chosen else 'the start (no complete checkpoint left)'}",
            file=sys.stderr,
            flush=True,
        )
    return chosen


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, data: dict) -> None:
    with disk_full_guard(path):
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        fsync_file(path)


# ------------------------------------------------------------------------------------------------ tensors
def split_state_dict(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(replicated, expert shard) tensors of this rank, shared storage (tied weights) written once."""
    replicated, experts, seen = {}, {}, set()
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):  # FSDP2 shard: gather the whole tensor (every rank takes part)
            tensor = tensor.full_tensor()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        target = experts if is_expert_param(name) else replicated
        target[name] = tensor.detach().cpu().contiguous()
    return replicated, experts


def split_optimizer_state(
    model: torch.nn.Module, optimizer, keep_replicated: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(replicated, expert shard) AdamW state of this rank keyed ``<parameter name>:<state key>``, FSDP2 shards
    gathered whole (every rank takes part, in the same order; without ``keep_replicated``, a rank that does not
    write them lets each gathered tensor go at once)."""
    replicated, experts = {}, {}
    for name, param in model.named_parameters():  # tied parameters once
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if not torch.is_tensor(value):
                continue
            if isinstance(value, DTensor):
                value = value.full_tensor()
            expert = is_expert_param(name)
            if expert or keep_replicated:
                (experts if expert else replicated)[f"{name}:{key}"] = value.detach().cpu().contiguous()
    return replicated, experts


class TensorIndex:
    """Where each tensor of a checkpoint lies, by its name in the whole model: ``whole`` (one file of whole
    tensors) and the expert shards ``<shard_prefix>ep<k>-of-<n>.safetensors`` (global experts k*E/n ..). `read`
    returns a tensor, or rows ``start:stop`` of an expert stack read from whichever shards hold them
    (``safe_open`` slices: a rank reads its experts only), whatever layout wrote them."""

    def __init__(self, ckpt: Path, whole: str, shard_prefix: str) -> None:
        self.ckpt = ckpt
        self._open: dict[Path, object] = {}
        # whole-model name -> [(file, name in the file, first global row, rows)]
        self.pieces: dict[str, list[tuple[Path, str, int, int]]] = {}
        if (ckpt / whole).is_file():
            self._add(ckpt / whole, 0, None)
        shards = sorted(ckpt.glob(f"{shard_prefix}ep*-of-*.safetensors"))
        for shard in shards:
            k, n = shard.name[len(shard_prefix) + 2 : -len(".safetensors")].split("-of-")
            self._add(shard, int(k), int(n))

    def _handle(self, path: Path):
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def _add(self, path: Path, k: int, n: int | None) -> None:
        handle = self._handle(path)
        for key in handle.keys():
            shape = handle.get_slice(key).get_shape()
            rows = shape[0] if shape else 0  # 0: a scalar (AdamW's step), the same in every shard
            self.pieces.setdefault(full_model_name(key), []).append(
                (path, key, 0 if n is None else k * rows, rows)
            )

    def names(self) -> list[str]:
        return list(self.pieces)

    def rows(self, name: str) -> int:
        """Rows (dim 0) of the whole tensor ``name``; 0 for a scalar."""
        return max(first + rows for _, _, first, rows in self.pieces[name])

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        pieces = self.pieces.get(name)
        if not pieces:
            raise CheckpointError(f"{self.ckpt}: no tensor {name}; resume with the same model config")
        if pieces[0][3] == 0 or (start is None and len(pieces) == 1):
            path, key, _, _ = pieces[0]
            return self._handle(path).get_tensor(key)
        if start is None:
            start, stop = 0, self.rows(name)
        parts = []
        for path, key, first, rows in sorted(pieces, key=lambda piece: piece[2]):
            lo, hi = max(start, first), min(stop, first + rows)
            if lo < hi or (lo == hi == start and not parts and first <= start <= first + rows):
                parts.append(self._handle(path).get_slice(key)[lo - first : hi - first])  # (may be empty)
        got = sum(part.shape[0] for part in parts)
        if not parts or got != stop - start:
            raise CheckpointError(
                f"{self.ckpt}: {name}: rows {start}..{stop - 1} wanted, {got} found; an expert shard is missing"
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_as(self, name: str, target: torch.Tensor, start: int | None = None, stop: int | None = None):
        """``name`` as ``target`` holds it: rows ``start:stop`` of an expert stack; for an FSDP2 DTensor of the
        same shape (``Shard(0)`` over a 1-D mesh), only this rank's rows, read as such; else the whole tensor."""
        if (
            isinstance(target, DTensor)
            and start is None
            and self.rows(name) == (target.shape[0] if target.ndim else 0)
        ):
            mesh, placements = target.device_mesh, tuple(target.placements)
            device = target.to_local().device
            if mesh.ndim == 1 and placements == (Shard(0),):
                lo, hi = shard_rows(target.shape[0], mesh.size(), mesh.get_local_rank())
                local = self.read(name, lo, hi).to(device)
                return DTensor.from_local(local, mesh, placements, shape=target.shape, stride=target.stride())
            return distribute_tensor(self.read(name).to(device), mesh, placements, src_data_rank=None)
        return self.read(name, start, stop)


def _expert_rows(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """State-dict name prefix of each expert shard -> (its first global expert, how many it holds)."""
    return {f"{name}.local.": (m.first_expert, m.num_local) for name, m in expert_modules(model)}


def _rows_of(name: str, rows: dict[str, tuple[int, int]]) -> tuple[int | None, int | None]:
    for prefix, (first, count) in rows.items():
        if name.startswith(prefix):
            return first, first + count
    return None, None


@torch.no_grad()
def load_model_state(model: torch.nn.Module, ckpt: Path) -> None:
    """This rank's weights from ``ckpt``, whatever layout wrote it: replicated tensors whole (FSDP2: this rank's
    rows of them) and its own experts' rows of every expert stack, copied into the live tensors one at a time
    (never a second copy of the model)."""
    index, rows = TensorIndex(ckpt, "model.safetensors", "experts-"), _expert_rows(model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    current = model.state_dict()  # the live parameters and buffers (FSDP2: this rank's DTensor shards)
    missing = [
        n for n in current if full_model_name(n) not in index.pieces and not (tied and n == "lm_head.weight")
    ]
    unexpected = set(index.names()) - {full_model_name(n) for n in current}
    if missing or unexpected:
        raise CheckpointError(
            f"{ckpt}: parameters do not match the model (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}); resume with the same model config"
        )
    for name, target in current.items():
        whole = full_model_name(name)
        if whole not in index.pieces:
            continue  # the tied head: its embedding is loaded
        value = index.read_as(whole, target, *_rows_of(name, rows))
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{ckpt}: {whole} has shape {tuple(value.shape)}, the model {tuple(target.shape)}; resume with "
                f"the same model config"
            )
        if isinstance(target, DTensor):
            target.to_local().copy_(value.to_local())
        else:
            target.copy_(value)


def load_optimizer_tensors(model: torch.nn.Module, optimizer, ckpt: Path, saved_groups: list | None) -> None:
    """AdamW's state from ``optimizer*.safetensors`` (format 3), resharded to this rank's parameters as
    `load_model_state` does the weights. ``saved_groups`` (the group settings of the rank file) replace the
    current groups' where the layout has as many groups (FSDP2 keeps its DTensors in groups of their own)."""
    index, rows = TensorIndex(ckpt, "optimizer.safetensors", "optimizer-experts-"), _expert_rows(model)
    keys: dict[str, list[str]] = {}
    for entry in index.names():
        name, key = entry.rsplit(":", 1)
        keys.setdefault(name, []).append(key)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    position = {id(p): i for i, p in enumerate(params)}
    state = {}
    for name, param in model.named_parameters():
        if id(param) not in position:
            continue
        whole, (start, stop) = full_model_name(name), _rows_of(name, rows)
        per_param = {}
        for key in keys.get(whole, []):  # exp_avg and exp_avg_sq shaped as the parameter; step a scalar
            per_param[key] = index.read_as(f"{whole}:{key}", param, start, stop)
        if per_param:
            state[position[id(param)]] = per_param
    groups = optimizer.state_dict()["param_groups"]
    if saved_groups is not None and len(saved_groups) == len(groups):
        groups = [
            {**saved, "params": group["params"]} for saved, group in zip(saved_groups, groups, strict=True)
        ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ------------------------------------------------------------------------------------------------ RNG
def rng_state() -> dict:
    """Every RNG the run draws from, as tensors, ints and tuples (``weights_only`` loads them)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------ save / load
def begin_checkpoint(ckpt_root: Path, step: int) -> Path:
    """The temporary directory every rank writes into (created by rank 0, `write_configs`, before a barrier)."""
    tmp = ckpt_root / f".tmp-{step_dir_name(step)}"
    return tmp


def write_configs(tmp: Path, train_config, model_config) -> None:
    """Rank 0: a fresh temporary directory with ``train_config.json`` and ``config.json`` in it."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with disk_full_guard(tmp):
        train_config.save(tmp / "train_config.json")
        model_config.save_pretrained(tmp)


def rank_state_name(rank: int) -> str:
    return f"rank{rank}-state.pt"


def estimated_bytes(model: torch.nn.Module, optimizer) -> int:
    """Roughly what one checkpoint of this rank takes on disk: parameters, buffers and optimizer tensors."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t))
    for per_param in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in per_param.values() if torch.is_tensor(v))
    return total


def save_rank_files(
    tmp: Path,
    model: torch.nn.Module,
    optimizer,
    *,
    rank: int,
    ep_rank: int,
    ep_size: int,
    dp_rank: int,
    write_replicated: bool,
    scheduler=None,
    data_state: dict | None = None,
    scaler=None,
    optimizer_in_rank_file: bool = False,
) -> None:
    """This rank's files: the weights and optimizer state it owns (safetensors, by name in the whole model) and
    ``rank<r>-state.pt`` (optimizer groups, scheduler, data position, loss scaler, RNG; tensors and plain
    containers only, so it loads with ``weights_only=True``). ``optimizer_in_rank_file``: the whole optimizer
    state in the rank file instead (DeepSpeed's, whose engine owns its layout)."""
    with disk_full_guard(tmp, estimated_bytes(model, optimizer)):
        replicated, experts = split_state_dict(model)
        files = {"model.safetensors": replicated, f"experts-ep{ep_rank}-of-{ep_size}.safetensors": experts}
        if not optimizer_in_rank_file:
            opt_replicated, opt_experts = split_optimizer_state(
                model, optimizer, keep_replicated=write_replicated
            )
            files[OPTIMIZER_FILE] = opt_replicated
            files[f"optimizer-experts-ep{ep_rank}-of-{ep_size}.safetensors"] = opt_experts
        for name, tensors in files.items():
            expert_file = "experts-" in name
            if (expert_file and tensors and dp_rank == 0) or (not expert_file and write_replicated):
                save_file(tensors, tmp / name, metadata={"format": "pt"})
                fsync_file(tmp / name)
        groups = [
            {k: v for k, v in group.items() if k != "params"}
            for group in optimizer.state_dict()["param_groups"]
        ]
        state = {
            "format": FORMAT,
            "optimizer": _local_optimizer_state(optimizer) if optimizer_in_rank_file else None,
            "optimizer_groups": groups,
            "rng": rng_state(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "data": data_state,
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
        path = tmp / rank_state_name(rank)
        torch.save(state, path)
        fsync_file(path)


def finish_checkpoint(tmp: Path, final: Path, trainer_state: dict) -> Path:
    """Rank 0, after every rank wrote its files: trainer state, then the manifest (the completion mark), then the
    atomic rename."""
    write_json(tmp / TRAINER_STATE, trainer_state)
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(tmp.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    write_json(tmp / MANIFEST, {"format": FORMAT, "step": trainer_state.get("step"), "files": files})
    fsync_directory(tmp)
    if final.exists():  # a checkpoint of the same step from an earlier attempt
        _remove_checkpoint(final)
    os.rename(tmp, final)
    fsync_directory(final.parent)
    return final


def _local_optimizer_state(optimizer) -> dict:
    """The optimizer state with FSDP2 DTensors replaced by this rank's shard (plain tensors load weights-only)."""
    state = optimizer.state_dict()  # its per-parameter dicts are the live ones: build new dicts
    state["state"] = {
        index: {
            key: value.to_local() if isinstance(value, DTensor) else value for key, value in per_param.items()
        }
        for index, per_param in state["state"].items()
    }
    return state


def load_optimizer_state(optimizer, state: dict) -> None:
    """Inverse of `_local_optimizer_state`: shards become DTensors shaped like their parameters again."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, per_param in state["state"].items():
        param = params[int(index)]
        if not isinstance(param, DTensor):
            continue
        for key, value in per_param.items():
            if torch.is_tensor(value) and value.shape == param.to_local().shape and key != "step":
                per_param[key] = DTensor.from_local(
                    value.to(param.device),
                    param.device_mesh,
                    param.placements,
                    shape=param.shape,
                    stride=param.stride(),
                )
    optimizer.load_state_dict(state)


def load_rank_files(ckpt: Path, rank: int) -> dict:
    """``rank<r>-state.pt`` loaded weights-only: a file holding anything but tensors and plain containers (a
    planted pickle payload, for one) is refused before any of it runs."""
    if is_old_format(ckpt):
        raise old_format_error(ckpt)
    path = ckpt / rank_state_name(rank)
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt}: no {path.name}; resume with the same number of processes as the run that wrote it"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path}: refused to load: it holds objects other than tensors and plain containers "
            f"({first[:200]}). moe-lab never writes such files; it may have been tampered with. "
            f"Resume from another checkpoint or start a new run"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(state, dict) or state.get("format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"{path}: not a rank state file of format {' or '.join(map(str, READABLE_FORMATS))}"
        )
    return state


def read_trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / TRAINER_STATE).read_text())


def tokens_trained(path: str | Path) -> int | None:
    """Training tokens behind the model at ``path``: a checkpoint's, a run directory's newest complete one's,
    or, for a run's exported model (``<run>/final``), its run's; None for anything else (a converted or
    hub model, a fine-tune's output)."""
    path = Path(path)
    if (path / TRAINER_STATE).is_file() and incomplete_reason(path) is None:
        return int(read_trainer_state(path)["tokens"])
    for run in (path, path.parent):
        ckpt = latest_checkpoint(run / "checkpoints")
        if ckpt is not None:
            return int(read_trainer_state(ckpt)["tokens"])
    return None


def _remove_checkpoint(path: Path) -> None:
    """Rename out of sight first (a kill midway leaves a ``.tmp-`` directory, never a half checkpoint), then delete."""
    doomed = path.parent / f".tmp-delete-{path.name}-{os.getpid()}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune_checkpoints(ckpt_root: Path, keep_last: int, best: str | None) -> None:
    """Delete all but the last `keep_last` checkpoints and the best one (complete ones count; incomplete
    ``step_*`` directories older than the newest complete one go too)."""
    found = list_checkpoints(ckpt_root)
    keep = {p.name for p in found[-keep_last:]}
    if best:
        keep.add(best)
    newest = step_of(found[-1]) if found else -1
    for path in _step_dirs(ckpt_root):
        if path.name not in keep and (path in found or step_of(path) < newest) and not is_old_format(path):
            _remove_checkpoint(path)


def clean_temporary(ckpt_root: Path) -> list[str]:
    """Remove checkpoint temporaries (``.tmp-step_*``, ``.tmp-delete-*``) of killed writers; call only while
    holding the output directory's lock, so no live writer is using them. Returns the names of the half-written
    checkpoints removed (``.tmp-step_*``), for the resume message."""
    discarded = []
    if ckpt_root.is_dir():
        for path in sorted(ckpt_root.glob(".tmp-*")):
            shutil.rmtree(path, ignore_errors=True)
            if path.name.startswith(".tmp-step_"):
                discarded.append(path.name)
    return discarded


# ------------------------------------------------------------------------------------------------ export
def gather_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full (Hugging Face) state dict of a checkpoint: expert shards concatenated along the expert dim."""
    state = load_file(ckpt / "model.safetensors")
    shards = sorted(ckpt.glob("experts-ep*-of-*.safetensors"), key=lambda p: int(p.name.split("-")[1][2:]))
    if shards:
        n = int(shards[0].stem.split("-of-")[1])
        if len(shards) != n:
            raise CheckpointError(
                f"{ckpt}: found {len(shards)} of {n} expert shards; the checkpoint is incomplete"
            )
        parts: dict[str, list[torch.Tensor]] = {}
        for shard in shards:
            for name, tensor in load_file(shard).items():
                parts.setdefault(full_model_name(name), []).append(tensor)
        state.update({name: torch.cat(tensors, dim=0) for name, tensors in parts.items()})
    return state


def checkpoint_model(ckpt: str | Path):
    """The model a training checkpoint holds: replicated weights plus every expert shard (`gather_state_dict`), on
    a model built on the meta device and given the tensors as read (``assign``; a float32 model initialized at
    random first held 4 bytes a parameter beside the checkpoint's own: a 7 B model's 26 GiB, for nothing), tied
    as its config says, with what no checkpoint holds (rotary frequencies) made. Raises `CheckpointError` when the
    weight files do not cover the model its config.json describes."""
    # lazy: the modeling stack takes seconds to import, and the flows' tasks import this module to read state
    from moe_core.config import MoEConfig
    from moe_core.errors import weight_mismatch
    from moe_core.model import MoEForCausalLM, materialize_unsaved

    ckpt = Path(ckpt)
    config = MoEConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = MoEForCausalLM(config)
    missing, unexpected = model.load_state_dict(gather_state_dict(ckpt), strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise CheckpointError(
            f"{ckpt}: its weight files do not cover the model its config.json describes "
            f"({weight_mismatch(missing, unexpected)})"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    materialize_unsaved(model)
    return model


def export_checkpoint(ckpt: str | Path, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Write a Hugging Face-loadable directory (config.json, model.safetensors, tokenizer if known)."""
    ckpt, out_dir = Path(ckpt), Path(out_dir)
    model = checkpoint_model(ckpt)
    with atomic_directory(
        out_dir, overwrite=True, error_cls=CheckpointError
    ) as tmp:  # full disk: a clear error
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.copy2(ckpt / "train_config.json", tmp / "train_config.json")
        if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
            shutil.copytree(tokenizer_dir, tmp / "tokenizer")
            for item in Path(tokenizer_dir).iterdir():  # also at the top level, where AutoTokenizer looks
                if item.is_file():
                    shutil.copy2(item, tmp / item.name)
            for copy in (tmp, tmp / "tokenizer"):  # data prepared before it named them adds token_type_ids
                set_model_input_names(copy)
    return out_dir
