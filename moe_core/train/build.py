"""A pretraining model that costs what a rank owns: built on the meta device, laid out, then each rank
materializes and initializes only its own parameters (torchtitan's order: build on meta, parallelize,
``to_empty``, ``init_weights``).

    model = build_meta_model(model_config)                   # every parameter on the meta device
    model = par.apply_expert_parallel(model, state)          # this rank's expert shards, still meta
    (FSDP2: par.wrap_data_parallel(model, state, "fsdp2"))   # dense weights become meta DTensor shards
    materialize_owned(model, state.device, seed)             # storage and initial values for what it owns

Initialization is the model's own (`MoEPreTrainedModel._init_weights`: one home for the rules), but each unit
draws from its own stream: a module from a generator seeded by (seed, its name in the whole model), each expert
of an expert stack by (seed, the stack's name, its global expert index). A rank holding experts 4..7 of a layer
therefore draws exactly what a one-process run draws for them, and the weights at a given seed are the same
bitwise at any world size and expert-parallel size (`tests/test_meta_start.py`). A dense tensor sharded by FSDP2
is drawn whole, one tensor at a time, and the rank keeps its shard (the transient is the largest single dense
tensor, never the model). The draws happen inside `torch.random.fork_rng`: the process's RNG streams (router
jitter, dropout) are left where `seed_everything` put them.

`rank_parameter_bytes` is the dry run's accounting (``moe-lab train --dry-run``): per rank, the bytes of the
parameters, gradients and AdamW state it would own, from the meta model alone.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moe_core.config import MoEConfig
from moe_core.experts import EXPERTS_MARK, GroupedExperts
from moe_core.model import MoEForCausalLM, materialize
from moe_core.train import parallel as par


def build_meta_model(model_config: MoEConfig) -> MoEForCausalLM:
    """The whole model with every parameter and buffer on the meta device: shapes only, no storage."""
    with torch.device("meta"):
        return MoEForCausalLM(model_config)


def unit_seed(seed: int, name: str, expert: int | None = None) -> int:
    """The seed of one initialization unit: a module (``name`` as in the whole, unsharded model) or one expert of
    an expert stack (its global index). 63 bits of SHA-256: stable across processes and Python versions."""
    key = f"{seed}/{name}" + ("" if expert is None else f"/expert{expert}")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(name, module), children before their parent: the order `nn.Module.apply` (and so `post_init`) uses, which
    lets a parent's rule override a child's."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


@contextlib.contextmanager
def _whole_tensors(module: nn.Module) -> Iterator[None]:
    """Inside: ``module``'s FSDP2-sharded parameters replaced by whole temporaries, for the init rule to draw;
    after: each rank keeps its shard of what was drawn (every rank drew the same whole tensor)."""
    swapped = []
    for pname, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            whole = nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device),
                requires_grad=param.requires_grad,
            )
            setattr(module, pname, whole)
            swapped.append((pname, param, whole))
    try:
        yield
    finally:
        for pname, param, whole in swapped:
            setattr(module, pname, param)
            with torch.no_grad():
                shard = distribute_tensor(
                    whole.detach(), param.device_mesh, param.placements, src_data_rank=None
                )
                param.to_local().copy_(shard.to_local())


def _expert_view(stack: GroupedExperts, e: int) -> GroupedExperts:
    """A one-expert `GroupedExperts` whose parameters are views of expert ``e`` of ``stack``: the init rule
    writes straight into the stack."""
    E, F_, D = stack.up_proj.shape
    with torch.device("meta"):
        view = GroupedExperts(1, D, F_, stack.activation, stack.impl)
    for name in ("gate_proj", "up_proj", "down_proj", "gate_proj_bias", "up_proj_bias", "down_proj_bias"):
        param = getattr(stack, name, None)  # (the biases: gpt-oss's experts)
        if param is not None:
            setattr(view, name, nn.Parameter(param.data[e : e + 1], requires_grad=False))
    return view


@torch.no_grad()
def init_parameters(model: MoEForCausalLM, seed: int) -> None:
    """Initial values for every parameter and buffer this rank holds (see the module docstring); the same
    values for the same seed whatever the layout."""
    rule = model._init_weights
    first_expert = {id(m.local): m.first_expert for _, m in par.expert_modules(model)}
    device = par.local(next(model.parameters())).device
    for name, module in _post_order(model):
        whole_name = par.full_model_name(name + ".").rstrip(".")
        if isinstance(module, GroupedExperts):
            first = first_expert.get(id(module), 0)
            for e in range(module.num_experts):
                with _seeded(unit_seed(seed, whole_name, first + e), device):
                    rule(_expert_view(module, e))
            continue
        if not any(True for _ in module.parameters(recurse=False)):
            continue  # (a router's gate is initialized by its own rule: `MoEBlock` marks it)
        with _seeded(unit_seed(seed, whole_name), device), _whole_tensors(module):
            rule(module)
    for module in model.modules():  # persistent buffers (router biases, pruning masks) start at zero
        for _, buffer in module.named_buffers(recurse=False):
            buffer.zero_()
        if hasattr(module, "reset_buffers"):  # what a constructor computes (rotary frequencies)
            module.reset_buffers()


def materialize_owned(model: MoEForCausalLM, device: torch.device, seed: int) -> MoEForCausalLM:
    """Storage on ``device`` for what this rank holds of a meta-built, laid-out model, then its initial values."""
    materialize(model, device)
    if model.config.tie_word_embeddings:
        model.tie_weights()  # to_empty gives each module its own tensor
    init_parameters(model, seed)
    return model


# ------------------------------------------------------------------------------------------------ loading
def expert_offsets(model: nn.Module):
    """``offset(name)``: the global index of the first expert that parameter ``name``'s stack holds on this rank
    (0 for a parameter of an unsharded stack or no stack)."""
    firsts = {f"{name}.local.": m.first_expert for name, m in par.expert_modules(model)}

    def offset(name: str) -> int:
        return next((first for prefix, first in firsts.items() if name.startswith(prefix)), 0)

    return offset


@torch.no_grad()
def copy_owned(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    """Copy ``value`` (the tensor as this rank holds it: an expert shard's own rows, a dense tensor whole) into
    ``param``; an FSDP2 DTensor keeps its ``Shard(0)`` rows of it. ``what`` names the source in a shape error."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{what} has shape {tuple(value.shape)}, the model's parameter {tuple(param.shape)}")
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        lo, hi = par.shard_rows(param.shape[0], mesh.size(), mesh.get_local_rank())
        value = value[lo:hi]
    par.local(param).copy_(value)


# ------------------------------------------------------------------------------------------------ accounting
def materialized_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters that have storage (FSDP2: its shards; meta parameters count nothing)."""
    total, seen = 0, set()
    for param in model.parameters():
        tensor = par.local(param)
        if tensor.is_meta or id(param) in seen:
            continue
        seen.add(id(param))
        total += tensor.numel() * tensor.element_size()
    return total


def rank_parameter_bytes(
    model_config: MoEConfig, world_size: int, ep_size: int, dp_mode: str = "ddp"
) -> list[dict[str, int]]:
    """Per rank, what it would own (bytes, fp32 as the trainer keeps them): ``params`` (``expert_params`` +
    ``dense_params``), ``grads`` and ``optimizer`` (AdamW's exp_avg and exp_avg_sq), and ``whole_model`` for
    scale. The model is built on the meta device and laid out as the trainer lays it out (this rank's
    `ExpertParallelExperts`); FSDP2's shards follow its ``Shard(0)`` split. Nothing is allocated."""
    experts = model_config.num_experts
    if world_size % ep_size or (experts and experts % ep_size) or (ep_size > 1 and not experts):
        raise par.ParallelError(
            f"parallel.ep_size={ep_size} must divide the world size {world_size} and "
            f"num_experts={experts}; choose a common divisor"
        )
    out = []
    for rank in range(world_size):
        state = par.ParallelState(
            world_size, rank, rank, ep_size, world_size // ep_size, rank % ep_size, rank // ep_size
        )
        model = par.apply_expert_parallel(build_meta_model(model_config), state)
        expert_bytes = dense_bytes = whole = 0
        for name, param in model.named_parameters():  # tied parameters once
            size = param.numel() * param.element_size()
            if EXPERTS_MARK in par.full_model_name(name):  # (one process keeps the experts unwrapped)
                expert_bytes += size
                whole += size * ep_size
            elif dp_mode == "fsdp2" and world_size > 1:
                rows = param.shape[0]
                start, stop = par.shard_rows(rows, world_size, rank)
                dense_bytes += size // rows * (stop - start)
                whole += size
            else:
                dense_bytes += size
                whole += size
        params = expert_bytes + dense_bytes
        out.append(
            {
                "rank": rank,
                "ep_rank": rank % ep_size,
                "params": params,
                "expert_params": expert_bytes,
                "dense_params": dense_bytes,
                "grads": params,
                "optimizer": 2 * params,
                "whole_model": whole,
            }
        )
    return out
